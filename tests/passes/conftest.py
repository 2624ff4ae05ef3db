"""Pass tests share one small compiled program: the MLP + mean-squared loss on tp=2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from autopar import Mesh, autoparallelize
from autopar.tools.testing import MLP

sys.path.insert(0, str(Path(__file__).parent))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


@pytest.fixture(scope="module")
def mlp_prog():
    torch.manual_seed(0)
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    prog = autoparallelize(MLP(), Mesh(tp=2), (x, y), loss_fn=mse)
    return prog, {rec.name: rec.graph for rec in prog.history}
