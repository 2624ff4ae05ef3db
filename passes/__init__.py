"""passes: graph rewrites that implement a plan, run in order by :func:`run_pipeline`.

Per stage of the lowered graph :func:`default_pipeline` (the tp passes, then ``fuse_norms``
on 16-bit RMSNorms; the stage split and context parallelism are recorded with them), then
``overlap_tp`` when the overlap planner part (autopar.planner.overlap) decomposes any tp
gather / scatter under its matmuls; then on each materialized stage
(autopar.codegen.materialize) :func:`batch_pipeline` for ep (``expert_parallel``,
``global_batch``), ``recompute`` in the program's mode, and dp's ``global_batch`` on a copy;
codegen's shard step then cuts each rank's module.

The runner times each pass, lints the graph after it, keeps a history of (pass, ms, node-count
diff, printed graph: a snapshot printed when first read) for inspection, and on failure names
the pass and the user source line of the node being rewritten.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from autopar.frontend.trace import Traced
from autopar.ir.meta import source
from autopar.ir.printing import GraphSnapshot
from autopar.mesh import Mesh
from autopar.rules import Strategy


@dataclass(frozen=True, kw_only=True)
class TpDecisions:
    """What the tensor-parallel passes apply (``PassContext.sections["tp"]``): the mesh axis
    the integer program solved and each node's chosen strategy on it."""

    axis: str
    choice: Mapping[str, Strategy]  # node name -> chosen strategy on ``axis``
    overlap: tuple[str, ...] = ()  # candidates passes.overlap_tp decomposes (planner.overlap)
    regather: tuple[str, ...] = ()  # gather candidates whose shard backward re-gathers


@dataclass(frozen=True, kw_only=True)
class PassContext:
    """What every pass may read: the whole mesh, the traced model, the values that need a
    gradient, and the plan's decisions, one section per axis (``sections["tp"]``:
    :class:`TpDecisions`; ``sections["cp"]``: the sequence layout and attention choices
    context parallelism applies).  A pass reads its own axis's section."""

    mesh: Mesh
    grad: frozenset[str]  # names of values that need a gradient
    traced: Traced
    replicate_outputs: bool = False  # graph outputs must be whole (pipeline stage boundaries)
    sections: Mapping[str, Any] = field(default_factory=dict)  # axis -> its decisions

    def section(self, axis: str) -> Any:
        """The ``axis`` section; a pass run without its axis's decisions is a bug."""
        if axis not in self.sections:
            raise PassError(f"the pass context has no {axis!r} section (sections: "
                            f"{', '.join(self.sections) or 'none'}): run the {axis} planner "
                            "part before its passes")  # fmt: skip
        return self.sections[axis]


@dataclass(frozen=True, kw_only=True)
class PassRecord:
    """One entry of the pipeline history: the graph after the pass is kept as snapshots
    (one per output graph) and printed when ``graph`` is first read."""

    name: str
    ms: float
    nodes_before: int
    nodes_after: int
    snapshots: tuple[GraphSnapshot, ...]
    staged: bool = False  # one graph per stage (``record``), printed under ``# graph i`` headers

    @functools.cached_property
    def graph(self) -> str:
        """The printed graph (``format_graph``), or each stage's under its header."""
        if not self.staged:
            return self.snapshots[0].text()
        return "".join(f"# graph {i}\n{s.text()}" for i, s in enumerate(self.snapshots))

    def __str__(self) -> str:
        diff = self.nodes_after - self.nodes_before
        return f"{self.name:<28} {self.ms:8.1f} ms  {self.nodes_after:5d} nodes ({diff:+d})"


Pass = Callable[[fx.GraphModule, PassContext], fx.GraphModule]


class PassError(RuntimeError):
    """A pass failed; the message names the pass and the user's source line."""


class NodeError(RuntimeError):
    """Raised inside a pass about one node; the runner adds the pass name."""

    def __init__(self, node: fx.Node, message: str) -> None:
        super().__init__(f"{message} (node '{node.name}' at {source(node)})")
        self.node = node


def run_pipeline(
    gm: fx.GraphModule, ctx: PassContext, passes: Sequence[Pass] | None = None
) -> tuple[fx.GraphModule, list[PassRecord]]:
    """Run ``passes`` (default: the full pipeline) in order and return the history."""
    history: list[PassRecord] = []
    for p in passes if passes is not None else default_pipeline():
        before = len(gm.graph.nodes)
        start = time.perf_counter()
        try:
            gm = p(gm, ctx)
            gm.graph.lint()
        except NodeError as exc:
            raise PassError(f"pass {p.__name__} failed: {exc}") from exc
        ms = (time.perf_counter() - start) * 1e3
        history.append(PassRecord(name=p.__name__, ms=ms, nodes_before=before,
                                  nodes_after=len(gm.graph.nodes),
                                  snapshots=(GraphSnapshot.of(gm),)))  # fmt: skip
    return gm, history


def record(name: str, before: int, start: float, graphs: Sequence[fx.GraphModule]) -> PassRecord:
    """The history entry of a pass that turns one graph into several (``pipeline_split``: one
    per stage), started at ``start`` (``time.perf_counter()``) on ``before`` nodes."""
    ms = (time.perf_counter() - start) * 1e3
    return PassRecord(name=name, ms=ms, nodes_before=before,
                      nodes_after=sum(len(g.graph.nodes) for g in graphs),
                      snapshots=tuple(GraphSnapshot.of(g) for g in graphs),
                      staged=True)  # fmt: skip


def default_pipeline() -> list[Pass]:
    from passes.cleanup import cleanup
    from passes.fuse_norms import fuse_norms
    from passes.localize import localize
    from passes.lower_collectives import lower_collectives
    from passes.propagate_layout import propagate_layout
    from passes.tensor_parallel import tensor_parallel

    return [propagate_layout, tensor_parallel, lower_collectives, localize, cleanup, fuse_norms]




def batch_pipeline(axis: str) -> list[Pass]:
    """The passes batch axis ``axis`` runs on each materialized stage: ep places the experts,
    then every batch axis (ep, dp) makes the statistics over the batch global."""
    from passes.expert_parallel import expert_parallel
    from passes.global_batch import global_batch

    return [expert_parallel, global_batch] if axis == "ep" else [global_batch]
