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
import re
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
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

    def __str__(self) -> str:
        shape = ",".join(map(str, self.shape))
        return f"{self.direction} {self.kind:<14} {self.axis:<3} {self.dtype}[{shape}]"


@dataclass(frozen=True, kw_only=True)
class DpSection:
    """The data axis's decision."""

    zero: int  # ZeRO stage


@dataclass(frozen=True, kw_only=True)
class EpSection:
    """The expert axis's decisions: E/ep contiguous experts of each layer per ep rank."""

    capacity_factor: float | None  # None: dropless
    layers: tuple[tuple[str, int], ...]  # (module path, experts) of each MoE layer placed


@dataclass(frozen=True, kw_only=True)
class PpSection:
    """The pipeline axis's decisions."""

    stage_starts: tuple[str, ...]  # the cuttable unit each stage after the first starts at
    schedule: str
    n_microbatches: int
    virtual_stages: int


@dataclass(frozen=True, kw_only=True)
class CpSection:
    """The context axis's decision per attention node."""

    attention: tuple[tuple[str, str], ...]  # (node, 'ring' | 'all_to_all')


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

    @property
    def hash(self) -> str:
        """Of the decisions: the mesh and tp choices, plus any other axis's (a tp-only plan's
        hash is that of its mesh and choices alone)."""
        extra = self._decisions()
        text = json.dumps([self.mesh, self.choice, *([extra] if extra else [])], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def _decisions(self) -> dict[str, Any]:
        """The decisions beyond tp that are set (sections, recompute, stage plans' hashes)."""
        out: dict[str, Any] = {a: asdict(getattr(self, a)) for a in SECTIONS if getattr(self, a)}
        if self.recompute != "none":
            out["recompute"] = self.recompute
        if self.stages:
            out["stages"] = [s.hash for s in self.stages]
        return out

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

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
             "advice": tuple(d.get("advice", ()))}  # fmt: skip
        d["collectives"] = tuple(
            Collective(**{**c, "shape": tuple(c["shape"])}) for c in d["collectives"]
        )
        for axis, cls in SECTIONS.items():
            if d.get(axis) is not None:
                d[axis] = _section(cls, d[axis])
        d["stages"] = tuple(Plan.from_dict(s) for s in d.get("stages", ()))
        return Plan(**d)

    @staticmethod
    def load(path: str | Path) -> Plan:
        return Plan.from_json(Path(path).read_text())

    def without(self, axis: str) -> Plan:
        """The plan of the sub-mesh without ``axis`` (as :meth:`Mesh.without`): its section
        and its collectives dropped."""
        mesh = tuple(a for a in self.mesh if a[0] != axis) or (("tp", 1),)
        kept = tuple(c for c in self.collectives if c.axis != axis)
        return replace(self, mesh=mesh, collectives=kept, **{axis: None})

    def differences(self, other: Plan) -> list[str]:
        """Every decision ``other`` does not share with this plan, named (model, mesh, each
        axis's section, recompute, each node's tp strategy, each stage's plan)."""
        out = [f"{name}: {mine!r} vs {theirs!r}" for name, mine, theirs in (
            ("model", self.model, other.model), ("mesh", dict(self.mesh), dict(other.mesh)),
            *((a, getattr(self, a), getattr(other, a)) for a in SECTIONS),
            ("recompute", self.recompute, other.recompute),
            ("pipeline stages", len(self.stages), len(other.stages)),
        ) if mine != theirs]  # fmt: skip
        out += _choice_differences(dict(self.choice), dict(other.choice))
        for i, (a, b) in enumerate(zip(self.stages, other.stages, strict=False)):
            out += [f"stage {i}: {d}" for d in a.differences(b)]
        return out

    def __str__(self) -> str:
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


def as_plan(plan: Any) -> Plan:
    """The one Plan of any program's plan (a wrapper axis's plan builds it: ``to_plan``)."""
    return plan if isinstance(plan, Plan) else plan.to_plan()


def _pairs(rows: list) -> tuple[tuple, ...]:
    return tuple(tuple(r) for r in rows)


def _section(cls: type, d: dict[str, Any]) -> Any:
    """A section of plan.json, its lists back to tuples."""
    return cls(**{k: (_pairs(v) if v and isinstance(v[0], list) else tuple(v))
                  if isinstance(v, list) else v for k, v in d.items()})  # fmt: skip


def _describe(section: Any) -> str:
    return ", ".join(f"{f.name}={getattr(section, f.name)!r}" for f in fields(section))


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
    diffs = plan.differences(as_plan(prog.plan))
    if diffs:
        raise PlanError(f"the plan does not fit this model on Mesh{dict(plan.mesh)} (saved vs "
                        f"compiled): {'; '.join(diffs)}; re-plan without plan=")  # fmt: skip
    return prog
