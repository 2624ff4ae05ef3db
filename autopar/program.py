"""A compiled program: the plan, the lowered graph, and per-rank modules and source.

A program's rank modules come from its :class:`Materialized` stages (one without pp): the
rank-independent program after every pass of the axes so far (the last, ``recompute``, in the
program's recompute mode), which a batch axis (dp, ep) copies and runs its own passes on; a
rank's module is its shard (autopar.codegen.shard).

:func:`collectives_of` reads one training step's collectives off the lowered graph: each
collective op contributes its forward transfer and the backward transfer its ``grad`` mode
implies (only when the value needs a gradient).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from autopar.codegen import copy_program, materialize, render, shard
from autopar.frontend.trace import Traced
from autopar.ir import meta
from autopar.mesh import Mesh
from autopar.ops import collectives as C
from autopar.ops import parallel_ops
from autopar.plan import Collective, Plan
from passes import Pass, PassContext, PassRecord, run_pipeline


@dataclass(frozen=True, kw_only=True)
class Materialized:
    """One stage's rank-independent program (``module``: materialized, after the passes so
    far) and what cuts a rank's module from it (:meth:`build`)."""

    module: fx.GraphModule
    traced: Traced
    mesh: Mesh  # the mesh whose axes its layouts name (ranks are numbered in it)

    def build(self, rank: int) -> fx.GraphModule:
        """``rank``'s module (``rank`` in :attr:`mesh`): its shard."""
        return shard(self.module, self.traced, self.mesh, rank)

    def rewritten(self, ctx: PassContext,
                  passes: list[Pass]) -> tuple[Materialized, list[PassRecord]]:  # fmt: skip
        """A copy whose module ``passes`` rewrote (this one is left as it is), and their
        history."""
        module, history = run_pipeline(copy_program(self.module), ctx, passes)
        return dataclasses.replace(self, module=module), history

    def recomputed(self, mode: str) -> tuple[Materialized, list[PassRecord]]:
        """After the ``recompute`` pass in ``mode`` (itself, no history, for "none")."""
        if mode == "none":
            return self, []
        from autopar.axes.recompute import RecomputeDecisions
        from passes.recompute import recompute

        decided = RecomputeDecisions(mode=mode, model=self.traced.model_name)
        ctx = PassContext(mesh=self.mesh, grad=frozenset(), traced=self.traced,
                          sections={"recompute": decided})
        return self.rewritten(ctx, [recompute])


class Program:
    """What :func:`autopar.autoparallelize` returns on a virtual mesh without dp, ep or pp.

    Every program kind answers the same questions: ``model_name``, ``core`` (the program of
    the mesh without the batch axes: a Program or a PipelineProgram), ``pipeline`` (the
    PipelineProgram inside, or None), ``inner`` (the program a batch axis wraps, or None) and
    ``loss_graph`` (the traced graph whose output is the loss)."""

    inner = None  # no batch axis wraps anything here
    pipeline = None

    def __init__(self, *, plan: Plan, mesh: Mesh, graph_module: fx.GraphModule,
                 traced: Traced, history: list[PassRecord]) -> None:  # fmt: skip
        self.plan = plan
        self.mesh = mesh
        self.graph_module = graph_module
        self.traced = traced
        self._history = history
        self._modules: dict[int, fx.GraphModule] = {}
        self._final: dict[str, tuple[Materialized, list[PassRecord]]] = {}  # by recompute mode
        self.recompute = "none"  # activation recomputation (autopar.axes.recompute.attach)

    @property
    def model_name(self) -> str:
        return self.traced.model_name

    @property
    def core(self) -> Program:
        return self

    @property
    def loss_graph(self) -> fx.GraphModule:
        return self.traced.gm

    @cached_property
    def materialized(self) -> fx.GraphModule:
        """The rank-independent program (whole parameters; :func:`autopar.codegen.materialize`)."""
        return materialize(self.graph_module, self.traced)

    @property
    def history(self) -> list[PassRecord]:
        """The passes that built the program (the tp passes, cp), then its recompute pass."""
        return [*self._history, *self._recomputed()[1]]

    def materialized_stage(self, stage: int = 0) -> Materialized:
        """The program's one materialized stage (``stage`` 0: a program without pp), after its
        recompute pass."""
        return self._recomputed()[0]

    def _recomputed(self) -> tuple[Materialized, list[PassRecord]]:
        if self.recompute not in self._final:
            whole = Materialized(module=self.materialized, traced=self.traced, mesh=self.mesh)
            self._final[self.recompute] = whole.recomputed(self.recompute)
        return self._final[self.recompute]

    def module(self, rank: int) -> fx.GraphModule:
        """The GraphModule of ``rank``, holding only that rank's parameter shards."""
        if rank not in self._modules:
            self._modules[rank] = self.materialized_stage().build(rank)
        return self._modules[rank]

    def code(self, rank: int = 0) -> str:
        """Readable generated source of ``rank``'s program."""
        return render(self.module(rank), self.header(rank))

    def header(self, rank: int) -> str:
        coords = ", ".join(f"{a}={c}" for a, c in self.mesh.coordinates(rank).items())
        return (
            f"# autopar program · plan {self.plan.hash} · rank {rank} of "
            f"{self.mesh.world_size} · mesh coordinates ({coords})\n"
            f"# {self.mesh}; comments give each node's local shape and layout "
            "P(per tensor dim: mesh axes splitting it; partial=axes still to be summed)\n"
        )

    def collectives(self) -> list[Collective]:
        """One training step's collectives: kind, axis, shape, dtype, bytes, direction."""
        return list(self.plan.collectives)

    @cached_property
    def distinct_programs(self) -> dict[str, list[int]]:
        """Source text (without header) -> ranks running it."""
        out: dict[str, list[int]] = {}
        for rank in range(self.mesh.world_size):
            out.setdefault(render(self.module(rank), ""), []).append(rank)
        return out

    def save(self, directory: str | Path) -> list[Path]:
        """Write one runnable .py per distinct program plus plan.txt and plan.json."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        written = []
        for i, (_, ranks) in enumerate(self.distinct_programs.items()):
            path = d / f"program_{i}.py"
            module = self.module(ranks[0])
            path.write_text(_preamble(module, ranks) + self.code(ranks[0]))
            written.append(path)
        (d / "plan.txt").write_text(str(self.plan) + "\n")
        (d / "plan.json").write_text(self.plan.to_json())
        return [*written, d / "plan.txt", d / "plan.json"]

    def report(self, path: str | Path, **options: Any) -> Path:
        """The plan drawn in one self-contained HTML file (`autopar.tools.report.write_report`:
        ``png_dir=`` also writes each chart as PNG, ``measured=`` a measured schedule)."""
        from autopar.tools.report import write_report

        return write_report(self, path, **options)

    def __repr__(self) -> str:
        return f"<autopar.Program {self.plan.model} on {self.mesh}, plan {self.plan.hash}>"


def _preamble(module: fx.GraphModule, ranks: list[int]) -> str:
    """Imports that make the printed class runnable on its own."""
    code = module.graph.python_code(root_module="self")
    lines = [f"# runs on ranks {ranks}; load parameters with module.load_state_dict(...)",
             "import torch", "from torch import device, inf, nan", ""]  # fmt: skip
    for name, obj in sorted(code.globals.items()):
        mod, qual = getattr(obj, "__module__", None), getattr(obj, "__name__", None)
        if mod and qual and name != qual and mod.startswith(("autopar", "passes")):
            lines.insert(-1, f"from {mod} import {qual} as {name}")
    return "\n".join(lines) + "\n"


_BACKWARD = {
    (C.all_reduce, "all_reduce"): "all_reduce",
    (C.all_gather, "reduce_scatter"): "reduce_scatter",
    (C.reduce_scatter, None): "all_gather",
    (C.split, None): "all_gather",
    (C.all_to_all, None): "all_to_all",
    (C.grad_all_reduce, None): "all_reduce",
}
_FORWARD = {
    C.all_reduce: "all_reduce",
    C.all_gather: "all_gather",
    C.reduce_scatter: "reduce_scatter",
    C.all_to_all: "all_to_all",
}


def collectives_of(gm: fx.GraphModule, grad: set[str], sizes: dict[str, int],
                   names: dict[str, str]) -> list[Collective]:  # fmt: skip
    """Forward and backward collectives of the lowered graph (see module docstring)."""
    found: list[Collective] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is parallel_ops.vocab_parallel_cross_entropy:
            found += _ce_collectives(node)
            continue
        if node.target is C.grad_sum_shared:
            found += _shared_collectives(node, sizes, names)
            continue
        if node.target not in (*_FORWARD, C.split, C.grad_all_reduce):
            continue
        x, axis = node.args[0], node.args[1]
        val = _message(node, sizes[axis])
        mode = node.args[-1] if node.target in (C.all_reduce, C.all_gather) else None
        where = _where(x, node, names)
        runs_in = meta.dtype(x)
        if node.target in _FORWARD:
            found.append(_record(_FORWARD[node.target], axis, val, "fwd", where, runs_in))
        back = _BACKWARD.get((node.target, mode))
        if back and x.name in grad:
            found.append(_record(back, axis, val, "bwd", where, runs_in))
    return found


def _where(x: fx.Node, node: fx.Node, names: dict[str, str]) -> str:
    """The module path a collective on ``x`` is listed under: a parameter's module (also
    through the gradient reductions stacked on it: a norm weight's over tp, then over cp),
    else the node's own."""
    while x.name not in names and x.target in (C.grad_all_reduce, C.grad_sum_shared):
        x = x.args[0]
    return names[x.name].rsplit(".", 1)[0] if x.name in names else meta.module_path(node)


def _record(kind: str, axis: str, val: torch.Tensor, direction: str, where: str,
            runs_in: torch.dtype | None = None) -> Collective:  # fmt: skip
    """``runs_in``: the dtype the message has when the program runs (its autocast dtype)."""
    runs_in = runs_in or val.dtype
    nbytes = val.numel() * runs_in.itemsize
    dtype = str(runs_in).replace("torch.", "")
    return Collective(kind=kind, axis=axis, shape=tuple(val.shape), dtype=dtype, bytes=nbytes,
                      direction=direction, where=where)  # fmt: skip


def _message(node: fx.Node, size: int) -> torch.Tensor:
    """The full (unsplit) tensor a collective moves, from the local shapes."""
    x = node.args[0].meta["val"]
    if node.target in (C.all_reduce, C.all_gather):
        return node.meta["val"]
    if node.target is C.all_to_all:
        shape = list(x.shape)
        shape[node.args[2]] *= size
        return x.new_empty(shape, device="meta")
    return x


def _shared_collectives(node: fx.Node, sizes: dict[str, int],
                        names: dict[str, str]) -> list[Collective]:  # fmt: skip
    """A shared split's gradient sum: one backward all-reduce of the pieces side by side."""
    x, axis, rep = node.args
    val = x.meta["val"].new_empty((sizes[axis] // rep, *x.meta["val"].shape), device="meta")
    return [_record("all_reduce", axis, val, "bwd", _where(x, node, names), meta.dtype(x))]


def _ce_collectives(node: fx.Node) -> list[Collective]:
    rows = node.args[0].meta["val"].shape[0]
    axis = node.args[2]
    stats = [torch.empty(rows, device="meta"), torch.empty(rows, 2, device="meta")]
    return [_record("all_reduce", axis, s, "fwd", meta.module_path(node)) for s in stats]


class BatchAxisProgram:
    """What a batch axis (dp, ep) returns: a program over ``inner``, the program of the mesh
    without that axis, run on every rank's slice of the batch.  Answers the questions every
    program kind answers from ``inner`` (see :class:`Program`)."""

    inner: Any
    mesh: Mesh
    inner_mesh: Mesh

    @property
    def model_name(self) -> str:
        return self.inner.model_name

    @property
    def core(self) -> Any:
        return self.inner.core

    @property
    def pipeline(self) -> Any:
        return self.inner.pipeline

    @property
    def loss_graph(self) -> fx.GraphModule:
        return self.inner.loss_graph

    @property
    def history(self) -> list[PassRecord]:
        """The passes that built the sub-mesh program (the axis rewrites its rank modules)."""
        return self.inner.history

    def inner_rank(self, rank: int) -> int:
        """The sub-mesh rank that global ``rank`` plays (its coordinates off this axis)."""
        coords = self.mesh.coordinates(rank)
        return self.inner_mesh.rank_of({a: coords.get(a, 0) for a, _ in self.inner_mesh.axes})

