"""Step time: tp collectives per layer, pipeline bubble per schedule, dp overlap, optimizer."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from cost.comm import collective_time, span_time
from cost.compute import KERNEL_LAUNCH_S, MEMORY_BW_FRACTION
from cost.config import ParallelConfig
from cost.errors import CostInputError
from cost.hardware import Cluster
from cost.model import ModelShape
from cost.step import (
    CP_MERGE_BWD,
    CP_MERGE_FWD,
    CP_STEP_KERNELS,
    pipeline_shares,
    ring_attention,
    step_time,
)
from cost.workload import shape_workload

SHAPE = ModelShape.gpt(layers=16, hidden=4096, heads=32, seq=2048, vocab=51200)
# the same layers with a small vocabulary: each end weighs less than a layer
EVEN = ModelShape.gpt(layers=16, hidden=4096, heads=32, seq=2048, vocab=8192)
CLUSTER = Cluster.preset("dgx-h100", nodes=8)


def _step(cfg: ParallelConfig, m: int = 16, shape: ModelShape = SHAPE, **over):
    cfg = replace(cfg, **over)
    work = shape_workload(shape, cfg, cfg.micro_batch, CLUSTER.gpu)
    return work, step_time(work, cfg, CLUSTER, micro_batches=m, schedule=cfg.schedule,
                           virtual=cfg.virtual_stages, recompute=cfg.recompute)  # fmt: skip


BASE = ParallelConfig(tp=8, pp=4, dp=2, global_batch=32, micro_batch=1, schedule="1f1b",
                      virtual_stages=1, recompute="none")  # fmt: skip


def _best_cuts(work, stages: int) -> list[tuple[tuple[int, bool, bool], ...]]:
    """Brute force over every cut of the units (the prologue, each block, the epilogue) into
    ``stages`` contiguous stages: those whose slowest stage is least, a stage costing its
    units' forward + backward seconds and, unless last, the send and receive of the
    boundary activation on the pipeline axis (Megatron nesting of BASE: stride tp·dp = 16,
    4 ranks).  Each as per stage (blocks, holds the prologue, holds the epilogue)."""
    layers = work.layers
    costs = [work.pre_s, *[work.layer_fwd_s + work.layer_bwd_s] * layers, work.post_s]
    n = len(costs)
    boundary = 2 * span_time("send_recv", work.boundary_bytes, CLUSTER, 8 * 2, 4)

    def worst(bounds):
        return max(sum(costs[a:b]) + (boundary if b < n else 0.0)
                   for a, b in itertools.pairwise(bounds))  # fmt: skip

    parts = [(0, *c, n) for c in itertools.combinations(range(1, n), stages - 1)]
    least = min(worst(b) for b in parts)
    return [tuple((sum(1 for u in range(a, b) if 1 <= u <= layers), a == 0, b == n)
                  for a, b in itertools.pairwise(bounds))
            for bounds in parts if worst(bounds) <= least * (1 + 1e-12)]  # fmt: skip


def test_tp_exposes_two_all_reduces_per_layer_per_pass():
    work, step = _step(BASE, shape=EVEN)
    # the balanced cut puts L/p = 4 blocks on every rank (ends and boundary lighter than a
    # layer: any other cut gives some stage 5 layers), so whichever rank is slowest runs 4
    assert [[s[0] for s in cut] for cut in _best_cuts(work, 4)] == [[4, 4, 4, 4]]
    ar = collective_time("all_reduce", 2 * 2048 * 4096, 8, CLUSTER.intra)
    assert work.tp_bytes == 2 * 2048 * 4096
    assert step.comm["tp"] == pytest.approx(16 * (16 / 4) * 2 * 2 * ar)  # m · L/p · passes · 2
    _, full = _step(BASE, shape=EVEN, recompute="full")
    assert full.comm["tp"] == pytest.approx(1.5 * step.comm["tp"])


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                             ("interleaved", 4)])  # fmt: skip
def test_bubble_fraction_per_schedule(schedule, v):
    m, p = 16, 4
    _, step = _step(BASE, m=m, schedule=schedule, virtual_stages=v)
    ideal = step.compute + sum(x for k, x in step.comm.items() if k != "dp")
    assert step.bubble / ideal == pytest.approx((p - 1) / (v * m))


def test_interleaving_sends_v_times_more_point_to_point():
    _, plain = _step(BASE)
    _, inter = _step(BASE, schedule="interleaved", virtual_stages=4)
    assert inter.comm["pp"] == pytest.approx(4 * plain.comm["pp"])
    p2p = span_time("send_recv", 2 * 2048 * 4096 / 8, CLUSTER, 8 * 2, 4)
    assert plain.comm["pp"] == pytest.approx(16 * 2 * p2p)


def test_serial_point_to_point_exposes_four_transfers_per_micro_batch():
    """DeepSpeed's pipeline engine issues a micro-batch's SendGrad, RecvActivation, RecvGrad
    and SendActivation as four blocking ops: four transfer times where Megatron's paired
    send-and-receive takes two; nothing else in the step moves."""
    _, paired = _step(BASE)
    _, serial = _step(BASE, pp_p2p="serial")
    p2p = span_time("send_recv", 2 * 2048 * 4096 / 8, CLUSTER, 8 * 2, 4)
    assert serial.comm["pp"] == pytest.approx(16 * 4 * p2p) == 2 * paired.comm["pp"]
    assert serial.total - paired.total == pytest.approx(16 * 2 * p2p * (1 + 3 / 16))  # + bubble
    assert {k: v for k, v in serial.comm.items() if k != "pp"} == {
        k: v for k, v in paired.comm.items() if k != "pp"}
    with pytest.raises(CostInputError, match="pp_p2p"):
        replace(BASE, pp_p2p="async")


def test_gradient_reduction_overlap_only_hides_time():
    dp_heavy = replace(BASE, tp=1, pp=1, dp=64)
    _, hidden = _step(dp_heavy, m=1)
    _, exposed = _step(dp_heavy, m=1, overlap_grad_reduce=False)
    assert 0 < hidden.comm["dp"] < exposed.comm["dp"]
    assert hidden.compute == exposed.compute


def test_zero_stages_change_dp_traffic_not_compute():
    _, ddp = _step(BASE, shape=EVEN, zero=0, overlap_grad_reduce=False)
    _, z1 = _step(BASE, shape=EVEN, zero=1, overlap_grad_reduce=False)
    work, z3 = _step(BASE, shape=EVEN, zero=3)
    assert ddp.compute == z1.compute == z3.compute
    # 4 blocks on every rank (test above); the slowest rank is the last: an end rank
    # reduces its table besides its blocks (every other term no less than a middle rank's),
    # and the epilogue outweighs the prologue (the tables alike: one end each)
    assert [[s[0] for s in cut] for cut in _best_cuts(work, 4)] == [[4, 4, 4, 4]]
    assert work.post_s > work.pre_s
    params = 4 * work.layer_dense_params + work.edge_params  # 4 blocks and one end's table
    span = (8, 2)  # dp groups: stride tp = 8, two ranks
    assert ddp.comm["dp"] == pytest.approx(span_time("all_reduce", 4 * params, CLUSTER, *span))
    scatter = span_time("reduce_scatter", 4 * params, CLUSTER, *span)
    gather = span_time("all_gather", 2 * params, CLUSTER, *span)
    assert z1.comm["dp"] == pytest.approx(scatter + gather)
    # ZeRO-3: per layer, a bf16 gather before the forward and before the backward, an fp32
    # reduce-scatter after it, each hidden only behind that layer's own pass; a stage's last
    # layer stays gathered into backward (no second gather); the first layer's gather is
    # exposed; the tables stream behind the end's own work (the last rank: the epilogue),
    # gathered once: FSDP's root, kept gathered into backward
    g_layer = span_time("all_gather", 2 * work.layer_dense_params, CLUSTER, *span)
    r_layer = span_time("reduce_scatter", 4 * work.layer_dense_params, CLUSTER, *span)
    fwd = max(0.0, g_layer - work.layer_fwd_s)
    bwd = max(0.0, g_layer + r_layer - work.layer_bwd_s)
    ends = (span_time("all_gather", 2 * work.edge_params, CLUSTER, *span)
            + span_time("reduce_scatter", 4 * work.edge_params, CLUSTER, *span))  # fmt: skip
    tail = max(0.0, ends - work.post_s)
    last = max(0.0, r_layer - work.layer_bwd_s)
    assert z3.comm["dp"] == pytest.approx(g_layer + 16 * (4 * fwd + 3 * bwd + last + tail))
    assert z1.optimizer == pytest.approx(ddp.optimizer / 2)  # Adam on a 1/dp shard


def test_no_pipeline_no_bubble_and_step_total_adds_up():
    _, step = _step(BASE, tp=8, pp=1, dp=8)
    assert step.bubble == 0.0 and step.comm["pp"] == 0.0
    total = step.compute + sum(step.comm.values()) + step.bubble + step.optimizer
    assert step.total == pytest.approx(total)


def test_context_parallel_ring_overlaps_each_step_with_its_own_block():
    cfg = replace(BASE, tp=8, pp=1, dp=4, cp=2)
    work, step = _step(cfg)
    ring = span_time("send_recv", work.cp_bytes, CLUSTER, 8, 2)
    ring2 = span_time("send_recv", 2 * work.cp_bytes, CLUSTER, 8, 2)
    block = work.attn_fwd_s / 2
    merge = work.attn_out_bytes / (CLUSTER.gpu.hbm_bw * MEMORY_BW_FRACTION)
    launches = 2 * CP_STEP_KERNELS * KERNEL_LAUNCH_S
    fwd = max(0.0, ring - block) + CP_MERGE_FWD * merge + launches
    bwd = 2 * max(0.0, ring2 - 2 * block) + CP_MERGE_BWD * merge + launches
    assert work.attn_out_bytes == 2 * 2048 // 2 * 4096 // 8
    assert step.comm["cp"] == pytest.approx(16 * 16 * (fwd + bwd))


def test_uneven_pipeline_stages_price_the_most_loaded_stage():
    """18 layers on 4 ranks: the balanced cut (as the compiled pipeline cuts) gives the
    heavy epilogue (the 51200-entry LM head and loss, ~1.4 layers) only 3 blocks and the
    first three ranks 5 each; the most loaded is the first (5 blocks and the embedding),
    not ⌈18/4⌉ = 5 layers plus the larger end."""
    shape = ModelShape.gpt(layers=18, hidden=4096, heads=32, seq=2048, vocab=51200)
    cfg = replace(BASE, pp=4)
    work = shape_workload(shape, cfg, 1, CLUSTER.gpu)
    step = step_time(work, cfg, CLUSTER, micro_batches=16, schedule="1f1b", virtual=1,
                     recompute="none")  # fmt: skip
    per_layer = work.layer_fwd_s + work.layer_bwd_s
    (cut,) = _best_cuts(work, 4)  # the one least-slowest-stage cut
    assert cut == ((5, True, False), (5, False, False), (5, False, False), (3, False, True))
    rank_s = [b * per_layer + work.pre_s * first + work.post_s * last for b, first, last in cut]
    # the first rank's compute is the largest, and so are its tp collectives (5 blocks,
    # tied), its tables' dp traffic and optimizer (an end): it is the slowest rank
    assert max(rank_s) == rank_s[0]
    assert step.compute == pytest.approx(16 * (5 * per_layer + work.pre_s))
    assert step.compute < 16 * (5 * per_layer + max(work.pre_s, work.post_s))


def test_ring_attention_never_hides_more_than_the_whole_attention_bound():
    work = shape_workload(SHAPE, replace(BASE, cp=4), 1, CLUSTER.gpu)
    a = work.attn_fwd_s
    for c in (2, 4, 8):
        for ring in (0.0, a / (4 * c), a / c, 2 * a / c, a):
            r = ring_attention(work, c, ring, 2 * ring, CLUSTER.gpu.hbm_bw)
            assert r.fwd >= max(0.0, (c - 1) * ring - a)  # the old, whole-attention bound
            assert r.bwd >= max(0.0, 2 * c * ring - 2 * a)
            assert r.wire_fwd == pytest.approx((c - 1) * ring)
            assert r.wire_bwd == pytest.approx(2 * c * ring)
        hidden = ring_attention(work, c, a / (4 * c), a / (2 * c), CLUSTER.gpu.hbm_bw)
        late = ring_attention(work, c, 2 * a / c, 4 * a / c, CLUSTER.gpu.hbm_bw)
        assert hidden.fwd > 0  # launches and merges even when every send hides
        # a send longer than its block exposes the excess at every step
        assert late.fwd - hidden.fwd == pytest.approx((c - 1) * a / c)
        assert late.bwd - hidden.bwd == pytest.approx(c * 2 * a / c)
    # more ring steps: more launches and merges for the same attention
    two, eight = (ring_attention(work, c, 0.0, 0.0, CLUSTER.gpu.hbm_bw) for c in (2, 8))
    assert eight.fwd > two.fwd and eight.bwd > two.bwd


def test_zero3_gathers_pay_latency_per_layer_growing_with_the_group():
    small = ModelShape.gpt(layers=4, hidden=1024, heads=16, seq=512, vocab=8192)

    def zero3(nodes: int):
        cluster = Cluster.preset("dgx-h100", nodes=nodes)
        cfg = ParallelConfig(tp=1, pp=1, dp=8 * nodes, zero=3, global_batch=8 * nodes,
                             micro_batch=1, recompute="none")  # fmt: skip
        work = shape_workload(small, cfg, 1, cluster.gpu)
        step = step_time(work, cfg, cluster, micro_batches=1, schedule="1f1b", virtual=1,
                         recompute="none")  # fmt: skip
        return work, cluster, step

    work, cluster, step = zero3(256)
    gather = span_time("all_gather", 2 * work.layer_dense_params, cluster, 1, 2048)
    assert gather > 2047 * cluster.inter.latency  # alpha-beta: one hop per ring step
    assert gather > work.layer_fwd_s  # per-layer compute too short to hide it
    assert step.comm["dp"] >= gather + 4 * (gather - work.layer_fwd_s)
    _, _, node = zero3(1)
    _, _, few = zero3(8)
    assert node.comm["dp"] < few.comm["dp"] < step.comm["dp"]


def test_cp_ring_and_dp_traffic_share_the_nic_only_when_both_cross_nodes():
    cfg = replace(BASE, tp=4, pp=1, dp=8, cp=2, zero=3, global_batch=64)
    work = shape_workload(SHAPE, cfg, 1, CLUSTER.gpu)

    def flat(kind, nbytes, stride, size):  # same price wherever the group sits
        return 0.0 if size == 1 else 1e-5 + nbytes / 20e9

    def run(cp_span):
        spans = {"tp": (1, 4), "cp": cp_span, "ep": (8, 1), "dp": (4, 16),
                 "dp_expert": (8, 8), "pp": (64, 1)}  # fmt: skip
        return step_time(work, cfg, CLUSTER, micro_batches=8, schedule="1f1b", virtual=1,
                         recompute="none", spans=spans, collective=flat)  # fmt: skip

    inside, across = run((4, 2)), run((32, 2))  # cp in one node vs cp across two
    assert inside.comm["cp"] == across.comm["cp"] and inside.compute == across.compute
    assert across.comm["dp"] > inside.comm["dp"]


def test_zero3_gathers_the_root_tables_once_unless_alone_in_a_stage():
    """FSDP's root (the embedding and head with blocks beside them) stays gathered from
    forward into backward, as torch does for a root and autopar's runtime does
    (`kept_gathered`): one gather a micro-batch.  A table alone in a stage is resharded and
    gathered again for backward.  With no compute at the ends to hide behind, the two differ
    by exactly one bf16 gather of the tables per micro-batch."""
    from cost.step import data_parallel_time

    cluster = Cluster.preset("dgx-h100", nodes=4)
    cfg = ParallelConfig(tp=1, pp=1, dp=32, zero=3, global_batch=64, micro_batch=1,
                         recompute="none")  # fmt: skip
    work = replace(shape_workload(SHAPE, cfg, 1, cluster.gpu), pre_s=0.0, post_s=0.0)
    kept, bare = (data_parallel_time(work, cfg, cluster, micro_batches=2, recompute="none",
                                     per_stage=work.layers, bare_edges=b)
                  for b in (False, True))  # fmt: skip
    gather = span_time("all_gather", 2 * work.edge_params, cluster, 1, 32)
    assert gather > 0
    assert bare - kept == pytest.approx(2 * gather, rel=1e-9)


def test_gradient_collectives_move_the_gradient_dtype_and_zero1_may_all_reduce_whole():
    """Every gradient collective moves `grad_bytes` per element (fms-fsdp's bf16 policy
    reduces in bf16); ZeRO-1's sync is a reduce-scatter unless `grad_sync="all_reduce"`
    (DeepSpeed's BF16_Optimizer: the whole fp32 gradient all-reduced, then the shard stepped
    and the bf16 weights all-gathered)."""
    span = (8, 2)  # BASE's dp groups: stride tp = 8, two ranks
    work, fp32 = _step(BASE, shape=EVEN, zero=0, overlap_grad_reduce=False)
    _, bf16 = _step(BASE, shape=EVEN, zero=0, overlap_grad_reduce=False, grad_bytes=2)
    params = 4 * work.layer_dense_params + work.edge_params  # the slowest (last) rank's
    assert fp32.comm["dp"] == pytest.approx(span_time("all_reduce", 4 * params, CLUSTER, *span))
    assert bf16.comm["dp"] == pytest.approx(span_time("all_reduce", 2 * params, CLUSTER, *span))
    _, scatter = _step(BASE, shape=EVEN, zero=1, overlap_grad_reduce=False)
    _, whole = _step(BASE, shape=EVEN, zero=1, overlap_grad_reduce=False,
                     grad_sync="all_reduce")  # fmt: skip
    gather = span_time("all_gather", 2 * params, CLUSTER, *span)
    assert scatter.comm["dp"] == pytest.approx(
        span_time("reduce_scatter", 4 * params, CLUSTER, *span) + gather)
    assert whole.comm["dp"] == pytest.approx(fp32.comm["dp"] + gather)
    assert whole.compute == scatter.compute
    for zero in (0, 2, 3):
        with pytest.raises(CostInputError, match="grad_sync"):
            replace(BASE, zero=zero, grad_sync="all_reduce")
    with pytest.raises(CostInputError, match="grad_sync"):
        replace(BASE, grad_sync="ring")


def test_deferred_fp32_accumulation_is_a_pass_per_micro_batch():
    """Under `defer_grad_sync` (FSDP2 under torch's pipeline schedules) each micro-batch's
    bf16 gradient is cast into (first) or added to (later) the fp32 accumulators by a kernel
    of its own: 2 + 4 bytes, then 2 + 4 + 4 a parameter, at streaming HBM speed on the rank's
    compute.  Syncing each micro-batch, a bf16 accumulator of bf16 gradients' first
    micro-batch, or no pp: nothing added."""
    from cost.step import accumulation_time

    gpu, params, m = CLUSTER.gpu, 1e9, 16
    deferred = replace(BASE, zero=3, defer_grad_sync=True)
    bw = gpu.hbm_bw * MEMORY_BW_FRACTION
    assert accumulation_time(params, m, deferred, gpu) == pytest.approx(
        params * (6 + (m - 1) * 10) / bw, rel=1e-12)
    bf16 = replace(deferred, grad_bytes=2)
    assert accumulation_time(params, m, bf16, gpu) == pytest.approx(params * (m - 1) * 6 / bw)
    for cfg in (replace(BASE, zero=3), replace(deferred, zero=1),
                replace(deferred, pp=1, schedule=None, virtual_stages=None)):
        assert accumulation_time(params, m, cfg, gpu) == 0.0
    # the step counts it with the compute of the slowest rank: one of the ranks' parameters
    work, synced = _step(BASE, m, zero=3, defer_grad_sync=False)
    _, held = _step(BASE, m, zero=3, defer_grad_sync=True)
    shares = pipeline_shares(work, deferred, CLUSTER, schedule="1f1b", virtual=1,
                             micro_batches=m)  # fmt: skip
    added = {accumulation_time(s.blocks * work.layer_dense_params + s.edges * work.edge_params,
                               m, deferred, gpu) for s in shares}  # fmt: skip
    assert min(added) > 0
    assert any(held.compute - synced.compute == pytest.approx(a, rel=1e-9) for a in added)


def test_backward_post_prefetch_exposes_every_backward_gather():
    """FSDP1's BACKWARD_POST (Composer's default) gathers the next layer's weights after the
    current layer's gradient computation: where BACKWARD_PRE hides every backward gather
    behind the layer before, each is exposed -- every layer's but the last one's (its weights
    stay gathered from forward), every micro-batch; the reduce-scatters still hide."""
    cluster = Cluster.preset("dgx-h100", nodes=1)
    shape = ModelShape.gpt(layers=8, hidden=4096, heads=32, seq=2048, vocab=8192)
    cfg = ParallelConfig(dp=8, zero=3, global_batch=32, micro_batch=2, recompute="none")
    work = shape_workload(shape, cfg, 2, cluster.gpu)

    def dp(c: ParallelConfig) -> float:
        return step_time(work, c, cluster, micro_batches=2, schedule="1f1b", virtual=1,
                         recompute="none").comm["dp"]  # fmt: skip

    gather = span_time("all_gather", 2 * work.layer_dense_params, cluster, 1, 8)
    assert 2 * gather < work.layer_bwd_s  # the gather and the reduce-scatter hide under "pre"
    pre, post = dp(cfg), dp(replace(cfg, backward_prefetch="post"))
    assert post - pre == pytest.approx(2 * 7 * gather, rel=1e-9)
    with pytest.raises(CostInputError, match="backward_prefetch"):
        replace(cfg, backward_prefetch="never")
