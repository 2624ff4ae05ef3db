"""The plan: what autopar decided and why, printable and serialisable.

A :class:`Plan` records the mesh, each parameter's layout, the collectives of one training
step (with bytes), the predicted step time and per-rank memory, and the chosen strategy of
every node (what makes it reloadable).  Printing groups repeated blocks by module-path
pattern (``layers.*.attn.q.weight``) so a 32-layer model prints like one layer.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path


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
class Plan:
    """A frozen, printable, serialisable parallel plan."""

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
    advice: tuple[str, ...] = ()  # NCCL settings the topology calls for (printed, not applied)

    @property
    def hash(self) -> str:
        text = json.dumps([self.mesh, self.choice], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> Plan:
        d = json.loads(text)
        d["mesh"] = tuple(tuple(a) for a in d["mesh"])
        d["params"] = tuple(tuple(p) for p in d["params"])
        d["choice"] = tuple(tuple(c) for c in d["choice"])
        d["notes"] = tuple(d["notes"])
        d["advice"] = tuple(d.get("advice", ()))
        d["collectives"] = tuple(
            Collective(**{**c, "shape": tuple(c["shape"])}) for c in d["collectives"]
        )
        return Plan(**d)

    @staticmethod
    def load(path: str | Path) -> Plan:
        return Plan.from_json(Path(path).read_text())

    def __str__(self) -> str:
        mesh = ", ".join(f"{a}={s}" for a, s in self.mesh)
        out = [
            f"autopar plan {self.hash} · {self.model} on Mesh({mesh}) · priced on {self.hardware}"
        ]
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
        return "\n".join(out)


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
