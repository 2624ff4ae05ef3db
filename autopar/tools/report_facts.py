"""The facts a report draws, read from whichever plan or program it is given.

One `Facts` record holds every number the report shows; each is copied from the plan's own
record (`autopar.plan.Plan`, the dp section's `memory`, a search `Choice`, a `Timeline`), or
computed by the function that produced that record, never estimated a second time here.

Algorithm (`facts_of`):
1. Recognise the object: a whole-cluster search (`autopar.planner.auto.Ranking`), one priced
   configuration (`cost.estimate.Estimate`), or a compiled program (`autopar.program.Program`,
   on any mesh).
2. Mesh on the cluster: each axis's (stride, size) in rank order and the link its groups
   ride: the topology's `links` for a search (the split `Plan.links` reports), the cluster's
   `axis_link` for a compiled mesh (what `Mesh.describe` prints).
3. Communication: bytes per (axis, kind, direction) summed over one step's collectives (under
   pp a stage's run once per micro-batch: `Plan.runs_per_step`);
   the step's components (compute, exposed communication per axis, bubble, optimizer) from
   the step breakdown or each stage's `Plan.compute_s` / `comm_s`.
4. Memory: per ZeRO stage the search's `rank_memory` at that stage, or the data-parallel
   plan's table; per pipeline rank the rows `memory_table` takes its maximum over.
5. Pipeline schedule: the simulated timeline with each slot's (stage, micro-batch), and a
   measured one when given.
6. Layouts per module-path pattern, the per-rank code, and the search's ranking.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from cost.hardware import Cluster

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True, kw_only=True)
class AxisRow:
    """One mesh axis on the cluster: its groups (size ranks, stride apart) and links."""

    axis: str
    size: int
    stride: int
    links: tuple[str, ...]  # link names, NVLink first
    in_node: bool  # every group inside one node's NVSwitch domain
    exposed_s: float | None  # predicted exposed seconds per step, None when not priced


@dataclass(frozen=True, kw_only=True)
class CommRow:
    """Bytes one step's collectives of one kind move on one axis in one direction."""

    axis: str
    kind: str
    direction: str  # fwd, bwd, step
    bytes: float
    count: int


@dataclass(frozen=True, kw_only=True)
class MemoryBar:
    """Per-rank bytes of one bar (a ZeRO stage, or a pipeline rank at the chosen stage)."""

    label: str
    weights: float
    grads: float
    optimizer: float
    activations: float
    reserve: float
    chosen: bool = False

    @property
    def parts(self) -> tuple[tuple[str, float], ...]:
        return (("weights", self.weights), ("gradients", self.grads),
                ("optimizer state", self.optimizer), ("activations", self.activations),
                ("reserve", self.reserve))  # fmt: skip

    @property
    def total(self) -> float:
        return sum(v for _, v in self.parts)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """A pipeline timeline: per pipeline rank, per slot (kind, stage, micro-batch) or None."""

    name: str
    slots: tuple[tuple[tuple[str, int, int] | None, ...], ...]
    bubble: float
    measured: tuple[tuple[int, str, int, float, float], ...] = ()  # rank, F|B, mb, t0, t1


@dataclass(frozen=True, kw_only=True)
class RankPoint:
    """One ranked configuration of a search."""

    rank: int
    label: str
    step_s: float
    memory_bytes: float
    loses_on: str
    compare: bool = False


@dataclass(frozen=True, kw_only=True)
class Facts:
    """Everything one report shows (see the module docstring)."""

    title: str
    summary: tuple[tuple[str, str], ...]
    cluster: Cluster
    axes: tuple[AxisRow, ...]
    comm: tuple[CommRow, ...]
    step: tuple[tuple[str, float], ...]  # (component, seconds) of the step's critical path
    step_note: str
    memory: tuple[MemoryBar, ...]
    capacity: float
    memory_note: str
    pipeline_memory: tuple[MemoryBar, ...] = ()
    schedule: Schedule | None = None
    layouts: tuple[tuple[str, str, int], ...] = ()  # (pattern, layout, count)
    code: tuple[tuple[str, str], ...] = ()  # (title, source)
    ranking: tuple[RankPoint, ...] = ()
    notes: tuple[str, ...] = ()


def facts_of(obj: Any, measured: Any = None) -> Facts:
    """Step 1: dispatch on the kind of plan or program (see the module docstring)."""
    from autopar.planner.auto import AutoChoice, Ranking
    from cost.estimate import Estimate

    if isinstance(obj, AutoChoice):
        obj = obj.plan
    if isinstance(obj, Ranking):
        return _search_facts(obj)
    if isinstance(obj, Estimate):
        return _estimate_facts(obj)
    if hasattr(obj, "mesh") and hasattr(obj, "plan") and hasattr(obj, "code"):
        from autopar.tools.report_program import program_facts

        return program_facts(obj, measured)
    raise TypeError(
        f"cannot report a {type(obj).__name__}: give a compiled program (autoparallelize's "
        "result), an autopar.planner.auto.Ranking (plan_shape) or a cost.estimate.Estimate"
    )


def group_of(rank: int, stride: int, size: int) -> int:
    """Index of the group (of `size` ranks `stride` apart) that `rank` belongs to."""
    return (rank // (stride * size)) * stride + rank % stride


def _search_facts(plan: Any) -> Facts:
    """A whole-cluster search: the best configuration's facts plus the ranking (step 6)."""
    best, r = plan.best, plan.result
    base = _choice_facts(r.estimate(best), best, plan)
    found = plan.compare_rank()
    compare_key = found[1].key if found else None
    ranking = tuple(
        RankPoint(rank=i + 1, label=ch.describe(), step_s=ch.step_time_s,
                  memory_bytes=ch.memory.total, loses_on="-" if i == 0 else r.why_lost(ch),
                  compare=ch.key == compare_key)
        for i, ch in enumerate(r.ranked)
    )  # fmt: skip
    c = r.cluster
    summary = (
        ("searched", f"{r.space:,} configurations ({r.priced:,} priced) in {r.seconds:.2f} s"),
        *base.summary,
    )
    if plan.compare is not None and found is None:
        summary += (("compare", "the hand-chosen configuration fits nowhere"),)
    title = f"{r.model.name} on {c.nodes} × {c.gpus_per_node} {c.gpu.name}"
    return replace(base, title=title, summary=summary, ranking=ranking)


def _estimate_facts(est: Any) -> Facts:
    """One priced configuration, its groups laid out as `cost.step` prices them."""
    return _choice_facts(est, None, None)


def _choice_facts(est: Any, choice: Any, plan: Any) -> Facts:
    """Steps 2-5 for a priced configuration (a search's choice or an estimate)."""
    c, cl = est.config, est.cluster
    order = choice.order if choice is not None else None
    axes = _priced_axes(est, choice, plan)
    step = (("compute", est.step.compute),
            *((f"{a} comm", s) for a, s in est.step.comm.items() if s > 0),
            ("bubble", est.step.bubble), ("optimizer", est.step.optimizer))  # fmt: skip
    summary = (
        ("configuration", _config_text(c, order)),
        ("step", f"{est.step_time_s:.4f} s, MFU {est.mfu:.1%}, "
                 f"{est.tokens_per_s:,.0f} tokens/s"),
        ("memory", f"{est.memory.total / 2**30:.1f} GiB per rank of "
                   f"{est.memory.capacity / 2**30:.0f} GiB"),
    )  # fmt: skip
    return Facts(
        title=f"{est.model} on {cl.nodes} × {cl.gpus_per_node} {cl.gpu.name}",
        summary=summary, cluster=cl, axes=axes, comm=_priced_comm(est, axes),
        step=tuple((k, float(v)) for k, v in step if v > 0 or k == "compute"),
        step_note="seconds of one optimizer step on the critical path (cost.step)",
        memory=_zero_bars(est), capacity=est.memory.capacity,
        memory_note="per rank on the most loaded pipeline stage (cost.memory.rank_memory)",
        schedule=simulated(c.schedule, c.pp, est.micro_batches, c.virtual_stages)
        if c.pp > 1 else None,
    )  # fmt: skip


def _config_text(c: Any, order: tuple[str, ...] | None) -> str:
    v = f" v={c.virtual_stages}" if c.schedule == "interleaved" else ""
    nest = f" nest={'>'.join(order)}" if order else ""
    return (f"tp={c.tp} pp={c.pp} dp={c.dp} cp={c.cp} ep={c.ep} b={c.micro_batch} "
            f"{c.schedule}{v} recompute={c.recompute} zero={c.zero}{nest}")  # fmt: skip


def _priced_axes(est: Any, choice: Any, plan: Any) -> tuple[AxisRow, ...]:
    """Step 2 for a priced configuration: the search's nesting on its topology, or the
    estimate's fixed order (pp, dp, cp, tp outermost first) on the two-level link model."""
    from cost.search import spans
    from cost.step import _spans

    c, cl = est.config, est.cluster
    if plan is not None:
        groups = spans(choice.order, c.tp, c.pp, c.dp, c.cp, c.ep)
        rows = plan.links(choice)
    else:
        groups, rows = _spans(c), []
    out = []
    for axis in ("pp", "dp", "cp", "ep", "tp"):
        stride, size = groups[axis]
        if size <= 1:
            continue
        in_node = cl.gpus_per_node % (stride * size) == 0
        links = tuple(link for a, link, _ in rows if a == axis)
        if not links:
            links = (cl.intra.name,) if in_node else (cl.inter.name,)
            if plan is not None:
                links = tuple(plan.topology.links("all_reduce", 1.0, stride, size))
        out.append(AxisRow(axis=axis, size=size, stride=stride, links=links, in_node=in_node,
                           exposed_s=float(est.step.comm.get(axis, 0.0))))  # fmt: skip
    return tuple(out)


def _priced_comm(est: Any, axes: tuple[AxisRow, ...]) -> tuple[CommRow, ...]:
    """Step 3 for a priced configuration: each axis's message (the bytes `Plan.links`
    prices it by), forward and backward where the axis communicates in both."""
    w, c = est.work, est.config
    params = w.layers * w.layer_dense_params / max(c.pp, 1) + w.edge_params
    volumes = {"tp": ("all_reduce", w.tp_bytes, ("fwd", "bwd")),
               "cp": ("send_recv", w.cp_bytes, ("fwd", "bwd")),
               "ep": ("all_to_all", w.ep_bytes, ("fwd", "bwd")),
               "pp": ("send_recv", w.boundary_bytes, ("fwd", "bwd")),
               "dp": ("all_reduce", 4 * params, ("bwd",))}  # fmt: skip
    out = []
    for row in axes:
        kind, nbytes, directions = volumes[row.axis]
        out += [CommRow(axis=row.axis, kind=kind, direction=d, bytes=float(nbytes), count=1)
                for d in directions]  # fmt: skip
    return tuple(out)


def _zero_bars(est: Any) -> tuple[MemoryBar, ...]:
    """Step 4 for a priced configuration: `rank_memory` at each ZeRO stage, the
    configuration's own stage being exactly its recorded breakdown."""
    from cost.memory import rank_memory
    from cost.step import pipeline_shares

    c, w = est.config, est.work
    ranks = pipeline_shares(w, c, est.cluster, schedule=c.schedule, virtual=c.virtual_stages,
                            micro_batches=est.micro_batches)  # fmt: skip
    bars = []
    for stage in (0, 1, 2, 3):
        m = est.memory if stage == c.zero else rank_memory(
            w, pp=c.pp, zero=stage, dp_dense=c.data_parallel,
            dp_expert=c.data_parallel // c.ep, schedule=c.schedule,
            micro_batches=est.micro_batches, virtual=c.virtual_stages, recompute=c.recompute,
            capacity=est.memory.capacity, grad_bytes=c.grad_bytes,
            weight_bytes=c.weight_bytes, ranks=ranks)  # fmt: skip
        bars.append(MemoryBar(label=f"ZeRO-{stage}", weights=m.weights, grads=m.grads,
                              optimizer=m.optimizer, activations=m.activations,
                              reserve=m.reserved, chosen=stage == c.zero))  # fmt: skip
    return tuple(bars)


def simulated(schedule: str, p: int, m: int, v: int, name: str | None = None) -> Schedule:
    """Step 5: `autopar.axes.schedule`'s simulation, each busy slot labelled with its action (the
    simulation runs a rank's actions in order, one per busy slot)."""
    from autopar.axes.schedule import actions, simulate

    per_rank = actions(schedule, p, m, v)
    timeline = simulate(per_rank, p * v)
    slots = []
    for row, acts in zip(timeline.rows, per_rank, strict=True):
        it = iter(acts)
        slots.append(tuple(None if ch == "." else next(it) for ch in row))
    title = name or f"{schedule}, {p} pipeline ranks, {m} micro-batches" + (
        f", {v} virtual stages" if v > 1 else ""
    )
    return Schedule(name=title, slots=tuple(slots), bubble=timeline.bubble)


def comm_rows(collectives: list[Any], times: Any = lambda c: 1) -> tuple[CommRow, ...]:
    """Step 3 for a compiled program: bytes of one step's collectives by (axis, kind,
    direction); ``times(c)``: how many times a step runs ``c`` (`Plan.runs_per_step`: under
    pp a stage's collectives once per micro-batch)."""
    total: Counter = Counter()
    count: Counter = Counter()
    for c in collectives:
        total[(c.axis, c.kind, c.direction)] += c.bytes * times(c)
        count[(c.axis, c.kind, c.direction)] += times(c)
    return tuple(CommRow(axis=a, kind=k, direction=d, bytes=float(total[(a, k, d)]),
                         count=count[(a, k, d)]) for a, k, d in sorted(total))  # fmt: skip
