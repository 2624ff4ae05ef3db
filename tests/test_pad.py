"""A vocabulary the tp degree does not divide is padded, masked, and cut back (autopar/frontend/pad.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar import Mesh, autoparallelize, verify
from autopar.tools.testing import Config, build, lm_loss, tokens

ODD = dict(layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=101, seq=8, batch=2)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_odd_vocab_verifies(tied, tp):
    c = Config(**ODD, tied=tied)
    model = build("gpt", c)
    report = verify(model, Mesh(tp=tp), tokens(c), loss_fn=lm_loss)
    assert report.ok, report
    names = {r.name for r in report.rows}
    assert "head.weight" in names or "wte.weight" in names


def test_logits_output_is_cut_back_to_the_vocab():
    c = Config(**ODD)
    model = build("llama", c)
    report = verify(model, Mesh(tp=2), tokens(c)[:1])  # logits are the output
    assert report.ok, report
    assert any("(2, 8, 101)" in r.name for r in report.rows)


def test_gpt2_small_shape_splits_the_padded_lm_head_without_gathering_logits():
    c = Config(layers=2, hidden=768, heads=12, kv_heads=12, ffn=3072, vocab=50257, seq=1024,
               batch=4)  # fmt: skip
    with torch.device("meta"):
        model = build("gpt", c)
    for tp in (2, 4):
        prog = autoparallelize(model, Mesh(tp=tp), tokens(c), loss_fn=lm_loss)
        assert dict(prog.plan.params)["head.weight"] == "P('tp', None)"
        assert prog.traced.padded == {"head.weight": 50257, "wte.weight": 50257}
        assert not [x for x in prog.collectives() if x.kind == "all_gather" and x.shape[-1] > 50000]
        head = dict(prog.module(0).named_parameters())["head.weight"]
        assert head.shape == (-(-50257 // tp), 768)


class SoftCapped(nn.Module):
    """A soft-capped LM head: tanh maps -inf padding to a finite value, so no padding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(101, 32)
        self.head = nn.Linear(32, 101, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.head(self.emb(ids)) / 30.0) * 30.0


def test_soft_capped_logits_are_not_padded():
    ids = torch.randint(0, 101, (2, 8))
    model = SoftCapped()
    prog = autoparallelize(model, Mesh(tp=2), (ids,))
    assert "head.weight" not in prog.traced.padded  # it splits its hidden dim instead
    assert verify(model, Mesh(tp=2), (ids,)).ok
