"""Public cost-model API: price a training configuration without running it.

    from autopar.estimate import estimate, ModelShape, Cluster, ParallelConfig
    est = estimate(ModelShape.preset("llama3-70b"), Cluster.preset("dgx-h100", nodes=8),
                   ParallelConfig(tp=8, pp=4, dp=2, global_batch=512))
    print(est)  # memory per rank, step-time breakdown, tokens/s, TFLOP/s per GPU, MFU

The implementation lives in the `cost` package; this module only re-exports it.
"""

from __future__ import annotations

from cost.config import ParallelConfig
from cost.errors import CostInputError
from cost.estimate import Estimate, estimate
from cost.hardware import GPU, Cluster, Link
from cost.model import ModelShape


def formulas() -> dict:
    """The closed forms of the cost model (sympy; loaded on first call): `cost.symbolic`."""
    from cost.symbolic import formulas as closed_forms

    return closed_forms()


__all__ = [
    "GPU",
    "Cluster",
    "CostInputError",
    "Estimate",
    "Link",
    "ModelShape",
    "ParallelConfig",
    "estimate",
    "formulas",
]
