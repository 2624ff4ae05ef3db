"""Ops that only run replicated (data-dependent indexing, random ops, ...)."""

from __future__ import annotations

import operator

import torch

from autopar.rules.core import RULES, aten

_REPLICATED_ONLY = [
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
    aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
    aten.pad.default, aten.index_select.default, aten.gather.default,
    aten.nll_loss_forward.default, aten.nll_loss.default, aten.nll_loss_nd.default,
    aten.item.default, aten._local_scalar_dense.default, aten.constant_pad_nd.default,
    aten.repeat.default, aten.outer.default,
    torch.ops.higher_order.wrap_with_set_grad_enabled, torch.ops.higher_order.wrap_with_autocast,
    operator.getitem,
]  # fmt: skip
for _op in _REPLICATED_ONLY:
    RULES.setdefault(_op, lambda node, ctx: [])
