"""Mixture-of-experts ops under tensor parallelism: grouped matmuls split like linears, routing
ops replicated, the combine's gathers and scatters linear in their data."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.frontend.trace import tensor_args
from autopar.ir.layout import PARTIAL, R, Shard
from autopar.rules.core import NAMED_RULES, RULES, RuleContext, Strategy, _dim, _shape, aten, rule
from autopar.rules.pointwise import _broadcast_placement, pointwise

#
# Tensor parallelism inside every expert (no expert axis): a grouped matmul x[S, k] @ w[E, k, n]
# (rows of x grouped by expert through offsets) splits like a linear: column split on n, row
# split on k -> partial.  The routing around it (router softmax, top-k, sort, histogram,
# gathers) runs replicated, and the gathers and scatters of the combine are linear in their
# data, so the routed sum stays one partial sum until the residual add reduces it.

def _grouped_mm_operands(node: fx.Node) -> tuple[list[torch.Size], bool]:
    """Shapes of (a, b) and whether a float bias follows (integer extra tensors are offsets)."""
    args = tensor_args(node)
    bias = any(a.meta["val"].is_floating_point() for a in args[2:])
    return [_shape(args[0]), _shape(args[1])], bias


def grouped_mm(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Grouped matmul: a[S, k] @ b[E, k, n] by row groups, or batched a[E, m, k] @ b[E, k, n].

    Column split on n (bias [E, n] split alike), row split on k -> partial, partial a or b ->
    partial (bilinear; not with a bias, which every rank would add).  Rows of a grouped by
    offsets never split: the offsets are global row positions.
    """
    (a, b), has_bias = _grouped_mm_operands(node)
    extra = len(tensor_args(node)) - 2
    rest = lambda p: (R,) * (extra - has_bias) + ((p,) if has_bias else ())  # noqa: E731
    found = [] if has_bias else [Strategy((PARTIAL, R) + rest(R), PARTIAL),
                                 Strategy((R, PARTIAL) + rest(R), PARTIAL)]  # fmt: skip
    if len(b) != 3 or len(a) not in (2, 3):
        return found
    out_n = len(a) - 1
    for blk in ctx.blocks:
        found.append(Strategy((R, Shard(2, blk)) + rest(Shard(1, blk)), Shard(out_n, blk)))
    if not has_bias:
        found.append(Strategy((Shard(len(a) - 1), Shard(1)) + rest(R), PARTIAL))
    if len(a) == 3:
        found.append(Strategy((Shard(0), Shard(0)) + rest(Shard(0)), Shard(0)))
        found.append(Strategy((Shard(1), R) + rest(R), Shard(1)))
    return found


RULES[aten._grouped_mm.default] = grouped_mm
NAMED_RULES["transformers::grouped_mm_fallback"] = grouped_mm


@rule(aten.topk.default)
def topk(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """topk(x, k, dim): values and indices split like x on every dim but ``dim``."""
    nd = len(_shape(node.args[0]))
    at = _dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1), nd)
    return [
        Strategy((Shard(d, b),), (Shard(d, b), Shard(d, b)))
        for d in range(nd)
        for b in ctx.blocks
        if d != at
    ]


@rule(aten.histc.default)
def histc(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Counts over fixed bins add up: any split of the input -> partial counts.  With
    min == max the bins come from the data's own range, which a shard does not know."""
    lo, hi = (list(node.args[2:4]) + [0, 0])[:2]
    if lo == hi:
        return []
    nd = len(_shape(node.args[0]))
    return [Strategy((Shard(d, b),), PARTIAL) for d in range(nd) for b in ctx.blocks]


@rule(aten.index.Tensor)
def index(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """x[i0, i1, ...] (advanced indexing): linear in x (partial x -> partial), split any dim
    of x that is not indexed, or split the (broadcast) index tensors with x replicated."""
    indices = list(node.args[1])
    if any(i is not None and i.meta["val"].dtype == torch.bool for i in indices):
        return []  # a boolean mask's result size depends on the data
    src, out = _shape(node.args[0]), _shape(node)
    pos = [k for k, i in enumerate(indices) if i is not None]
    idx_shapes = [_shape(indices[k]) for k in pos]
    nb = len(out) - (len(src) - len(pos))  # dims of the broadcast index shape
    first, where = _index_dims(len(src), pos, nb)
    n_idx = len(pos)
    found = [Strategy((PARTIAL,) + (R,) * n_idx, PARTIAL)]
    for d, out_d in where.items():
        for b in ctx.blocks:
            found.append(Strategy((Shard(d, b),) + (R,) * n_idx, Shard(out_d, b)))
    bshape = out[first : first + nb]
    for j in range(nb):
        placed = tuple(_broadcast_placement(s, bshape, j, 1) for s in idx_shapes)
        found.append(Strategy((R,) + placed, Shard(first + j)))
    return found


def _index_dims(nd: int, pos: list[int], nb: int) -> tuple[int, dict[int, int]]:
    """Where advanced indexing puts things: (first dim of the index result in the output,
    {unindexed input dim: output dim}).  Adjacent indexed dims are replaced in place by the
    broadcast index shape; separated ones move it to the front (numpy's rule)."""
    kept = [d for d in range(nd) if d not in pos]
    if pos == list(range(pos[0], pos[-1] + 1)):
        return pos[0], {d: d if d < pos[0] else d - len(pos) + nb for d in kept}
    return 0, {d: nb + i for i, d in enumerate(kept)}


@rule(aten.index_put_.default, aten.index_put.default)
def index_put(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """A scatter by index (an inverse permutation, a routed combine): replicated."""
    return []


rule(aten.floor_divide.default, aten.div_.Tensor)(pointwise)


_ZEROS = {aten.zeros_like.default, aten.zeros.default, aten.new_zeros.default}


@rule(aten.index_add.default)
def index_add(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """index_add(acc, dim, index, rows): linear in (acc, rows) together (both partial ->
    partial; a zeros accumulator is its own partial, so replicated zeros + partial rows ->
    partial), and split alike on any dim but ``dim`` (index replicated)."""
    nd = len(_shape(node.args[0]))
    at = _dim(node.args[1], nd)
    found = [Strategy((PARTIAL, R, PARTIAL), PARTIAL)]
    if node.args[0].target in _ZEROS:
        found.append(Strategy((R, R, PARTIAL), PARTIAL))
    found += [Strategy((Shard(d, b), R, Shard(d, b)), Shard(d, b))
              for d in range(nd) for b in ctx.blocks if d != at]  # fmt: skip
    return found


@rule(aten.sort.stable)
def sort_stable(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """sort(x, stable=True, dim=d): values and indices split like x on every dim but d."""
    nd = len(_shape(node.args[0]))
    at = _dim(node.kwargs.get("dim", -1), nd)
    return [Strategy((Shard(d, b),), (Shard(d, b), Shard(d, b)))
            for d in range(nd) for b in ctx.blocks if d != at]  # fmt: skip
