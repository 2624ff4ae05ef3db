"""Pointwise ops with broadcasting: any split of the output maps to its inputs' dims; linear
ops (add, neg, casts, ``copy_``) also pass partial sums through.  An in-place op here writes
a whole value (``autopar.frontend.inplace`` turned writes through views into dataflow), so writing it
where it lies, in its own layout, is a local op."""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx

from autopar.frontend.trace import tensor_args
from autopar.ir.layout import PARTIAL, Placement, R, Shard
from autopar.rules.core import RuleContext, Strategy, _shape, aten, rule

_POINTWISE = [
    "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "mul.Tensor", "mul.Scalar",
    "div.Tensor", "div.Scalar", "div.Tensor_mode", "neg.default", "exp.default", "log.default",
    "tanh.default", "gelu.default", "silu.default", "relu.default", "sigmoid.default",
    "pow.Tensor_Scalar", "pow.Tensor_Tensor", "rsqrt.default", "sqrt.default", "cos.default",
    "sin.default", "abs.default", "reciprocal.default", "erf.default", "clamp.default",
    "where.self", "masked_fill.Scalar", "masked_fill.Tensor", "clone.default",
    "_to_copy.default", "to.dtype", "to.dtype_layout", "to.device", "alias.default",
    "contiguous.default", "detach.default", "lift_fresh_copy.default", "dropout.default",
    "eq.Tensor", "eq.Scalar", "ne.Tensor", "ne.Scalar", "lt.Tensor", "lt.Scalar", "le.Tensor",
    "le.Scalar", "gt.Tensor", "gt.Scalar", "ge.Tensor", "ge.Scalar", "__and__.Tensor",
    "__or__.Tensor", "logical_and.default", "logical_or.default", "logical_not.default",
    "bitwise_not.default", "zeros_like.default", "ones_like.default", "full_like.default",
    "empty_like.default", "type_as.default", "softplus.default", "square.default",
    "mish.default", "leaky_relu.default", "hardtanh.default", "fill.Scalar",
    "where.ScalarOther", "where.ScalarSelf", "where.Scalar", "min.other", "max.other",
    "minimum.default", "maximum.default", "clamp_min.default", "clamp_max.default",
    "clamp.Tensor", "expm1.default", "log1p.default", "exp2.default", "log2.default",
    "pow.Scalar", "sign.default", "floor.default", "ceil.default", "round.default",
    "trunc.default", "remainder.Scalar", "remainder.Tensor", "floor_divide.default",
    "bitwise_and.Tensor", "bitwise_or.Tensor", "bitwise_xor.Tensor", "__xor__.Tensor",
    "logical_xor.default", "isnan.default", "isinf.default", "nan_to_num.default",
    "elu.default", "selu.default", "celu.default", "hardswish.default", "hardsigmoid.default",
    "tan.default", "atan.default", "sinh.default", "cosh.default", "logit.default",
    "threshold.default", "rsub.Scalar", "rsub.Tensor", "lerp.Scalar", "addcmul.default",
    "addcdiv.default", "polar.default", "complex.default", "real.default", "imag.default",
    "conj.default", "_conj.default", "resolve_conj.default", "add_.Tensor", "sub_.Tensor",
    "mul_.Tensor", "mul_.Scalar", "div_.Tensor", "div_.Scalar", "neg_.default",
    "detach_.default", "masked_fill_.Scalar", "relu_.default", "silu_.default",
    "gelu_.default", "sigmoid_.default", "tanh_.default", "clamp_.default", "copy_.default",
    "fill_.Scalar", "fill.Tensor", "fill_.Tensor", "zero_.default", "zero.default",
]  # fmt: skip
_LINEAR_ALL_P = {"add.Tensor", "sub.Tensor", "neg.default", "clone.default", "_to_copy.default",
                 "to.dtype", "to.dtype_layout", "to.device", "alias.default", "contiguous.default",
                 "detach.default", "lift_fresh_copy.default", "type_as.default", "add_.Tensor",
                 "sub_.Tensor", "neg_.default", "detach_.default", "complex.default",
                 "real.default", "imag.default", "conj.default", "_conj.default",
                 "resolve_conj.default", "copy_.default"}  # fmt: skip
_LINEAR_ONE_P = {"mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar", "mul_.Tensor",
                 "mul_.Scalar", "div_.Tensor", "div_.Scalar"}  # fmt: skip
_WITH_SCALAR = {"add.Tensor", "sub.Tensor", "add_.Tensor", "sub_.Tensor"}
# partial + replicated: the replicated operand is added on rank 0 only (tensor_parallel's
# ``add_once`` lowering), e.g. a per-expert bias after a row-split expert projection
_ADD_ONCE = {"add.Tensor", "sub.Tensor", "add_.Tensor", "sub_.Tensor"}


def _aten(name: str) -> object:
    pkt, overload = name.split(".")
    return getattr(getattr(aten, pkt), overload)


@rule(*[_aten(n) for n in _POINTWISE])
def pointwise(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    out = _shape(node)
    ins = [_shape(a) for a in tensor_args(node)]
    found = []
    for d in range(len(out)):
        for b in ctx.blocks:
            placed = [_broadcast_placement(shape, out, d, b) for shape in ins]
            found.append(Strategy(tuple(placed), Shard(d, b)))
    found += _partial_pointwise(node, len(ins))
    return found


def _broadcast_placement(shape: Sequence[int], out: Sequence[int], d: int, b: int) -> Placement:
    in_dim = d - (len(out) - len(shape))
    if in_dim < 0 or (shape[in_dim] == 1 and out[d] != 1):
        return R
    return Shard(in_dim, b)


def _partial_pointwise(node: fx.Node, n_in: int) -> list[Strategy]:
    name = f"{node.target._opname}.{node.target._overloadname}"
    non_tensor = [a for a in node.args[1:] if not isinstance(a, fx.Node)]
    if name in _LINEAR_ALL_P and not (name in _WITH_SCALAR and non_tensor):
        found = [Strategy((PARTIAL,) * n_in, PARTIAL)]
        if name in _ADD_ONCE and n_in == 2:  # a replicated addend joins the partial sum once
            found.append(Strategy((PARTIAL, R), PARTIAL, "add_once"))
            if not name.endswith("_.Tensor"):  # in place: only into the partial operand
                found.append(Strategy((R, PARTIAL), PARTIAL, "add_once"))
        return found
    if name in _LINEAR_ONE_P:
        firsts = range(1) if name.startswith("div") else range(n_in)
        return [
            Strategy(tuple(PARTIAL if i == j else R for i in range(n_in)), PARTIAL) for j in firsts
        ]
    return []


@rule(aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default)
def new_like(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """``x.new_empty(size)`` and its kin read only ``x``'s dtype and device: ``x`` is taken as
    it lies, and the constant output is made whole or split (each rank makes its own local
    piece: ``localize`` gives it the local size).  DeepSeek's MLA fills a ``new_empty`` key
    buffer made from the head-split ``kv_b`` output; reading that output whole would gather it."""
    src, out = _shape(node.args[0]), _shape(node)
    ins = [R, *[Shard(d) for d in range(len(src))]]  # plain splits: blocked ones only add ties
    outs = [Shard(d) for d in range(len(out))]
    found = [Strategy((p,), R) for p in ins[1:]] + [Strategy((R,), q) for q in outs]
    found += [Strategy((p,), p) for p in ins[1:] if p.dim < len(out)]  # the same dims split
    return found
