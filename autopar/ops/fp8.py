"""FP8 linears in a rank program: torchao's float8 training recipes on this rank's shards, each
scale reduced over the mesh axes its tensor is split on (what ``fp8_linear`` nodes call;
passes/fp8.py writes them).

``fp8_linear(x, w, b, recipe, axes)`` is ``F.linear(x, w, b)`` computed as torchao's
``Float8Linear`` computes it (``torchao.float8.float8_linear.matmul_with_hp_or_float8_args``):
the three GEMMs of a training step (output, input gradient, weight gradient) on
``Float8TrainingTensor`` operands, so each runs as ``torch._scaled_mm``.

Algorithm:
1. ``recipe`` ("tensorwise" | "rowwise") is torchao's recipe name:
   ``Float8LinearConfig.from_recipe_name`` gives each of the six casts (input, weight,
   output gradient, and the three for the backward GEMMs) its float8 dtype (e4m3 forward;
   e5m2 gradients for tensorwise, e4m3 for rowwise) and granularity, and the GEMM settings
   (``LinearMMConfig`` as ``Float8Linear`` builds it).
2. Each cast, in the order and with the reshapes ``matmul_with_hp_or_float8_args`` uses:
   amax by torchao's ``tensor_to_amax`` (the whole tensor, or rowwise along one dim), then
   all-reduced with MAX over each mesh axis of that cast's entry in ``axes`` (the axes that
   split the part of the tensor one scale covers; the pass computes them from the layouts),
   scale by ``amax_to_scale``, cast by ``hp_tensor_and_scale_to_float8``.  So every rank
   uses the scale one device holding the whole tensor would.
3. Backward casts the output gradient (and again the saved input and weight along the other
   dims for rowwise) the same way; the bias is added in high precision outside the GEMM.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.distributed as dist

from autopar.ops.collectives import graph_op, group

RECIPES = ("tensorwise", "rowwise")
# the six casts of one linear, in the order of ``axes`` (torchao's Float8LinearConfig fields)
CASTS = ("input", "weight", "grad_output", "input_for_grad_weight", "weight_for_grad_input",
         "grad_output_for_grad_weight")  # fmt: skip


@functools.cache
def recipe_config(recipe: str):  # noqa: ANN201 - torchao types are imported lazily
    """torchao's ``Float8LinearConfig`` of ``recipe`` and the ``LinearMMConfig`` its
    ``Float8Linear`` builds from it."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    c = Float8LinearConfig.from_recipe_name(recipe)
    mm = LinearMMConfig(*(ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)
                          for g in (c.gemm_config_output, c.gemm_config_grad_input,
                                    c.gemm_config_grad_weight)))  # fmt: skip
    return c, mm


def _cast(t: torch.Tensor, which: str, dim: int, axes: Sequence[str], recipe: str,
          role: object) -> torch.Tensor:  # fmt: skip
    """Step 2: ``t`` as a ``Float8TrainingTensor`` by cast ``which`` of ``recipe``, rowwise
    along ``dim``; its amax reduced with MAX over ``axes``."""
    from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

    c, mm = recipe_config(recipe)
    cast = getattr(c, f"cast_config_{which}")
    along = get_maybe_axiswise_dim(dim, cast.scaling_granularity)
    with torch.no_grad():
        amax = tensor_to_amax(t, scaling_granularity=cast.scaling_granularity, axiswise_dim=along)
        for axis in axes:
            amax = amax.contiguous()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group(axis))
        scale = amax_to_scale(amax, cast.target_dtype, c.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, mm, role, along)


class _Fp8Matmul(torch.autograd.Function):
    """``x @ w.t()`` with float8 operands in all three GEMMs (steps 2-3)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: str,
                axes: tuple[tuple[str, ...], ...]) -> torch.Tensor:  # fmt: skip
        from torchao.float8.float8_training_tensor import GemmInputRole

        w_t = w.t()
        ctx.save_for_backward(x, w_t)
        ctx.recipe, ctx.axes = recipe, axes
        x8 = _cast(x, "input", -1, axes[0], recipe, GemmInputRole.INPUT)
        w8 = _cast(w_t, "weight", 0, axes[1], recipe, GemmInputRole.WEIGHT)
        shape = x8.shape
        out = torch.mm(x8.reshape(-1, shape[-1]), w8)
        return out.reshape(*shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN205
        from torchao.float8.float8_training_tensor import GemmInputRole as R

        x, w_t = ctx.saved_tensors
        recipe, axes = ctx.recipe, ctx.axes
        shape = g.shape
        g2 = g.reshape(-1, shape[-1])
        g8 = _cast(g2, "grad_output", -1, axes[2], recipe, R.GRAD_OUTPUT)
        w8 = _cast(w_t, "weight_for_grad_input", -1, axes[4], recipe, R.WEIGHT)
        grad_x = torch.mm(g8, w8.t()).reshape(*shape[:-1], w_t.shape[0])
        x2 = x.reshape(-1, x.shape[-1])
        g8w = _cast(g2, "grad_output_for_grad_weight", 0, axes[5], recipe, R.GRAD_OUTPUT)
        x8w = _cast(x2, "input_for_grad_weight", 0, axes[3], recipe, R.INPUT)
        grad_w = torch.mm(g8w.t(), x8w)
        return grad_x, grad_w, None, None


@graph_op
def fp8_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, recipe: str,
               axes: tuple[tuple[str, ...], ...]) -> torch.Tensor:  # fmt: skip
    """``F.linear(x, w, b)`` with its GEMMs in float8 by torchao's ``recipe``; ``axes``: per
    cast (:data:`CASTS` order) the mesh axes its scale's amax is reduced over."""
    if torch.is_autocast_enabled(x.device.type):  # as Float8Linear: the autocast dtype
        x = x.to(torch.get_autocast_dtype(x.device.type))
    out = _Fp8Matmul.apply(x, w, recipe, axes)
    return out if b is None else out + b.to(out.dtype)
