"""Pipeline stages: the cut of a model into stages, and what each pipeline rank holds.

The compiled pipeline (`autopar.axes.pipeline.choose_cuts`) cuts a traced model's units --
the prologue (embedding), each repeated block, the epilogue (final norm, LM head, loss) --
with `balanced_cuts`; the whole-cluster search cuts its `Workload` with the same rule, so
both price the same bottleneck stage.

Algorithm (`pipeline_ranks`, p ranks, v stages each):
1. Units and their forward+backward seconds per micro-batch: pre, L blocks of one layer's
   seconds each, post; every cut before a unit costs the stage before it the send and
   receive of the boundary activation (the last stage sends nothing).
2. Cut them into p·v contiguous stages minimising the slowest (`balanced_cuts`).
3. Rank r holds stages r, r + p, ... (interleaved placement): its blocks, whether it runs the
   prologue or the epilogue, its v stages, and the micro-batches it holds at its peak
   (`cost.memory.in_flight` at its position).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from cost.errors import CostInputError


@dataclass(frozen=True, kw_only=True)
class RankShare:
    """What one pipeline rank runs per micro-batch: `blocks` repeated blocks over `chunks`
    stages, the prologue (`first`) and/or the epilogue (`last`), and `held` micro-batches of
    activations at its peak; `bare_edges`: every end table on the rank lies in a stage
    without blocks (an interleaved chunk of the embedding or the head alone), which ZeRO-3
    reshards after forward like any group (`autopar.axes.data_parallel.kept_gathered`: a
    stage without blocks keeps nothing gathered)."""

    blocks: int
    first: bool
    last: bool
    chunks: int
    held: float
    bare_edges: bool = False

    @property
    def edges(self) -> float:
        """Embedding / head tables on the rank, in units of `Workload.edge_params` (which
        counts both ends without pp and one end with pp)."""
        return 1.0 if self.first or self.last else 0.0


def balanced_cuts(costs: Sequence[float], boundary: Sequence[float], stages: int,
                  pinned: Sequence[int] = (), fits: Callable[[int, int], bool] | None = None,
                  ) -> tuple[list[int], float]:  # fmt: skip
    """Exact contiguous partition of ``costs`` into ``stages`` minimising the slowest stage.

    A stage over units [a, b) costs sum(costs[a:b]) + boundary[b] (what it sends on; the
    last stage sends nothing).  No stage may straddle a pinned cut; ``fits(a, b)`` may veto one.
    Returns (cuts, slowest-stage cost); raises CostInputError when no partition exists.
    """
    n = len(costs)
    prefix = [0.0, *itertools.accumulate(costs)]
    pins = set(pinned)
    inf = math.inf

    def cost(a: int, b: int) -> float:
        if any(a < p < b for p in pins) or (fits is not None and not fits(a, b)):
            return inf
        return prefix[b] - prefix[a] + (boundary[b] if b < n else 0.0)

    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for b in range(k, n + 1):
            for a in range(k - 1, b):
                value = max(best[k - 1][a], cost(a, b))
                if value < best[k][b]:
                    best[k][b], back[k][b] = value, a
    if best[stages][n] == inf:
        raise CostInputError(
            f"no split of {n} units into {stages} stages fits (pinned cuts {sorted(pins)})"
        )
    cuts, b = [], n
    for k in range(stages, 0, -1):
        b = back[k][b]
        cuts.append(b)
    return sorted(cuts)[1:], best[stages][n]


@lru_cache(maxsize=4096)
def stage_blocks(layers: int, pre: float, layer: float, post: float, stages: int,
                 boundary: float) -> tuple[tuple[int, bool, bool], ...]:  # fmt: skip
    """Steps 1-2: per stage (blocks, holds the prologue, holds the epilogue)."""
    costs = [pre, *([layer] * layers), post]
    cuts = _fast_cuts(costs, boundary, stages)
    bounds = [0, *cuts, layers + 2]
    return tuple((sum(1 for u in range(a, b) if 0 < u <= layers), a == 0, b == layers + 2)
                 for a, b in itertools.pairwise(bounds))  # fmt: skip


def _fast_cuts(costs: Sequence[float], boundary: float, stages: int) -> list[int]:
    """`balanced_cuts` without pins or vetoes and one boundary price, each DP row in one
    array step: the same sums (prefix differences), the same first-of-equals choice
    (`argmin`), so the same cuts, at the search's thousands of configurations.

    Stage k (of p, over n units) can only end at a unit b in [k, n - p + k] (every stage
    before it holds at least one unit, and every one after it too), so each row works on
    that band of width w = n - p + 1: a [w, w] block of the stage spans, its starts a in
    [k - 1, n - p + k - 1] (the previous row's band, in order) below its ends (a <= b's
    offset), the cells no partition reaches never built."""
    n = len(costs)
    width = n - stages + 1
    if width < 1:
        raise CostInputError(f"no split of {n} units into {stages} stages fits")
    prefix = np.array([0.0, *itertools.accumulate(costs)])
    span = prefix[None, :] - prefix[:, None] + np.where(np.arange(n + 1) < n, boundary, 0.0)
    offsets = np.arange(width)
    below = offsets[:, None] <= offsets[None, :]  # start a = k-1+i before end b = k+j
    best = np.full(width, np.inf)
    best[0] = 0.0
    backs = []
    for k in range(1, stages + 1):
        block = span[k - 1:k - 1 + width, k:k + width]
        value = np.where(below, np.maximum(best[:, None], block), np.inf)
        back = np.argmin(value, axis=0)
        best = value[back, offsets]
        backs.append(back + (k - 1))
    cuts, b = [], n
    for k in range(stages, 0, -1):
        b = int(backs[k - 1][b - k])
        cuts.append(b)
    return sorted(cuts)[1:]


def pipeline_ranks(layers: int, unit_s: tuple[float, float, float], pp: int, virtual: int,
                   held: Callable[[int], float], boundary_s: float) -> tuple[RankShare, ...]:
    """Step 3 over the stages `stage_blocks` cuts: one `RankShare` per pipeline rank;
    `unit_s` = (prologue, one block, epilogue) seconds, `held(r)` the micro-batches rank r
    holds, `boundary_s` a boundary's send and receive."""
    if pp == 1:
        return (RankShare(blocks=layers, first=True, last=True, chunks=1, held=held(0)),)
    stages = stage_blocks(layers, *unit_s, pp * virtual, boundary_s)
    out = []
    for r in range(pp):
        mine = stages[r::pp]
        ends = [s for s in mine if s[1] or s[2]]
        out.append(RankShare(blocks=sum(s[0] for s in mine), first=any(s[1] for s in mine),
                             last=any(s[2] for s in mine), chunks=len(mine), held=held(r),
                             bare_edges=bool(ends) and not any(s[0] for s in ends)))  # fmt: skip
    return tuple(out)
