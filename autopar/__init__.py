"""autopar: an automatic-parallelisation compiler for PyTorch.

``autoparallelize(model, Mesh(tp=4), example_inputs=(x,))`` traces the model, plans its
layouts with a cost model, rewrites the graph with explicit collectives and returns one
readable program per rank.  ``verify`` checks it against the single-device model.
"""

from autopar.api import autoparallelize
from autopar.compare import VerifyReport
from autopar.errors import (
    AutoparError,
    InputError,
    MeshError,
    PlanError,
    ShardingRuleError,
    TraceError,
)
from autopar.ir.layout import Layout, Partial, Replicate, Shard
from autopar.mesh import Mesh
from autopar.plan import Collective, Plan
from autopar.program import Program
from autopar.verify import verify
from cost.config import ParallelConfig
from cost.estimate import estimate
from cost.hardware import Cluster
from cost.model import ModelShape

__all__ = [
    "AutoparError",
    "Cluster",
    "ModelShape",
    "ParallelConfig",
    "VerifyReport",
    "estimate",
    "verify",
    "Collective",
    "InputError",
    "Layout",
    "Mesh",
    "MeshError",
    "Partial",
    "Plan",
    "PlanError",
    "Program",
    "Replicate",
    "Shard",
    "ShardingRuleError",
    "TraceError",
    "autoparallelize",
]
