"""HF transformers LlamaForCausalLM (tiny config, random weights, loss from labels) under tp=2."""

from __future__ import annotations

import pytest
import torch

from autopar import Mesh, autoparallelize
from autopar.verify import verify

transformers = pytest.importorskip("transformers")


def tiny_llama(kv_heads: int = 2, use_cache: bool = False):
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
        use_cache=use_cache,
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


@pytest.mark.parametrize("mesh", [Mesh(tp=2), Mesh(pp=2)], ids=str)
def test_use_cache_passed_as_a_keyword_compiles_and_matches(mesh):
    """HF's own default config (use_cache on) with `use_cache=False` passed to forward: the
    bool input has no layout (it crashed propagate_layout), and no pipeline stage takes it
    (the first stage was handed it and failed while the next waited on its activations)."""
    ids, labels = batch()
    report = verify(tiny_llama(use_cache=True), mesh, (ids,),
                    example_kwargs={"labels": labels, "use_cache": False})  # fmt: skip
    assert report.ok, str(report)


def test_a_returned_kv_cache_says_to_turn_it_off():
    from autopar.errors import TraceError

    ids, labels = batch()
    with pytest.raises(TraceError, match=r"returns a DynamicCache.*use_cache=False"):
        autoparallelize(tiny_llama(use_cache=True), Mesh(tp=2), (ids,),
                        example_kwargs={"labels": labels})  # fmt: skip
