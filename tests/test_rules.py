"""Every op the reference models export has a sharding rule; ops without one are loud."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar import Mesh, ShardingRuleError, autoparallelize
from autopar.frontend.trace import trace
from autopar.rules import has_rule
from autopar.tools.testing import Config, build, lm_loss, tokens

CONFIGS = {
    "gpt": Config(layers=1, hidden=32, heads=4, kv_heads=4, ffn=64, vocab=64, seq=8, tied=True),
    "gpt-fused": Config(
        layers=1, hidden=32, heads=4, kv_heads=4, ffn=64, vocab=64, seq=8, fused_qkv=True
    ),
    "llama": Config(layers=1, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64, seq=8, bias=False),
}


def _ops(traced) -> set[str]:
    return {n for n in traced.gm.graph.nodes if n.op == "call_function"}


def _missing(traced) -> list[str]:
    return sorted({str(n.target) for n in _ops(traced) if not has_rule(n)})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reference_models_have_a_rule_for_every_op(name):
    c = CONFIGS[name]
    traced = trace(build(name.split("-")[0], c), tokens(c), loss_fn=lm_loss)
    assert _missing(traced) == []


def test_hf_llama_has_a_rule_for_every_op():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    traced = trace(model, (ids,), {"labels": torch.randint(0, 64, (2, 8))})
    assert _missing(traced) == []


class CumProd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumprod(self.lin(x), dim=0)  # aten.cumprod has no sharding rule


def test_op_without_rule_is_replicated_with_a_warning_naming_op_and_line():
    with pytest.warns(UserWarning, match=r"no sharding rule for cumprod.*test_rules.py"):
        prog = autoparallelize(CumProd(), Mesh(tp=2), (torch.randn(4, 8),))
    node = next(n for n in prog.graph_module.graph.nodes if "cumprod" in str(n.target))
    assert node.meta["autopar"].strategy == "(R)->R"


def test_op_without_rule_raises_under_strict():
    with pytest.raises(ShardingRuleError, match="no sharding rule for cumprod"):
        autoparallelize(CumProd(), Mesh(tp=2), (torch.randn(4, 8),), strict=True)
