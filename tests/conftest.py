"""Shared test setup: hypothesis profiles (derandomised in CI) and small model builders."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


class MLP(nn.Module):
    """The smallest Megatron pair: column-split up-projection, row-split down-projection."""

    def __init__(self, d: int = 16, f: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(d, f)
        self.down = nn.Linear(f, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.fixture
def mlp() -> MLP:
    torch.manual_seed(0)
    return MLP()
