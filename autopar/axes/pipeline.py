"""Pipeline parallelism: cost-balanced stage cuts, per-stage programs, real schedules.

Algorithm (:func:`compile_pipeline`):
1. The schedule and micro-batch count come first (:func:`pipeline_config`): the driver
   traces the model (plus loss) once, on one micro-batch (the batch must divide by the
   micro-batch count); the traced function must return one scalar loss.
2. Price each cuttable unit (prologue, each block, epilogue): its forward+backward compute on
   the stage's tensor-parallel degree, plus the send/recv of the values live across each
   boundary on the pipeline axis's link.
3. Choose the cuts exactly: a dynamic program over contiguous partitions minimises the slowest
   stage (compute + boundary traffic), skipping partitions whose stages do not fit memory
   (parameters with Adam state + the schedule's in-flight micro-batches of activations);
   user-pinned cuts (``split_points``) are kept; a reloaded plan's cuts are taken as saved.
4. Split the graph (passes.pipeline_split) and compile every stage for the tensor-parallel axis,
   in order: each boundary value leaves a stage in the layout its plan produced it in (a
   Megatron-SP sequence shard is sent as each rank's shard, not gathered whole) and the next
   stage's plan takes that placement as the one the value arrives in
   (``PlanOptions.arrive``); the plan's "sends" are the compiled per-rank bytes.  Under cp
   a sequence-split boundary value travels as each cp rank's chunks (:func:`_cp_stages`).
5. Run with torch.distributed.pipelining's schedules (GPipe, 1F1B, interleaved 1F1B,
   interleaved zero-bubble); gradients of a weight used on two stages (tied embeddings) are
   summed between them after each step.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopar.errors import FitError, InputError, MeshError, PlanError
from autopar.frontend.precision import annotate_autocast
from autopar.frontend.trace import Traced
from autopar.ir import meta
from autopar.ir.analysis import needs_grad
from autopar.mesh import Mesh
from autopar.plan import Plan, PpSection
from autopar.planner.tp import PlanOptions, run_node_time
from autopar.program import StageProgram
from autopar.runtime import RankShare
from autopar.runtime.guards import StepInputs
from cost.comm import collective_time
from cost.compute import train_factor
from cost.errors import CostInputError
from cost.memory import in_flight as cost_in_flight
from cost.memory import stage_buffers
from cost.stages import balanced_cuts as stage_cuts
from passes import PassRecord, record
from passes.pipeline_split import (
    StageGraph,
    Unit,
    boundary_bytes,
    boundary_dtype,
    cuttable_units,
    split_stages,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
ADAM_BYTES_PER_PARAM = 16  # fp32 parameter, gradient and two Adam moments


@dataclass(frozen=True, kw_only=True)
class StageCut:
    """The chosen cuts and what the cost model predicts for each stage."""

    cuts: tuple[int, ...]  # unit index where each stage after the first starts
    units: tuple[str, ...]
    stage_s: tuple[float, ...]  # predicted forward+backward seconds per micro-batch per stage
    boundary_bytes: tuple[float, ...]  # bytes sent by each stage per micro-batch (forward)
    # of those, the bytes of the values that carry a gradient (what comes back in backward);
    # None: all of them
    grad_bytes: tuple[float, ...] | None = None

    @property
    def gradient_bytes(self) -> tuple[float, ...]:
        """Bytes of each stage's sent values whose gradient comes back per micro-batch."""
        return self.boundary_bytes if self.grad_bytes is None else self.grad_bytes

    @property
    def slowest_s(self) -> float:
        return max(self.stage_s)

    def describe(self) -> list[str]:
        bounds = [0, *self.cuts, len(self.units)]
        rows = []
        for s, (a, b) in enumerate(itertools.pairwise(bounds)):
            names = self.units[a:b]
            span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            rows.append(f"stage {s}: {span:<34} {self.stage_s[s] * 1e3:8.3f} ms/micro-batch"
                        f"  sends {self.boundary_bytes[s] / 2**20:8.2f} MiB")  # fmt: skip
        return rows


def balanced_cuts(costs: Sequence[float], boundary: Sequence[float], stages: int,
                  pinned: Sequence[int] = (), fits: Callable[[int, int], bool] | None = None,
                  ) -> tuple[list[int], float]:  # fmt: skip
    """Exact contiguous partition of ``costs`` into ``stages`` minimising the slowest stage:
    `cost.stages.balanced_cuts`, the rule the whole-cluster search cuts its stages by too
    (a stage over units [a, b) costs sum(costs[a:b]) + boundary[b]); PlanError when no
    partition exists."""
    try:
        return stage_cuts(costs, boundary, stages, pinned, fits)
    except CostInputError as exc:
        raise PlanError(str(exc)) from None


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    n_microbatches: int
    schedule: str
    virtual_stages: int
    param_dtype: torch.dtype = torch.float32  # weights' compute dtype (mixed precision)
    mixed_precision: str = "cast"  # how a 16-bit param_dtype runs (autopar.options)

    @property
    def autocast_dtype(self) -> torch.dtype:
        """The dtype stages compute under autocast and send activations in ("autocast"), else
        fp32: a "cast" graph is traced in ``param_dtype`` and sends what it traced."""
        return self.param_dtype if self.mixed_precision == "autocast" else torch.float32

    def in_flight(self, stage: int, stages: int) -> float:
        """Micro-batches of activations ``stage`` of ``stages`` holds at its peak: GPipe all
        of them; 1F1B one per stage still ahead of it (at most all); interleaved (stage s on
        pipeline rank r = s mod p of p ranks, v stages each) the rank's warm-up chunk
        forwards plus one, (v - 1) p + 2 (p - 1 - r) + 1, in micro-batches of all its
        stages (÷ v), at most all m, as ``cost.memory.in_flight`` prices it."""
        m = self.n_microbatches
        if self.schedule == "gpipe":
            return m
        v = max(self.virtual_stages, 1)
        if v == 1:
            return min(m, stages - stage)
        ranks = max(stages // v, 1)
        return cost_in_flight("interleaved", ranks, m, v, stage % ranks)

    @property
    def order(self) -> str:
        """The action order simulated for this schedule (zero-bubble runs interleaved's F/B
        order; its split of B into input and weight passes fills the bubble further)."""
        return "interleaved" if self.schedule == "zero_bubble" else self.schedule


def choose_cuts(traced: Traced, units: list[Unit], mesh: Mesh, config: PipelineConfig,
                split_points: Sequence[str], memory_limit: float | None = None,
                saved: Sequence[str] | None = None) -> StageCut:  # fmt: skip
    """Steps 2-3: price units and boundaries, then cut exactly; every stage must fit
    ``memory_limit`` (default: the GPU's memory).  ``saved`` (a reloaded plan's stage
    starts) are the cuts, priced but not chosen."""
    p = mesh.size("pp") * config.virtual_stages
    if p > len(units):
        raise PlanError(
            f"{p} pipeline stages but {traced.model_name} has only {len(units)} cuttable units "
            f"({', '.join(u.name for u in units)}); use fewer stages or virtual stages"
        )
    costs, boundary, sent = unit_costs(traced, units, mesh, config.autocast_dtype)
    if saved is not None:
        return _stage_cut(saved_cuts(units, saved, p, traced), units, costs, boundary, sent)
    pinned = [_pin_index(units, name, traced) for name in split_points]
    capacity = memory_limit if memory_limit is not None else mesh.cluster.gpu.hbm_bytes
    fits = _memory_check(traced, units, mesh, config, p, capacity, sent)
    try:
        cuts, _ = balanced_cuts(costs, boundary, p, pinned, fits)
    except PlanError as exc:
        held = config.in_flight(0, p)
        raise FitError(
            f"{exc}: a stage must hold its parameters with Adam state (16 B each), "
            f"{held:g} in-flight micro-batch(es) of activations and a receive buffer per "
            f"micro-batch at each boundary within {capacity / 2**30:.2f} GiB "
            f"per GPU ({'memory_limit' if memory_limit is not None else mesh.cluster.gpu.name}); "
            "use more pipeline stages, more micro-batches, tp, or a larger memory_limit"
        ) from None
    return _stage_cut(cuts, units, costs, boundary, sent)


def _stage_cut(cuts: list[int], units: list[Unit], costs: list, boundary: list,
               sent: list) -> StageCut:  # fmt: skip
    """The cuts with each stage's predicted time and the bytes it sends on."""
    bounds = [0, *cuts, len(units)]
    stage_s = tuple(sum(costs[a:b]) + (boundary[b] if b < len(units) else 0.0)
                    for a, b in itertools.pairwise(bounds))  # fmt: skip
    out_bytes = tuple(sent[b] if b < len(units) else 0.0 for _, b in itertools.pairwise(bounds))
    return StageCut(cuts=tuple(cuts), units=tuple(u.name for u in units), stage_s=stage_s,
                    boundary_bytes=out_bytes)  # fmt: skip


def saved_cuts(units: list[Unit], starts: Sequence[str], stages: int, traced: Traced) -> list[int]:
    """A reloaded plan's stage starts as unit indices: one per stage after the first, each a
    cuttable unit of this model, in order."""
    names = [u.name for u in units]
    if len(starts) != stages - 1:
        raise PlanError(f"the plan's pp section cuts {len(starts) + 1} stages but this mesh "
                        f"and its virtual stages make {stages}; re-plan without plan=")  # fmt: skip
    unknown = [s for s in starts if s not in names[1:]]
    if unknown:
        raise PlanError(f"the plan's pp section starts stages at {', '.join(unknown)}, which "
                        f"{traced.model_name} has no cuttable unit after the first for (its "
                        f"units: {', '.join(names)}); re-plan without plan=")  # fmt: skip
    cuts = [names.index(s) for s in starts]
    if cuts != sorted(set(cuts)):
        raise PlanError(f"the plan's pp section starts stages out of order: {', '.join(starts)}")
    return cuts


def unit_costs(traced: Traced, units: list[Unit], mesh: Mesh,
               param_dtype: torch.dtype = torch.float32) -> tuple[list, list, list]:  # fmt: skip
    """Per unit: forward+backward seconds on the stage's tp degree; per boundary: seconds to
    send the live values forward and their gradients back, and the bytes (activations in
    ``param_dtype`` under mixed precision, as the runtime sends them)."""
    tp, gpu = mesh.size("tp"), mesh.cluster.gpu
    grad = needs_grad(traced)
    costs = [sum(run_node_time(n, gpu) * train_factor(n, n in grad) for n in u.nodes) / tp
             for u in units]  # fmt: skip
    link = mesh.cluster.axis_link(mesh.axes, "pp")
    sent = boundary_bytes(traced, units, grad=frozenset(n.name for n in grad),
                          param_dtype=param_dtype)  # fmt: skip
    boundary = [2 * collective_time("send_recv", b, 2, link) if b else 0.0 for b in sent]
    return costs, boundary, sent


def _pin_index(units: list[Unit], name: str, traced: Traced) -> int:
    for i, u in enumerate(units):
        if u.name == name or u.name.startswith(name + "."):
            if i == 0:
                raise PlanError(
                    f"split point {name!r} is the first unit: a cut there makes an empty stage"
                )
            return i
    known = ", ".join(u.name for u in units)
    raise PlanError(
        f"split point {name!r} is not a cuttable module of {traced.model_name}; "
        f"cuts can fall before: {known}"
    )


def _memory_check(traced: Traced, units: list[Unit], mesh: Mesh, config: PipelineConfig,
                  p: int, capacity: float, sent: Sequence[float] = ()) -> Callable[[int, int], bool]:  # fmt: skip
    """A stage over units [a, b) fits: its parameters with Adam state, the first stage's
    in-flight micro-batches of its activations, and the runtime's buffers at its boundaries
    (``sent[i]``: bytes live before unit i; `data_parallel.pipeline_buffers`), all ÷ tp."""
    tp = mesh.size("tp")
    m = config.n_microbatches
    param_bytes = []
    act_bytes = []
    for u in units:
        params = {a for n in u.nodes for a in n.all_input_nodes if a.name in traced.params}
        param_bytes.append(sum(a.meta["val"].numel() for a in params) * ADAM_BYTES_PER_PARAM / tp)
        act_bytes.append(sum(_nbytes(n) for n in u.nodes) / tp)
    held = config.in_flight(0, p)  # every stage is checked with the first stage's worst case

    def buffers(a: int, b: int) -> float:
        if not sent:
            return 0.0
        inputs, outputs = sent[a] if a > 0 else 0.0, sent[b] if b < len(units) else 0.0
        return stage_buffers(m, held, inputs, outputs) / tp

    def fits(a: int, b: int) -> bool:
        return sum(param_bytes[a:b]) + held * sum(act_bytes[a:b]) + buffers(a, b) <= capacity

    return fits


def _nbytes(n: fx.Node) -> float:
    """Bytes of ``n``'s value as the stage holds it (its autocast dtype under bf16)."""
    return meta.nbytes(n) if isinstance(n.meta.get("val"), torch.Tensor) else 0.0


def microbatch(example_inputs: Sequence[Any], example_kwargs: dict | None, m: int) -> tuple:
    """The first of ``m`` equal micro-batches of every tensor input (dim 0)."""

    def first(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % m:
            raise InputError(
                f"n_microbatches={m} does not divide the batch dimension of an input of shape "
                f"{tuple(t.shape)}; choose a micro-batch count that divides {t.shape[0]}"
            )
        return t[: t.shape[0] // m]

    return tuple(first(t) for t in example_inputs), {
        k: first(v) for k, v in (example_kwargs or {}).items()
    }


def default_microbatches(batch: int, stages: int) -> int:
    """Smallest divisor of the batch that is at least twice the stage count (else the batch)."""
    for m in range(2 * stages, batch + 1):
        if batch % m == 0:
            return m
    return batch


def loss_output(traced: Traced) -> fx.Node:
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    leaves = [a for a in torch.utils._pytree.tree_leaves(out.args[0]) if isinstance(a, fx.Node)]
    scalars = [
        a
        for a in leaves
        if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dim() == 0
    ]
    if len(scalars) != 1:
        raise InputError(
            f"pipeline parallelism needs {traced.model_name} (with loss_fn) to return one scalar "
            f"loss; it returns {len(leaves)} outputs, {len(scalars)} of them scalar. Pass "
            "loss_fn=... (the last example input is its target) or labels to an HF model."
        )
    return scalars[0]


def _precision(config: PipelineConfig) -> list[str]:
    if config.param_dtype == torch.float32:
        return []
    name = str(config.param_dtype).replace("torch.", "")
    if config.mixed_precision == "cast":
        return [f"mixed precision: stages compute in {name} (weights cast once per step, fp32 "
                f"masters); activations and their gradients cross stage boundaries in {name} "
                "(values the model keeps in fp32 cross in fp32)"]  # fmt: skip
    return [f"mixed precision: stages compute under {name} autocast (fp32 weights); "
            f"activations and their gradients cross stage boundaries in {name}"]  # fmt: skip


def _formula(config: PipelineConfig, p: int) -> float:
    from autopar.axes.schedule import formula_bubble

    return formula_bubble(config.order, p, config.n_microbatches, config.virtual_stages)


@dataclass(frozen=True, kw_only=True)
class PipelineLayout:
    """The pipeline axis of a :class:`autopar.program.Program`: the stage cuts, the schedule,
    each stage's graph (its boundary inputs and outputs), the names that carry a gradient, the
    split pass's record, and the weights several stages use (tied: FQN -> stages)."""

    cut: StageCut
    config: PipelineConfig
    graphs: tuple[StageGraph, ...]
    grad_names: frozenset[str]
    split: PassRecord
    tied: dict[str, tuple[int, ...]]
    model_name: str  # the whole model's (each stage's trace is named per stage)
    inputs: StepInputs  # what a step's call must be (checked before the schedule runs)

    def timeline(self, p: int, n_stages: int) -> Any:
        from autopar.axes.schedule import actions, simulate

        c = self.config
        return simulate(actions(c.order, p, c.n_microbatches, c.virtual_stages), n_stages)

    def share(self, prog: Any, coords: dict[str, int], modules: dict[int, Any]) -> RankShare:
        """What the rank at ``coords`` of ``prog`` runs: ``modules`` (its stages') and the
        schedule's settings."""
        stages = prog.stages
        io = {s: _io(stages[s].graph_module, self.graphs[s], self.grad_names) for s in modules}
        placements = {s: {fqn: lay for fqn, lay in _tp_placements(stages[s]).items()
                          if fqn in self.tied} for s in modules}  # fmt: skip
        shapes = {fqn: tuple(stages[ix[0]].traced.tensors[fqn].shape)
                  for fqn, ix in self.tied.items()}  # fmt: skip
        return RankShare(modules=modules, n_stages=len(stages), config=self.config,
                         tied_shapes=shapes, mesh=prog.mesh, coords=coords, io=io,
                         placements=placements, inputs=self.inputs)  # fmt: skip


def _tied(stages: Sequence[StageProgram]) -> dict[str, tuple[int, ...]]:
    """Weights used on more than one stage (tied embeddings) -> those stages."""
    uses: dict[str, list[int]] = {}
    for i, st in enumerate(stages):
        for fqn in st.traced.params.values():
            uses.setdefault(fqn, []).append(i)
    return {fqn: tuple(ix) for fqn, ix in uses.items() if len(ix) > 1}


def _tp_placements(prog: StageProgram) -> dict[str, str]:
    return {prog.traced.params[n.name]: str(meta.layout(n).placement("tp")
                                            if meta.layout(n) is not None else "R")
            for n in prog.graph_module.graph.nodes
            if n.op == "placeholder" and n.name in prog.traced.params}  # fmt: skip


def pipeline_plan(mesh: Mesh, layout: PipelineLayout, stages: Sequence[Plan]) -> Plan:
    """The one Plan of a pipelined mesh: the pp section (cuts, schedule, bubble), each stage's
    plan (priced in its recompute mode), and every stage's parameters and collectives (compute
    and communication summed over the stages, one micro-batch each)."""
    c, cut, p = layout.config, layout.cut, mesh.size("pp")
    section = PpSection(stage_starts=tuple(cut.units[i] for i in cut.cuts),
                        schedule=c.schedule, n_microbatches=c.n_microbatches,
                        virtual_stages=c.virtual_stages,
                        bubble=layout.timeline(p, len(stages)).bubble,
                        formula_bubble=_formula(c, p), slowest_s=cut.slowest_s,
                        tied=tuple(sorted(layout.tied)),
                        precision=tuple(_precision(c)))  # fmt: skip
    stages = tuple(stages)
    return Plan(model=layout.model_name, mesh=mesh.axes, hardware=stages[0].hardware,
                params=tuple(dict.fromkeys(x for s in stages for x in s.params)),
                collectives=tuple(x for s in stages for x in s.collectives), choice=(),
                compute_s=sum(s.compute_s for s in stages), comm_s=sum(s.comm_s for s in stages),
                memory_bytes=max(s.memory_bytes for s in stages), notes=tuple(cut.describe()),
                pp=section, recompute=stages[0].recompute, stages=stages)  # fmt: skip


def _io(gm: fx.GraphModule, stage: StageGraph, grad: frozenset[str]) -> tuple[list, list]:
    """(shape, dtype, requires_grad) of a stage program's inputs and outputs at their local
    shapes (whole over tp; under cp a sequence-split boundary value is this rank's chunks); a
    boundary value carries a gradient when it depends on a weight."""
    spec = lambda n, name: (tuple(n.meta["val"].shape), n.meta["val"].dtype, name in grad)  # noqa: E731
    ins = [
        spec(n, n.name) for n in gm.graph.nodes if n.op == "placeholder" and n.name in stage.inputs
    ]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = torch.utils._pytree.tree_leaves(out.args[0])
    return ins, [spec(a, name) for a, name in zip(leaves, stage.outputs, strict=True)]


class TrainStepPreview:
    """``prog.train_step(...)`` on a virtual mesh: prints the schedule; runs nowhere."""

    def __init__(self, prog: Any, optimizer_factory: Callable) -> None:
        self.prog, self.optimizer_factory = prog, optimizer_factory

    def __str__(self) -> str:
        c = self.prog.pipeline.config
        t = self.prog.timeline()
        return (f"{c.schedule} schedule, {c.n_microbatches} micro-batches, {len(self.prog.stages)} stages "
                f"on {self.prog.mesh.size('pp')} pipeline ranks\n{t}\n"
                f"formula bubble: {_formula(c, self.prog.mesh.size('pp')):.1%}")  # fmt: skip

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(
            "a virtual Mesh has no processes to run on: call autoparallelize(model, device_mesh, "
            "...) inside torchrun (or autopar.verify) and use the returned runner's train_step"
        )


def pipeline_config(mesh: Mesh, batch: int, n_microbatches: int | None, schedule: str,
                    virtual_stages: int | None, param_dtype: torch.dtype = torch.float32,
                    mixed_precision: str = "cast") -> PipelineConfig:  # fmt: skip
    """Step 1 before tracing: the schedule, its virtual stages and the micro-batch count for a
    per-rank batch of ``batch`` rows (the micro-batch is what the driver traces)."""
    if schedule not in SCHEDULES:
        raise InputError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    v = virtual_stages or (2 if schedule in ("interleaved", "zero_bubble") else 1)
    p = mesh.size("pp")
    m = n_microbatches or default_microbatches(batch, p * v)
    if schedule == "zero_bubble" and mesh.size("tp") > 1:
        raise InputError(
            "the zero_bubble schedule splits backward into input- and weight-gradient passes, and "
            "tensor-parallel collectives inside backward then run in a different order on "
            "different ranks (a deadlock); use schedule='interleaved' or '1f1b' with tp > 1"
        )
    if schedule != "gpipe" and m < p:
        raise InputError(
            f"the {schedule} schedule needs at least as many micro-batches as pipeline ranks "
            f"({p}); got n_microbatches={m} (GPipe has no such limit)"
        )
    return PipelineConfig(n_microbatches=m, schedule=schedule, virtual_stages=v,
                          param_dtype=param_dtype, mixed_precision=mixed_precision)  # fmt: skip


def compile_pipeline(traced: Traced, mesh: Mesh, config: PipelineConfig, options: PlanOptions,
                     split_points: Sequence[str], log: Callable[[str], None],
                     cp_attention: str | None = None, *,
                     plan: Plan | None = None) -> tuple[list[StageProgram], PipelineLayout]:  # fmt: skip
    """Steps 2-4 (see the module docstring) on ``traced``, one micro-batch's graph; with a cp
    axis every stage is split along the sequence (autopar.axes.context_parallel), its
    sequence-split boundary values sent as each cp rank's chunks (:func:`_cp_stages`).  ``config.param_dtype`` 16-bit: stages run under autocast with their
    activations sent in it (priced so).  A reloaded ``plan`` gives the cuts and each stage's
    plan (its config is the caller's, taken from the plan).  Returns the stage programs and
    the pipeline's layout (the driver prices their recompute mode and makes the Program)."""
    from autopar.axes.tensor_parallel import compile_traced

    param_dtype = config.autocast_dtype
    annotate_autocast(traced.gm, param_dtype)  # stage memory priced in the runtime dtype
    loss = loss_output(traced)
    units = cuttable_units(traced)
    cut = choose_cuts(traced, units, mesh, config, split_points, options.memory_limit,
                      plan.pp.stage_starts if plan else None)  # fmt: skip
    log("stage cuts: " + "; ".join(cut.describe()))
    start, before = time.perf_counter(), len(traced.gm.graph.nodes)
    graphs = split_stages(traced, units, list(cut.cuts), loss)
    split = record("pipeline_split", before, start, [g.traced.gm for g in graphs])
    log(str(split))
    stage_mesh = Mesh(mesh.cluster, tp=mesh.size("tp"))
    stage_opts = PlanOptions(memory_limit=options.memory_limit, memory_weight=options.memory_weight,
                             strict=options.strict, param_dtype=param_dtype,
                             solve_cache=options.solve_cache, tp_overlap=options.tp_overlap)  # fmt: skip
    if "cp" in mesh.sizes:
        stage_mesh = Mesh.ordered(tuple(a for a in mesh.axes if a[0] in ("cp", "tp")),
                                  mesh.cluster)  # fmt: skip
        whole = dataclasses.replace(stage_opts, replicate_outputs=True)  # whole over tp
        stages = _cp_stages(traced, graphs, stage_mesh, whole, plan, cp_attention)
    else:
        stages, arrive = [], {}
        link = mesh.cluster.axis_link(mesh.axes, "pp")
        for g, opts, _ in _stage_plans(graphs, stage_opts, stage_mesh, plan):
            opts = dataclasses.replace(opts, send_link=link if g is not graphs[-1] else None,
                                       arrive=tuple((n, arrive[n]) for n in g.inputs
                                                    if n in arrive))  # fmt: skip
            stages.append(compile_traced(g.traced, stage_mesh, opts, log, whole_model=False))
            arrive.update(sent_placements(stages[-1].graph_module, g))
    grad = frozenset(n.name for n in needs_grad(traced))
    sent = [_sent_bytes(st.graph_module, g, grad, param_dtype) if g is not graphs[-1] else 0.0
            for st, g in zip(stages, graphs, strict=True)]  # fmt: skip
    back = [_sent_bytes(st.graph_module, g, grad, param_dtype, only_grad=True)
            if g is not graphs[-1] else 0.0 for st, g in zip(stages, graphs, strict=True)]  # fmt: skip
    cut = dataclasses.replace(cut, boundary_bytes=tuple(sent), grad_bytes=tuple(back))
    return stages, PipelineLayout(cut=cut, config=config, graphs=tuple(graphs), grad_names=grad,
                                  split=split, tied=_tied(stages),
                                  model_name=traced.model_name,
                                  inputs=StepInputs.of(traced, config.n_microbatches))  # fmt: skip


def _cp_stages(traced: Traced, graphs: list[StageGraph], stage_mesh: Mesh, options: PlanOptions,
               plan: Plan | None, cp_attention: str | None) -> list[StageProgram]:  # fmt: skip
    """Step 4 under cp: every stage split along the sequence, its boundary values sent as
    each cp rank's chunks (as Megatron's and torchtitan's stages send them: cp x fewer
    bytes, no gather).

    Algorithm:
    1. One sequence layout for every stage (autopar.axes.context_parallel.seq_layout of the
       whole model: every stage sees the same sequence, so a causal model's balanced chunks
       are the same chunks on both sides of a boundary).
    2. Compile the stages in order (compile_traced_cp): a boundary value the cp pass splits
       leaves its stage as this rank's chunks (no gather), and the next stage takes it as
       arriving in that placement (no re-split; its gradient goes back split).  Values
       without a split sequence dim (the labels, a window cut from a split value) travel
       whole, as before.
    """
    from autopar.axes.context_parallel import compile_traced_cp, seq_layout

    lay = seq_layout(traced, stage_mesh.size("cp"))
    stages: list[StageProgram] = []
    arrive: dict[str, Any] = {}
    for g, opts, saved in _stage_plans(graphs, options, stage_mesh, plan):
        stages.append(compile_traced_cp(
            g.traced, stage_mesh, cp_attention, opts, saved.cp if saved else None, layout=lay,
            arrive=tuple((n, arrive[n]) for n in g.inputs if n in arrive), keep_split=True))
        arrive.update(cp_sent_placements(stages[-1].graph_module, g))
    return stages


def cp_sent_placements(gm: fx.GraphModule, stage: StageGraph) -> dict[str, Any]:
    """Step 2 of :func:`_cp_stages`: the boundary values of ``stage`` that leave split over
    cp, with their cp placement (a ``Shard`` of the sequence dim)."""
    from autopar.ir.layout import Layout, Shard

    found = {}
    for node, name in zip(_outputs(gm), stage.outputs, strict=True):
        lay = meta.layout(node) if isinstance(node, fx.Node) else None
        p = lay.placement("cp") if isinstance(lay, Layout) else None
        if isinstance(p, Shard):
            found[name] = p
    return found


def _outputs(gm: fx.GraphModule) -> list[fx.Node]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [a for a in torch.utils._pytree.tree_leaves(out.args[0])]


def sent_placements(gm: fx.GraphModule, stage: StageGraph) -> dict[str, str]:
    """Step 4: the tp placement each boundary value of ``stage`` leaves in (the layout its
    plan produced it in: Megatron-SP's sequence shard stays a shard), which the next stage's
    plan takes as the placement it arrives in."""
    found = {}
    for node, name in zip(_outputs(gm), stage.outputs, strict=True):
        lay = meta.layout(node) if isinstance(node, fx.Node) else None
        found[name] = str(lay.placement("tp")) if lay is not None else "R"
    return found


def _sent_bytes(gm: fx.GraphModule, stage: StageGraph, grad: frozenset[str],
                param_dtype: torch.dtype, only_grad: bool = False) -> float:  # fmt: skip
    """Bytes one rank of ``stage`` sends per micro-batch: its boundary values' local shards
    in the dtype they cross in (``passes.pipeline_split.boundary_dtype``); ``only_grad``:
    only the values that carry a gradient (whose gradients come back in backward)."""
    total = 0.0
    for node, name in zip(_outputs(gm), stage.outputs, strict=True):
        v = node.meta.get("val") if isinstance(node, fx.Node) else None
        if only_grad and not (name in grad and isinstance(v, torch.Tensor)
                              and v.dtype.is_floating_point):  # fmt: skip
            continue
        if isinstance(v, torch.Tensor):
            total += v.numel() * boundary_dtype(v.dtype, v.shape, name in grad, param_dtype).itemsize
    return total


def _stage_plans(graphs: list[StageGraph], options: PlanOptions, stage_mesh: Mesh,
                 plan: Plan | None) -> list[tuple[StageGraph, PlanOptions, Plan | None]]:  # fmt: skip
    """Per stage: its graph, its solver options (a reloaded stage plan's tp strategies fixed)
    and that stage plan (None without a plan)."""
    if plan is None:
        return [(g, options, None) for g in graphs]
    if len(plan.stages) != len(graphs):
        raise PlanError(f"the plan has {len(plan.stages)} stage plans for {len(graphs)} "
                        "stages; re-plan without plan=")  # fmt: skip
    for i, saved in enumerate(plan.stages):
        if saved.mesh != stage_mesh.axes:
            raise MeshError(f"the plan's stage {i} was made for Mesh{dict(saved.mesh)} but "
                            f"the stage mesh is {stage_mesh}")  # fmt: skip
    return [(g, dataclasses.replace(options, fixed=saved.choice, overlap_fixed=saved.overlap), saved)
            for g, saved in zip(graphs, plan.stages, strict=True)]  # fmt: skip


def batch_size(args: Sequence[Any], kwargs: dict | None) -> int:
    for t in [*args, *(kwargs or {}).values()]:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return t.shape[0]
    raise InputError(
        "pipeline parallelism needs a batched tensor input to split into micro-batches"
    )
