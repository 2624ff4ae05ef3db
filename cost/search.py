"""The whole-cluster search: the cost model's fastest training configuration for a cluster.

A configuration is the factorisation of the GPUs into tp · pp · (dp · cp) degrees (ep the inner
part of dp), the nesting of those axes on the rank order (which link each rides), micro-batch
size, pipeline schedule and virtual stages, recomputation, ZeRO stage and sequence parallelism.

Algorithm (`search`):
1. Factorisations: tp over the divisors of the world that divide the heads (and the KV heads
   when there are at least tp of them), cp over the divisors left whose 2·cp divides the
   sequence, pp over the divisors left up to the layer count, dp the rest, ep over the common
   divisors of dp and the expert count; dp must divide the global batch.
2. Per-layer prices are reused: one `Workload` per (tp, cp, ep, sequence parallelism, whether
   pp > 1, micro-batch), shared by every pp, dp, schedule, recompute, ZeRO stage and nesting.
3. Exact memory bound: model state on the most loaded stage (v = 1 holds the fewest layers)
   plus the least activation memory over the recompute modes at one micro-batch of one
   sequence; a factorisation and ZeRO stage above HBM is skipped whole.
4. Exact time bound (branch and bound): compute of every micro-batch with the fewest layers,
   the bubble at the most virtual stages, the optimizer at its most sharded. A candidate whose
   bound is not below the N-th best configuration found (or the `keep` time) cannot enter the
   ranking and is skipped with everything under it.
5. Price the rest: memory (`cost.memory.rank_memory`) first, then the step time
   (`cost.step.step_time`) under every nesting of the non-trivial axes, the collectives priced
   by the topology (`cost.topology`) when one is given, else by the two-level link model.
6. Rank by step time the best configuration of each degree tuple (tp, pp, dp, cp, ep); the
   runners-up say which step-time components they lose on.

`search(..., prune=False)` prices the whole space without steps 3-4 (brute force, for tests).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from cost.compute import MEMORY_BW_FRACTION
from cost.config import RECOMPUTE, ParallelConfig, validate
from cost.errors import CostInputError
from cost.estimate import Estimate, Priced, as_priced
from cost.hardware import Cluster
from cost.memory import RESERVED_BYTES, MemoryBreakdown, model_state, rank_memory, state_bytes
from cost.model import ModelShape
from cost.step import ADAM_BYTES_PER_PARAM, Collective, StepBreakdown, pipeline_shares, step_time
from cost.workload import Workload

TIE_REL = 1e-3  # step times closer than 0.1% are a tie (far below the model's accuracy)
BLOCKS = ("pp", "dp", "tp")  # nesting units, Megatron order outermost first; cp and ep live in dp
GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """What the search may choose. A degree tuple None means every valid divisor; `nest` False
    keeps Megatron's nesting (pp outermost, then dp·cp, tp innermost)."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = RECOMPUTE
    schedules: tuple[str, ...] = ("1f1b", "interleaved")
    max_virtual: int = 16
    micro_batch: tuple[int, ...] | None = None
    sequence_parallel: tuple[bool, ...] = (True, False)
    nest: bool = True
    attention: str = "flash"
    overlap_grad_reduce: bool = True
    grad_bytes: int = 4
    weight_bytes: int = 2  # 4: fp32 weights (no bf16 copy beside an fp32 master)
    gemm_bytes: int = 2  # 1: the linear layers' GEMMs in FP8 (ParallelConfig.gemm_bytes)
    accumulate: bool = True  # False: without pp one micro-batch per step (no accumulation)


@dataclass(frozen=True, kw_only=True)
class Choice:
    """One priced configuration: degrees and settings, axis nesting, memory, step time."""

    config: ParallelConfig
    order: tuple[str, ...]
    memory: MemoryBreakdown
    step: StepBreakdown
    micro_batches: int
    work: Workload = field(repr=False, compare=False)
    step_time_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "step_time_s", self.step.total)

    @property
    def key(self) -> tuple[int, int, int, int, int]:
        c = self.config
        return (c.tp, c.pp, c.dp, c.cp, c.ep)

    def describe(self) -> str:
        c = self.config
        v = f" v={c.virtual_stages}" if c.schedule == "interleaved" else ""
        return (f"tp={c.tp} pp={c.pp} dp={c.dp} cp={c.cp} ep={c.ep} b={c.micro_batch} "
                f"{c.schedule}{v} recompute={c.recompute} zero={c.zero} "
                f"sp={sp_label(c)} nest={nesting(self.order)}")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """The ranking (best configuration per degree tuple, fastest first) and search statistics."""

    model: Priced = field(repr=False)
    cluster: Cluster
    global_batch: int
    ranked: tuple[Choice, ...]
    space: int  # configurations in the search space (priced + pruned)
    priced: int  # configurations whose step time was computed
    seconds: float
    collective: Collective | None = field(default=None, repr=False)

    @property
    def best(self) -> Choice:
        return self.ranked[0]

    def rank_of(self, key: tuple[int, ...]) -> int | None:
        """1-based rank of a degree tuple (tp, pp, dp, cp, ep) in the ranking, None if absent."""
        for i, choice in enumerate(self.ranked):
            if choice.key == key:
                return i + 1
        return None

    def estimate(self, choice: Choice) -> Estimate:
        """The `Estimate` (printable breakdown, throughput, MFU) of a choice."""
        return Estimate(model=self.model.name, cluster=self.cluster, config=choice.config,
                        memory=choice.memory, step=choice.step,
                        tokens_per_step=float(self.global_batch * self.model.seq),
                        flops_per_token=self.model.flops_per_token(),
                        micro_batches=choice.micro_batches, work=choice.work,
                        shape=getattr(self.model, "shape", None))  # fmt: skip

    def why_lost(self, choice: Choice) -> str:
        """The step-time components on which `choice` loses to the best, largest first."""
        return why_lost(choice, self.best)


def sp_label(cfg: ParallelConfig) -> str:
    """Sequence parallelism: on / off, '-' without tp (it shards nothing then)."""
    return "-" if cfg.tp == 1 else ("on" if cfg.sequence_parallel else "off")


def nesting(order: tuple[str, ...]) -> str:
    """`pp>dp>tp`: the non-trivial nesting blocks, outermost first."""
    return ">".join(order) or "-"


def spans(order: tuple[str, ...], tp: int, pp: int, dp: int, cp: int, ep: int) -> dict:
    """(stride, size) of every communication group in the rank order `order` (outermost first
    among pp, dp, tp; cp sits inside dp, ep is the inner part of dp)."""
    size = {"pp": pp, "dp": dp * cp, "tp": tp}
    stride, inner = {}, 1
    for block in reversed(BLOCKS if not order else _full(order)):
        stride[block] = inner
        inner *= size[block]
    s0 = stride["dp"]
    return {"tp": (stride["tp"], tp), "pp": (stride["pp"], pp), "cp": (s0, cp),
            "ep": (s0 * cp, ep), "dp": (s0, dp * cp), "dp_expert": (s0 * cp * ep, dp // ep)}  # fmt: skip


def contiguous(tp: int, pp: int, dp: int, cp: int, ep: int) -> dict:
    """Every group on consecutive ranks (stride 1): no nesting realises it for two axes at
    once, but each collective is cheapest there, and the step time only grows with each
    collective's time, so the step priced on it bounds every nesting's from below."""
    return {"tp": (1, tp), "pp": (1, pp), "cp": (1, cp), "ep": (1, ep), "dp": (1, dp * cp),
            "dp_expert": (1, dp // ep)}  # fmt: skip


def _full(order: tuple[str, ...]) -> tuple[str, ...]:
    """The order with the trivial blocks added (outermost; their stride is irrelevant)."""
    return tuple(b for b in BLOCKS if b not in order) + order


def orders(tp: int, pp: int, dp_block: int, nest: bool) -> list[tuple[str, ...]]:
    """Distinct nestings: permutations of the blocks larger than one."""
    live = tuple(b for b, n in zip(BLOCKS, (pp, dp_block, tp), strict=True) if n > 1)
    return list(itertools.permutations(live)) if nest else [live]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def why_lost(choice: Choice, best: Choice) -> str:
    """'+0.84 s bubble, +0.21 s tp comm' — the components larger than the best's."""

    def parts(c: Choice) -> dict[str, float]:
        s = c.step
        out = {"compute": s.compute, "bubble": s.bubble, "optimizer": s.optimizer}
        out.update({f"{k} comm": v for k, v in s.comm.items()})
        return out

    mine, theirs = parts(choice), parts(best)
    deltas = sorted(((mine.get(k, 0.0) - theirs.get(k, 0.0), k) for k in mine | theirs),
                    reverse=True)  # fmt: skip
    shown = [f"+{d:.3g} s {k}" for d, k in deltas if d > 1e-3 * best.step_time_s][:3]
    return ", ".join(shown) or "ties"


@dataclass
class _Ranking:
    """Best choice per degree tuple and the pruning threshold (the N-th best time)."""

    top: int
    keep: float
    best: dict = field(default_factory=dict)
    times: dict = field(default_factory=dict)
    threshold: float = math.inf

    def beats(self, key: tuple[int, ...], seconds: float) -> bool:
        """Whether a configuration of `key` taking `seconds` would enter the ranking."""
        return seconds < self.times.get(key, math.inf) and seconds < self.threshold * (1 + TIE_REL)

    def offer(self, choice: Choice) -> None:
        key = choice.key
        old = self.best.get(key)
        if old is not None and not _preferred(choice, old):
            return
        self.best[key], self.times[key] = choice, choice.step_time_s
        if len(self.times) >= self.top:
            nth = heapq.nsmallest(self.top, self.times.values())[-1]
            self.threshold = max(nth, self.keep)

    def bar(self, key: tuple[int, ...]) -> float:
        """A candidate of `key` whose time bound reaches this cannot change the ranking."""
        return min(self.threshold * (1 + TIE_REL), self.times.get(key, math.inf))

    def ranked(self) -> list[Choice]:
        """Fastest first; configurations within TIE_REL of the fastest remaining one are a
        tie, ordered simplest first (`rank_key`)."""
        rest = sorted(self.best.values(), key=lambda c: c.step_time_s)
        out = []
        while rest:
            limit = rest[0].step_time_s * (1 + TIE_REL)
            tied = [c for c in rest if c.step_time_s <= limit]
            out += sorted(tied, key=rank_key)
            rest = rest[len(tied) :]
        return out


def _preferred(new: Choice, old: Choice) -> bool:
    """Faster, or tied within TIE_REL and simpler."""
    if abs(new.step_time_s - old.step_time_s) <= TIE_REL * old.step_time_s:
        return rank_key(new) < rank_key(old)
    return new.step_time_s < old.step_time_s


def rank_key(choice: Choice) -> tuple:
    """Ties broken toward the simpler configuration: fewer cp, pp, tp, ep ranks, lower ZeRO
    stage, less recompute, then time and memory."""
    c = choice.config
    return (c.cp, c.pp, c.tp, c.ep, c.zero, RECOMPUTE.index(c.recompute), choice.step_time_s,
            choice.memory.total)  # fmt: skip


def _factorisations(model: Priced, world: int, global_batch: int | None,
                    space: SearchSpace) -> Iterator[tuple[int, int, int, int, int]]:  # fmt: skip
    """(tp, pp, dp, cp, ep) satisfying divisibility (step 1)."""

    def allowed(values: tuple[int, ...] | None, candidates: list[int]) -> list[int]:
        return [c for c in candidates if values is None or c in values]

    for tp in allowed(space.tp, divisors(world)):
        if model.heads % tp or (model.g >= tp and model.g % tp):
            continue
        for cp in allowed(space.cp, divisors(world // tp)):
            if cp > 1 and model.seq % (2 * cp):
                continue
            for pp in allowed(space.pp, divisors(world // (tp * cp))):
                dp = world // (tp * cp * pp)
                if pp > model.layers or (global_batch is not None and global_batch % dp):
                    continue
                for ep in allowed(space.ep, divisors(math.gcd(dp, model.experts))):
                    yield tp, pp, dp, cp, ep


def _settings(pp: int, layers: int, space: SearchSpace) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs: 1F1B, and interleaved with 2.. chunks per stage."""
    out = [("1f1b", 1)] if "1f1b" in space.schedules or pp == 1 else []
    if pp > 1 and "interleaved" in space.schedules:
        per_stage = -(-layers // pp)
        out += [("interleaved", v) for v in range(2, min(per_stage, space.max_virtual) + 1)
                if pp * v <= layers]  # fmt: skip
    return out


def runnable(schedule: str, pp: int, micro_batches: int) -> bool:
    """Interleaved 1F1B runs micro-batches in groups of pp (Megatron-LM requires m % pp == 0;
    autopar's pipeline at least m >= pp)."""
    return schedule != "interleaved" or micro_batches % pp == 0


class _Pricer:
    """Workloads and collective prices cached across configurations (step 2)."""

    def __init__(self, model: Priced, cluster: Cluster, collective: Collective | None) -> None:
        self.model, self.cluster = model, cluster
        self.works: dict[tuple, Workload] = {}
        self.coll_cache: dict[tuple, float] = {}
        base = collective
        if base is None:
            from cost.comm import span_time

            def base(kind: str, nbytes: float, stride: int, size: int) -> float:
                return span_time(kind, nbytes, cluster, stride, size)

        self.base = base

    def collective(self, kind: str, nbytes: float, stride: int, size: int) -> float:
        key = (kind, nbytes, stride, size)
        hit = self.coll_cache.get(key)
        if hit is None:
            hit = self.coll_cache[key] = self.base(kind, nbytes, stride, size)
        return hit

    def work(self, cfg: ParallelConfig, b: int) -> Workload:
        key = (cfg.tp, cfg.cp, cfg.ep, cfg.sequence_parallel, cfg.pp > 1, b)
        work = self.works.get(key)
        if work is None:
            work = self.works[key] = self.model.workload(cfg, b, self.cluster.gpu)
        return work


def _memory_floor(work1: Workload, cfg: ParallelConfig, capacity: float) -> float:
    """Least memory per rank over micro-batch, schedule, virtual stages, recompute (step 3):
    without pp the one rank at one micro-batch; with pp the average pipeline rank (the most
    loaded holds no less, whatever the cut): 1/p of every block's and both end tables'
    state, and of one micro-batch of every block's least activations and the logits."""
    dpd, p = cfg.data_parallel, cfg.pp
    if p == 1:
        return min(rank_memory(work1, pp=1, zero=cfg.zero, dp_dense=dpd,
                               dp_expert=dpd // cfg.ep, schedule="1f1b", micro_batches=1,
                               virtual=1, recompute=r, capacity=capacity,
                               grad_bytes=cfg.grad_bytes,
                               weight_bytes=cfg.weight_bytes).total
                   for r in RECOMPUTE)  # fmt: skip
    w_bytes, o_bytes = state_bytes(cfg.weight_bytes)
    dense = (work1.layers * work1.layer_dense_params + 2 * work1.edge_params) / p
    state = model_state(dense, work1.layers * work1.layer_expert_params / p, cfg.zero, dpd,
                        dpd // cfg.ep, cfg.grad_bytes, w_bytes, o_bytes)  # fmt: skip
    acts = (work1.layers * min(work1.act_bytes.values()) + work1.post_act_bytes) / p
    return sum(state) + acts + RESERVED_BYTES


def search(model, cluster: Cluster, global_batch: int, *, space: SearchSpace | None = None,
           top: int = 10, keep: ParallelConfig | None = None, collective: Collective | None = None,
           prune: bool = True) -> SearchResult:  # fmt: skip
    """Rank the configurations of `model` on `cluster` at `global_batch` sequences per step
    (see the module docstring). `keep` ranks a hand-chosen configuration too (its degrees,
    any settings): the pruning threshold never drops below its time, so its rank is exact."""
    start = time.perf_counter()
    priced = as_priced(model)
    space = space or SearchSpace()
    pricer = _Pricer(priced, cluster, collective)
    ranking = _Ranking(top=top, keep=math.inf)
    counts = {"space": 0, "priced": 0}
    if keep is not None:
        kept = _best_of(priced, cluster, global_batch, space, pricer, keep)
        if kept is not None:
            ranking.keep = kept.step_time_s
            ranking.offer(kept)
    floor: list = []
    units = []
    for degrees in _factorisations(priced, cluster.world_size, global_batch, space):
        units += _units(priced, cluster, global_batch, space, pricer, degrees, counts, prune,
                        floor)  # fmt: skip
    units.sort(key=lambda u: u[0])  # best-first: a good incumbent early prunes the rest
    for bound, degrees, sp, zeros in units:
        if prune and bound >= ranking.threshold * (1 + TIE_REL):
            break
        _search_unit(priced, cluster, global_batch, space, pricer, ranking, degrees, sp, zeros,
                     counts, prune)  # fmt: skip
    if not ranking.best:
        _raise_nothing(priced, cluster, global_batch, space, floor)
    ranked = ranking.ranked()
    cut = max(top, 1 + max((i for i, c in enumerate(ranked)
                            if keep is not None and c.key == _key(keep, cluster)),
                           default=0))  # fmt: skip
    return SearchResult(model=priced, cluster=cluster, global_batch=global_batch,
                        ranked=tuple(ranked[:cut]), space=counts["space"],
                        priced=counts["priced"], seconds=time.perf_counter() - start,
                        collective=pricer.collective)  # fmt: skip


def _key(cfg: ParallelConfig, cluster: Cluster) -> tuple[int, ...]:
    dp = cfg.dp or cluster.world_size // (cfg.tp * cfg.pp * cfg.cp)
    return (cfg.tp, cfg.pp, dp, cfg.cp, cfg.ep)


def _best_of(model: Priced, cluster: Cluster, global_batch: int, space: SearchSpace,
             pricer: _Pricer, cfg: ParallelConfig) -> Choice | None:  # fmt: skip
    """The best configuration with `cfg`'s degrees (all settings searched, no pruning)."""
    tp, pp, dp, cp, ep = degrees = _key(cfg, cluster)
    if tp * pp * dp * cp != cluster.world_size:
        raise CostInputError(
            f"tp·pp·dp·cp = {tp}·{pp}·{dp}·{cp} = {tp * pp * dp * cp} but the cluster has "
            f"{cluster.world_size} GPUs ({cluster.nodes} nodes × {cluster.gpus_per_node})"
        )
    validate(replace(cfg, dp=dp, tp_across_nodes=True), cluster, model.layers, model.heads,
             model.g, model.seq, model.experts)  # fmt: skip
    if global_batch % dp:
        raise CostInputError(f"global batch {global_batch} is not divisible by dp={dp}")
    ranking = _Ranking(top=1, keep=math.inf)
    counts = {"space": 0, "priced": 0}
    for _, _, sp, zeros in _units(model, cluster, global_batch, space, pricer, degrees, counts,
                                  True, []):  # fmt: skip
        _search_unit(model, cluster, global_batch, space, pricer, ranking, degrees, sp, zeros,
                     counts, True)  # fmt: skip
    return ranking.best.get(degrees)


def _units(model: Priced, cluster: Cluster, global_batch: int, space: SearchSpace,
           pricer: _Pricer, degrees: tuple[int, ...], counts: dict, prune: bool,
           floor: list) -> list[tuple]:  # fmt: skip
    """(time bound, degrees, sequence parallel, ZeRO stages that may fit) for one
    factorisation (steps 2-4); counts its whole space."""
    tp, pp, dp, cp, ep = degrees
    cap = cluster.gpu.hbm_bytes
    per_rank = global_batch // dp
    micro = _micro(per_rank, space, pp)
    settings = _settings(pp, model.layers, space)
    sps = [True] if tp == 1 else list(space.sequence_parallel)
    if ep > 1 and tp > 1:
        sps = [s for s in sps if s]  # Megatron requires SP with ep and tp
    zeros = [0] if dp * cp == 1 else _zeros(space.zero, prune)
    nests = orders(tp, pp, dp * cp, space.nest)
    full_zeros = 1 if dp * cp == 1 else len(space.zero)
    per_sp = sum(1 for b in micro for sched, _ in settings if runnable(sched, pp, per_rank // b))
    counts["space"] += len(sps) * per_sp * full_zeros * len(space.recompute) * len(nests)
    v_max = max((v for _, v in settings), default=1)
    out = []
    for sp in sps:
        base = _base(degrees, global_batch, sp, space, cluster)
        work1 = pricer.work(base, 1)
        live = []
        for z in zeros:
            low = _memory_floor(work1, replace(base, zero=z), cap)
            floor.append((low, replace(base, zero=z)))
            if low <= cap or not prune:
                live.append(z)
        if live:
            bound = min(_time_floor(pricer.work(base, b), base, cluster, per_rank // b, v_max)
                        for b in micro)  # fmt: skip
            out.append((bound, degrees, sp, live))
    return out


def _micro(per_rank: int, space: SearchSpace, pp: int) -> list[int]:
    """Micro-batch sizes: divisors of the per-rank batch (the whole of it when the space does
    not accumulate gradients outside a pipeline)."""
    if not space.accumulate and pp == 1:
        return [per_rank]
    return [b for b in divisors(per_rank) if space.micro_batch is None or b in space.micro_batch]


def _base(degrees: tuple[int, ...], global_batch: int, sp: bool, space: SearchSpace,
          cluster: Cluster) -> ParallelConfig:  # fmt: skip
    tp, pp, dp, cp, ep = degrees
    return ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, global_batch=global_batch,
                          sequence_parallel=sp, attention=space.attention,
                          overlap_grad_reduce=space.overlap_grad_reduce,
                          tp_across_nodes=tp > cluster.gpus_per_node,
                          grad_bytes=space.grad_bytes,
                          weight_bytes=space.weight_bytes,
                          gemm_bytes=space.gemm_bytes)  # fmt: skip


def _search_unit(model: Priced, cluster: Cluster, global_batch: int, space: SearchSpace,
                 pricer: _Pricer, ranking: _Ranking, degrees: tuple[int, ...], sp: bool,
                 zeros: list[int], counts: dict, prune: bool) -> None:  # fmt: skip
    """Step 5 for one factorisation and sequence-parallel mode: every micro-batch (most
    promising first) and schedule whose time bound can still change the ranking."""
    tp, pp, dp, cp, ep = degrees
    per_rank = global_batch // dp
    settings = _settings(pp, model.layers, space)
    nests = [(o, spans(o, tp, pp, dp, cp, ep)) for o in orders(tp, pp, dp * cp, space.nest)]
    if len(nests) > 1:
        nests.append((None, contiguous(tp, pp, dp, cp, ep)))
    recomputes = sorted(space.recompute, key=RECOMPUTE.index)
    base = _base(degrees, global_batch, sp, space, cluster)
    zcfgs = [replace(base, zero=z) for z in zeros]
    entries = []
    for b in _micro(per_rank, space, pp):
        work = pricer.work(base, b)
        for schedule, v in settings:
            if not runnable(schedule, pp, per_rank // b):
                continue
            bound = _floor(work, base, cluster, per_rank // b, v, v, 0.0)
            entries.append((bound, b, schedule, v, work))
    entries.sort(key=lambda e: e[0])  # most promising first: the bar tightens early
    for bound, b, schedule, v, work in entries:
        if prune and bound >= ranking.bar(degrees):
            break  # sorted: every later entry is bounded out too
        unit = _Unit(work=work, b=b, m=per_rank // b, schedule=schedule, virtual=v)
        _price_settings(unit, cluster, _zero_stages(zcfgs, unit.m, prune), recomputes, nests,
                        pricer, ranking, counts, prune)  # fmt: skip


@dataclass(frozen=True)
class _Unit:
    """One micro-batch size and schedule of a factorisation."""

    work: Workload
    b: int
    m: int
    schedule: str
    virtual: int


def _time_floor(work: Workload, cfg: ParallelConfig, cluster: Cluster, m: int,
                v_max: int) -> float:  # fmt: skip
    """Least step time of any setting of these degrees and micro-batch (step 4)."""
    return _floor(work, cfg, cluster, m, 1, v_max, 0.0)


def _floor(work: Workload, cfg: ParallelConfig, cluster: Cluster, m: int, v: int,
           v_bubble: int, recompute_s: float) -> float:  # fmt: skip
    """Compute of m micro-batches on the busiest pipeline rank (no less than the average
    rank's share of all layers and both ends, nor than either end), the bubble at v_bubble
    virtual stages on compute alone, and the most sharded optimizer (with pp none: a rank
    of the cut may hold few layers): no communication."""
    layer = work.layer_fwd_s + work.layer_bwd_s + recompute_s
    total = work.layers * layer + work.pre_s + work.post_s
    compute_mb = total if cfg.pp == 1 else max(total / cfg.pp, work.pre_s, work.post_s)
    params = 0.0 if cfg.pp > 1 else (work.layers * (work.layer_dense_params
                                                    + work.layer_expert_params)
                                     + work.edge_params)  # fmt: skip
    optimizer = (
        ADAM_BYTES_PER_PARAM
        * params
        / cfg.data_parallel
        / (cluster.gpu.hbm_bw * MEMORY_BW_FRACTION)
    )
    return m * compute_mb + (cfg.pp - 1) / v_bubble * compute_mb + optimizer


def _price_settings(unit: _Unit, cluster: Cluster, zcfgs: list[ParallelConfig],
                    recomputes: list[str], nests: list, pricer: _Pricer, ranking: _Ranking,
                    counts: dict, prune: bool) -> None:  # fmt: skip
    """Step 5 for one (degrees, micro-batch, schedule): memory per ZeRO stage and recompute
    mode, then step time per nesting. Recompute modes are tried cheapest first (none,
    selective, full add time and never remove any): pruning stops at the first that fits.
    With several nestings, the step on `contiguous` spans (the last entry of `nests`, order
    None) bounds them all first."""
    work, m, v, schedule = unit.work, unit.m, unit.virtual, unit.schedule
    key = _key(zcfgs[0], cluster)
    bound_spans = nests[-1][1] if nests[-1][0] is None else None
    ranks = None  # the cut: the same for every ZeRO stage and recompute mode (its degrees)
    for zcfg in zcfgs:
        for recompute in recomputes:
            floor = _floor(work, zcfg, cluster, m, v, v, work.recompute_s[recompute])
            if prune and floor >= ranking.bar(key):
                break
            dpd = zcfg.data_parallel
            if ranks is None:
                ranks = pipeline_shares(work, zcfg, cluster, schedule=schedule, virtual=v,
                                        micro_batches=m)  # fmt: skip
            memory = rank_memory(work, pp=zcfg.pp, zero=zcfg.zero, dp_dense=dpd,
                                 dp_expert=dpd // zcfg.ep, schedule=schedule,
                                 micro_batches=m, virtual=v, recompute=recompute,
                                 capacity=cluster.gpu.hbm_bytes,
                                 grad_bytes=zcfg.grad_bytes,
                                 weight_bytes=zcfg.weight_bytes, ranks=ranks,
                                 pp_buffers=zcfg.pp_buffers)  # fmt: skip
            if not memory.fits:
                continue
            if prune and bound_spans is not None:
                bound = step_time(work, zcfg, cluster, micro_batches=m, schedule=schedule,
                                  virtual=v, recompute=recompute, spans=bound_spans,
                                  collective=pricer.collective, ranks=ranks)  # fmt: skip
                if not ranking.beats(key, bound.total):
                    break
            for order, order_spans in nests:
                if order is None:
                    continue
                counts["priced"] += 1
                step = step_time(work, zcfg, cluster, micro_batches=m, schedule=schedule,
                                 virtual=v, recompute=recompute, spans=order_spans,
                                 collective=pricer.collective, ranks=ranks)  # fmt: skip
                if prune and not ranking.beats(key, step.total):
                    continue
                cfg = replace(zcfg, micro_batch=unit.b, schedule=schedule, virtual_stages=v,
                              recompute=recompute)  # fmt: skip
                ranking.offer(Choice(config=cfg, order=order, memory=memory, step=step,
                                     micro_batches=m, work=work))  # fmt: skip
            if prune:
                break  # a slower recompute mode of this ZeRO stage cannot win


def _zeros(allowed: tuple[int, ...], prune: bool) -> list[int]:
    """ZeRO stages worth pricing. ZeRO-1 is no slower than stage 0 (an fp32 all-reduce
    moves more than an fp32 reduce-scatter + bf16 all-gather, and its optimizer is unsharded)
    and holds less, so pruning keeps the higher of 0-1 present, and 2 and 3 (ZeRO-2 takes
    ZeRO-1's time at one micro-batch, where `_zero_stages` drops the dominated one, but
    reduces every micro-batch over several: `cost.step` step 6)."""
    if not prune:
        return list(allowed)
    low = [z for z in allowed if z < 2]
    return ([max(low)] if low else []) + [z for z in (2, 3) if z in allowed]


def _zero_stages(zcfgs: list[ParallelConfig], m: int, prune: bool) -> list[ParallelConfig]:
    """The ZeRO stages of `zcfgs` worth pricing at m micro-batches: at one, ZeRO-2 takes the
    time of 1 (or 0) and holds less, so pruning drops those below it."""
    if not prune or m > 1 or not any(c.zero == 2 for c in zcfgs):
        return zcfgs
    return [c for c in zcfgs if c.zero >= 2]


def _raise_nothing(model: Priced, cluster: Cluster, global_batch: int, space: SearchSpace,
                   floor: list) -> None:  # fmt: skip
    """No configuration fits or divides: say which, by how much, and what would be needed."""
    world = cluster.world_size
    if not floor:
        raise CostInputError(
            f"global batch {global_batch}: no factorisation of {world} GPUs divides it. dp must "
            f"divide the global batch and tp·pp·cp = {world}/dp is limited by the model "
            f"(heads {model.heads} for tp, layers {model.layers} for pp, sequence {model.seq} "
            f"for cp: 2·cp must divide it); use a global batch that is a multiple of "
            f"{_smallest_dp(model, world)}"
        )
    low, cfg = min(floor, key=lambda f: (round(f[0] / 2**20), f[1].cp, f[1].pp, f[1].tp))
    cap = cluster.gpu.hbm_bytes
    if low <= cap:
        raise CostInputError(
            f"{model.name} fits nowhere on {world} × {cluster.gpu.name} at global batch "
            f"{global_batch}: its model state fits (tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} "
            f"cp={cfg.cp} ep={cfg.ep} zero={cfg.zero}: {low / GIB:.1f} GiB at one sequence "
            f"per micro-batch), but every micro-batch size the global batch allows keeps too "
            "many activations in flight; use a global batch with more divisors or more GPUs"
        )
    state = _full_state_bytes(model, cluster, space.grad_bytes, space.weight_bytes)
    gpus = math.ceil(state / max(cap - RESERVED_BYTES, 1.0))
    raise CostInputError(
        f"{model.name} fits nowhere on {world} × {cluster.gpu.name} "
        f"({cap / GIB:.1f} GiB each): the least memory per rank over every configuration is "
        f"{low / GIB:.1f} GiB (tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} cp={cfg.cp} ep={cfg.ep} "
        f"zero={cfg.zero}, its leanest recompute, one sequence per micro-batch), "
        f"{(low - cap) / GIB:.1f} GiB over. "
        f"Model state alone is {state / GIB:.1f} GiB: it needs at least {gpus} GPUs of this "
        f"kind, or a GPU with at least {low / GIB:.1f} GiB"
    )


def _full_state_bytes(model: Priced, cluster: Cluster, grad_bytes: int,
                      weight_bytes: int) -> float:  # fmt: skip
    """Weights, gradients and Adam state of every parameter (no sharding)."""
    shape = getattr(model, "shape", None)
    params = shape.params if isinstance(shape, ModelShape) else _graph_params(model, cluster)
    w, g, o = model_state(params, 0.0, 0, 1, 1, grad_bytes, *state_bytes(weight_bytes))
    return w + g + o


def _graph_params(model: Priced, cluster: Cluster) -> float:
    """Every parameter of a traced model (its workload at no parallelism)."""
    work = model.workload(ParallelConfig(global_batch=1), 1, cluster.gpu)
    return work.layers * (work.layer_dense_params + work.layer_expert_params) + work.edge_params


def _smallest_dp(model: Priced, world: int) -> int:
    """The smallest dp any factorisation needs (ignoring the batch)."""
    return min(
        (dp for _, _, dp, _, _ in _factorisations(model, world, None, SearchSpace())), default=world
    )


def reprice(choice: Choice, model, cluster: Cluster,
            collective: Collective | None = None) -> Choice:  # fmt: skip
    """``choice`` priced again on ``model``: another pricing of the same model (e.g. the
    compiler's own tp / cp solutions, `autopar.planner.solved.SolvedModel`).  The same
    configuration (degrees, micro-batch, schedule, ZeRO, recompute) and nesting; its workload,
    per-rank memory and step time come from ``model``, on the spans its nesting gives."""
    cfg = choice.config
    pricer = _Pricer(as_priced(model), cluster, collective)
    work = pricer.work(cfg, cfg.micro_batch)
    dpd = cfg.data_parallel
    ranks = pipeline_shares(work, cfg, cluster, schedule=cfg.schedule,
                            virtual=cfg.virtual_stages, micro_batches=choice.micro_batches)  # fmt: skip
    memory = rank_memory(work, pp=cfg.pp, zero=cfg.zero, dp_dense=dpd, dp_expert=dpd // cfg.ep,
                         schedule=cfg.schedule, micro_batches=choice.micro_batches,
                         virtual=cfg.virtual_stages, recompute=cfg.recompute,
                         capacity=cluster.gpu.hbm_bytes, grad_bytes=cfg.grad_bytes,
                         weight_bytes=cfg.weight_bytes, ranks=ranks,
                         pp_buffers=cfg.pp_buffers)  # fmt: skip
    step = step_time(work, cfg, cluster, micro_batches=choice.micro_batches,
                     schedule=cfg.schedule, virtual=cfg.virtual_stages, recompute=cfg.recompute,
                     spans=spans(choice.order, cfg.tp, cfg.pp, cfg.dp, cfg.cp, cfg.ep),
                     collective=pricer.collective, ranks=ranks)  # fmt: skip
    return Choice(config=cfg, order=choice.order, memory=memory, step=step,
                  micro_batches=choice.micro_batches, work=work)  # fmt: skip
