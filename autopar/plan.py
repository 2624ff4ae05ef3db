"""The plan: what autopar decided and why, printable and serialisable.

A :class:`Plan` records the mesh, each parameter's layout, the collectives of one training
step (with bytes), the predicted step time and per-rank memory, and the chosen strategy of
every node (what makes it reloadable).  Printing groups repeated blocks by module-path
pattern (``layers.*.attn.q.weight``) so a 32-layer model prints like one layer.

One Plan holds every axis's decisions, so one JSON document reloads any mesh:
1. ``choice``: the tp strategy of every node (empty under pp: each stage's plan holds its own).
2. One section per other axis the mesh has: ``dp`` (ZeRO stage), ``ep`` (capacity factor and
   the MoE layers placed), ``pp`` (the unit each stage starts at, schedule, micro-batches,
   virtual stages; ``stages`` holds each stage's Plan), ``cp`` (each attention's choice);
   ``recompute`` the mode of every rank program.
3. :meth:`Plan.without` is the plan of the sub-mesh a wrapper axis compiles (the front door
   hands it down); :meth:`Plan.differences` names every decision two plans do not share,
   which the front door reports when a reloaded plan does not come back as saved.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from autopar.errors import PlanError


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective of one training step."""

    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all
    axis: str
    shape: tuple[int, ...]  # the full (unsplit) tensor the collective moves
    dtype: str
    bytes: int  # the full message size
    direction: str  # 'fwd' or 'bwd'
    where: str  # module path of the value
    hidden_s: float = 0.0  # seconds a decomposition under its matmuls saves (planner.overlap)
    regather: bool = False  # a backward re-gather of a kept shard (planner.overlap step 4)

    def __str__(self) -> str:
        shape = ",".join(map(str, self.shape))
        ring = " ring-overlapped" if self.hidden_s else ""
        again = " re-gather" if self.regather else ""
        return f"{self.direction} {self.kind:<14} {self.axis:<3} {self.dtype}[{shape}]{ring}{again}"


@dataclass(frozen=True, kw_only=True)
class ZeroMemory:
    """Per-rank bytes under one ZeRO stage."""

    stage: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    # of the activations, what the pipeline runtime holds besides the saved tensors (receive
    # buffers, in-flight outputs: `autopar.axes.data_parallel.pipeline_buffers`); 0 without pp
    buffers: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    def __str__(self) -> str:
        held = f" incl. pipeline buffers {_fmt_bytes(self.buffers)}" if self.buffers else ""
        parts = (f"weights {_fmt_bytes(self.weights)}, gradients {_fmt_bytes(self.grads)}, "
                 f"optimizer {_fmt_bytes(self.optimizer)}, activations "
                 f"{_fmt_bytes(self.activations)}{held}")  # fmt: skip
        return f"ZeRO-{self.stage}: {_fmt_bytes(self.total):>10} per rank ({parts})"


@dataclass(frozen=True, kw_only=True)
class PlanStep:
    """The compiled plan's predicted seconds of one training step, by the search's functions
    (`cost.step`): the sub-mesh program's micro-batches (compute + tp/cp/pp communication,
    under pp the slowest stage's m micro-batches plus the bubble), the exposed data-axis
    gradient traffic and the optimizer step."""

    sub_mesh: float
    bubble: float
    dp: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.sub_mesh + self.bubble + self.dp + self.optimizer

    def __str__(self) -> str:
        return (f"predicted step {self.total * 1e3:.3f} ms = sub-mesh forward+backward "
                f"{self.sub_mesh * 1e3:.3f} ms + pipeline bubble {self.bubble * 1e3:.3f} ms + "
                f"exposed data-axis traffic {self.dp * 1e3:.3f} ms + optimizer step "
                f"{self.optimizer * 1e3:.3f} ms")  # fmt: skip


def fact(default: Any = None) -> Any:
    """A section field that records what the axis found (printed, saved), not a decision:
    the plan's hash and :meth:`Plan.differences` compare decisions only."""
    return field(default=default, compare=False)


@dataclass(frozen=True, kw_only=True)
class DpSection:
    """The data axis: the ZeRO stage (the decision) and what chose it."""

    zero: int  # ZeRO stage
    reduction: str = fact("mean")  # the loss over the batch: gradients averaged or summed
    batch: int = fact(0)  # global batch
    zero_axes: tuple[str, ...] = fact(("dp",))  # the ZeRO group: gradients reduced once over these
    memory: tuple[ZeroMemory, ...] = fact(())  # per-rank bytes at each ZeRO stage
    memory_limit: float = fact(0.0)
    links: tuple[str, ...] = fact(())  # per mesh axis: "dp=2 over ib", ...
    param_dtype: str = fact("float32")  # compute (and ZeRO-3 all-gather) dtype
    mixed_precision: str = fact("cast")  # how a 16-bit param_dtype runs (autopar.options)
    reduce_dtype: str = fact("float32")  # gradient reduction dtype
    step: PlanStep | None = fact()  # predicted step time, the search's functions
    notes: tuple[str, ...] = fact(())  # why this stage (and engine)
    # times a step runs each forward/backward gather and reduce-scatter: the micro-batches of
    # a pipeline under ZeRO-2/3 (each micro-batch's backward syncs), else 1
    micro_batches: int = fact(1)

    @staticmethod
    def revive(d: dict[str, Any]) -> DpSection:
        """From plan.json (lists back to tuples, the memory rows and step to records)."""
        d = {**d, "memory": tuple(ZeroMemory(**m) for m in d.get("memory", ())),
             "step": PlanStep(**d["step"]) if d.get("step") else None}  # fmt: skip
        return DpSection(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@dataclass(frozen=True, kw_only=True)
class EpSection:
    """The expert axis: E/ep contiguous experts of each layer per ep rank (the decisions: the
    capacity factor and the layers placed) and the traffic that follows."""

    capacity_factor: float | None  # None: dropless
    layers: tuple[tuple[str, int], ...]  # (module path, experts) of each MoE layer placed
    reduction: str = fact("mean")
    batch: int = fact(0)  # global batch
    links: tuple[str, ...] = fact(())
    link: str = fact("")  # the link the ep groups ride
    layer_s: float = fact(0.0)  # predicted all-to-all seconds per MoE layer (fwd + bwd)
    comm_s: float = fact(0.0)  # predicted ep seconds of one step (all-to-alls, loss, dense grads)
    param_bytes: tuple[int, int] = fact((0, 0))  # per rank: dense parameters, this rank's experts
    described: tuple[str, ...] = fact(())  # one line per MoE layer (its grouped matmuls)
    bucket_bytes: int = fact(0)  # the dense-gradient bucket cap
    notes: tuple[str, ...] = fact(())

    @staticmethod
    def revive(d: dict[str, Any]) -> EpSection:
        return EpSection(**{k: (_pairs(v) if k == "layers" else tuple(v))
                            if isinstance(v, list) else v for k, v in d.items()})  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class PpSection:
    """The pipeline axis: the cuts, schedule and micro-batches (the decisions) and the
    predicted bubble."""

    stage_starts: tuple[str, ...]  # the cuttable unit each stage after the first starts at
    schedule: str
    n_microbatches: int
    virtual_stages: int
    cuts: tuple[str, ...] = fact(())  # one line per stage: units, time, bytes sent
    bubble: float = fact(0.0)  # of the simulated schedule
    formula_bubble: float = fact(0.0)
    slowest_s: float = fact(0.0)  # seconds per micro-batch of the slowest stage
    tied: tuple[str, ...] = fact(())  # parameters held by several stages (gradients summed)
    precision: tuple[str, ...] = fact(())

    @staticmethod
    def revive(d: dict[str, Any]) -> PpSection:
        return PpSection(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@dataclass(frozen=True, kw_only=True)
class CpSection:
    """The context axis's decision per attention node."""

    attention: tuple[tuple[str, str], ...]  # (node, 'ring' | 'all_to_all')

    @staticmethod
    def revive(d: dict[str, Any]) -> CpSection:
        return CpSection(attention=_pairs(d["attention"]))


SECTIONS = {"dp": DpSection, "ep": EpSection, "pp": PpSection, "cp": CpSection}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A frozen, printable, serialisable parallel plan (every axis's decisions)."""

    model: str
    mesh: tuple[tuple[str, int], ...]
    hardware: str
    params: tuple[tuple[str, str], ...]  # (fqn, layout)
    collectives: tuple[Collective, ...]
    choice: tuple[tuple[str, str], ...]  # (node name, strategy)
    compute_s: float
    comm_s: float
    memory_bytes: float
    notes: tuple[str, ...] = ()
    dp: DpSection | None = None
    ep: EpSection | None = None
    pp: PpSection | None = None
    cp: CpSection | None = None
    recompute: str = "none"
    stages: tuple[Plan, ...] = ()  # under pp: each stage's plan
    advice: tuple[str, ...] = ()  # NCCL settings the topology calls for (printed, not applied)
    overlap: tuple[str, ...] = ()  # tp collectives decomposed under their matmuls (planner.overlap)

    @property
    def hash(self) -> str:
        """Of the decisions: the mesh and tp choices, plus any other axis's (a tp-only plan's
        hash is that of its mesh and choices alone)."""
        extra = self._decisions()
        text = json.dumps([self.mesh, self.choice, *([extra] if extra else [])], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def _decisions(self) -> dict[str, Any]:
        """The decisions beyond tp that are set (sections, recompute, stage plans' hashes)."""
        out: dict[str, Any] = {a: decisions(getattr(self, a)) for a in SECTIONS if getattr(self, a)}
        if self.recompute != "none":
            out["recompute"] = self.recompute
        if self.overlap:
            out["overlap"] = list(self.overlap)
        if self.stages:
            out["stages"] = [s.hash for s in self.stages]
        return out

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    def runs_per_step(self, c: Collective) -> int:
        """How many times one training step runs collective ``c`` of this plan (the plan
        lists a pipeline stage's collectives for one micro-batch): under pp the stage
        programs' and the expert axis's once per micro-batch, the data axis's ZeRO-2/3
        gathers and reduce-scatters `DpSection.micro_batches` times; the loss all-reduce
        and the once-a-step gradient reductions and post-step gather once."""
        if self.pp is None or c.where == "loss":
            return 1
        if "dp" in c.axis.split("_"):
            return self.dp.micro_batches if self.dp and _per_micro_batch(c) else 1
        return self.pp.n_microbatches

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> Plan:
        return Plan.from_dict(json.loads(text))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Plan:
        """The Plan of a parsed plan.json (a file without sections: a tp-only plan)."""
        known = {f.name for f in fields(Plan)}
        if unknown := sorted(set(d) - known):
            raise PlanError(f"plan.json has unknown fields {', '.join(unknown)} (a plan of "
                            f"another autopar version?); it knows {', '.join(sorted(known))}")  # fmt: skip
        d = {**d, "mesh": _pairs(d["mesh"]), "params": _pairs(d["params"]),
             "choice": _pairs(d["choice"]), "notes": tuple(d.get("notes", ())),
             "advice": tuple(d.get("advice", ())), "overlap": tuple(d.get("overlap", ()))}  # fmt: skip
        d["collectives"] = tuple(
            Collective(**{**c, "shape": tuple(c["shape"])}) for c in d["collectives"]
        )
        for axis, cls in SECTIONS.items():
            if d.get(axis) is not None:
                d[axis] = cls.revive(d[axis])
        d["stages"] = tuple(Plan.from_dict(s) for s in d.get("stages", ()))
        return Plan(**d)

    @staticmethod
    def load(path: str | Path) -> Plan:
        return Plan.from_json(Path(path).read_text())

    def without(self, axis: str) -> Plan:
        """The plan of the sub-mesh without ``axis`` (as :meth:`Mesh.without`): its section
        and its collectives (also those of a group it is part of: ``dp_cp``) dropped."""
        mesh = tuple(a for a in self.mesh if a[0] != axis) or (("tp", 1),)
        kept = tuple(c for c in self.collectives if axis not in c.axis.split("_"))
        return replace(self, mesh=mesh, collectives=kept, **{axis: None})

    def differences(self, other: Plan) -> list[str]:
        """Every decision ``other`` does not share with this plan, named (model, mesh, each
        axis's section, recompute, each node's tp strategy, each stage's plan)."""
        out = [f"{name}: {mine!r} vs {theirs!r}" for name, mine, theirs in (
            ("model", self.model, other.model), ("mesh", dict(self.mesh), dict(other.mesh)),
            *((a, getattr(self, a), getattr(other, a)) for a in SECTIONS),
            ("recompute", self.recompute, other.recompute),
            ("tp overlap", self.overlap, other.overlap),
            ("pipeline stages", len(self.stages), len(other.stages)),
        ) if mine != theirs]  # fmt: skip
        out += _choice_differences(dict(self.choice), dict(other.choice))
        for i, (a, b) in enumerate(zip(self.stages, other.stages, strict=False)):
            out += [f"stage {i}: {d}" for d in a.differences(b)]
        return out

    @property
    def label(self) -> str:
        """The plan's printed name: a tp (or cp) plan's hash; under pp the stages' hashes
        (``e8e4-81f0``); with a batch axis the sub-mesh plan's label and the axis
        (``…-ep2``, ``…-dp2z1``: dp degree and ZeRO stage)."""
        sizes = dict(self.mesh)
        if self.dp:
            group = "".join(f"{a}{sizes[a]}" for a in self.dp.zero_axes)
            return f"{self.without('dp').label}-{group}z{self.dp.zero}"
        if self.ep:
            return f"{self.without('ep').label}-ep{sizes['ep']}"
        if self.pp:
            return "-".join(s.hash[:4] for s in self.stages)
        return self.hash

    def __str__(self) -> str:
        """The outermost axis's paragraph, then the plan of the mesh without it: dp, then ep,
        then pp (each stage's plan), then the tp / cp plan's layouts and collectives."""
        if self.dp:
            return "\n".join(_dp_lines(self))
        if self.ep:
            return "\n".join(_ep_lines(self))
        if self.pp:
            return "\n".join(_pp_lines(self))
        mesh = ", ".join(f"{a}={s}" for a, s in self.mesh)
        out = [
            f"autopar plan {self.hash} · {self.model} on Mesh({mesh}) · priced on {self.hardware}"
        ]
        out += [f"{a}: {_describe(getattr(self, a))}" for a in SECTIONS if getattr(self, a)]
        if self.recompute != "none":
            out.append(f"recompute: {self.recompute}")
        out.append("parameters (layout per module-path pattern):")
        for (pattern, lay), n in _patterns(self.params).items():
            out.append(f"  {pattern:<48} {lay:<22} ×{n}")
        out.append("collectives of one training step (message = full tensor):")
        for (c, where), n in _collective_groups(self.collectives).items():
            out.append(
                f"  {c:<44} {_fmt_bytes(_bytes_of(c, self.collectives)):>10}  ×{n:<3} {where}"
            )
        if not self.collectives:
            out.append("  (none)")
        total = sum(c.bytes for c in self.collectives)
        out.append(f"  total {_fmt_bytes(total)} per step")
        out.append(
            f"predicted step: compute {self.compute_s * 1e3:.3f} ms + communication "
            f"{self.comm_s * 1e3:.3f} ms = {self.step_s * 1e3:.3f} ms (fwd+bwd)"
        )
        out.append(
            f"memory per rank: {_fmt_bytes(self.memory_bytes)} "
            "(parameters, gradients and Adam moments in fp32, plus saved activations)"
        )
        out += [f"why: {n}" for n in self.notes]
        out += [f"advice (launch environment; autopar sets none of it): {a}" for a in self.advice]
        for i, stage in enumerate(self.stages):
            out += ["", f"--- stage {i} ---", str(stage)]
        return "\n".join(out)


def wire_bytes(c: Collective, size: int) -> float:
    """Bytes one rank sends for ``c`` on a ring of ``size`` ranks (REFERENCE.md)."""
    factor = 2 if c.kind == "all_reduce" else 1
    return factor * (size - 1) / size * c.bytes


def _precision_line(param_dtype: str, reduce_dtype: str, mode: str = "cast") -> str:
    if param_dtype == "float32":
        return "precision: fp32 throughout"
    how = ("weights and inputs cast once per step, activations and the residual stream in "
           f"{param_dtype}, the statistics the model upcasts in fp32" if mode == "cast"
           else "torch.autocast, weights cast per step")  # fmt: skip
    return (f"mixed precision: {param_dtype} compute ({how}; gathered in {param_dtype}), fp32 "
            f"master weights and optimizer state, gradients reduced in {reduce_dtype}")  # fmt: skip


def _dp_lines(plan: Plan) -> list[str]:
    """The data axis's paragraph (degree, ZeRO group, memory per stage, traffic, why), then
    the sub-mesh plan."""
    dp, sizes = plan.dp, dict(plan.mesh)
    n, group = sizes["dp"], math.prod(sizes[a] for a in plan.dp.zero_axes)
    mesh = ", ".join(f"{a}={s}" for a, s in plan.mesh)
    out = [f"autopar data-parallel plan {plan.label} on Mesh({mesh})",
           "mesh axes (outermost first): " + "; ".join(dp.links),
           f"data axis: dp={n}, global batch {dp.batch} -> {dp.batch // n} per rank; loss is "
           f"a {dp.reduction} over the batch: gradients "
           f"{'averaged' if dp.reduction == 'mean' else 'summed'} over dp",
           _precision_line(dp.param_dtype, dp.reduce_dtype, dp.mixed_precision),
           f"ZeRO group {' x '.join(dp.zero_axes)} = {group} ranks"
           + (" (the cp ranks join the gradient reduction: no separate cp all-reduce)"
              if "cp" in dp.zero_axes else ""),
           *([str(dp.step)] if dp.step else []),
           f"ZeRO stage {dp.zero}; per-rank memory by stage "
           f"(limit {_fmt_bytes(dp.memory_limit)}):"]  # fmt: skip
    out += [f"  {'*' if m.stage == dp.zero else ' '} {m}" for m in dp.memory]
    m = dp.micro_batches  # (plan.runs_per_step)
    out.append("data-axis traffic of one training step (message = local shard"
               + (f"; 'per micro-batch' rows run x{m}, once for each of the {m} "
                  "micro-batches):" if m > 1 else "):"))  # fmt: skip
    mine = [c for c in plan.collectives if "dp" in c.axis.split("_")]
    groups: dict[tuple[str, str], list[Collective]] = {}
    for c in mine:
        groups.setdefault((str(c), _pattern(c.where + ".").rstrip(".")), []).append(c)
    for (text, where), cs in groups.items():
        each = " per micro-batch" if m > 1 and _per_micro_batch(cs[0]) else ""
        out.append(f"  {text:<44} {_fmt_bytes(cs[0].bytes):>10}  x{len(cs):<3} {where}{each}")
    wire = sum(wire_bytes(c, n if c.axis == "dp" else group) * plan.runs_per_step(c)
               for c in mine)  # fmt: skip
    out.append(f"  total {_fmt_bytes(wire)} sent per rank per step (ring)")
    out += [f"why: {note}" for note in dp.notes]
    out += [f"advice (launch environment; autopar sets none of it): {a}" for a in plan.advice]
    out.append("sub-mesh program (every dp rank runs it on its batch slice):")
    return [*out, str(replace(plan.without("dp"), advice=()))]


def _per_micro_batch(c: Collective) -> bool:
    """Whether a data-axis collective runs every micro-batch under ZeRO-2/3 in a pipeline
    (`DpSection.micro_batches`): the forward and backward gathers and reduce-scatters; the
    loss all-reduce and ZeRO-0/1's once-a-step reductions and post-step gather do not."""
    return c.direction in ("fwd", "bwd") and c.kind in ("all_gather", "reduce_scatter")


def _ep_lines(plan: Plan) -> list[str]:
    """The expert axis's paragraph (experts per rank, traffic, why), then the sub-mesh plan."""
    ep, n = plan.ep, dict(plan.mesh)["ep"]
    mesh = ", ".join(f"{a}={s}" for a, s in plan.mesh)
    cap = (f"capacity factor {ep.capacity_factor} (rows over capacity dropped, counted)"
           if ep.capacity_factor else "dropless")  # fmt: skip
    dense_b, expert_b = ep.param_bytes
    out = [f"autopar expert-parallel plan {plan.label} on Mesh({mesh})",
           "mesh axes (outermost first): " + "; ".join(ep.links),
           f"expert axis: ep={n}, global batch {ep.batch} -> {ep.batch // n} per rank (dense "
           f"part data-parallel, loss a {ep.reduction}); {cap}",
           f"{len(ep.layers)} MoE layers, each rank holds 1/{n} of their experts (parameters "
           f"per rank: {_fmt_bytes(dense_b + expert_b)}, experts {_fmt_bytes(expert_b)} of "
           f"{_fmt_bytes(expert_b * n)}):"]  # fmt: skip
    out += [f"  {line}" for line in ep.described]
    out.append(f"expert-axis traffic of one training step (predicted {ep.comm_s * 1e3:.3f} ms "
               f"on {ep.link}; all-to-alls {ep.layer_s * 1e6:.1f} us per MoE layer):")  # fmt: skip
    mine = [c for c in plan.collectives if c.axis == "ep"]
    for c in mine:
        if c.kind == "all_to_all" or c.where == "loss":
            out.append(f"  {c!s:<44} {_fmt_bytes(c.bytes):>10}  {c.where}")
    dense = [c for c in mine if c.kind == "all_reduce" and c.where != "loss"]
    out.append(f"  bwd all_reduce ep x{len(dense)} dense-gradient buckets (at most "
               f"{_fmt_bytes(ep.bucket_bytes)} each), {_fmt_bytes(sum(c.bytes for c in dense))}")  # fmt: skip
    out += [f"why: {note}" for note in ep.notes]
    out.append("sub-mesh program (every ep rank runs it on its batch slice):")
    return [*out, str(plan.without("ep"))]


def _pp_lines(plan: Plan) -> list[str]:
    """The pipeline's paragraph (cuts, schedule, bubble), then each stage's plan."""
    pp = plan.pp
    mesh = ", ".join(f"{a}={s}" for a, s in plan.mesh)
    out = [f"autopar pipeline plan {plan.label} · {plan.model} on Mesh({mesh}) · "
           f"{len(plan.stages)} stages · schedule {pp.schedule} · {pp.n_microbatches} "
           "micro-batches", *pp.precision, *plan.notes,
           f"predicted bubble: {pp.bubble:.1%} (formula {pp.formula_bubble:.1%}); slowest "
           f"stage {pp.slowest_s * 1e3:.3f} ms/micro-batch"]  # fmt: skip
    if pp.tied:
        out.append("tied across stages (gradients summed): " + ", ".join(pp.tied))
    for i, stage in enumerate(plan.stages):
        out += ["", f"--- stage {i} ---", str(stage)]
    return out


def _pairs(rows: list) -> tuple[tuple, ...]:
    return tuple(tuple(r) for r in rows)


def decisions(section: Any) -> dict[str, Any]:
    """A section's decision fields (not its :func:`fact` fields), as plain data."""
    whole = asdict(section)
    return {f.name: whole[f.name] for f in fields(section) if f.compare}


def _describe(section: Any) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in decisions(section).items())


def _choice_differences(mine: dict[str, str], theirs: dict[str, str], shown: int = 5) -> list[str]:
    """The nodes this plan decides whose tp strategy differs or that the other lacks (the
    first few); nodes only the other decides are not differences (a plan may pin a few nodes
    and leave the rest to the solver)."""
    rows = [f"node '{n}': {s} vs {theirs.get(n, '(not in the model)')}"
            for n, s in sorted(mine.items()) if s != theirs.get(n)]  # fmt: skip
    if len(rows) > shown:
        rows = [*rows[:shown], f"... and {len(rows) - shown} more nodes"]
    return rows


_INDEX = re.compile(r"\.\d+\.")


def _pattern(name: str) -> str:
    return _INDEX.sub(".*.", name)


def _patterns(params: tuple[tuple[str, str], ...]) -> Counter:
    return Counter((_pattern(fqn), lay) for fqn, lay in params)


def _collective_groups(cs: tuple[Collective, ...]) -> Counter:
    return Counter((str(c), _pattern(c.where + ".").rstrip(".") or "<top>") for c in cs)


def _bytes_of(text: str, cs: tuple[Collective, ...]) -> int:
    return next(c.bytes for c in cs if str(c) == text)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


# ---------------------------------------------------------------- reusing a saved plan


def section(plan: Plan | None, axis: str) -> Any:
    """The ``axis`` section of a reloaded plan for a mesh with that axis (None: no plan)."""
    if plan is None:
        return None
    found = getattr(plan, axis)
    if found is None:
        raise PlanError(f"the plan for Mesh{dict(plan.mesh)} has no {axis} section (the "
                        f"{axis} axis's decisions); re-plan without plan= and save it again")  # fmt: skip
    return found


def settle(name: str, given: Any, saved: Any) -> Any:
    """An option a reloaded plan decides: the plan's value; a given one must agree."""
    if given is None or saved is None or given == saved:
        return saved if given is None else given
    raise PlanError(f"{name}={given!r} contradicts the plan, which has {name}={saved!r}; drop "
                    f"{name}= to run the plan, or re-plan without plan=")  # fmt: skip


def check_attention(forced: str | None, plan: Plan | None) -> None:
    """A given ``cp_attention`` must be every attention choice of the plan (its stages')."""
    if forced is None or plan is None:
        return
    chosen = [(n, c) for p in (plan, *plan.stages) if p.cp for n, c in p.cp.attention]
    other = [f"{n}={c}" for n, c in chosen if c != forced]
    if other:
        raise PlanError(f"cp_attention={forced!r} contradicts the plan, which has "
                        f"{', '.join(other)}; drop cp_attention= or re-plan without plan=")  # fmt: skip


def check_split_points(split_points: Any, saved: PpSection | None) -> None:
    """Given split points must each start a stage of the reloaded plan."""
    if saved is None:
        return
    for name in split_points:
        if not any(s == name or s.startswith(name + ".") for s in saved.stage_starts):
            raise PlanError(f"split point {name!r} contradicts the plan, whose stages start at "
                            f"{', '.join(saved.stage_starts)}; drop split_points= or re-plan "
                            "without plan=")  # fmt: skip


def honoured(plan: Plan | None, prog: Any) -> Any:
    """``prog`` compiled from a reloaded ``plan`` must carry its decisions; returns ``prog``."""
    if plan is None:
        return prog
    diffs = plan.differences(prog.plan)
    if diffs:
        raise PlanError(f"the plan does not fit this model on Mesh{dict(plan.mesh)} (saved vs "
                        f"compiled): {'; '.join(diffs)}; re-plan without plan=")  # fmt: skip
    return prog
