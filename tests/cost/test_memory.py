"""Memory per rank: model state per ZeRO stage, pipeline in-flight, Korthikanti activations."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cost.config import ParallelConfig
from cost.errors import CostInputError
from cost.hardware import GPU
from cost.memory import RESERVED_BYTES, in_flight, model_state, rank_memory
from cost.model import ModelShape
from cost.symbolic import formulas
from cost.workload import activation_bytes, shape_workload

PROPERTY = settings(max_examples=80, deadline=None)
GPT = ModelShape.gpt(layers=4, hidden=1024, heads=16, seq=2048, vocab=51200)


@pytest.mark.parametrize("d", [1, 8, 64])
def test_model_state_bytes_per_parameter(d):
    f = formulas()
    for zero, name in ((0, "model_state_ddp"), (1, "model_state_zero1"),
                       (2, "model_state_zero2"), (3, "model_state_zero3")):  # fmt: skip
        kept = {"N_k": 1e8} if zero == 3 else {}  # ZeRO-3's root group + last block
        assert sum(model_state(1e9, 0.0, zero, d, d, kept=1e8)) == pytest.approx(
            f[name].evaluate(N_r=1e9, d=d, **kept)
        )
    assert sum(model_state(1.0, 0.0, 0, d, d)) == 18


def test_expert_state_shards_over_the_expert_data_group():
    weights, grads, optim = model_state(0.0, 8e9, 1, 64, 8)
    assert (weights, grads, optim) == (16e9, 32e9, 12e9)


@PROPERTY
@given(dense=st.floats(0, 1e12), expert=st.floats(0, 1e12), d=st.integers(1, 1024),
       ep=st.integers(1, 64), z1=st.integers(0, 3), z2=st.integers(0, 3))  # fmt: skip
def test_memory_falls_as_the_zero_stage_rises(dense, expert, d, ep, z1, z2):
    lo, hi = sorted((z1, z2))
    d_expert = max(1, d // ep)
    assert sum(model_state(dense, expert, hi, d, d_expert)) <= sum(
        model_state(dense, expert, lo, d, d_expert)
    ) * (1 + 1e-12)


def test_in_flight_micro_batches_per_schedule():
    assert in_flight("1f1b", 1, 32, 1) == 1
    assert in_flight("gpipe", 8, 32, 1) == 32
    assert in_flight("1f1b", 8, 32, 1) == 8
    assert in_flight("1f1b", 8, 4, 1) == 4
    assert in_flight("interleaved", 8, 32, 2) == pytest.approx(8 * (1 + 7 / 16))
    # no rank holds more than every chunk of every micro-batch (torchtitan's PP 8, m = 8, v = 2:
    # rank 0 runs all 16 chunk forwards before its first backward, 8 micro-batches' worth)
    assert in_flight("interleaved", 8, 8, 2) == 8
    assert in_flight("interleaved", 8, 10, 2) == 10


@pytest.mark.parametrize("t", [1, 2, 8])
def test_shape_activations_match_korthikanti(t):
    f, s, b, h, a = formulas(), GPT.seq, 2, GPT.hidden, GPT.heads
    unfused = dict(tp=t, global_batch=8, attention="unfused")
    plain = activation_bytes(GPT, ParallelConfig(**unfused, sequence_parallel=False), b)
    assert plain["none"] == pytest.approx(
        f["activations_per_layer_tp"].evaluate(s=s, b=b, h=h, a=a, t=t)
    )
    sp = activation_bytes(GPT, ParallelConfig(**unfused), b)
    vals = dict(s=s, b=b, h=h, a=a, t=t)
    assert sp["none"] == pytest.approx(f["activations_per_layer_tp_sp"].evaluate(**vals))
    assert sp["selective"] == pytest.approx(
        f["activations_per_layer_selective"].evaluate(s=s, b=b, h=h, t=t)
    )
    assert plain["full"] == pytest.approx(f["activations_per_layer_full"].evaluate(s=s, b=b, h=h))
    assert sp["full"] == pytest.approx(plain["full"] / t)


def test_flash_attention_keeps_no_scores():
    flash = activation_bytes(GPT, ParallelConfig(global_batch=8), 2)
    s, b, h, a = GPT.seq, 2, GPT.hidden, GPT.heads
    assert flash["none"] == pytest.approx(34 * s * b * h + 4 * a * s * b)
    assert flash["selective"] == flash["none"]


@pytest.mark.parametrize(("h", "f"), [(256, 128), (128, 384)])
def test_routed_rows_are_saved_as_autograd_saves_them(h, f):
    """A routed MoE layer saves, per routed row, its token's copy going into the expert (the
    grouped GEMM's weight gradient reads it), the expert's gate/up and product, and the
    expert's output row (the routing weight's gradient reads it). Measured on the reference
    MoE block (`autopar.tools.testing.MoEBlock`, bf16, autograd's pack hook) between top-2
    and top-4: the shape's count per routed row, 2·2h + 3·2f, plus what the eager block keeps
    besides (silu's output, 2f, which a fused SwiGLU recomputes; the int64 top-k indices, sort
    permutation, its gather and scatter indices and two bf16 weight columns, 36 bytes)."""
    from autopar.axes.recompute import saved_bytes
    from autopar.tools.testing import MoEBlock, MoEConfig

    tokens = 512

    def measured(k: int) -> int:
        torch.manual_seed(0)
        block = MoEBlock(MoEConfig(hidden=h, expert_ffn=f, experts=8, top_k=k, seq=tokens,
                                   batch=1)).to(torch.bfloat16)  # fmt: skip
        x = torch.randn(1, tokens, h, dtype=torch.bfloat16, requires_grad=True)
        fixed = {t.untyped_storage().data_ptr() for t in (x, *block.parameters())}
        return saved_bytes(lambda: block(x), fixed)

    def priced(k: int) -> float:
        shape = ModelShape.llama(layers=1, hidden=h, heads=4, kv_heads=4, ffn=f, seq=tokens,
                                 vocab=64, experts=8, top_k=k)  # fmt: skip
        return activation_bytes(shape, ParallelConfig(global_batch=1), 1)["none"]

    rows = tokens * (4 - 2)
    assert priced(4) - priced(2) == rows * (2 * 2 * h + 3 * 2 * f)
    assert measured(4) - measured(2) == priced(4) - priced(2) + rows * (2 * f + 36)


def test_rank_memory_breakdown_and_fit():
    """Two pipeline ranks, cut as the compiled pipeline cuts (the slowest stage least; with
    no boundary priced, on compute alone): rank 0 the embedding and k blocks with p = 2
    micro-batches in flight (1F1B), rank 1 the other blocks and the LM head with one
    micro-batch and its logits; each with torch's pipeline buffers over m = 8 micro-batches
    (rank 0: a gradient receive buffer per micro-batch and its two in-flight outputs; rank
    1: an activation receive buffer per micro-batch, the in-flight one its saved input);
    the memory is the fuller rank's."""
    gpu = GPU.preset("a100-40gb")
    shape = ModelShape.gpt(layers=4, hidden=1024, heads=16, seq=2048, vocab=16384)
    cfg = ParallelConfig(tp=1, pp=2, dp=4, global_batch=64, micro_batch=2, schedule="1f1b",
                         virtual_stages=1, recompute="none")  # fmt: skip
    work = shape_workload(shape, cfg, 2, gpu)
    mem = rank_memory(work, pp=2, zero=1, dp_dense=4, dp_expert=4, schedule="1f1b",
                      micro_batches=8, virtual=1, recompute="none", capacity=gpu.hbm_bytes)  # fmt: skip
    layer = work.layer_fwd_s + work.layer_bwd_s
    k = min(range(5), key=lambda k: max(work.pre_s + k * layer, (4 - k) * layer + work.post_s))
    assert k == 3  # the epilogue (a 16384-entry head and its loss) outweighs a layer
    assert work.post_act_bytes == 2 * shape.seq * shape.vocab * (2 + 4)
    ranks = []
    sent = work.boundary_bytes
    for blocks, held, logits, buffers in ((k, 2, 0.0, (8 + 2) * sent),
                                          (4 - k, 1, work.post_act_bytes, (8 - 1) * sent)):
        params = blocks * shape.layer_params + shape.embedding_params  # an end's table each
        acts = held * (blocks * work.act_bytes["none"] + logits) + buffers
        ranks.append((params, acts, (2 + 4 + 12 / 4) * params + acts))  # ZeRO-1, d = 4
    params, acts, _ = max(ranks, key=lambda r: r[2])
    assert params == ranks[0][0]  # rank 0: three blocks, two micro-batches
    assert mem.weights == pytest.approx(2 * params)
    assert mem.grads == pytest.approx(4 * params)
    assert mem.optimizer == pytest.approx(12 * params / 4)
    assert mem.activations == pytest.approx(acts)
    assert mem.reserved == RESERVED_BYTES
    assert mem.total == pytest.approx(sum(v for k, v in mem.rows() if k != "total"))
    assert mem.fits == (mem.total <= gpu.hbm_bytes)


def test_a_table_alone_in_a_stage_is_resharded_under_zero3():
    """Interleaved, 2 blocks over pp 2 x v 2: the embedding and the head each get a stage of
    their own, which per-block ZeRO-3 reshards after forward like any group (the runtime's
    `shard_per_block`: a stage without blocks is one group); only a stage's last block is
    kept gathered. With a block beside it the table is FSDP2's root, kept gathered."""
    from cost.stages import pipeline_ranks

    gpu = GPU.preset("h100")
    shape = ModelShape.gpt(layers=2, hidden=1024, heads=16, seq=2048, vocab=16384)
    cfg = ParallelConfig(tp=1, pp=2, dp=8, zero=3, global_batch=64, micro_batch=1,
                         schedule="interleaved", virtual_stages=2, recompute="none")  # fmt: skip
    work = shape_workload(shape, cfg, 1, gpu)
    unit = (work.pre_s, work.layer_fwd_s + work.layer_bwd_s, work.post_s)
    bare = pipeline_ranks(2, unit, 2, 2, lambda r: 1.0, 0.0)
    assert [(s.blocks, s.bare_edges) for s in bare] == [(1, True), (1, True)]
    args = dict(pp=2, zero=3, dp_dense=8, dp_expert=8, schedule="interleaved",
                micro_batches=8, virtual=2, recompute="none", capacity=gpu.hbm_bytes)  # fmt: skip
    alone = rank_memory(work, ranks=bare, **args)
    beside = rank_memory(work, ranks=[replace(s, bare_edges=False) for s in bare], **args)
    block, table = work.layer_dense_params, work.edge_params
    assert alone.weights == pytest.approx(2 * (block + table) / 8 + 2 * block * 7 / 8)
    assert beside.weights - alone.weights == pytest.approx(2 * table * 7 / 8)
    kept = rank_memory(work, ranks=bare, reshard_after_forward=False, **args)
    assert kept.weights == pytest.approx(2 * (block + table))  # torchtitan: nothing resharded


@pytest.mark.parametrize(("zero", "gb"), [(0, 112.0), (1, 29.3), (2, 15.5), (3, 1.75)])
def test_reference_zero_table_for_7b_on_64_gpus(zero, gb):
    """REFERENCE.md: 7B on 64 GPUs, bf16 weights and gradients, Adam K=12: 112/29.3/15.5/1.75 GB."""
    assert sum(model_state(7e9, 0.0, zero, 64, 64, grad_bytes=2)) / 1e9 == pytest.approx(gb, abs=0.05)


def test_cli_grad_dtype_changes_the_gradient_bytes(capsys):
    from autopar.tools.cli import main

    shape = ["estimate", "--model", "llama", "--layers", "32", "--hidden", "4096", "--heads", "32",
             "--kv-heads", "32", "--ffn", "11008", "--vocab", "32000", "--seq", "2048",
             "--nodes", "8", "--dp", "64", "--zero", "0", "--global-batch", "512"]  # fmt: skip
    rows = {}
    for dtype in ("fp32", "bf16"):
        main([*shape, "--grad-dtype", dtype])
        out = capsys.readouterr().out
        rows[dtype] = float(next(ln.split()[-1] for ln in out.splitlines()
                                 if ln.strip().startswith("gradients")))  # fmt: skip
    assert rows["fp32"] == pytest.approx(2 * rows["bf16"], rel=1e-3)


def test_pipeline_buffers_follow_the_runtime():
    """What a pipeline rank holds besides its in-flight saved tensors, per runtime: torch's
    `PipelineStage` a receive buffer per micro-batch for its input activations (beyond the
    in-flight ones, which are its saved inputs) and for its output gradients, plus its
    in-flight outputs; torch before May 2025 every output of every micro-batch, the last
    stage's the logits; Megatron nothing more."""
    from cost.memory import pipeline_buffers
    from cost.stages import RankShare

    gpu = GPU.preset("h100")
    shape = ModelShape.gpt(layers=8, hidden=1024, heads=16, seq=2048, vocab=16384)
    cfg = ParallelConfig(tp=2, pp=4, dp=1, global_batch=16, micro_batch=1, schedule="1f1b",
                         virtual_stages=1, recompute="none")  # fmt: skip
    work = shape_workload(shape, cfg, 1, gpu)
    sent = work.boundary_bytes
    assert sent == 2 * 2048 * 1024 / 2  # bf16, split over tp
    assert work.output_bytes == 2 * 2048 * 16384 / 2  # bf16 logits, the vocabulary over tp
    first = RankShare(blocks=2, first=True, last=False, chunks=1, held=4)
    middle = RankShare(blocks=2, first=False, last=False, chunks=1, held=3)
    last = RankShare(blocks=2, first=False, last=True, chunks=1, held=1)
    looped = RankShare(blocks=2, first=True, last=True, chunks=2, held=5)  # 2 chunks, both ends
    m = 16
    assert pipeline_buffers(work, first, m) == (m + 4) * sent
    assert pipeline_buffers(work, middle, m) == ((m - 3) + (m + 3)) * sent
    assert pipeline_buffers(work, last, m) == (m - 1) * sent
    assert pipeline_buffers(work, looped, m) == ((m - 5) + (m + 5)) * sent
    assert pipeline_buffers(work, middle, m, "torch_2024") == ((m - 3) + 2 * m) * sent
    assert pipeline_buffers(work, last, m, "torch_2024") == (m - 1) * sent + m * work.output_bytes
    for share in (first, middle, last, looped):
        assert pipeline_buffers(work, share, m, "in_flight") == 0.0
    with pytest.raises(CostInputError, match="pp_buffers"):
        ParallelConfig(global_batch=8, pp_buffers="none")
    # without pp no rank has a neighbour: rank_memory adds nothing
    flat = ParallelConfig(tp=2, pp=1, dp=4, global_batch=16, micro_batch=1, recompute="none")
    one = shape_workload(shape, flat, 1, gpu)
    mem = rank_memory(one, pp=1, zero=1, dp_dense=4, dp_expert=4, schedule="1f1b",
                      micro_batches=4, virtual=1, recompute="none", capacity=gpu.hbm_bytes)  # fmt: skip
    assert mem.activations == one.layers * one.act_bytes["none"] + one.post_act_bytes
    assert mem.buffers == 0.0
    # with pp the busiest rank's buffers are part of its activations and shown apart
    ranks = (first, middle, RankShare(blocks=2, first=False, last=False, chunks=1, held=2), last)
    piped = rank_memory(work, pp=4, zero=1, dp_dense=1, dp_expert=1, schedule="1f1b",
                        micro_batches=m, virtual=1, recompute="none", capacity=gpu.hbm_bytes,
                        ranks=ranks)  # fmt: skip
    busiest = max(ranks, key=lambda s: rank_memory(
        work, pp=4, zero=1, dp_dense=1, dp_expert=1, schedule="1f1b", micro_batches=m,
        virtual=1, recompute="none", capacity=gpu.hbm_bytes, ranks=(s,)).total)  # fmt: skip
    assert piped.buffers == pipeline_buffers(work, busiest, m) > 0
    saved = busiest.held * busiest.blocks * work.act_bytes["none"]
    assert piped.activations == pytest.approx(saved + piped.buffers
                                              + busiest.last * work.post_act_bytes)
