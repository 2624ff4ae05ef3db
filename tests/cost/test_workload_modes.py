"""The opt-in execution modes of a model-shape workload: eager kernels, torchtitan's
selective recompute (op-level and layer-level), and tp overlap with the GEMMs."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from cost.compute import MEMORY_BW_FRACTION
from cost.config import ParallelConfig
from cost.errors import CostInputError
from cost.hardware import Cluster
from cost.model import ModelShape
from cost.step import TP_OVERLAP_SPLITS, overlapped_tp, tp_time
from cost.workload import eager_bytes, shape_workload

LLAMA = ModelShape.llama(name="l", layers=4, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                         seq=1024, vocab=32000)  # fmt: skip
GPT = ModelShape.gpt(name="g", layers=4, hidden=2048, heads=16, seq=1024, vocab=32000)
GPU = Cluster.preset("dgx-a100", nodes=1).gpu
CFG = ParallelConfig(global_batch=8, micro_batch=1)


def test_eager_bytes_follow_the_reference_ops():
    """Per token: two RMSNorms (36 B vs 4 B fused per element), RoPE on q and k (20 B), SwiGLU
    as silu then product (10 B vs 6 B on f), repeat_kv (read kv, write query width, K and V)."""
    h, kv, f = 4096, 8 * 128, 14336
    expected = 2 * 32 * h + 20 * (h + kv) + 4 * f + 2 * 2 * (kv + h)
    assert eager_bytes(LLAMA, CFG) == expected
    assert eager_bytes(GPT, CFG) == 0.0  # native_layer_norm is one kernel in eager too


def test_eager_kernels_add_their_bytes_at_streaming_bandwidth():
    fused = shape_workload(LLAMA, CFG, 1, GPU)
    eager = shape_workload(LLAMA, replace(CFG, kernels="eager"), 1, GPU)
    extra = 1024 * eager_bytes(LLAMA, CFG) / (GPU.hbm_bw * MEMORY_BW_FRACTION)
    assert eager.layer_fwd_s - fused.layer_fwd_s == pytest.approx(extra, rel=1e-9)
    assert eager.layer_bwd_s - fused.layer_bwd_s == pytest.approx(2 * extra, rel=1e-9)
    assert eager.act_bytes == fused.act_bytes
    # the loss: bf16 logits + fp32 copy (6 B) fused; eager's backward peak 3 fp32 tensors
    assert fused.post_act_bytes == 1024 * 32000 * 6
    assert eager.post_act_bytes == 1024 * 32000 * 12


def test_checkpoint_every_other_layer_is_the_mean_of_full_and_none():
    one = shape_workload(LLAMA, CFG, 1, GPU)
    two = shape_workload(LLAMA, replace(CFG, checkpoint_every=2), 1, GPU)
    assert two.recompute_s["full"] == pytest.approx(one.layer_fwd_s / 2)
    assert two.act_bytes["full"] == pytest.approx((one.act_bytes["full"] + one.act_bytes["none"]) / 2)
    assert (two.recompute_s["selective"], two.act_bytes["none"]) == (
        one.recompute_s["selective"], one.act_bytes["none"])  # fmt: skip


def test_matmul_policy_saves_every_other_matmul_output():
    """q, v, MLP up and down outputs saved (k, o, gate recomputed), with the layer input and
    attention's output and log-sum-exp; compiled blocks drop the down projection's output,
    which only a residual add reads (`test_compiled_blocks_do_not_save_...` below)."""
    w = shape_workload(LLAMA, replace(CFG, selective="matmuls"), 1, GPU)
    megatron = shape_workload(LLAMA, CFG, 1, GPU)
    h, kv, f, tokens = 4096, 1024, 14336, 1024
    per_token = 2 * h + 2 * (h + kv + f + h) + 2 * h + 4 * 32
    eager = shape_workload(LLAMA, replace(CFG, selective="matmuls", kernels="eager"), 1, GPU)
    assert eager.act_bytes["selective"] == pytest.approx(tokens * per_token)
    assert w.act_bytes["selective"] == pytest.approx(tokens * (per_token - 2 * h))
    assert w.act_bytes["selective"] < megatron.act_bytes["selective"]
    assert megatron.recompute_s["selective"] < w.recompute_s["selective"] < w.layer_fwd_s


def test_tp_overlap_hides_all_but_the_first_chunk():
    assert overlapped_tp(8.0, 100.0) == 8.0 / TP_OVERLAP_SPLITS
    assert overlapped_tp(8.0, 0.0) == 8.0
    tp = replace(CFG, tp=4)
    work = shape_workload(LLAMA, tp, 1, GPU)
    coll = lambda kind, nbytes, stride, size: 1e-3  # noqa: E731
    exposed = tp_time(work, coll, (1, 4), "none", 4)
    hidden = tp_time(work, coll, (1, 4), "none", 4, overlap=True)
    assert exposed / TP_OVERLAP_SPLITS <= hidden < exposed


def test_unknown_modes_are_refused():
    for field, value in (("kernels", "jit"), ("selective", "ops"), ("checkpoint_every", 0)):
        with pytest.raises(CostInputError, match=field):
            replace(CFG, **{field: value})


def test_an_eager_loss_under_fused_blocks_holds_the_eager_peak():
    """`loss_kernels="eager"` (torchtitan compiles its blocks, not its loss): the blocks keep
    the fused kernels' time and saved bytes, the loss the eager peak of 12 bytes a logit."""
    fused = shape_workload(LLAMA, CFG, 1, GPU)
    eager_loss = shape_workload(LLAMA, replace(CFG, loss_kernels="eager"), 1, GPU)
    eager = shape_workload(LLAMA, replace(CFG, kernels="eager"), 1, GPU)
    assert eager_loss.layer_fwd_s == fused.layer_fwd_s and eager_loss.act_bytes == fused.act_bytes
    assert eager_loss.post_act_bytes == eager.post_act_bytes == 2 * fused.post_act_bytes
    with pytest.raises(CostInputError, match="loss_kernels"):
        replace(CFG, loss_kernels="compiled")


def test_without_resharding_after_forward_every_block_stays_gathered():
    """ZeRO-3 on 8 data ranks: FSDP2's reshard_after_forward=False holds every block's bf16
    weights whole (torchtitan under pp), where resharding holds the last block only."""
    from cost.estimate import estimate

    cluster = Cluster.preset("dgx-a100", nodes=1)
    cfg = ParallelConfig(dp=8, zero=3, global_batch=8, micro_batch=1)
    kept = estimate(LLAMA, cluster, cfg).memory
    held = estimate(LLAMA, cluster, replace(cfg, reshard_after_forward=False)).memory
    block = LLAMA.layer_params
    assert held.weights - kept.weights == pytest.approx(3 * block * 2 * 7 / 8, rel=1e-9)
    assert (held.grads, held.optimizer, held.activations) == (kept.grads, kept.optimizer,
                                                              kept.activations)  # fmt: skip


def test_float8_tp_gathers_move_one_byte_an_element():
    """Megatron-SP under torchao's Float8 tp styles: the all-gathers move float8 activations
    (cast before the gather), the reduce-scatters stay bf16; without sequence parallelism the
    all-reduces are unchanged."""
    from cost.step import micro_batch_time

    tp = replace(CFG, tp=4)
    work = shape_workload(LLAMA, tp, 1, GPU)
    sizes = []
    def coll(kind, nbytes, stride, size):  # a ring: an all-reduce is a reduce-scatter + gather
        sizes.append((kind, nbytes))
        return 2 * nbytes if kind == "all_reduce" else nbytes

    bf16 = tp_time(work, coll, (1, 4), "none", 1)
    fp8 = tp_time(work, coll, (1, 4), "none", 1, gather_bytes=1)
    assert fp8 == pytest.approx(0.75 * bf16)  # AG at half the bytes, RS whole: 3 of 4 units
    assert ("all_gather", work.tp_bytes / 2) in sizes and ("reduce_scatter", work.tp_bytes) in sizes
    spans = {"tp": (1, 4), "cp": (4, 1), "ep": (4, 1), "pp": (4, 1)}
    for sp, ratio in ((True, 0.75), (False, 1.0)):
        cfg = replace(tp, sequence_parallel=sp)
        w = shape_workload(LLAMA, cfg, 1, GPU)
        base = micro_batch_time(w, cfg, coll, spans, "none", 4, 1, Cluster.default())[1]["tp"]
        cast = micro_batch_time(w, replace(cfg, tp_gather_bytes=1), coll, spans, "none", 4, 1,
                                Cluster.default())[1]["tp"]  # fmt: skip
        assert cast == pytest.approx(ratio * base)
    with pytest.raises(CostInputError, match="tp activation gathers"):
        replace(CFG, tp_gather_bytes=4)


def test_deferred_gradient_sync_holds_whole_fp32_accumulators_under_pp():
    """FSDP2 under torch's pipeline schedules (torchtitan's 3D rows): every stage's gradients
    accumulate whole, in fp32, across the micro-batches, in place of the fp32 shards; float8
    gathered weights are held at one byte a block parameter; each layer is gathered once a
    step and reduce-scattered once, after the last backward, all of it exposed."""
    from cost.estimate import estimate

    shape = ModelShape.llama(name="l8", layers=8, hidden=4096, heads=32, kv_heads=8,
                             ffn=14336, seq=1024, vocab=32000)  # fmt: skip
    cluster = Cluster.preset("dgx-h100", nodes=2)
    cfg = ParallelConfig(pp=2, dp=8, zero=3, global_batch=64, micro_batch=1, schedule="1f1b",
                         recompute="full", reshard_after_forward=False)  # fmt: skip
    eager = estimate(shape, cluster, cfg)
    deferred = estimate(shape, cluster, replace(cfg, defer_grad_sync=True))
    stage = 4 * shape.layer_params + shape.embedding_params  # rank 0: 4 blocks + embedding
    assert deferred.memory.grads == pytest.approx(4 * stage, rel=1e-9)
    assert eager.memory.grads == pytest.approx(4 * stage / 8, rel=1e-9)
    assert (deferred.memory.weights, deferred.memory.activations) == (
        eager.memory.weights, eager.memory.activations)  # fmt: skip
    fp8 = estimate(shape, cluster, replace(cfg, defer_grad_sync=True, gather_bytes=1))
    held = 4 * shape.layer_params * 7 / 8  # the blocks' gathered part, beyond the shard
    assert deferred.memory.weights - fp8.memory.weights == pytest.approx(held, rel=1e-9)
    # 8 micro-batches: one gather and one reduce-scatter a step, where the eager path pays a
    # gather per micro-batch and hides it; the reduce-scatters are now exposed
    assert deferred.step.comm["dp"] != eager.step.comm["dp"]
    without_pp = replace(cfg, pp=1, dp=16, schedule=None, defer_grad_sync=True)
    assert estimate(shape, cluster, without_pp).memory.grads == pytest.approx(
        4 * (8 * shape.layer_params + 2 * shape.embedding_params) / 16, rel=1e-9)


def test_the_embedding_and_the_head_may_each_fill_a_pipeline_chunk():
    """Llama 3's interleaved schedule: the first chunk holds only the embedding, the last only
    the output projection and the loss, so pp·v may reach the layers + 2."""
    from cost.estimate import estimate

    cluster = Cluster.preset("dgx-h100", nodes=1)
    cfg = ParallelConfig(pp=4, dp=2, global_batch=8, micro_batch=1, schedule="interleaved",
                         virtual_stages=2, recompute="none")  # fmt: skip
    shape = replace(LLAMA, layers=6)
    est = estimate(shape, cluster, cfg)  # 8 chunks: embedding, 6 single layers, head
    assert est.step.compute > 0
    with pytest.raises(CostInputError, match="5 layers cannot fill pp·virtual_stages = 8"):
        estimate(replace(LLAMA, layers=5), cluster, cfg)


def test_an_eager_loss_parallel_holds_four_fp32_tensors_a_logit():
    """torch's loss_parallel backward keeps the saved fp32 log-softmax output, a zeros
    tensor, its exp and their sum at once: 16 bytes a vocab-split logit; only under tp."""
    from cost.workload import LOSS_PARALLEL_BYTES, loss_bytes

    eager = replace(CFG, tp=4, loss_kernels="eager")
    assert loss_bytes(eager) == 12 and loss_bytes(replace(eager, loss_parallel=True)) == 16
    assert loss_bytes(replace(eager, tp=1, loss_parallel=True)) == 12  # no vocab split
    assert loss_bytes(replace(CFG, tp=4, loss_parallel=True)) == 6  # a fused loss: unchanged
    w = shape_workload(LLAMA, replace(eager, loss_parallel=True), 1, GPU)
    assert w.post_act_bytes == 1024 * 32000 / 4 * LOSS_PARALLEL_BYTES


def test_micro_pipelined_tp_chunks_per_rank_and_sums_its_partials():
    """torchtitan's AsyncTP (torch's micro-pipelined tp): a collective split in one chunk a
    tp rank, the first exposed; each reduce-scatter ends with the local sum of the t pulled
    partials (read the whole message, write 1/t of it) at streaming bandwidth, exposed; the
    backward's reduce-scatters are not fused (pytorch/pytorch#149946) and run whole."""
    from cost.step import micro_batch_time, micro_pipeline_reduce_s

    assert overlapped_tp(8.0, 100.0, splits=8) == 1.0
    tp = replace(CFG, tp=4)
    work = shape_workload(LLAMA, tp, 1, GPU)
    reduce_s = micro_pipeline_reduce_s(work, 4, GPU.hbm_bw)
    assert reduce_s == pytest.approx(work.tp_bytes * 1.25 / (GPU.hbm_bw * MEMORY_BW_FRACTION))
    coll = lambda kind, nbytes, stride, size: 1e-3  # noqa: E731
    plain = tp_time(work, coll, (1, 4), "full", 2, overlap=True, splits=4)
    summed = tp_time(work, coll, (1, 4), "full", 2, overlap=True, splits=4, reduce_s=reduce_s)
    assert summed - plain == pytest.approx(2 * 3 * work.tp_calls * reduce_s)  # 2 layers, 3 passes
    spans = {"tp": (1, 4), "cp": (4, 1), "ep": (4, 1), "pp": (4, 1)}
    cluster = Cluster.preset("dgx-a100", nodes=1)
    times = {mode: micro_batch_time(work, replace(tp, tp_overlap=mode), coll, spans, "none", 4, 1,
                                    cluster)[1]["tp"]  # fmt: skip
             for mode in (False, True, "userbuffers", "micro_pipeline")}
    assert times[True] == times["userbuffers"] < times[False]
    # the forward's all-gathers and reduce-scatters pipelined, each reduce-scatter summing its
    # partials; in backward the all-gathers pipelined and the reduce-scatters whole (each takes
    # a sum of the sharing projections' input gradients, which the pass does not fuse)
    forward = overlapped_tp(2 * 1e-3, work.layer_fwd_s, 4) + 2 * reduce_s
    backward = overlapped_tp(2 * 1e-3, work.layer_bwd_s, 4) + 2 * 1e-3
    assert times["micro_pipeline"] == pytest.approx(4 * (forward + backward))
    with pytest.raises(CostInputError, match="tp_overlap"):
        replace(CFG, tp_overlap="async")


def test_flash_attention_2_is_capped_on_hopper_only():
    """attention="flash2" (torch SDPA's FlashAttention-2) runs at most the GPU's
    `fa2_fraction` of its peak: on an H100 (0.35, the FlashAttention-3 paper's figure for FA2)
    its attention is slower than a Hopper-native kernel's by their efficiencies' ratio, both
    passes; on an A100, which FA2 was written for, nothing changes."""
    from cost.compute import matmul_efficiency
    from cost.hardware import FA2_ON_HOPPER
    from cost.hardware import GPU as GPUS

    h100 = GPUS.preset("h100")
    fa2 = replace(CFG, attention="flash2")
    native, capped = shape_workload(LLAMA, CFG, 1, h100), shape_workload(LLAMA, fa2, 1, h100)
    eff = matmul_efficiency(1024, 1024, 128)
    assert eff > FA2_ON_HOPPER == h100.fa2_fraction
    # the cap is of the data-sheet peak; the native kernel runs at the sustained one
    assert capped.attn_fwd_s == pytest.approx(
        native.attn_fwd_s * eff * h100.matmul_scale() / FA2_ON_HOPPER, rel=1e-9)
    slower = capped.attn_fwd_s - native.attn_fwd_s
    assert capped.layer_fwd_s - native.layer_fwd_s == pytest.approx(slower, rel=1e-9)
    assert capped.layer_bwd_s - native.layer_bwd_s == pytest.approx(2.5 * slower, rel=1e-9)
    assert GPU.fa2_fraction is None  # the A100
    assert shape_workload(LLAMA, fa2, 1, GPU) == shape_workload(LLAMA, CFG, 1, GPU)


def test_flash_attention_1_runs_at_its_published_throughput():
    """attention="flash1" prices the attention core at FlashAttention v1's measured causal
    forward + backward TFLOP/s (the FA2 paper's figures, `cost.hardware.FLASH1_*`): at a
    tabled point the forward takes its FLOPs over that figure, the backward 2.5x as long;
    between head dims and sequences it interpolates; the GEMMs and every other kernel are
    priced as under "flash"; a GPU with no measurement, or a head dim outside the measured
    ones, is a clear error."""
    from cost.hardware import FLASH1_A100, FLASH1_H100
    from cost.hardware import GPU as GPUS

    fa1 = replace(CFG, attention="flash1")
    h100 = GPUS.preset("h100")
    for gpu, table in ((GPU, FLASH1_A100), (h100, FLASH1_H100)):
        tflops = dict(table)[128][3]  # head dim 128 (LLAMA), 4K
        shape = replace(LLAMA, seq=4096)
        flops = 4 * LLAMA.heads * 4096 * 4096 * 128 * 0.5 * 4097 / 4096
        work, flash = shape_workload(shape, fa1, 1, gpu), shape_workload(shape, CFG, 1, gpu)
        assert work.attn_fwd_s == pytest.approx(flops / (tflops * 1e12), rel=1e-9)
        slower = work.attn_fwd_s - flash.attn_fwd_s
        assert slower > 0
        assert work.layer_fwd_s - flash.layer_fwd_s == pytest.approx(slower, rel=1e-9)
        assert work.layer_bwd_s - flash.layer_bwd_s == pytest.approx(2.5 * slower, rel=1e-9)
    a100 = dict(FLASH1_A100)
    assert GPU.flash1_flops(128, 16384) == GPU.flash1_flops(128, 131072) == a100[128][-1] * 1e12
    assert GPU.flash1_flops(64, 256) == a100[64][0] * 1e12
    w = math.log2(3 * 1024) - 11  # 3K: between the 2K and 4K columns, in log2(seq)
    at = {d: a100[d][2] + w * (a100[d][3] - a100[d][2]) for d in (64, 128)}
    assert GPU.flash1_flops(96, 3 * 1024) == pytest.approx(1e12 * (at[64] + at[128]) / 2)
    with pytest.raises(CostInputError, match="flash1.*b200"):
        shape_workload(LLAMA, fa1, 1, GPUS.preset("b200"))
    with pytest.raises(CostInputError, match="head dim 256"):
        GPU.flash1_flops(256, 4096)


def test_zero2_over_micro_batches_reduces_every_micro_batch():
    """ZeRO-2 keeps no whole gradient to accumulate micro-batches in: over m micro-batches it
    gathers and reduce-scatters every one (priced as ZeRO-3 without the backward's re-gather),
    where ZeRO-1 reduces once a step; at one micro-batch the two take the same time."""
    from cost.estimate import estimate

    shape = ModelShape.llama(name="l8", layers=8, hidden=4096, heads=32, kv_heads=8,
                             ffn=14336, seq=1024, vocab=32000)  # fmt: skip
    slow = Cluster.preset("dgx-h100", nodes=2)
    slow = replace(slow, inter=replace(slow.inter, bandwidth=slow.inter.bandwidth / 50))
    dp = {}
    for m in (1, 2, 4, 8):
        for zero in (1, 2, 3):
            cfg = ParallelConfig(pp=2, dp=8, zero=zero, global_batch=8 * m, micro_batch=1,
                                 schedule="1f1b", recompute="none")  # fmt: skip
            dp[m, zero] = estimate(shape, slow, cfg).step.comm["dp"]
    assert dp[1, 2] == dp[1, 1]
    assert dp[2, 1] == dp[4, 1] == dp[8, 1] == dp[1, 1]  # ZeRO-1: once a step
    # ZeRO-2 from two micro-batches on: a fixed first gather plus the same exposed traffic
    # every micro-batch, more than ZeRO-1's once but less than ZeRO-3's
    each = dp[4, 2] - dp[2, 2]
    assert each > 0 and dp[8, 2] - dp[4, 2] == pytest.approx(2 * each, rel=1e-9)
    assert dp[1, 1] < dp[4, 2] < dp[4, 3]
    deferred = ParallelConfig(pp=2, dp=8, zero=2, global_batch=32, micro_batch=1,
                              schedule="1f1b", recompute="none", defer_grad_sync=True)  # fmt: skip
    assert estimate(shape, slow, deferred).step.comm["dp"] == dp[4, 1]  # once: whole grads


def test_compiled_blocks_do_not_save_what_only_a_residual_add_reads():
    """torchtitan's op-level policy saves every other matmul output. Eager's checkpoint caches
    them all; a compiled block's partitioner keeps only what its backward reads, and the two
    output projections feed only a residual add: at Llama's 7 matmuls the down projection
    (the 7th, saved by the policy) is dropped, 2h bytes a token (measured on CPU with torch's
    own checkpoint and inductor: benchmarks/sac_memory.py, 7952 vs 6928 B a token a layer at
    h 512)."""
    from cost.workload import activation_bytes, saved_matmuls

    op = replace(CFG, selective="matmuls")
    eager, fused = replace(op, kernels="eager"), replace(op, kernels="fused")
    assert len(saved_matmuls(LLAMA, eager, 1)[1]) == 4  # q, v, gate, down
    assert len(saved_matmuls(LLAMA, fused, 1)[1]) == 3  # q, v, gate
    assert saved_matmuls(LLAMA, eager, 1)[0] == saved_matmuls(LLAMA, fused, 1)[0]  # same replay
    gap = activation_bytes(LLAMA, eager, 1)["selective"] - activation_bytes(LLAMA, fused, 1)["selective"]
    assert gap == 2 * 4096 * 1024
    # the measured shape: 7952 B a token a layer eager, 6928 compiled
    small = ModelShape.llama(name="s", layers=2, hidden=512, heads=4, kv_heads=1, ffn=1792,
                             seq=1024, vocab=1000)  # fmt: skip
    per_token = {k: activation_bytes(small, replace(op, kernels=k), 2)["selective"] / 2048
                 for k in ("eager", "fused")}  # fmt: skip
    assert per_token == {"eager": 7952, "fused": 6928}
    # GPT (6 matmuls): the down projection is the 6th, recomputed either way
    assert activation_bytes(GPT, eager, 1) == activation_bytes(GPT, fused, 1)
