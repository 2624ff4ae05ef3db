"""The opt-in execution modes of a model-shape workload: eager kernels, torchtitan's
selective recompute (op-level and layer-level), and tp overlap with the GEMMs."""

from __future__ import annotations

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
    attention's output and log-sum-exp."""
    w = shape_workload(LLAMA, replace(CFG, selective="matmuls"), 1, GPU)
    megatron = shape_workload(LLAMA, CFG, 1, GPU)
    h, kv, f, tokens = 4096, 1024, 14336, 1024
    per_token = 2 * h + 2 * (h + kv + f + h) + 2 * h + 4 * 32
    assert w.act_bytes["selective"] == pytest.approx(tokens * per_token)
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
