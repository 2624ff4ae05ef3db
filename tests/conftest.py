"""Shared test setup: hypothesis profiles (derandomised in CI) and small model builders."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

from autopar.tools.testing import MLP

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.fixture
def mlp() -> MLP:
    torch.manual_seed(0)
    return MLP()
