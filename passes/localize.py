"""localize: rewrite global shapes into per-rank shapes.

Algorithm:
1. Every node's ``meta["val"]`` becomes a meta tensor of its local shape (global shape divided
   along the split dims of its layout), so printed programs show what each rank holds.
2. Ops that carry sizes as arguments get their local sizes: view / reshape / expand /
   broadcast_to and new_empty / new_zeros / new_ones / new_full take the local output shape
   (no -1 left); split and split_with_sizes on a split dim divide the piece sizes by the axis
   size; a grouped convolution whose input channels are split divides its ``groups`` (each
   rank holds whole groups).  A ``view`` stays a ``view``: every collective
   returns a fresh row-major tensor (``autopar.ops.collectives``), so a view valid on the global
   tensor's strides is valid on the local one.
3. Anything else whose size argument would change is an error naming the node, never a
   silently wrong shape.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from autopar.ir import meta
from autopar.ir.layout import Layout
from passes import NodeError, PassContext

aten = torch.ops.aten
_SHAPE_ARG = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
              aten.expand.default, aten.broadcast_to.default)  # fmt: skip
_NEW = (aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
        aten.new_empty.default)  # fmt: skip
_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
          aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding)  # fmt: skip
_SIZED = (aten.repeat.default,)


def localize(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Rewrite shape arguments and shape metadata to local sizes (steps 1-3)."""
    sizes = ctx.mesh.sizes
    for node in gm.graph.nodes:
        lay = meta.layout(node)
        if lay is None:
            continue
        if node.op == "call_function":
            _rewrite_args(node, lay, sizes, ctx)
        node.meta["val"] = _local_val(node.meta.get("val"), lay, sizes)
    gm.recompile()
    return gm


def _local_val(val: object, lay: Layout | tuple, sizes: dict[str, int]) -> object:
    if isinstance(val, torch.Tensor) and isinstance(lay, Layout):
        return torch.empty(lay.local_shape(val.shape, sizes), dtype=val.dtype, device="meta")
    if isinstance(val, (tuple, list)) and isinstance(lay, tuple):
        return type(val)(_local_val(v, lt, sizes) for v, lt in zip(val, lay, strict=True))
    return val


def _rewrite_args(node: fx.Node, lay: Layout | tuple, sizes: dict[str, int],
                  ctx: PassContext) -> None:  # fmt: skip
    if node.target in _SHAPE_ARG and isinstance(lay, Layout):
        local = list(lay.local_shape(node.meta["val"].shape, sizes))
        node.args = (node.args[0], local, *node.args[2:])
    elif node.target in _NEW and isinstance(lay, Layout):
        local = list(lay.local_shape(node.meta["val"].shape, sizes))
        node.args = (node.args[0], local, *node.args[2:])
    elif node.target in (aten.split.Tensor, aten.split_with_sizes.default):
        _split_sizes(node, ctx)
    elif node.target in _CONVS:
        _conv_groups(node, ctx)
    elif node.target in _SIZED and isinstance(lay, Layout) and not lay.is_replicated:
        raise NodeError(node, f"{node.target} with a split output needs a localize rule")


def _conv_groups(node: fx.Node, ctx: PassContext) -> None:
    groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    src_lay = meta.layout(node.args[0])
    if groups == 1 or not isinstance(src_lay, Layout) or not src_lay.dims[1]:
        return
    t = math.prod(ctx.mesh.size(axis) for axis in src_lay.dims[1])
    if len(node.args) > 6:
        node.args = (*node.args[:6], groups // t, *node.args[7:])
    else:
        node.kwargs = {**node.kwargs, "groups": groups // t}


def _split_sizes(node: fx.Node, ctx: PassContext) -> None:
    src = node.args[0]
    src_lay = meta.layout(src)
    val = src.meta["val"]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    dim = dim + val.dim() if dim < 0 else dim
    if not isinstance(src_lay, Layout) or not src_lay.dims[dim]:
        return
    t = ctx.mesh.size(ctx.section("tp").axis)
    pieces = node.args[1]
    new = [p // t for p in pieces] if isinstance(pieces, (list, tuple)) else pieces // t
    node.args = (src, new, *node.args[2:])
