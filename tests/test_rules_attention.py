"""Matmul / attention rules on real architectures: GPT-2 Conv1D (addmm, fused QKV), BLOOM
(ALiBi through baddbmm over [batch * heads]), GPT-NeoX (head-interleaved fused QKV), and the
vision-transformer idiom (fused QKV reshaped, permuted and unbound)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import Mesh, autoparallelize
from autopar.frontend.trace import trace
from autopar.rules import RuleContext, strategies, view_block_counts
from autopar.verify import verify

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten


def tiny(name: str) -> torch.nn.Module:
    h, layers, heads, vocab = 64, 2, 4, 128
    configs = {
        "GPT2": lambda: transformers.GPT2Config(
            n_embd=h, n_layer=layers, n_head=heads, n_positions=64, vocab_size=vocab,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
        "Bloom": lambda: transformers.BloomConfig(
            hidden_size=h, n_layer=layers, n_head=heads, vocab_size=vocab),
        "GPTNeoX": lambda: transformers.GPTNeoXConfig(
            hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads,
            intermediate_size=4 * h, max_position_embeddings=64, vocab_size=vocab),
    }  # fmt: skip
    cfg = configs[name]()
    cfg.use_cache = False
    torch.manual_seed(0)
    cls = {"GPT2": "GPT2LMHeadModel", "Bloom": "BloomForCausalLM", "GPTNeoX": "GPTNeoXForCausalLM"}
    return getattr(transformers, cls[name])(cfg)


def batch(b: int = 2, s: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (b, s), generator=g), torch.randint(0, 128, (b, s), generator=g)


def _nodes(model: torch.nn.Module, target: object) -> list:
    ids, labels = batch()
    gm = trace(model, (ids,), {"labels": labels}).gm
    return [n for n in gm.graph.nodes if n.target is target]


def test_addmm_becomes_mm_plus_bias():
    ids, labels = batch()
    gm = trace(tiny("GPT2"), (ids,), {"labels": labels}).gm
    targets = Counter(n.target for n in gm.graph.nodes)
    assert targets[aten.addmm.default] == 0
    assert targets[aten.mm.default] == 4 * 2  # c_attn, c_proj, c_fc, c_proj per layer
    mm = next(n for n in gm.graph.nodes if n.target is aten.mm.default)
    (add,) = mm.users
    assert add.target is aten.add.Tensor and "bias" in add.args[1].name


def test_mm_offers_blocked_column_split():
    mm = _nodes(tiny("GPT2"), aten.mm.default)[0]  # c_attn: [32, 64] @ [64, 192]
    found = {str(s) for s in strategies(mm, RuleContext(size=2, blocks=(1, 3)))}
    assert "(R,S(1:3))->S(1:3)" in found
    assert "(S(1),S(0))->P" in found  # row split: the bias is added after the reduction


def test_view_block_counts():
    bloom = tiny("Bloom")
    views = [n for n in _nodes(bloom, aten.reshape.default) if n.meta["val"].dim() == 3]
    assert 2 in view_block_counts(views[0])  # [2, 4, 16, 16] -> [8, 16, 16]: batch 2 outer


def test_baddbmm_splits_heads_of_flat_batch_heads_dim():
    (node, *_) = _nodes(tiny("Bloom"), aten.baddbmm.default)  # alibi [8, 1, 16] + q @ k
    found = {str(s) for s in strategies(node, RuleContext(size=2, blocks=(1, 2)))}
    assert "(S(0:2),S(0:2),S(0:2))->S(0:2)" in found  # heads of [batch * heads], alibi too
    assert "(R,S(1),R)->S(1)" in found  # alibi broadcasts over the query dim
    assert not any("P" in s for s in found)  # no k split: the bias would be added twice


@pytest.mark.parametrize("name", ["GPT2", "Bloom", "GPTNeoX"])
def test_tp2_matches_single_device(name):
    ids, labels = batch()
    report = verify(tiny(name), Mesh(tp=2), (ids,), example_kwargs={"labels": labels})
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-5


_MEGATRON = {
    "GPT2": {"attn.c_attn.weight": "P(None, 'tp:3')", "attn.c_proj.weight": "P('tp', None)",
             "mlp.c_fc.weight": "P(None, 'tp')", "mlp.c_proj.weight": "P('tp', None)"},
    "Bloom": {"self_attention.query_key_value.weight": "P('tp', None)",
              "self_attention.dense.weight": "P(None, 'tp')"},
    "GPTNeoX": {"attention.query_key_value.weight": "P('tp', None)",
                "attention.dense.weight": "P(None, 'tp')"},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(_MEGATRON))
def test_tiny_plan_is_megatron(name):
    """Conv1D weights are [in, out]: column split on dim 1, blocked for the fused q|k|v;
    head-interleaved fused QKV ([heads, 3, d]) is a plain split of the fused rows."""
    ids, labels = batch()
    prog = autoparallelize(tiny(name), Mesh(tp=2), (ids,), example_kwargs={"labels": labels})
    lay = {k.split(".0.", 1)[1]: v for k, v in prog.plan.params if ".0." in k}
    assert {k: lay[k] for k in _MEGATRON[name]} == _MEGATRON[name]


def test_bloom_realistic_plan_is_megatron():
    """hidden 2048, seq 2048, vocab 32000 on the meta device: heads split through baddbmm,
    every layer weight split, per layer no more forward traffic than Megatron's."""
    cfg = transformers.BloomConfig(hidden_size=2048, n_layer=2, n_head=16, vocab_size=32000)
    cfg.use_cache = False
    with torch.device("meta"):
        model = transformers.BloomForCausalLM(cfg)
    ids = torch.zeros((1, 2048), dtype=torch.long, device="meta")
    prog = autoparallelize(model, Mesh(tp=2), (ids,), example_kwargs={"labels": ids})
    lay = dict(prog.plan.params)
    for name in ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h",
                 "mlp.dense_4h_to_h"):  # fmt: skip
        assert "'tp'" in lay[f"transformer.h.0.{name}.weight"], name
    fwd = [c for c in prog.collectives() if c.direction == "fwd" and ".h.0." in c.where]
    assert fwd and all(c.shape == (1, 2048, 2048) for c in fwd)
    # Megatron's 2 all-reduces per layer; all-gather + reduce-scatter pairs move the same bytes
    assert sum(2 if c.kind == "all_reduce" else 1 for c in fwd) <= 4, [str(c) for c in fwd]
    chosen = {n.meta["autopar"].strategy for n in prog.graph_module.graph.nodes
              if n.target is aten.baddbmm.default}  # fmt: skip
    assert chosen == {"(S(0),S(0),S(0))->S(0)"}  # batch 1: [batch * heads] split is by heads


class UnbindAttention(nn.Module):
    """timm / ViT: qkv(x).reshape(b, s, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)."""

    def __init__(self, hidden: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(x).reshape(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, s, h))


def test_unbind_of_fused_qkv_is_three_blocks():
    torch.manual_seed(0)
    model, x = UnbindAttention(), torch.randn(2, 16, 64)
    prog = autoparallelize(model, Mesh(tp=2), (x,))
    assert dict(prog.plan.params)["qkv.weight"] == "P('tp:3', None)"  # its q, k and v heads
    assert [(c.kind, c.direction) for c in prog.collectives()] == [("all_reduce", "fwd")]
    report = verify(model, Mesh(tp=2), (x,))
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-5
