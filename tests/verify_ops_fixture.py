"""A custom operator registered with ``torch.library.Library`` at import time (not with
``custom_op``), for tests/test_verify.py: worker processes must import this module to run a
program that calls it."""

from __future__ import annotations

import torch
import torch.nn as nn

_LIB = torch.library.Library("autopar_test", "DEF")
_LIB.define("scale(Tensor x, float s) -> Tensor")
_LIB.impl("scale", lambda x, s: x * s, "CompositeExplicitAutograd")
torch.library.register_fake("autopar_test::scale", lambda x, s: torch.empty_like(x), lib=_LIB)


def _setup(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.s = inputs[1]


def _backward(ctx: object, grad: torch.Tensor) -> tuple:
    return torch.ops.autopar_test.scale(grad, ctx.s), None


torch.library.register_autograd("autopar_test::scale", _backward, setup_context=_setup, lib=_LIB)


class ScaledMLP(nn.Module):
    """Column/row MLP with the custom operator between the two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.ops.autopar_test.scale(torch.relu(self.up(x)), 3.0))
