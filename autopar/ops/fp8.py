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
4. Float8 all-gather under FSDP2 (ZeRO-2/3; :func:`gather_in_float8`, which the runtime calls
   before ``fully_shard``): a parameter that only tensorwise ``fp8_linear`` s read as their
   weight becomes a ``Float8GatherWeight``, torchao's ``WeightWithDynamicFloat8CastTensor``
   (FSDP2's all-gather extension) whose amax is also reduced over the mesh axes splitting the
   weight (``axes[1]``): each shard is cast to float8 before the all-gather with the scale of
   the whole weight (amax all-reduced with MAX over the FSDP group and those axes), FSDP2
   gathers the float8 bytes, and ``fp8_linear`` receives a ``Float8TrainingTensor`` it uses as
   is for the forward and the input-gradient GEMMs (tensorwise casts the weight once, the same
   e4m3 cast for both).  The bytes on the wire are torchao's; the numbers are the ones the
   gathered-then-cast weight gives (the same scale, the same elementwise cast).  Rowwise
   scales the weight per row in each of two directions, which torchao's extension does not
   support: its weights are gathered in their own dtype and cast after.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.fx as fx

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
            amax = _max_over(amax.contiguous(), axis)
        scale = amax_to_scale(amax, cast.target_dtype, c.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, mm, role, along)


def _max_over(t: torch.Tensor, axis: str) -> torch.Tensor:
    """``t`` all-reduced with MAX over ``axis``: a functional collective (as torchao's
    ``tensor_to_amax`` reduces), which AOTAutograd traces under ``compile=``."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_reduce

    out = all_reduce(t, "MAX", group(axis))
    return out.wait() if isinstance(out, AsyncCollectiveTensor) else out


def _is_float8(t: torch.Tensor) -> bool:
    """Whether ``t`` arrived cast (FSDP2's float8 all-gather, step 4)."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    return isinstance(t, Float8TrainingTensor)


@torch._dynamo.allow_in_graph
class _Fp8Matmul(torch.autograd.Function):
    """``x @ w.t()`` with float8 operands in all three GEMMs (steps 2-3).  Under
    ``compile=`` dynamo records the call as one op (as torchao marks its
    ``matmul_with_hp_or_float8_args``: torchao's configs are opaque to dynamo) and
    AOTAutograd traces its forward and backward, casts and amax all-reduces included."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: str,
                axes: tuple[tuple[str, ...], ...]) -> torch.Tensor:  # fmt: skip
        from torchao.float8.float8_training_tensor import GemmInputRole

        w_t = w.t()
        ctx.save_for_backward(x, w_t)
        ctx.recipe, ctx.axes = recipe, axes
        x8 = _cast(x, "input", -1, axes[0], recipe, GemmInputRole.INPUT)
        w8 = w_t if _is_float8(w_t) else _cast(w_t, "weight", 0, axes[1], recipe,
                                                 GemmInputRole.WEIGHT)  # fmt: skip
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
        w8 = w_t if _is_float8(w_t) else _cast(w_t, "weight_for_grad_input", -1, axes[4], recipe,
                                                 R.WEIGHT)  # fmt: skip
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


@functools.cache
def gather_weight_class() -> type:
    """Step 4's ``Float8GatherWeight`` (built on first use: torchao is imported lazily)."""
    from torchao.float8.float8_training_tensor import GemmInputRole, hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as Base

    class Float8GatherWeight(Base):
        """torchao's FSDP2 float8 all-gather weight whose amax is also reduced over
        ``axes`` (the mesh axes splitting the weight), so the scale is the whole weight's."""

        @staticmethod
        def __new__(cls, tensor, mm, dtype, axes=()):  # noqa: ANN001, ANN204
            return Base.__new__(cls, tensor, mm, dtype)

        def __init__(self, tensor, mm, dtype, axes=()) -> None:  # noqa: ANN001
            super().__init__(tensor, mm, dtype)
            self._axes = tuple(axes)

        @classmethod
        def __torch_dispatch__(cls, func, types, args, kwargs=None):  # noqa: ANN001, ANN206
            axes = next(a._axes for a in torch.utils._pytree.tree_leaves((args, kwargs))
                        if isinstance(a, cls))  # fmt: skip
            out = Base.__torch_dispatch__.__func__(cls, func, types, args, kwargs)
            return torch.utils._pytree.tree_map_only(
                Base, lambda t: cls(t._tensor, t._linear_mm_config, t._dtype, axes), out)  # fmt: skip

        def __tensor_flatten__(self):  # noqa: ANN204
            names, ctx = super().__tensor_flatten__()
            return names, {**ctx, "axes": self._axes}

        @staticmethod
        def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):  # noqa: ANN001, ANN205
            return Float8GatherWeight(inner["_tensor"], ctx["mm_config"], ctx["dtype"],
                                      ctx["axes"])  # fmt: skip

        def fsdp_pre_all_gather(self, mesh):  # noqa: ANN001, ANN201
            with torch.no_grad():
                amax = tensor_to_amax(self._tensor, reduce_amax=True, device_mesh=mesh)
                for axis in self._axes:
                    amax = _max_over(amax, axis)
                scale = amax_to_scale(amax, self._dtype)
            w8 = hp_tensor_and_scale_to_float8(self._tensor, scale, self._dtype,
                                               self._linear_mm_config, GemmInputRole.WEIGHT)  # fmt: skip
            return (w8._data,), (w8._scale,)

    return Float8GatherWeight


def gather_in_float8(module: torch.nn.Module) -> tuple[str, ...]:
    """Step 4: every parameter of ``module`` that only tensorwise ``fp8_linear`` s read (as
    their weight, in the program or its block submodules) replaced by a
    ``Float8GatherWeight`` (:func:`gather_weight_class`: torchao's float8 all-gather under
    FSDP2), its amax reduced over the axes its calls give the weight cast; the names
    replaced."""
    reads: dict[int, list[tuple[fx.Node, fx.Node]]] = {}  # parameter -> (user, its read)
    params: dict[int, torch.nn.Parameter] = {}
    for owner in (m for m in module.modules() if isinstance(m, fx.GraphModule)):
        for node in owner.graph.nodes:
            if node.op == "get_attr":
                p = _parameter(owner, node.target)
                if p is not None:
                    params[id(p)] = p
                    reads.setdefault(id(p), []).extend((u, node) for u in node.users)
    chosen = {}  # parameter -> the axes of its weight cast (the same in every call)
    for key, users in reads.items():
        axes = {u.args[4][1] for u, n in users if _weight_of_tensorwise(u, n)}
        if users and len(axes) == 1 and all(_weight_of_tensorwise(u, n) for u, n in users):
            chosen[key] = axes.pop()
    if not chosen:
        return ()
    cls, (c, mm) = gather_weight_class(), recipe_config("tensorwise")
    wrapped = {key: torch.nn.Parameter(cls(params[key].detach(), mm,
                                           c.cast_config_weight.target_dtype, axes),
                                       requires_grad=params[key].requires_grad)
               for key, axes in chosen.items()}  # fmt: skip
    names = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, p in list(sub._parameters.items()):
            if p is not None and id(p) in wrapped:
                sub._parameters[name] = wrapped[id(p)]
                names.append(f"{prefix}.{name}" if prefix else name)
    return tuple(dict.fromkeys(names))


def _parameter(owner: torch.nn.Module, target: str) -> torch.nn.Parameter | None:
    try:
        return owner.get_parameter(target)
    except AttributeError:
        return None


def _weight_of_tensorwise(user: fx.Node, read: fx.Node) -> bool:
    """Whether ``user`` is a tensorwise ``fp8_linear`` reading ``read`` as its weight alone."""
    return (user.target is fp8_linear and user.args[3] == "tensorwise" and user.args[1] is read
            and read is not user.args[0] and read is not user.args[2])  # fmt: skip
