"""Step time of a whole plan: compute, exposed communication per mesh axis, pipeline bubble.

Algorithm (`step_time`):
1. One micro-batch on the bottleneck stage: ⌈L/(p·v)⌉·v layers × (forward + backward + recompute
   forward) plus the end-stage work (embedding; final norm, LM head and loss).
2. Tensor parallelism (`tp_time`), on the critical path: the collectives a solved tp plan
   lists (a traced model priced as the compiler builds it), else Megatron's 2 all-reduces on
   the [b, s/c, h] activation per layer per pass (forward, backward, and the recompute
   forward under full recompute).  `micro_batch_time` (steps 1-5) is what the compiled
   plan's predicted step prices its micro-batches with.
3. Context parallelism (`ring_attention`): the zig-zag-balanced causal ring runs c steps per
   pass, each on 1/c of the attention work; a K/V block send overlaps only its own step's block
   (not the whole attention), the backward ring carries K,V and the partial dK,dV (twice the
   bytes, c sends: the last returns dK,dV to their owner), and every step pays its kernel
   launches and the online-softmax merge of the partial outputs.
4. Expert parallelism: dispatch + combine all-to-alls per layer per pass, exposed.
5. Pipeline: a send and a receive of the boundary activation per micro-batch per virtual
   stage, paired with the gradient's (two transfer times; four where the engine issues each
   as its own blocking op: `ParallelConfig.pp_p2p`); the bubble is (p−1)/v micro-batch times
   (GPipe and 1F1B: v = 1).
6. Data parallelism (gradients of dense weights over dp·cp, of experts over dp·cp/ep), one
   bucket per layer: fp32 reduce-scatter + bf16 all-gather (ZeRO-1/2) or all-reduce (stage 0),
   once per step, hidden (`cost.comm.exposed_behind`) behind the last micro-batch's backward
   when overlap is on (the last layer's bucket is always exposed; the tables' gradients are
   ready early, the LM head's first). Over several micro-batches ZeRO-2's shards hold no
   whole gradient to accumulate in, so it gathers and reduce-scatters every micro-batch
   (FSDP2's default, DeepSpeed ZeRO-2), priced as ZeRO-3 without the backward's re-gather.
   ZeRO-3 (`_zero3`) gathers each layer's bf16 weights
   before its forward and again before its backward (the recompute forward, if any, runs in
   the same window) and reduce-scatters its gradients after, every micro-batch: each layer's
   traffic hides only behind that layer's own compute in that pass; the first layer's gather
   is exposed. Every collective pays alpha-beta with its group size, per layer.
   HSDP (`shard_group`): ZeRO-3 over each shard group, then each shard's gradient
   all-reduced across the replicas in the same backward window (`_replicas`).
   NIC sharing: when the dp group and the cp ring both leave the node they share each GPU's
   NIC, so the ring's time on the wire in a pass is subtracted from the window the dp traffic
   hides behind (pp sends are priced on the critical path, never inside a compute window).
7. Optimizer: Adam reads and writes ~34 B per local parameter shard at HBM speed.
8. Gradient accumulation (`accumulation_time`): where ZeRO-2/3 gradients accumulate unsharded
   over the micro-batches (`ParallelConfig.defer_grad_sync`, FSDP2 under torch's pipeline
   schedules) each micro-batch's 16-bit gradient is added into the accumulators by a kernel
   of its own, at streaming HBM speed, on the critical path of the rank's backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cost.comm import crosses_nodes, exposed_behind, span_time
from cost.compute import KERNEL_LAUNCH_S, MEMORY_BW_FRACTION
from cost.config import P2P_TRANSFERS, ParallelConfig
from cost.hardware import Cluster
from cost.memory import in_flight
from cost.stages import RankShare, pipeline_ranks
from cost.workload import Workload

ADAM_BYTES_PER_PARAM = 34  # read fp32 master, m, v, grad + bf16 param; write the same back


@dataclass(frozen=True, kw_only=True)
class StepBreakdown:
    """Seconds of one optimizer step on the critical path."""

    compute: float
    comm: dict[str, float]
    bubble: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.compute + sum(self.comm.values()) + self.bubble + self.optimizer


def _spans(cfg: ParallelConfig) -> dict[str, tuple[int, int]]:
    """(stride, size) in global rank order of each communication group; mesh pp, dp, cp, tp
    (outermost first) with ep the inner part of dp."""
    t, c, d, e = cfg.tp, cfg.cp, cfg.dp or 1, cfg.ep
    spans = {"tp": (1, t), "cp": (t, c), "ep": (t * c, e), "dp": (t, d * c),
             "dp_expert": (t * c * e, d // e), "pp": (t * c * d, cfg.pp)}  # fmt: skip
    if cfg.shard_group and cfg.shard_degree < cfg.data_parallel:  # HSDP: shard, then replicate
        k = cfg.shard_degree
        spans |= {"dp": (t, k), "dp_replica": (t * k, d * c // k)}
    return spans


# (kind, nbytes, stride, size) -> seconds: prices one collective over a rank span
Collective = Callable[[str, float, int, int], float]


def default_collective(cluster: Cluster) -> Collective:
    """The two-level link model's price of a collective over a rank span."""
    return lambda kind, nbytes, stride, size: span_time(kind, nbytes, cluster, stride, size)


def _passes(recompute: str) -> int:
    return 3 if recompute == "full" else 2


CP_STEP_KERNELS = 3  # per ring step and pass: the block's attention kernel, the merge, the P2P
CP_MERGE_FWD = 5.0  # merge bytes per bf16 output byte: read the block's output, r/w fp32 acc
CP_MERGE_BWD = 4.0  # backward: read/write the fp32 dQ accumulator


@dataclass(frozen=True, kw_only=True)
class AttentionWork:
    """What `ring_attention` reads of a layer: its forward attention seconds on the rank
    (whole sequence, this rank's queries) and the bytes of its attention output."""

    attn_fwd_s: float
    attn_out_bytes: float


@dataclass(frozen=True, kw_only=True)
class RingAttention:
    """Seconds of one layer's ring attention per micro-batch: `fwd`/`bwd` exposed (the excess
    over the blocks they hide behind, plus launches and merges), `wire_fwd`/`wire_bwd` the ring's
    time on the wire (what it takes from a shared NIC)."""

    fwd: float
    bwd: float
    wire_fwd: float
    wire_bwd: float


def ring_attention(work: Workload | AttentionWork, c: int, ring_fwd: float, ring_bwd: float,
                   hbm_bw: float) -> RingAttention:  # fmt: skip
    """Ring attention over c ranks (module docstring, step 3).

    Derivation: with the zig-zag split each of the c steps of a pass computes 1/c of the
    causal attention, A/c forward (A = `attn_fwd_s`) and 2A/c backward. Forward: c−1 K/V sends
    of `ring_fwd` seconds, each overlapped with one step's block only, so each exposes
    max(0, ring_fwd − A/c) — never less than the whole-attention bound max(0, (c−1)·ring − A).
    Backward: c sends of K,V,dK,dV (`ring_bwd`), each behind a 2A/c block. Every step launches
    `CP_STEP_KERNELS` kernels, and each step after the first merges its partial output into
    the fp32 accumulator by log-sum-exp (forward: read the bf16 block output and read/write
    the fp32 accumulator, `CP_MERGE_FWD` bytes per output byte; backward: the fp32 dQ
    accumulator, `CP_MERGE_BWD`), at streaming HBM bandwidth.
    """
    block = work.attn_fwd_s / c
    launches = c * CP_STEP_KERNELS * KERNEL_LAUNCH_S
    merge = work.attn_out_bytes / (hbm_bw * MEMORY_BW_FRACTION)
    fwd = (c - 1) * (max(0.0, ring_fwd - block) + CP_MERGE_FWD * merge) + launches
    bwd = c * max(0.0, ring_bwd - 2 * block) + (c - 1) * CP_MERGE_BWD * merge + launches
    return RingAttention(fwd=fwd, bwd=bwd, wire_fwd=(c - 1) * ring_fwd, wire_bwd=c * ring_bwd)


def _ring(work: Workload, cfg: ParallelConfig, coll: Collective, spans: dict,
          cluster: Cluster) -> RingAttention:  # fmt: skip
    if cfg.cp == 1:
        return RingAttention(fwd=0.0, bwd=0.0, wire_fwd=0.0, wire_bwd=0.0)
    fwd = coll("send_recv", work.cp_bytes, *spans["cp"])
    bwd = coll("send_recv", 2 * work.cp_bytes, *spans["cp"])
    return ring_attention(work, cfg.cp, fwd, bwd, cluster.gpu.hbm_bw)


def _layer_comm(work: Workload, cfg: ParallelConfig, coll: Collective, spans: dict,
                recompute: str, ring: RingAttention) -> dict:  # fmt: skip
    """Exposed seconds per micro-batch per layer for cp and ep (steps 3–4)."""
    passes = _passes(recompute)
    ep = work.ep_calls * coll("all_to_all", work.ep_bytes, *spans["ep"])
    cp = (passes - 1) * ring.fwd + ring.bwd
    return {"cp": cp, "ep": passes * ep}


TP_OVERLAP_SPLITS = 4  # chunks of a pipelined tp collective (userbuffers' num_splits)


def overlapped_tp(comm: float, window: float, splits: int = TP_OVERLAP_SPLITS) -> float:
    """Exposed seconds of a layer's tp collectives (`comm`) split into `splits` chunks
    (`TP_OVERLAP_SPLITS`: Megatron's userbuffers; the tp degree: torch's micro-pipelined tp)
    and pipelined with the GEMMs of a pass (`window`): the chunk that starts (all-gather) or
    ends (reduce-scatter) the chain is exposed, the rest hides behind the pass's compute
    (`exposed_behind`)."""
    chunk = comm / splits
    return chunk + exposed_behind(comm - chunk, window)


def micro_pipeline_reduce_s(work: Workload, tp: int, hbm_bw: float) -> float:
    """Seconds of one reduce-scatter's local sum under torch's micro-pipelined tp
    (`torch.distributed._symmetric_memory._fused_matmul_reduce_scatter_impl`: each rank
    produces the tp partials of [M/t, N], peers pull them into `stacked_partials`, then
    `torch.sum(stacked_partials_view, dim=0)`): read t partials (the whole message), write
    one, at streaming HBM bandwidth, after the last partial lands (exposed)."""
    return work.tp_bytes * (1 + 1 / tp) / (hbm_bw * MEMORY_BW_FRACTION)


def tp_time(work: Workload, coll: Collective, span: tuple[int, int], recompute: str,
            per_stage: int, ends: tuple[bool, bool] = (True, True),
            overlap: bool = False, gather_bytes: int = 2, splits: int = TP_OVERLAP_SPLITS,
            reduce_s: float = 0.0, micro: bool = False) -> float:  # fmt: skip
    """Tensor-parallel seconds of one micro-batch of `per_stage` layers (step 2), on the
    critical path.  A solved plan's collectives (`work.tp_collectives`): each once, a
    repeated block's scaled to the stage's layers, one outside the blocks only on a rank
    that runs its end (`ends`: the prologue, the epilogue), a block's forward ones once
    more under full recompute (the checkpointed forward re-issues them), one the compiler
    decomposed under its matmuls (autopar.planner.overlap) less the seconds its ring steps
    hide; else Megatron's 2 all-reduces of [b, s/c, h] per layer per pass, exposed, or under
    `overlap` (a published run's Megatron userbuffers) pipelined with each pass's compute
    (`overlapped_tp`); `gather_bytes` 1: each all-reduce is Megatron-SP's all-gather of FP8
    activations (1 byte an element: torchao's Float8 tp styles cast before the gather) and
    reduce-scatter of the 16-bit output; `splits` the chunks of an overlapped collective and
    `reduce_s` the exposed local sum each overlapped reduce-scatter ends with (torch's
    micro-pipelined tp, `micro_pipeline_reduce_s`); `micro` (that pass, inductor's
    `micro_pipeline_tp`): the forward's collectives and the backward's all-gathers are
    pipelined, the backward's reduce-scatters are not (each takes a sum of matmuls, where the
    pass fuses one matmul into its reduce-scatter: the input gradient of Q, K and V, and of
    the gate and up projections, which the model shapes and torchtitan's Llama keep apart;
    pytorch/pytorch#149946: "only valid scaled_mm-reduce-scatter patterns in the forward
    graph, but not in the backward graph")."""
    if work.tp_collectives is None:
        split = gather_bytes < 2 or (overlap and micro)
        gather = coll("all_gather", work.tp_bytes * gather_bytes / 2, *span) if split else 0.0
        scatter = coll("reduce_scatter", work.tp_bytes, *span) if split else 0.0
        per_call = gather + scatter if gather_bytes < 2 else coll("all_reduce", work.tp_bytes, *span)
        per_layer = work.tp_calls * per_call
        if overlap and micro:
            # torch's pass fuses a reduce-scatter only with the one matmul that feeds it: in
            # backward each reduce-scatter takes the sum of the input-gradient matmuls of the
            # projections sharing an input (Q, K, V; gate and up), so it runs unfused, whole
            forward = [work.layer_fwd_s] * (1 + (recompute == "full"))
            fused = sum(overlapped_tp(per_layer, w, splits) + work.tp_calls * reduce_s
                        for w in forward)  # fmt: skip
            backward = overlapped_tp(work.tp_calls * gather, work.layer_bwd_s, splits)
            return per_stage * (fused + backward + work.tp_calls * scatter)
        if overlap:
            windows = [work.layer_fwd_s, work.layer_bwd_s] + [work.layer_fwd_s] * (recompute == "full")
            return per_stage * sum(overlapped_tp(per_layer, w, splits)
                                   + work.tp_calls * reduce_s for w in windows)  # fmt: skip
        return per_stage * _passes(recompute) * per_layer
    total, per = 0.0, per_stage / max(work.layers, 1)
    for c in work.tp_collectives:
        if not c.in_block and not ends[1 if c.after else 0]:
            continue
        again = c.in_block and c.forward and recompute == "full"
        seconds = max(0.0, coll(c.kind, c.nbytes, *span) - c.hidden_s)  # a decomposed one's rest
        total += (per if c.in_block else 1.0) * (1 + again) * seconds
    return total


def micro_batch_time(work: Workload, cfg: ParallelConfig, coll: Collective, spans: dict,
                     recompute: str, per_stage: int, v: int, cluster: Cluster,
                     ends: tuple[bool, bool] | None = None) -> tuple[float, dict[str, float]]:  # fmt: skip
    """Steps 1–5 for one micro-batch of `per_stage` layers on a pipeline rank: (compute
    seconds, exposed seconds per axis); `ends` whether the rank runs the prologue and the
    epilogue (None: a stage program's own ends, both without pp, the larger with pp).  The
    whole-cluster search and the compiled plan's predicted step
    (`autopar.axes.data_parallel.predict_step`) both price a micro-batch with it."""
    if ends is None:
        edge_s = work.pre_s + work.post_s if cfg.pp == 1 else max(work.pre_s, work.post_s)
        ends = (True, True)
    else:
        edge_s = work.pre_s * ends[0] + work.post_s * ends[1]
    layer = work.layer_fwd_s + work.layer_bwd_s + work.recompute_s[recompute]
    ring = _ring(work, cfg, coll, spans, cluster)
    layer_comm = _layer_comm(work, cfg, coll, spans, recompute, ring)
    gather = cfg.tp_gather_bytes if cfg.sequence_parallel else 2
    micro = cfg.tp_overlap == "micro_pipeline"
    splits = cfg.tp if micro else TP_OVERLAP_SPLITS
    reduce_s = micro_pipeline_reduce_s(work, cfg.tp, cluster.gpu.hbm_bw) if micro else 0.0
    comm = {"tp": tp_time(work, coll, spans["tp"], recompute, per_stage, ends,
                          bool(cfg.tp_overlap), gather, splits, reduce_s, micro),
            **{k: per_stage * x for k, x in layer_comm.items()}}  # fmt: skip
    p2p = coll("send_recv", work.boundary_bytes, *spans["pp"])
    comm["pp"] = P2P_TRANSFERS[cfg.pp_p2p] * v * p2p if cfg.pp > 1 else 0.0
    return per_stage * layer + edge_s, comm


def _groups(work: Workload, spans: dict, layers: float, edges: float) -> tuple:
    """((params, span), ...) of the dense and expert gradient groups."""
    return ((layers * work.layer_dense_params + edges * work.edge_params, spans["dp"]),
            (layers * work.layer_expert_params, spans["dp_expert"]))  # fmt: skip


def _each(coll: Collective, groups: tuple, kind: str, bytes_per_param: int) -> float:
    return sum(coll(kind, bytes_per_param * p, *span) for p, span in groups)


def _reduce(coll: Collective, groups: tuple, zero: int, gather_bytes: float = 2,
            grad_bytes: int = 4, whole: bool = False) -> float:  # fmt: skip
    """Gradient synchronisation of `groups`, `grad_bytes` per gradient element: all-reduce
    (stage 0), reduce-scatter + bf16 all-gather of the stepped weights (1, 2; `gather_bytes`
    per parameter), reduce-scatter alone (3).  `whole` (stage 1): the whole gradient is
    all-reduced before each rank steps its shard (`ParallelConfig.grad_sync`)."""
    if zero == 0:
        return _each(coll, groups, "all_reduce", grad_bytes)
    gather = _each(coll, groups, "all_gather", gather_bytes) if zero < 3 else 0.0
    return _each(coll, groups, "all_reduce" if whole else "reduce_scatter", grad_bytes) + gather


def _dp_comm(work: Workload, cfg: ParallelConfig, coll: Collective, spans: dict,
             micro_batches: int, recompute: str, per_stage: int, ring: RingAttention,
             shared: bool, ends: tuple[bool, bool], bare_edges: bool = False) -> float:  # fmt: skip
    """Exposed data-parallel seconds per step (step 6), for `per_stage` layers on the rank
    and the end tables when it runs an end (`ends`; `bare_edges`: they lie alone in stages
    without blocks). `shared`: the dp traffic and the cp ring share the NIC."""
    tables = 1.0 if any(ends) else 0.0
    deferred = cfg.whole_grads
    if cfg.zero == 3 or (cfg.zero == 2 and micro_batches > 1 and not deferred):
        return _zero3(work, coll, spans, micro_batches, recompute, per_stage, ring, shared, ends,
                      cfg.grad_bytes, cfg.gather_bytes, deferred=deferred,
                      regather=cfg.zero == 3, bare_edges=bare_edges,
                      post_prefetch=cfg.backward_prefetch == "post")  # fmt: skip
    sync = {"grad_bytes": cfg.grad_bytes, "whole": cfg.grad_sync == "all_reduce"}
    if not cfg.overlap_grad_reduce:
        return _reduce(coll, _groups(work, spans, per_stage, tables), cfg.zero, **sync)
    bucket = _reduce(coll, _groups(work, spans, 1, 0), cfg.zero, cfg.gather_bytes, **sync)
    edges = _reduce(coll, _groups(work, spans, 0, tables), cfg.zero, **sync)
    busy = ring.wire_bwd if shared else 0.0
    window = per_stage * max(0.0, work.layer_bwd_s - busy)
    return max(bucket, exposed_behind(per_stage * bucket + edges, window))


def _zero3(work: Workload, coll: Collective, spans: dict, micro_batches: int, recompute: str,
           per_stage: int, ring: RingAttention, shared: bool,
           ends: tuple[bool, bool] = (True, True), grad_bytes: int = 4,
           gather_bytes: float = 2, deferred: bool = False,
           regather: bool = True, bare_edges: bool = False,
           post_prefetch: bool = False) -> float:  # fmt: skip
    """ZeRO-3 exposed seconds per step (step 6); with `regather` False, ZeRO-2 over several
    micro-batches (weights kept gathered from forward to backward, so only the forward
    gathers).

    Derivation, per layer per micro-batch: its bf16 gather G (`gather_bytes` per parameter;
    less with FP8 weights gathered in float8) (alpha-beta over the dp group:
    the latency grows with the group, paid per layer) is prefetched behind the previous
    layer's compute in the same pass, so the forward exposes max(0, G − free forward window)
    and the backward, which also reduce-scatters the fp32 gradient R on the same NIC, exposes
    max(0, G + R − free backward window); the backward window includes the recompute forward
    (it runs between the gather and the backward). A window is free of the cp ring's wire
    time when both share the NIC (`exposed_behind`). The embedding/head tables stream behind
    the end stages' work, gathered once a micro-batch: they are FSDP's root, which torch keeps
    gathered from the end of forward into backward (FSDP1 and FSDP2 alike; autopar's runtime,
    `autopar.axes.data_parallel.kept_gathered`), unless they lie alone in a stage without
    blocks (`bare_edges`), resharded and gathered again for backward like any group. The
    first layer's gather of the step has nothing before it: exposed.
    A stage's last layer is not resharded after forward (its backward comes first; autopar's
    runtime and torchtitan keep it), so its backward exposes only its reduce-scatter.
    `post_prefetch` (FSDP1's BACKWARD_POST): the backward gather is issued after the current
    layer's gradient computation and the next layer's waits for it, so every backward gather
    is exposed and only the reduce-scatter hides behind the window.
    `deferred` (FSDP2 under torch's pipeline schedules: no reshard after forward or backward,
    no gradient sync before the last micro-batch): each layer is gathered once, in the first
    micro-batch's forward, and every gradient is reduce-scattered once, after the stage's
    last backward, with no compute of the rank left to hide behind.
    """
    layer, edge = _groups(work, spans, 1, 0), _groups(work, spans, 0, 1.0 if any(ends) else 0.0)
    gather = _each(coll, layer, "all_gather", gather_bytes)
    scatter = (_reduce(coll, layer, 3, grad_bytes=grad_bytes)
               + _replicas(work, coll, spans, 1, 0, grad_bytes))  # fmt: skip
    tables = ((1 + bare_edges) * _each(coll, edge, "all_gather", 2)
              + _reduce(coll, edge, 3, grad_bytes=grad_bytes)
              + _replicas(work, coll, spans, 0, 1.0 if any(ends) else 0.0, grad_bytes))  # fmt: skip
    busy_f, busy_b = (ring.wire_fwd, ring.wire_bwd) if shared else (0.0, 0.0)
    window = work.layer_bwd_s + work.recompute_s[recompute]
    fwd = exposed_behind(gather, work.layer_fwd_s, busy_f)
    bwd = (gather * regather + exposed_behind(scatter, window, busy_b) if post_prefetch
           else exposed_behind(gather * regather + scatter, window, busy_b))
    last = exposed_behind(scatter, window, busy_b)
    tail = exposed_behind(tables, work.pre_s * ends[0] + work.post_s * ends[1])
    if deferred:
        return gather + per_stage * (fwd + scatter) + tail
    layers = per_stage * fwd + max(per_stage - 1, 0) * bwd + (last if per_stage else 0.0)
    return gather + micro_batches * (layers + tail)


def _replicas(work: Workload, coll: Collective, spans: dict, layers: float,
              edges: float, grad_bytes: int = 4) -> float:  # fmt: skip
    """HSDP: the all-reduce (`grad_bytes` per element) of each shard's reduced gradient
    across the replicas (0 without a `dp_replica` span)."""
    if "dp_replica" not in spans:
        return 0.0
    stride, size = spans["dp"]
    params = (layers * work.layer_dense_params + edges * work.edge_params) / size
    return coll("all_reduce", grad_bytes * params, *spans["dp_replica"])


def bubble_time(micro_batch_s: float, pp: int, virtual: int = 1) -> float:
    """Pipeline bubble of a step (step 5): (p − 1)/v micro-batch times of the bottleneck stage."""
    return (pp - 1) / virtual * micro_batch_s


def accumulation_time(params: float, micro_batches: int, cfg: ParallelConfig, gpu,
                      new_bytes: int = 2) -> float:  # fmt: skip
    """Seconds a pipeline rank spends accumulating the unsharded gradients of its `params`
    local parameters over `micro_batches` (step 8): only under `cfg.defer_grad_sync` with pp
    and ZeRO >= 2 (else gradients are reduce-scattered each micro-batch, or accumulate inside
    the weight-gradient GEMM as Megatron's fused accumulation does).  FSDP2 (torch's
    `FSDPParam.to_accumulated_grad_if_needed` / `accumulate_unsharded_grad_if_needed`): the
    first micro-batch's `new_bytes`-per-element gradient is cast into a `cfg.grad_bytes`
    accumulator when the dtypes differ (read `new_bytes`, write `grad_bytes`), every later one
    is added to it (read `new_bytes` + `grad_bytes`, write `grad_bytes`)."""
    if not cfg.whole_grads or micro_batches < 1:
        return 0.0
    first = new_bytes + cfg.grad_bytes if cfg.grad_bytes != new_bytes else 0
    later = new_bytes + 2 * cfg.grad_bytes
    moved = params * (first + (micro_batches - 1) * later)
    return moved / (gpu.hbm_bw * MEMORY_BW_FRACTION)


def optimizer_time(params: float, shard: int, gpu) -> float:
    """Adam's step over `params` local parameters sharded `shard` ways (step 7): it reads and
    writes `ADAM_BYTES_PER_PARAM` bytes per parameter of the shard at streaming HBM speed."""
    return ADAM_BYTES_PER_PARAM * params / shard / (gpu.hbm_bw * MEMORY_BW_FRACTION)


def data_parallel_time(work: Workload, cfg: ParallelConfig, cluster: Cluster, *,
                       micro_batches: int, recompute: str, per_stage: int,
                       spans: dict | None = None, collective: Collective | None = None,
                       ends: tuple[bool, bool] = (True, True),
                       bare_edges: bool = False) -> float:  # fmt: skip
    """Exposed data-parallel seconds of one step (step 6) for `per_stage` layers of `work`
    on the rank (and its end tables, when `ends` says it runs one; `bare_edges`: each in a
    stage without blocks, `cost.stages.RankShare.bare_edges`): what `step_time` prices, and
    what the compiled plan's step prices."""
    spans = spans or _spans(cfg)
    coll = collective or default_collective(cluster)
    ring = _ring(work, cfg, coll, spans, cluster)
    gpn = cluster.gpus_per_node
    shared = crosses_nodes(*spans["cp"], gpn) and crosses_nodes(*spans["dp"], gpn)
    return _dp_comm(work, cfg, coll, spans, micro_batches, recompute, per_stage, ring, shared,
                    ends, bare_edges)  # fmt: skip


def pipeline_shares(work: Workload, cfg: ParallelConfig, cluster: Cluster, *, schedule: str,
                    virtual: int, micro_batches: int) -> tuple[RankShare, ...]:  # fmt: skip
    """Step 5's cut: each pipeline rank's share (`cost.stages.pipeline_ranks`), the units
    priced as the compiled pipeline's `unit_costs` prices them (forward + backward seconds,
    `work.cut_s` when given; each boundary the send and receive of its activation on the
    pipeline axis of Megatron's nesting, the two-level link model), so memory and every
    nesting see one cut."""
    v = virtual if schedule == "interleaved" else 1
    sent = work.boundary_bytes if work.cut_bytes is None else work.cut_bytes
    p2p = span_time("send_recv", sent, cluster, *_spans(cfg)["pp"])
    unit = work.cut_s or (work.pre_s, work.layer_fwd_s + work.layer_bwd_s, work.post_s)
    held = lambda r: in_flight(schedule, cfg.pp, micro_batches, v, r)  # noqa: E731
    return pipeline_ranks(work.layers, unit, cfg.pp, v, held, 2 * p2p)


def step_time(work: Workload, cfg: ParallelConfig, cluster: Cluster, *, micro_batches: int,
              schedule: str, virtual: int, recompute: str, spans: dict | None = None,
              collective: Collective | None = None,
              ranks: Sequence[RankShare] | None = None) -> StepBreakdown:  # fmt: skip
    """Seconds of one training step of `micro_batches` micro-batches per data-parallel rank
    on its slowest pipeline rank (`ranks`, default `pipeline_shares`); `spans` (axis →
    (stride, size)) and `collective` override the Megatron layout and the flat two-level
    link model (the planner passes other nestings and its topology)."""
    spans = spans or _spans(cfg)
    coll = collective or default_collective(cluster)
    v = virtual if schedule == "interleaved" else 1
    ranks = ranks or pipeline_shares(work, cfg, cluster, schedule=schedule, virtual=virtual,
                                     micro_batches=micro_batches)  # fmt: skip
    # a rank's step reads its blocks, ends and chunks, not its in-flight count: price each
    # distinct share once (the first of equals, as over all ranks)
    distinct = {(s.blocks, s.first, s.last, s.chunks, s.bare_edges): s for s in reversed(ranks)}
    steps = [_rank_step(work, cfg, cluster, share, micro_batches, v, recompute, spans, coll)
             for share in sorted(distinct.values(), key=ranks.index)]  # fmt: skip
    return max(steps, key=lambda s: s.total)


def _rank_step(work: Workload, cfg: ParallelConfig, cluster: Cluster, share: RankShare,
               micro_batches: int, v: int, recompute: str, spans: dict,
               coll: Collective) -> StepBreakdown:  # fmt: skip
    """Steps 1-8 on one pipeline rank: its micro-batches, the bubble at its micro-batch
    time, its gradients' exposed traffic, its optimizer step and its deferred gradients'
    accumulation (counted with the compute)."""
    ends = (share.first, share.last)
    compute_mb, comm_mb = micro_batch_time(work, cfg, coll, spans, recompute, share.blocks, v,
                                           cluster, ends)  # fmt: skip
    per_mb = compute_mb + sum(comm_mb.values())
    comm = {k: micro_batches * x for k, x in comm_mb.items()}
    comm["dp"] = data_parallel_time(work, cfg, cluster, micro_batches=micro_batches,
                                    recompute=recompute, per_stage=share.blocks, spans=spans,
                                    collective=coll, ends=ends,
                                    bare_edges=share.bare_edges)  # fmt: skip
    params = (share.blocks * (work.layer_dense_params + work.layer_expert_params)
              + share.edges * work.edge_params)  # fmt: skip
    shard = cfg.shard_degree if cfg.zero >= 1 else 1
    accumulate = accumulation_time(params, micro_batches, cfg, cluster.gpu, cfg.weight_bytes)
    return StepBreakdown(compute=micro_batches * compute_mb + accumulate, comm=comm,
                         bubble=bubble_time(per_mb, cfg.pp, v),
                         optimizer=optimizer_time(params, shard, cluster.gpu))  # fmt: skip
