"""HF transformers LlamaForCausalLM (tiny config, random weights, loss from labels) under tp=2."""

from __future__ import annotations

import pytest
import torch

from autopar import Mesh, autoparallelize
from autopar.verify import verify

transformers = pytest.importorskip("transformers")


def tiny_llama(kv_heads: int = 2):
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
        use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_hf_llama_tp2_matches_single_device(kv_heads):
    ids, labels = batch()
    report = verify(tiny_llama(kv_heads), Mesh(tp=2), (ids,), example_kwargs={"labels": labels})
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-4
    assert (
        len([r for r in report.rows if r.kind == "grad"]) == 3 + 2 * 9
    )  # embed, norm, head + 9/layer


def test_hf_llama_plan_is_megatron():
    ids, labels = batch()
    prog = autoparallelize(tiny_llama(), Mesh(tp=2), (ids,), example_kwargs={"labels": labels})
    lay = dict(prog.plan.params)
    assert lay["model.layers.0.self_attn.q_proj.weight"] == "P('tp', None)"
    assert lay["model.layers.0.self_attn.o_proj.weight"] == "P(None, 'tp')"
    assert lay["model.layers.0.mlp.down_proj.weight"] == "P(None, 'tp')"
