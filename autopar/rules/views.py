"""View-like ops (view/reshape through dim groups, transpose, permute and the other dim
reorderings, slice, expand, split, cat, stack): a split follows the dim it moves to; blocked
splits map through dim groups."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx

from autopar.frontend.trace import tensor_args
from autopar.ir.layout import PARTIAL, Placement, R, Shard
from autopar.rules.core import Out, RuleContext, Strategy, _dim, _shape, aten, rule
from autopar.rules.pointwise import _broadcast_placement


def _view_groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of dims of equal total size: [(src dims, dst dims), ...]."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [i] if i < len(src) else [], [j] if j < len(dst) else []
        ps = src[i] if i < len(src) else 1
        pd = dst[j] if j < len(dst) else 1
        i, j = i + len(gi), j + len(gj)
        while ps != pd:
            if ps < pd and i < len(src):
                ps *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst):
                pd *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
        groups.append((gi, gj))
    return groups


def map_view(src: Sequence[int], dst: Sequence[int], p: Placement, size: int) -> Placement | None:
    """The placement of a reshape's output when its input is placed ``p`` (None: invalid)."""
    if not isinstance(p, Shard):
        return p
    for gi, gj in _view_groups(src, dst):
        if p.dim not in gi:
            continue
        outer = math.prod(src[k] for k in gi if k < p.dim) * p.blocks
        before = 1
        for k in gj:
            if outer % before == 0:
                b = outer // before
                if dst[k] % (b * size) == 0:
                    return Shard(k, b)
            before *= dst[k]
        return None
    return None


def _view_candidates(node: fx.Node, ctx: RuleContext, linear: bool = True) -> list[Placement]:
    shape = _shape(tensor_args(node)[0])
    cands: list[Placement] = [Shard(d, b) for d in range(len(shape)) for b in ctx.blocks]
    return cands + ([PARTIAL] if linear else [])


def _unary_map(node: fx.Node, ctx: RuleContext, fn: Callable[[Placement], Out | None]) -> list:
    n_in = len(tensor_args(node))
    found = []
    for p in _view_candidates(node, ctx):
        out = fn(p)
        if out is not None:
            found.append(Strategy((p,) + (R,) * (n_in - 1), out))
    return found


@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints)
def view(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    src, dst = _shape(node.args[0]), _shape(node)
    return _unary_map(node, ctx, lambda p: map_view(src, dst, p, ctx.size))


@rule(aten.transpose.int)
def transpose(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    nd = len(_shape(node))
    a, b = _dim(node.args[1], nd), _dim(node.args[2], nd)
    swap = {a: b, b: a}
    return _unary_map(node, ctx, lambda p: _remap(p, lambda d: swap.get(d, d)))


@rule(aten.permute.default)
def permute(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    nd = len(_shape(node))
    perm = [_dim(d, nd) for d in node.args[1]]
    return _unary_map(node, ctx, lambda p: _remap(p, perm.index))


@rule(aten.numpy_T.default)
def numpy_t(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    nd = len(_shape(node))
    return _unary_map(node, ctx, lambda p: _remap(p, lambda d: nd - 1 - d))


_PERMUTING = (aten.mT.default, aten.mH.default, aten.adjoint.default, aten.matrix_H.default,
              aten.swapaxes.default, aten.swapdims.default, aten.movedim.int,
              aten.movedim.intlist, aten.moveaxis.int, aten.moveaxis.intlist)  # fmt: skip


@rule(*_PERMUTING)
def dim_permutation(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Views that only reorder dims (``x.mT``, ``swapaxes``, ``movedim``; ``mH`` / ``adjoint``
    also conjugate, elementwise and additive, so partial sums pass): a split follows its dim
    to where the op moves it."""
    moved = _moved_dims(node)
    return _unary_map(node, ctx, lambda p: _remap(p, moved.index))


def _moved_dims(node: fx.Node) -> list[int]:
    """``moved[k]``: the input dim that output dim ``k`` views, read off the strides of the op
    applied to a meta tensor whose strides all differ (a size-2 dim each)."""
    nd = len(_shape(node.args[0]))
    probe = torch.empty((2,) * nd, device="meta")
    strides = probe.stride()
    out = node.target(probe, *node.args[1:], **node.kwargs)
    return [strides.index(st) for st in out.stride()]


@rule(aten.view_as_complex.default, aten.view_as_real.default)
def complex_view(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """[..., 2] real <-> [...] complex: every dim but the pair passes through unchanged."""
    n_src = len(_shape(node.args[0]))
    pair = n_src - 1 if node.target is aten.view_as_complex.default else None
    return _unary_map(node, ctx, lambda p: _remap(p, lambda d: None if d == pair else d))


@rule(aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor)
def repeat_interleave(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Each element repeated in place along ``dim``: other dims pass through; so does ``dim``
    itself (rank r's rows repeat into its own contiguous output rows) when the repeat count is
    one integer and no global ``output_size`` is given."""
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None:
        return []  # flattens the input first
    at = _dim(dim, len(_shape(node)))
    whole = node.target is aten.repeat_interleave.self_int and not _output_size(node)
    return _unary_map(node, ctx, lambda p: _remap(p, lambda d: None if d == at and not whole else d))


def _output_size(node: fx.Node) -> object:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("output_size")


@rule(aten.t.default)
def t(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    nd = len(_shape(node))
    return _unary_map(node, ctx, lambda p: _remap(p, lambda d: nd - 1 - d if nd == 2 else d))


@rule(aten.unsqueeze.default)
def unsqueeze(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    at = _dim(node.args[1], len(_shape(node)))
    return _unary_map(node, ctx, lambda p: _remap(p, lambda d: d + (d >= at)))


@rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def squeeze(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    src = _shape(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else range(len(src))
    dims = [dims] if isinstance(dims, int) else dims
    gone = {_dim(d, len(src)) for d in dims if src[_dim(d, len(src))] == 1}
    keep = [d for d in range(len(src)) if d not in gone]
    return _unary_map(
        node, ctx, lambda p: _remap(p, lambda d: keep.index(d) if d in keep else None)
    )


@rule(aten.slice.Tensor, aten.select.int, aten.narrow.default)
def slice_select(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    nd = len(_shape(node.args[0]))
    at = _dim(node.args[1] if len(node.args) > 1 else 0, nd)
    drop = node.target is aten.select.int
    found = _unary_map(
        node, ctx, lambda p: _remap(p, lambda d: None if d == at else d - (drop and d > at))
    )
    return found + _strided_over_split(node, ctx, at)


def _strided_over_split(node: fx.Node, ctx: RuleContext, at: int) -> list[Strategy]:
    """``x[start::step]`` along the whole of dim ``at`` (start < step; an interleaved fused
    projection's ``gate_up[..., ::2]``, ``[..., 1::2]``): output element j reads input
    start + step * j, so each rank's contiguous piece of the input (each block's, blocked)
    holds exactly its piece of the output, sliced locally, when the piece's length is a
    multiple of ``step``.  The output splits as the input does."""
    if node.target is not aten.slice.Tensor:
        return []
    size = _shape(node.args[0])[at]
    start, end, step = (list(node.args[2:]) + [None, None, 1])[:3]
    start, end, step = start or 0, size if end is None else end, step or 1
    if start < 0 or not 0 <= start < step or end < size or step == 1:
        return []
    n_in = len(tensor_args(node))
    return [Strategy((Shard(at, b),) + (R,) * (n_in - 1), Shard(at, b)) for b in ctx.blocks
            if size % (b * ctx.size) == 0 and (size // (b * ctx.size)) % step == 0]  # fmt: skip


@rule(aten.flip.default)
def flip(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Reversed along ``dims``: every other dim passes through (partial sums too)."""
    nd = len(_shape(node))
    flipped = {_dim(d, nd) for d in node.args[1]}
    return _unary_map(node, ctx, lambda p: _remap(p, lambda d: None if d in flipped else d))


@rule(aten.slice_scatter.default, aten.select_scatter.default)
def scatter_into_view(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``base`` with ``src`` written where ``slice`` / ``select`` (dim ``at``) reads it (an
    in-place write, functionalised): every other dim splits base, src and output alike; the
    write is linear in (base, src), so partial sums pass through."""
    nd = len(_shape(node.args[0]))
    at = _dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), nd)
    drop = node.target is aten.select_scatter.default
    found = [Strategy((PARTIAL, PARTIAL), PARTIAL)]
    for d in range(nd):
        for b in ctx.blocks:
            if d != at:
                found.append(Strategy((Shard(d, b), Shard(d - (drop and d > at), b)), Shard(d, b)))
    return found


@rule(aten.broadcast_tensors.default)
def broadcast_tensors(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Each input expanded to the common shape: an output dim splits every input that is not
    broadcast along it (the others arrive replicated and expand locally)."""
    ins = [_shape(a) for a in tensor_args(node)]
    out = node.meta["val"][0].shape
    n = len(node.meta["val"])
    found = [Strategy((PARTIAL,) * len(ins), (PARTIAL,) * n)]
    for d in range(len(out)):
        for b in ctx.blocks:
            placed = tuple(_broadcast_placement(s, out, d, b) for s in ins)
            found.append(Strategy(placed, (Shard(d, b),) * n))
    return found


@rule(aten.expand.default, aten.broadcast_to.default)
def expand(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    src, dst = _shape(node.args[0]), _shape(node)
    off = len(dst) - len(src)
    kept = lambda d: d + off if src[d] == dst[d + off] else None  # noqa: E731
    found = _unary_map(node, ctx, lambda p: _remap(p, kept))
    for k in range(len(dst)):
        if k < off or (src[k - off] == 1 and dst[k] != 1):
            found.append(Strategy((R,), Shard(k)))  # broadcast dim: expand locally, smaller
    return found


def _remap(p: Placement, fn: Callable[[int], int | None]) -> Placement | None:
    if not isinstance(p, Shard):
        return p
    d = fn(p.dim)
    return None if d is None else Shard(d, p.blocks)


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def split(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    src = _shape(node.args[0])
    pos = 1 if node.target is aten.unbind.int else 2  # unbind(x, dim); split/chunk(x, n, dim)
    at = _dim(node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", 0), len(src))
    outs = [v.shape for v in node.meta["val"]]
    n = len(outs)
    found = [Strategy((PARTIAL,), (PARTIAL,) * n)]
    for d in range(len(src)):
        for b in ctx.blocks:
            if d != at:
                shift = node.target is aten.unbind.int and d > at
                found.append(Strategy((Shard(d, b),), (Shard(d - shift, b),) * n))
    equal = len({o[at] for o in outs}) == 1 and node.target is not aten.unbind.int
    if equal and n > 1:
        found.append(Strategy((Shard(at, n),), (Shard(at),) * n))
    return found


def view_block_counts(node: fx.Node, inner: bool = False) -> set[int]:
    """Block counts a view or unbind puts in play: a split of an inner dim of a merged leading
    group (heads in [batch * heads], sequence in [batch * seq]) is a blocked split of the
    merge; unbinding n pieces (a ViT's [3, heads, ...]) makes n blocks of the fused dim.
    ``inner``: the counts of groups that do not lead ([.., g, n] <-> [.., g*n]: head groups);
    the planner keeps those that the axis size does not divide."""
    if node.target is aten.unbind.int and len(node.meta.get("val", ())) > 1:
        return set() if inner else {len(node.meta["val"])}
    if node.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return set()
    found = set()
    for side in _view_groups(_shape(node.args[0]), _shape(node)):
        for dims, shape in zip(side, (_shape(node.args[0]), _shape(node)), strict=True):
            if not dims or (dims[0] != 0) != inner:
                continue  # inner merges ([heads, d] -> [h]) only offer splits inside a head
            prefix = (math.prod(shape[k] for k in dims[:i]) for i in range(1, len(dims)))
            found.update(p for p in prefix if p > 1)
    return found


@rule(aten.cat.default)
def cat(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    ins = [_shape(a) for a in tensor_args(node)]
    nd = len(_shape(node))
    at = _dim(node.args[1] if len(node.args) > 1 else 0, nd)
    n = len(ins)
    found = [Strategy((PARTIAL,) * n, PARTIAL)]
    for d in range(nd):
        for b in ctx.blocks:
            if d != at:
                found.append(Strategy((Shard(d, b),) * n, Shard(d, b)))
    if n > 1 and len({s[at] for s in ins}) == 1:
        found.append(Strategy((Shard(at),) * n, Shard(at, n)))
    return found


@rule(aten.stack.default)
def stack(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Inputs of equal shape stacked along a new dim: split inputs stay split around it."""
    n = len(tensor_args(node))
    nd = len(_shape(node))
    at = _dim(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0), nd)
    found = [Strategy((PARTIAL,) * n, PARTIAL)]
    for d in range(nd - 1):
        for b in ctx.blocks:
            found.append(Strategy((Shard(d, b),) * n, Shard(d + (d >= at), b)))
    return found
