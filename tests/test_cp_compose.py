"""Context parallelism composed with the other axes' harder cases, on real Gloo ranks.

Megatron sequence parallelism under cp: tp splits the sequence dim between blocks (all-gather
before the column GEMMs, reduce-scatter after the row GEMMs) within each cp rank's chunks,
the dim split cp outer, tp inner; loss and every gradient equal one device's (fp32, 1e-5).
The tp planner is steered to sequence parallelism by ``memory_weight`` (what activation
memory costs), and each test first checks that the tp program it splits really uses it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import Mesh, autoparallelize, verify
from autopar.axes.context_parallel import ContextParallelError
from autopar.ops import cp_ops
from autopar.tools.testing import (
    Config,
    MoEConfig,
    build,
    build_moe,
    hf_tiny_llama,
    lm_loss,
    tokens,
)

SP_WEIGHT = 1e-9  # memory_weight at which the tp planner picks sequence parallelism here


def shifted_loss(out, labels: torch.Tensor) -> torch.Tensor:
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def reference(strategy: str) -> torch.dtype | None:
    """Ring attention rounds one precision up: compare it with float64 (as
    tests/test_context_parallel.py does); all-to-all runs the model's own SDPA."""
    return torch.float64 if strategy == "ring" else None


def _hf_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 32), generator=g)
    labels = torch.randint(0, 128, (2, 32), generator=g)
    return ids, torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def _sequence_scatters(prog, shape: tuple) -> list:
    """The forward reduce-scatters over tp of a [batch, seq, hidden] residual whose sequence
    dim ``shape[1]`` is split by both axes (shape: cp-local)."""
    return [c for c in prog.collectives() if c.kind == "reduce_scatter" and c.axis == "tp"
            and c.direction == "fwd" and c.shape == shape]  # fmt: skip


@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
def test_hf_llama_sequence_parallel_tp_under_cp(strategy):
    ids, labels = _hf_batch()
    kw = dict(memory_weight=SP_WEIGHT, cp_attention=strategy)
    prog = autoparallelize(hf_tiny_llama(2), Mesh(cp=2, tp=2), (ids, labels), shifted_loss, **kw)
    rows = _sequence_scatters(prog, (2, 16, 64))  # after o_proj and down_proj, per layer
    assert sorted(c.where for c in rows) == sorted(
        f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.o_proj", "mlp.down_proj"))
    code = prog.code(0)
    assert "P(None, ('cp', 'tp'), None)" in code  # the residual: cp outer, tp inner
    report = verify(hf_tiny_llama(2), Mesh(cp=2, tp=2), (ids, labels), shifted_loss, rtol=1e-5,
                    reference_dtype=reference(strategy), **kw)  # fmt: skip
    assert report.ok, report


def test_testing_llama_sequence_parallel_tp_under_cp():
    c = Config(seq=64, hidden=64, heads=4, ffn=128, kv_heads=2, vocab=64)
    x, y = tokens(c)
    kw = dict(memory_weight=SP_WEIGHT, cp_attention="ring")
    prog = autoparallelize(build("llama", c), Mesh(cp=2, tp=2), (x, y), lm_loss, **kw)
    assert len(_sequence_scatters(prog, (c.batch, c.seq // 2, c.hidden))) == 2 * c.layers
    report = verify(build("llama", c), Mesh(cp=2, tp=2), (x, y), lm_loss, rtol=1e-5,
                    reference_dtype=torch.float64, **kw)  # fmt: skip
    assert report.ok, report


class Tempered(nn.Module):
    """HF Llama on embeddings scaled per token by an input: under sequence parallelism tp
    splits the input along the sequence (``split`` then ``unsqueeze``), a value cp holds
    whole, so cp takes its chunks above tp's split and recomputes the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = hf_tiny_llama(2)

    def forward(self, ids: torch.Tensor, temp: torch.Tensor):
        return self.lm(inputs_embeds=self.lm.model.embed_tokens(ids) * temp[..., None])


def test_tp_split_of_a_whole_input_is_recomputed_from_cp_chunks():
    ids, _ = _hf_batch()
    temp = torch.rand(2, 32, generator=torch.Generator().manual_seed(2)) + 0.5
    kw = dict(memory_weight=SP_WEIGHT, cp_attention="ring")
    tp = autoparallelize(Tempered(), Mesh(tp=2), (ids, temp), memory_weight=SP_WEIGHT)
    assert "autopar_ops_collectives_split(temp, 'tp', 1, 1)" in tp.code(0)
    prog = autoparallelize(Tempered(), Mesh(cp=2, tp=2), (ids, temp), **kw)
    code = prog.code(0)
    assert "autopar_ops_collectives_split(temp" not in code  # split after cp's chunks, not before
    assert "autopar_ops_cp_ops_cp_localize(temp, 'cp', 1, 1, True)" in code
    report = verify(Tempered(), Mesh(cp=2, tp=2), (ids, temp), rtol=1e-5,
                    reference_dtype=torch.float64, **kw)  # fmt: skip
    assert report.ok, report


# ---------------------------------------------------------------- a padded causal mask


def _ring_causal(prog) -> list[bool]:
    return [n.args[7] for n in prog.graph_module.graph.nodes
            if n.target is cp_ops.ring_attention_out]  # fmt: skip


@pytest.mark.parametrize(("cp", "strategy"), [(2, "ring"), (4, "ring"), (2, "all_to_all")])
def test_padded_causal_mask_gets_balanced_chunks(cp, strategy):
    """HF's mask of a right-padded batch is ``causal & attention_mask[b, key]``: it hides at
    least what causal hides, so the sequence gets the balanced chunks, the ring skips the
    pairs above the diagonal and applies the padding mask to the rest; loss, logits and every
    gradient equal one device's."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 32), generator=g)
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 21:] = 0
    kwargs = {"attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    prog = autoparallelize(hf_tiny_llama(2), Mesh(cp=cp), (ids,), example_kwargs=kwargs,
                           cp_attention=strategy)  # fmt: skip
    chunks = f"{2 * cp} chunks, rank i holds chunks i and {2 * cp - 1}-i"
    assert any(chunks in n for n in prog.plan.notes), prog.plan
    assert _ring_causal(prog) == ([True, True] if strategy == "ring" else [])
    report = verify(hf_tiny_llama(2), Mesh(cp=cp), (ids,), example_kwargs=kwargs, rtol=1e-5,
                    cp_attention=strategy, reference_dtype=reference(strategy))  # fmt: skip
    assert report.ok, report
    assert len([r for r in report.rows if r.kind == "output"]) == 2


# ---------------------------------------------------------------- cp x ep


@pytest.mark.parametrize("axes", [{"cp": 2}, {"cp": 2, "ep": 2}, {"cp": 2, "ep": 2, "tp": 2}])
def test_moe_under_cp_is_refused_with_the_reason(axes):
    """An MoE layer sorts every token of the traced sequence by expert: no sharding rule
    splits that along the sequence, so cp (alone or under ep) names the layer and says to
    split the tokens by the batch instead."""
    c = MoEConfig(seq=16)
    with pytest.raises(ContextParallelError,
                       match=r"MoE layer at module 'blocks.0'.*routes every token.*Mesh\(ep=\.\.\.\)"):
        autoparallelize(build_moe(c), Mesh(**axes), tokens(c), lm_loss)
