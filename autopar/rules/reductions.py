"""Reductions, softmax-like ops along a dim, and norms: split any dim not reduced; a sum over
the split dim gives a partial sum (mean: ``partial_mean``); variance and standard deviation
over a split dim all-reduce the [..., 1] partial moments (``partial_moments``)."""

from __future__ import annotations

import math

import torch.fx as fx
from torch.fx.operator_schemas import normalize_function

from autopar.frontend.trace import tensor_args
from autopar.ir.layout import PARTIAL, R, Shard
from autopar.ops.norms import rms_norm_16
from autopar.rules.core import RuleContext, Strategy, _dim, _shape, aten, rule
from autopar.rules.pointwise import _broadcast_placement


def _reduced_dims(node: fx.Node) -> tuple[list[int], bool]:
    src = _shape(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else None
    dims = node.kwargs.get("dim", dims)
    keep = bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))
    if dims is None or dims == []:
        return list(range(len(src))), keep
    dims = [dims] if isinstance(dims, int) else dims
    return sorted(_dim(d, len(src)) for d in dims), keep


@rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
      aten.amin.default, aten.max.dim, aten.min.dim)  # fmt: skip
def reduction(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    dims, keep = _reduced_dims(node)
    linear = node.target in (aten.sum.dim_IntList, aten.sum.default, aten.mean.dim,
                             aten.mean.default)  # fmt: skip
    tuple_out = isinstance(node.meta["val"], (tuple, list))
    wrap = (lambda p: (p, p)) if tuple_out else (lambda p: p)  # noqa: E731
    found = [Strategy((PARTIAL,), PARTIAL)] if linear else []
    nd = len(_shape(node.args[0]))
    for d in range(nd):
        for b in ctx.blocks:
            if d in dims:
                if node.target in (aten.sum.dim_IntList, aten.sum.default):
                    found.append(Strategy((Shard(d, b),), PARTIAL))
                elif node.target in (aten.mean.dim, aten.mean.default):
                    found.append(Strategy((Shard(d, b),), PARTIAL, "partial_mean"))
                continue
            out_d = d if keep else d - sum(1 for r in dims if r < d)
            found.append(Strategy((Shard(d, b),), wrap(Shard(out_d, b))))
    return found


MOMENTS = (aten.var.correction, aten.var.dim, aten.std.correction, aten.std.dim,
           aten.var_mean.correction, aten.var_mean.dim, aten.std_mean.correction,
           aten.std_mean.dim)  # fmt: skip


@rule(*MOMENTS)
def moments(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """var / std (and with the mean) over ``dims``: split a dim not reduced, or a reduced one;
    over a split dim each rank sums its shard and two all-reduces of the [..., 1] partial sums
    (first of x, for the mean; then of the centred squares) give the replicated statistics."""
    dims, keep, _ = moment_args(node)
    shape = _shape(node.args[0])
    wrap = (lambda p: (p, p)) if isinstance(node.meta["val"], (tuple, list)) else (lambda p: p)  # noqa: E731
    rows = math.prod(n for d, n in enumerate(shape) if d not in dims) * 4  # fp32 statistics
    comm = (("all_reduce", rows),) * 4  # the sum and the centred square sum, forward and backward
    found = []
    for d in range(len(shape)):
        for b in ctx.blocks:
            if d in dims:
                found.append(Strategy((Shard(d, b),), wrap(R), "partial_moments", comm))
                continue
            out_d = d if keep else d - sum(1 for r in dims if r < d)
            found.append(Strategy((Shard(d, b),), wrap(Shard(out_d, b))))
    return found


def moment_args(node: fx.Node) -> tuple[list[int], bool, float]:
    """(reduced dims sorted, keepdim, correction) of a var / std / var_mean / std_mean node:
    ``unbiased`` is correction 1 or 0; no correction given is 1 (torch's default)."""
    bound = normalize_function(node.target, node.args, node.kwargs,
                               normalize_to_only_use_kwargs=True).kwargs  # fmt: skip
    nd = len(_shape(node.args[0]))
    dims = bound.get("dim")
    dims = list(range(nd)) if dims is None or dims == [] else dims
    dims = [dims] if isinstance(dims, int) else dims
    correction = bound.get("correction")
    if "unbiased" in bound:
        correction = 1 if bound["unbiased"] else 0
    correction = 1 if correction is None else correction
    return sorted(_dim(d, nd) for d in dims), bool(bound.get("keepdim", False)), float(correction)


@rule(aten.mse_loss.default)
def mse_loss(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """mean / sum of (input - target)^2, or the squares themselves: input and target split
    alike on any dim (target replicated where it broadcasts); a sum over split elements is a
    partial sum, a mean the local sum over the global count (``partial_mean``)."""
    x, y = (_shape(a) for a in tensor_args(node))
    reduction = node.args[2] if len(node.args) > 2 else node.kwargs.get("reduction", 1)
    found = []
    for d in range(len(x)):
        for b in ctx.blocks:
            ins = (Shard(d, b), _broadcast_placement(y, x, d, b))
            if reduction == 0:
                found.append(Strategy(ins, Shard(d, b)))
            else:
                found.append(Strategy(ins, PARTIAL, "partial_mean" if reduction == 1 else None))
    return found


@rule(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
      aten.cumsum.default, aten.diff.default, aten.sort.default, aten.argmax.default)  # fmt: skip
def along_dim(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    nd = len(_shape(node.args[0]))
    at = _dim(node.args[1] if len(node.args) > 1 else -1, nd)
    n_in = len(tensor_args(node))
    found = []
    for d in range(nd):
        for b in ctx.blocks:
            if d != at:
                out = Shard(d, b)
                val = node.meta["val"]
                found.append(
                    Strategy(
                        (Shard(d, b),) + (R,) * (n_in - 1),
                        (out, out) if isinstance(val, tuple) else out,
                    )
                )
    return found


@rule(aten.layer_norm.default, aten.rms_norm.default)
def norm(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """Split a batch dim (weights replicated), or a normalized dim: the distributed norm
    all-reduces [..., 1] statistics (sum of squares; layer_norm first the sum) and splits the
    weight and bias the same way."""
    shape = _shape(node.args[0])
    nd, normed = len(shape), len(node.args[1])
    n_in = len(tensor_args(node))
    found = [
        Strategy((Shard(d, b),) + (R,) * (n_in - 1), Shard(d, b))
        for d in range(nd - normed)
        for b in ctx.blocks
    ]
    rows = math.prod(shape[: nd - normed]) * 4  # fp32 statistics per row
    stats = 1 if node.target is aten.rms_norm.default else 2
    comm = (("all_reduce", rows),) * (2 * stats)  # forward and backward
    for d in range(nd - normed, nd):
        for b in ctx.blocks:
            w = Shard(d - (nd - normed), b)
            found.append(Strategy((Shard(d, b),) + (w,) * (n_in - 1), Shard(d, b),
                                  "distributed_norm", comm))  # fmt: skip
    return found


@rule(rms_norm_16)
def fused_rms_norm(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """autopar's fused 16-bit RMSNorm (passes/fuse_norms.py writes it after the tp passes; the
    cp pass splits it): split a dim it does not normalize, the weight replicated."""
    nd, n_in = len(_shape(node.args[0])), len(tensor_args(node))
    return [Strategy((Shard(d, b),) + (R,) * (n_in - 1), Shard(d, b))
            for d in range(nd - 1) for b in ctx.blocks]  # fmt: skip


@rule(aten.triu.default, aten.tril.default)
def triangle(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    nd = len(_shape(node))
    return [Strategy((Shard(d),), Shard(d)) for d in range(nd - 2)]
