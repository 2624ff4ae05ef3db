"""Pipeline schedules as action lists, simulated into an ASCII timeline and a bubble fraction.

Algorithm:
1. Each schedule orders, per rank, its forward (F) and backward (B) actions on (stage,
   micro-batch): GPipe runs all forwards then all backwards; 1F1B warms up with p-1-r
   forwards then alternates; interleaved 1F1B does the same over v virtual stages per rank in
   groups of p micro-batches (stage s lives on rank s mod p).
2. A discrete-time simulation runs every rank's list in order, one action per time slot, an
   action starting only when its producer (the previous stage's F, the next stage's B) has
   finished in an earlier slot.
3. Idle slots print as '.'; the bubble is idle slots / all slots.
"""

from __future__ import annotations

from dataclasses import dataclass

Action = tuple[str, int, int]  # ('F' | 'B', stage, micro-batch)


def actions(schedule: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Per-rank ordered actions (step 1)."""
    if schedule == "gpipe":
        return [[("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)] for r in range(p)]
    if schedule == "1f1b":
        return [_one_f_one_b(r, p, m) for r in range(p)]
    return [_interleaved(r, p, m, v) for r in range(p)]


def _one_f_one_b(r: int, p: int, m: int) -> list[Action]:
    warm = min(p - 1 - r, m)
    out = [("F", r, i) for i in range(warm)]
    f, b = warm, 0
    while b < m:
        if f < m:
            out.append(("F", r, f))
            f += 1
        out.append(("B", r, b))
        b += 1
    return out


def _interleaved(r: int, p: int, m: int, v: int) -> list[Action]:
    order = [(c, i) for g in range(0, m, p) for c in range(v) for i in range(g, min(g + p, m))]
    fwd = [("F", c * p + r, i) for c, i in order]
    bwd = [("B", (v - 1 - c) * p + r, i) for c, i in order]
    warm = min((v - 1) * p + 2 * (p - 1 - r), len(fwd))
    out = fwd[:warm]
    f, b = warm, 0
    while b < len(bwd):
        if f < len(fwd):
            out.append(fwd[f])
            f += 1
        out.append(bwd[b])
        b += 1
    return out


@dataclass(frozen=True, kw_only=True)
class Timeline:
    rows: tuple[str, ...]  # one per rank: 'F', 'B' or '.' per slot
    bubble: float

    def __str__(self) -> str:
        width = len(self.rows[0]) if self.rows else 0
        head = "slot    " + "".join(str(i % 10) for i in range(width))
        body = [f"rank {r:<3}" + row for r, row in enumerate(self.rows)]
        return "\n".join([head, *body, f"bubble: {self.bubble:.1%} of rank-slots idle"])


def simulate(per_rank: list[list[Action]], stages: int) -> Timeline:
    """Steps 2-3: one action per slot, waiting on producers finished in earlier slots."""
    done: dict[tuple[str, int, int], int] = {}
    cursor = [0] * len(per_rank)
    rows: list[list[str]] = [[] for _ in per_rank]
    slot = 0
    while any(c < len(a) for c, a in zip(cursor, per_rank, strict=True)):
        started = []
        for r, acts in enumerate(per_rank):
            if cursor[r] < len(acts) and _ready(acts[cursor[r]], done, slot, stages):
                kind, stage, mb = acts[cursor[r]]
                started.append((kind, stage, mb))
                rows[r].append(kind)
                cursor[r] += 1
            else:
                rows[r].append(".")
        for key in started:
            done[key] = slot
        slot += 1
        if slot > 10_000:
            raise RuntimeError("schedule simulation did not finish: an action waits forever")
    idle = sum(row.count(".") for row in rows)
    total = sum(len(row) for row in rows)
    return Timeline(rows=tuple("".join(r) for r in rows), bubble=idle / total if total else 0.0)


def _ready(action: Action, done: dict, slot: int, stages: int) -> bool:
    kind, stage, mb = action
    if kind == "F":
        return stage == 0 or done.get(("F", stage - 1, mb), slot) < slot
    need_f = done.get(("F", stage, mb), slot) < slot
    return need_f and (stage == stages - 1 or done.get(("B", stage + 1, mb), slot) < slot)


def formula_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """REFERENCE.md: GPipe and 1F1B (p-1)/(m+p-1) of the step; interleaved (p-1)/(v*m) of the
    ideal time, i.e. (p-1)/(v*m+p-1) of the step."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    return (p - 1) / (v * m + p - 1)
