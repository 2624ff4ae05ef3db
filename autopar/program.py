"""A compiled program: one class on every mesh (:class:`Program`), built from the stage programs
of the mesh without the batch axes (:class:`StageProgram`, one per pipeline stage; one without
pp) and the phases the batch axes and recompute run on each stage.

A program's rank modules come from its stages' materialized programs: each stage's
rank-independent program (autopar.codegen.materialize, after the tp and cp passes) rewritten by
the program's :class:`Phase` s in order (ep places the experts and makes its batch statistics
global, the recompute pass in the stage's mode, dp makes its batch statistics global); a rank's
module is its shard (autopar.codegen.shard).

:func:`collectives_of` reads one training step's collectives off the lowered graph: each
collective op contributes its forward transfer and the backward transfer its ``grad`` mode
implies (only when the value needs a gradient).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from autopar.codegen import copy_program, materialize, ready, render, shard
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


class StageProgram:
    """One stage's compiled program of the mesh without the batch axes (tp, or cp x tp; the
    whole model without pp): its plan, lowered graph, trace and pass history, and the recompute
    mode its plan was priced with (:func:`autopar.axes.recompute.priced`).  A
    :class:`Program` holds one per pipeline stage."""

    def __init__(self, *, plan: Plan, mesh: Mesh, graph_module: fx.GraphModule,
                 traced: Traced, history: list[PassRecord], recompute: str = "none",
                 recompute_effect: Any = None, priced_graph: fx.GraphModule | None = None) -> None:  # fmt: skip
        self.plan = plan
        self.mesh = mesh
        self.graph_module = graph_module
        # what the cost model prices: the graph before passes.overlap_tp fused collectives
        # into matmuls (the same work; the plan's collectives carry the seconds it hides)
        self.priced_graph = priced_graph if priced_graph is not None else graph_module
        self.traced = traced
        self.history = history
        self.recompute = recompute  # the mode the recompute phase runs on this stage
        self.recompute_effect = recompute_effect
        self._modules: dict[int, fx.GraphModule] = {}

    def priced(self, plan: Plan, recompute: str, effect: Any) -> StageProgram:
        """This stage with ``plan`` (re-priced for ``recompute``), sharing its graph."""
        out = StageProgram(plan=plan, mesh=self.mesh, graph_module=self.graph_module,
                           traced=self.traced, history=self.history, recompute=recompute,
                           recompute_effect=effect, priced_graph=self.priced_graph)  # fmt: skip
        if "materialized" in self.__dict__:  # already built: the copy shares it
            out.materialized = self.materialized
        return out

    @cached_property
    def materialized(self) -> fx.GraphModule:
        """The rank-independent program (whole parameters; :func:`autopar.codegen.materialize`)."""
        return materialize(self.graph_module, self.traced)

    @property
    def whole(self) -> Materialized:
        return Materialized(module=self.materialized, traced=self.traced, mesh=self.mesh)

    def module(self, rank: int) -> fx.GraphModule:
        """``rank``'s (in :attr:`mesh`) shard of the stage before the phases (no recompute):
        what the planners of the batch axes read."""
        if rank not in self._modules:
            self._modules[rank] = self.whole.build(rank)
        return self._modules[rank]

    def __repr__(self) -> str:
        return f"<autopar.StageProgram {self.plan.model} on {self.mesh}, plan {self.plan.hash}>"


@dataclass(frozen=True, kw_only=True)
class Phase:
    """What one axis runs on every materialized stage after the stages are compiled: ``run(i,
    stage)`` returns stage ``i`` rewritten (itself where nothing changed) and the records of
    its passes."""

    name: str
    run: Callable[[int, Materialized], tuple[Materialized, list[PassRecord]]]


def recompute_phase(stages: Sequence[StageProgram]) -> Phase:
    """The ``recompute`` pass on each stage in the mode its plan was priced with."""
    return Phase(name="recompute", run=lambda i, m: m.recomputed(stages[i].recompute))


def compile_phase(backend: str, micro_pipeline_tp: bool = False) -> Phase:
    """The ``compile_blocks`` pass on each stage (``compile=``), after every other phase;
    ``micro_pipeline_tp``: inductor's micro-pipelined TP on (autopar.ops.compiled)."""
    def run(i: int, m: Materialized) -> tuple[Materialized, list[PassRecord]]:
        from passes.compile_blocks import compile_blocks

        ctx = PassContext(mesh=m.mesh, grad=frozenset(), traced=m.traced,
                          sections={"compile": backend, "micro_pipeline_tp": micro_pipeline_tp})
        return m.rewritten(ctx, [compile_blocks])

    return Phase(name="compile", run=run)


def fp8_phase(recipe: str, heads: frozenset[str], batch: tuple[str, ...]) -> Phase:
    """The ``fp8`` pass on each stage (``fp8=``; ``heads``: the output head's linears,
    ``batch``: the program's batch axes), after the batch axes' and recompute phases, before
    ``compile``; its savings priced on the stage mesh's GPU."""
    def run(i: int, m: Materialized) -> tuple[Materialized, list[PassRecord]]:
        from passes.fp8 import Fp8Decisions, fp8

        decided = Fp8Decisions(recipe=recipe, heads=heads, batch=batch, gpu=m.mesh.cluster.gpu)
        ctx = PassContext(mesh=m.mesh, grad=frozenset(), traced=m.traced,
                          sections={"fp8": decided})
        return m.rewritten(ctx, [fp8])

    return Phase(name="fp8", run=run)


class Program:
    """What :func:`autopar.autoparallelize` returns on a virtual mesh, whatever its axes.

    1. ``plan``: the one frozen :class:`autopar.plan.Plan` (a section per axis).
    2. ``stages``: the :class:`StageProgram` of each pipeline stage (one without pp);
       ``pipeline`` the stage cuts and schedule (autopar.axes.pipeline.PipelineLayout, None
       without pp); ``stage_layers`` the MoE layers ep found per stage (empty without ep).
    3. ``phases``: what the axes run on each materialized stage, in order (ep's passes, the
       recompute pass, dp's); :meth:`final` is a stage after them all, :attr:`history` every
       pass that built the program.
    4. ``module(rank)`` / ``share(rank)`` (under pp: the rank's stages and schedule) /
       ``code(rank)`` / ``collectives()`` / ``save(directory)`` / ``report(path)``.
    """

    def __init__(self, *, mesh: Mesh, plan: Plan, stages: Sequence[StageProgram],
                 pipeline: Any = None, phases: Sequence[Phase] = (),
                 stage_layers: tuple[tuple[Any, ...], ...] = ()) -> None:  # fmt: skip
        self.mesh, self.plan = mesh, plan
        self.stages = tuple(stages)
        self.pipeline = pipeline
        self.phases = tuple(phases)
        self.stage_layers = stage_layers
        self._finals: dict[tuple[int, int], tuple[Materialized, list[PassRecord]]] = {}
        self._modules: dict[tuple[int, int], fx.GraphModule] = {}

    def then(self, mesh: Mesh, plan: Plan, phase: Phase | None = None, *, first: bool = False,
             **facts: Any) -> Program:  # fmt: skip
        """This program's stages on ``mesh`` with ``plan``, ``phase`` run after its phases (before
        them: ``first``); ``facts`` replace the ep facts (``stage_layers``)."""
        extra = () if phase is None else (phase,)
        phases = (*extra, *self.phases) if first else (*self.phases, *extra)
        kept = {"stage_layers": self.stage_layers, **facts}
        out = Program(mesh=mesh, plan=plan, stages=self.stages, pipeline=self.pipeline,
                      phases=phases, **kept)  # fmt: skip
        if not first:  # the same phases first: the stages already run through them are kept
            out._finals = self._finals
        return out

    @property
    def model_name(self) -> str:
        return self.plan.model

    @property
    def layers(self) -> tuple[Any, ...]:
        """The MoE layers ep places (every stage's)."""
        return tuple(layer for ls in self.stage_layers for layer in ls)

    @property
    def loss_graph(self) -> fx.GraphModule:
        """The traced graph whose output is the loss (the last stage's)."""
        return self.stages[-1].traced.gm

    @property
    def graph_module(self) -> fx.GraphModule:
        """The lowered graph of a program of one stage."""
        return self._one_stage().graph_module

    @property
    def priced_graph(self) -> fx.GraphModule:
        """The graph the cost model prices, of a program of one stage (StageProgram's)."""
        return self._one_stage().priced_graph

    @property
    def traced(self) -> Traced:
        """The trace of a program of one stage."""
        return self._one_stage().traced

    def _one_stage(self) -> StageProgram:
        if len(self.stages) != 1:
            raise AttributeError(f"{self!r} has {len(self.stages)} pipeline stages: read "
                                 "prog.stages[i].graph_module / .traced")  # fmt: skip
        return self.stages[0]

    # ------------------------------------------------------------ stages after the phases

    def final(self, stage: int = 0, upto: int | None = None) -> Materialized:
        """Stage ``stage`` materialized after the first ``upto`` phases (default: all)."""
        return self._after(stage, len(self.phases) if upto is None else upto)[0]

    def _after(self, stage: int, k: int) -> tuple[Materialized, list[PassRecord]]:
        if k == 0:
            return self.stages[stage].whole, []
        if (stage, k) not in self._finals:
            before = self._after(stage, k - 1)[0]
            self._finals[(stage, k)] = self.phases[k - 1].run(stage, before)
        return self._finals[(stage, k)]

    @property
    def history(self) -> list[PassRecord]:
        """Every pass that built the program: the stage split and each stage's tp / cp passes,
        then each phase on each stage in turn."""
        def tag(r: PassRecord, i: int) -> PassRecord:
            return dataclasses.replace(r, name=f"{r.name} [stage {i}]") if self.pipeline else r

        built = [tag(r, i) for i, st in enumerate(self.stages) for r in st.history]
        if self.pipeline is not None:
            built.insert(0, self.pipeline.split)
        for k in range(1, len(self.phases) + 1):
            built += [tag(r, i) for i in range(len(self.stages)) for r in self._after(i, k)[1]]
        return built

    def stages_of(self, pp_rank: int) -> list[int]:
        """Stages held by a pipeline rank: s, s + p, ... (interleaved placement; [0] without pp)."""
        if self.pipeline is None:
            return [0]
        return list(range(pp_rank, len(self.stages), self.mesh.size("pp")))

    # ------------------------------------------------------------ a rank's program

    def module(self, rank: int, stage: int | None = None) -> fx.GraphModule:
        """``rank``'s module of ``stage`` (default: the rank's first stage), holding only its
        shards: every data-parallel replica runs the same one."""
        coords = self.mesh.coordinates(rank)
        stage = self.stages_of(coords.get("pp", 0))[0] if stage is None else stage
        final = self.final(stage)
        local = final.mesh.rank_of({**coords, "dp": 0})
        if (stage, local) not in self._modules:
            self._modules[(stage, local)] = ready(final.build(local))
        return self._modules[(stage, local)]

    def share(self, rank: int) -> Any:
        """Under pp, what ``rank`` runs: its stages' modules and the schedule's settings
        (autopar.runtime.RankShare)."""
        if self.pipeline is None:
            raise AttributeError(f"{self!r} has no pipeline axis: run prog.module(rank)")
        coords = self.mesh.coordinates(rank)
        return self.pipeline.share(self, coords, {s: self.module(rank, s)
                                                  for s in self.stages_of(coords["pp"])})  # fmt: skip

    def code(self, rank: int = 0) -> str:
        """Readable generated source of ``rank``'s program (each of its stages under pp)."""
        stages = self.stages_of(self.mesh.coordinates(rank).get("pp", 0))
        if self.pipeline is None:
            return render(self.module(rank), self.header(rank))
        return "\n".join(f"# ===== stage {s} of {len(self.stages)} on rank {rank} =====\n"
                         + render(self.module(rank, s), self.header(rank)) for s in stages)  # fmt: skip

    def header(self, rank: int) -> str:
        coords = self.mesh.coordinates(rank)
        at = ", ".join(f"{a}={c}" for a, c in coords.items())
        lines = [f"# autopar program · plan {self.plan.label} · rank {rank} of "
                 f"{self.mesh.world_size} · mesh coordinates ({at})"]  # fmt: skip
        if self.plan.dp:
            lines.append(f"# batch slice dp={coords['dp']}; gradients reduced over "
                         f"{' x '.join(self.plan.dp.zero_axes)} with ZeRO-{self.plan.dp.zero}")
        if self.plan.ep:
            lines.append(f"# batch slice ep={coords['ep']}: the experts of this ep rank")
        lines.append(f"# {self.mesh}; comments give each node's local shape and layout "
                     "P(per tensor dim: mesh axes splitting it; partial=axes still to be summed)")
        return "\n".join(lines) + "\n"

    def collectives(self) -> list[Collective]:
        """The plan's collectives: kind, axis, shape, dtype, bytes, direction; under pp each
        stage's for one micro-batch (`Plan.runs_per_step` says how often a step runs each)."""
        return list(self.plan.collectives)

    def timeline(self) -> Any:
        """Under pp: the simulated schedule (autopar.axes.schedule)."""
        return self._pipeline().timeline(self.mesh.size("pp"), len(self.stages))

    def train_step(self, optimizer_factory: Callable[[list[Any]], Any]) -> Any:
        """Under pp on a virtual mesh: the schedule this step would run (print it)."""
        from autopar.axes.pipeline import TrainStepPreview

        self._pipeline()
        return TrainStepPreview(self, optimizer_factory)

    def _pipeline(self) -> Any:
        if self.pipeline is None:
            raise AttributeError(f"{self!r} has no pipeline axis")
        return self.pipeline

    @cached_property
    def distinct_programs(self) -> dict[str, tuple[int, list[int]]]:
        """Source text (without header) -> (its pipeline stage, the ranks running it)."""
        out: dict[str, tuple[int, list[int]]] = {}
        for rank in range(self.mesh.world_size):
            for s in self.stages_of(self.mesh.coordinates(rank).get("pp", 0)):
                out.setdefault(render(self.module(rank, s), ""), (s, []))[1].append(rank)
        return out

    def save(self, directory: str | Path) -> list[Path]:
        """Write one runnable .py per distinct program (under pp: per stage), plan.txt,
        plan.json, and under pp pipeline.txt (the simulated schedule)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        written = []
        for i, (stage, ranks) in enumerate(self.distinct_programs.values()):
            path = d / f"program_{i}.py"
            module = self.module(ranks[0], stage)
            head = f"# pipeline stage {stage} of {len(self.stages)}\n" if self.pipeline else ""
            path.write_text(_preamble(module, ranks) + head + render(module, self.header(ranks[0])))
            written.append(path)
        (d / "plan.txt").write_text(str(self.plan) + "\n")
        (d / "plan.json").write_text(self.plan.to_json())
        written += [d / "plan.txt", d / "plan.json"]
        if self.pipeline is not None:
            (d / "pipeline.txt").write_text(str(self.timeline()) + "\n")
            written.append(d / "pipeline.txt")
        return written

    def report(self, path: str | Path, **options: Any) -> Path:
        """The plan drawn in one self-contained HTML file (`autopar.tools.report.write_report`:
        ``png_dir=`` also writes each chart as PNG, ``measured=`` a measured schedule)."""
        from autopar.tools.report import write_report

        return write_report(self, path, **options)

    def __repr__(self) -> str:
        stages = f", {len(self.stages)} stages" if self.pipeline is not None else ""
        return f"<autopar.Program {self.plan.model} on {self.mesh}{stages}, plan {self.plan.label}>"


def program_of(mesh: Mesh, stages: Sequence[StageProgram], pipeline: Any = None) -> Program:
    """The program of the mesh without the batch axes: its stages (each priced in its recompute
    mode), their plan (under pp: the pipeline's, autopar.axes.pipeline.pipeline_plan) and the
    recompute phase."""
    if pipeline is None:
        plan = stages[0].plan
    else:
        from autopar.axes.pipeline import pipeline_plan

        plan = pipeline_plan(mesh, pipeline, [s.plan for s in stages])
    return Program(mesh=mesh, plan=plan, stages=stages, pipeline=pipeline,
                   phases=(recompute_phase(stages),))  # fmt: skip


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
                   names: dict[str, str],
                   hidden: Mapping[str, tuple[float, float]] | None = None,
                   regathered: Mapping[str, float] | None = None) -> list[Collective]:  # fmt: skip
    """Forward and backward collectives of the lowered graph (see module docstring); one that
    ``hidden`` names (collective node -> forward, backward seconds) is decomposed under its
    matmuls (passes.overlap_tp) and carries the seconds that saves; a gather ``regathered``
    names (-> seconds its ring hides) runs once more in backward, re-gathering its shard."""
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
        fwd_s, bwd_s = (hidden or {}).get(node.name, (0.0, 0.0))
        if node.target in _FORWARD:
            rec = _record(_FORWARD[node.target], axis, val, "fwd", where, runs_in)
            found.append(dataclasses.replace(rec, hidden_s=fwd_s))
        back = _BACKWARD.get((node.target, mode))
        if back and x.name in grad:
            found.append(dataclasses.replace(_record(back, axis, val, "bwd", where, runs_in),
                                             hidden_s=bwd_s))  # fmt: skip
        if node.name in (regathered or {}):
            found.append(dataclasses.replace(_record("all_gather", axis, val, "bwd", where, runs_in),
                                             hidden_s=regathered[node.name], regather=True))  # fmt: skip
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
    """A shared split's gradient sum: one backward all-reduce of this rank's piece on the
    sub-group of the ``rep`` ranks holding it (listed, and priced, on the axis: an upper
    bound, the sub-group has fewer ranks)."""
    x, axis, rep = node.args
    return [_record("all_reduce", axis, x.meta["val"], "bwd", _where(x, node, names),
                    meta.dtype(x))]  # fmt: skip


def _ce_collectives(node: fx.Node) -> list[Collective]:
    rows = node.args[0].meta["val"].shape[0]
    axis = node.args[2]
    stats = [torch.empty(rows, device="meta"), torch.empty(rows, 2, device="meta")]
    return [_record("all_reduce", axis, s, "fwd", meta.module_path(node)) for s in stats]
