"""global_batch pass: a loss with a product of two batch means (a load-balancing-like term) on
ep=2 -- the printed graph (each boundary statistic followed by its ``batch_mean``), a sum
loss refused, and numerics against one device."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from golden import assert_golden, masked

from autopar import Mesh, autoparallelize, verify
from autopar.errors import InputError


class StatLoss(nn.Module):
    """Cross-entropy plus a product of two batch means; ``reduction="sum"`` sums the terms."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 4)
        self.reduction = reduction

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        logits = self.head(h)
        balance = (torch.softmax(logits, -1).mean(0) * h.abs().mean(0)[:4]).sum() * 4
        ce = nn.functional.cross_entropy(logits, y, reduction=self.reduction)
        if self.reduction == "sum":
            return torch.stack([ce, 0.5 * balance]).sum()
        return ce + 0.5 * balance


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


EP2 = Mesh(ep=2)


def _compile(model: nn.Module, mesh: Mesh = EP2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ep without an MoE layer runs as a data axis
        return autoparallelize(model, mesh, _xy())


def test_printed_graph():
    prog = _compile(StatLoss())
    rec = prog.history[-1]
    assert rec.name == "global_batch" and rec.nodes_after == rec.nodes_before + 2
    assert_golden("statloss_ep2_global_batch", masked(rec.graph))


def test_each_batch_axis_runs_it_in_turn():
    """dp x ep: ep's passes, then dp's global_batch on a copy of ep's program: a batch_mean per
    axis after each boundary statistic."""
    prog = _compile(StatLoss(), Mesh(dp=2, ep=2))
    names = [r.name for r in prog.history]
    assert names[-3:] == ["expert_parallel", "global_batch", "global_batch"]
    ep, dp = prog.history[-2].graph, prog.history[-1].graph
    assert ep.count("batch_mean(") == 2 and "'dp'" not in ep
    assert dp.count(", 'ep')") == 2 and dp.count(", 'dp')") == 2
    assert sum(n.name.startswith("batch_mean") for n in prog.module(0).graph.nodes) == 4


def test_a_sum_loss_is_refused():
    prog = _compile(StatLoss("sum"))
    with pytest.raises(InputError, match=r"statistic over the batch.*sum over the batch"):
        prog.module(0)


def test_matches_one_device():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(StatLoss(), Mesh(ep=2), _xy(), rtol=1e-5)
    assert report.ok, report
