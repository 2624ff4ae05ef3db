"""Sharding rules: for each ATen op, the ways it can run split along one mesh axis.

A rule maps a node (global shapes in ``meta["val"]``) to its :class:`Strategy` list.  A
strategy fixes the placement each tensor input must arrive in and the placement of the output;
the op then runs on local shards unchanged, or through a named ``lowering`` (vocab-parallel
embedding, vocab-parallel cross-entropy, ...) that the tensor_parallel pass writes in.

Algorithm of :func:`strategies`:
1. Look up the rule by op; ops without one get the replicated strategy and a warning naming the
   op and the user's source line (an error under ``strict=True``).
2. Every rule offers the fully replicated strategy; the others come from the op's dim
   structure (pointwise broadcasting, view dim groups, matmul batch/m/n/k dims, ...).
3. Drop strategies whose split dims do not divide evenly by the axis size (times blocks).
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.errors import ShardingRuleError
from autopar.layout import PARTIAL, Placement, R, Replicate, Shard
from autopar.meta import source
from autopar.trace import tensor_args

aten = torch.ops.aten
Out = Placement | tuple[Placement, ...]


@dataclass(frozen=True)
class Strategy:
    """One way to run an op split along an axis."""

    inputs: tuple[Placement, ...]  # one per tensor argument (see trace.tensor_args)
    output: Out
    lowering: str | None = None  # name of the tensor_parallel lowering, if any
    comm: tuple[tuple[str, int], ...] = ()  # collectives inside the lowering: (kind, bytes)

    @property
    def redundant(self) -> bool:
        """Every rank computes the whole op (all inputs and outputs replicated)."""
        outs = self.output if isinstance(self.output, tuple) else (self.output,)
        return all(isinstance(p, Replicate) for p in (*self.inputs, *outs))

    def __str__(self) -> str:
        ins = ",".join(map(str, self.inputs))
        outs = self.output if isinstance(self.output, tuple) else (self.output,)
        low = f" [{self.lowering}]" if self.lowering else ""
        return f"({ins})->{','.join(map(str, outs))}{low}"


@dataclass(frozen=True)
class RuleContext:
    """What a rule may consult besides the node: axis size and the block counts in play."""

    size: int
    blocks: tuple[int, ...] = (1,)


Rule = Callable[[fx.Node, RuleContext], list[Strategy]]
RULES: dict[object, Rule] = {}


def rule(*ops: object) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return register


def has_rule(node: fx.Node) -> bool:
    return node.target in RULES or _named_rule(node.target) is not None


def strategies(node: fx.Node, ctx: RuleContext, strict: bool = False) -> list[Strategy]:
    """All valid strategies of ``node`` on an axis of ``ctx.size`` ranks (replicated first)."""
    fn = RULES.get(node.target) or _named_rule(node.target)
    if fn is None:
        msg = f"no sharding rule for {_op_name(node)} at {source(node)}; it runs replicated"
        if strict:
            raise ShardingRuleError(
                msg.replace("it runs replicated", "add a rule in autopar/rules.py")
                + " (or pass strict=False to replicate it)"
            )
        warnings.warn(msg, stacklevel=2)
        return [replicated(node)]
    found = [replicated(node)] + [s for s in fn(node, ctx) if not s.redundant]
    unique = list(dict.fromkeys(found))
    return [s for s in unique if _divides(node, s, ctx.size)]


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def replicated(node: fx.Node) -> Strategy:
    n_in = len(tensor_args(node))
    val = node.meta.get("val")
    out: Out = tuple(R for _ in val) if isinstance(val, (tuple, list)) else R
    return Strategy((R,) * n_in, out)


def _divides(node: fx.Node, s: Strategy, size: int) -> bool:
    pairs = list(zip(tensor_args(node), s.inputs, strict=True))
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    outs = s.output if isinstance(s.output, tuple) else (s.output,)
    shapes = [a.meta["val"].shape for a, _ in pairs] + [
        v.shape if isinstance(v, torch.Tensor) else () for v in vals
    ]
    for shape, p in zip(shapes, [p for _, p in pairs] + list(outs), strict=True):
        if isinstance(p, Shard) and (p.dim >= len(shape) or shape[p.dim] % (size * p.blocks)):
            return False
    return True


def _shape(node: fx.Node) -> torch.Size:
    return node.meta["val"].shape


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


# ---------------------------------------------------------------- pointwise (broadcasting)

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
    "gelu_.default", "sigmoid_.default", "tanh_.default", "clamp_.default",
]  # fmt: skip
_LINEAR_ALL_P = {"add.Tensor", "sub.Tensor", "neg.default", "clone.default", "_to_copy.default",
                 "to.dtype", "to.dtype_layout", "to.device", "alias.default", "contiguous.default",
                 "detach.default", "lift_fresh_copy.default", "type_as.default", "add_.Tensor",
                 "sub_.Tensor", "neg_.default", "detach_.default", "complex.default",
                 "real.default", "imag.default", "conj.default", "_conj.default",
                 "resolve_conj.default"}  # fmt: skip
_LINEAR_ONE_P = {"mul.Tensor", "mul.Scalar", "div.Tensor", "div.Scalar", "mul_.Tensor",
                 "mul_.Scalar", "div_.Tensor", "div_.Scalar"}  # fmt: skip
_WITH_SCALAR = {"add.Tensor", "sub.Tensor", "add_.Tensor", "sub_.Tensor"}


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
        return [Strategy((PARTIAL,) * n_in, PARTIAL)]
    if name in _LINEAR_ONE_P:
        firsts = range(1) if name.startswith("div") else range(n_in)
        return [
            Strategy(tuple(PARTIAL if i == j else R for i in range(n_in)), PARTIAL) for j in firsts
        ]
    return []


# ---------------------------------------------------------------- view-like ops


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


@rule(aten.slice.Tensor, aten.select.int)
def slice_select(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    nd = len(_shape(node.args[0]))
    at = _dim(node.args[1] if len(node.args) > 1 else 0, nd)
    drop = node.target is aten.select.int
    return _unary_map(
        node, ctx, lambda p: _remap(p, lambda d: None if d == at else d - (drop and d > at))
    )


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


def view_block_counts(node: fx.Node) -> set[int]:
    """Block counts a view or unbind puts in play: a split of an inner dim of a merged leading
    group (heads in [batch * heads], sequence in [batch * seq]) is a blocked split of the
    merge; unbinding n pieces (a ViT's [3, heads, ...]) makes n blocks of the fused dim."""
    if node.target is aten.unbind.int and len(node.meta.get("val", ())) > 1:
        return {len(node.meta["val"])}
    if node.target not in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return set()
    found = set()
    for side in _view_groups(_shape(node.args[0]), _shape(node)):
        for dims, shape in zip(side, (_shape(node.args[0]), _shape(node)), strict=True):
            if not dims or dims[0] != 0:
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


# ---------------------------------------------------------------- reductions, softmax, norms


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
      aten.amin.default, aten.max.dim, aten.min.dim, aten.var.correction, aten.std.correction)  # fmt: skip
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


@rule(aten.triu.default, aten.tril.default)
def triangle(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    nd = len(_shape(node))
    return [Strategy((Shard(d),), Shard(d)) for d in range(nd - 2)]


# ---------------------------------------------------------------- matmul family


@rule(aten.linear.default)
def linear(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """x[..., k] @ w[n, k].T (+ b[n]): batch dims, column (n) and row (k) splits, partial x."""
    x = _shape(node.args[0])
    has_bias = len(tensor_args(node)) == 3
    nd = len(x)
    bias = lambda p: (p,) if has_bias else ()  # noqa: E731
    found = []
    for d in range(nd - 1):
        found.append(Strategy((Shard(d), R) + bias(R), Shard(d)))
    for b in ctx.blocks:
        found.append(Strategy((R, Shard(0, b)) + bias(Shard(0, b)), Shard(nd - 1, b)))
    if not has_bias:  # trace.py splits biases off, so row splits add the bias after reducing
        found.append(Strategy((Shard(nd - 1), Shard(1)), PARTIAL))
        found.append(Strategy((PARTIAL, R), PARTIAL))
    return found


@rule(aten.mm.default, aten.bmm.default, aten.matmul.default)
def matmul(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """a[..., m, k] @ b[..., k, n]: batch, m, n (blocked: fused QKV) and k (-> partial)."""
    a, b = _shape(node.args[0]), _shape(node.args[1])
    out = _shape(node)
    if len(a) < 2 or len(b) < 2:
        return []
    found = [
        Strategy((Shard(len(a) - 2), R), Shard(len(out) - 2)),
        *[Strategy((R, Shard(len(b) - 1, n)), Shard(len(out) - 1, n)) for n in ctx.blocks],
        Strategy((Shard(len(a) - 1), Shard(len(b) - 2)), PARTIAL),
        Strategy((PARTIAL, R), PARTIAL),
        Strategy((R, PARTIAL), PARTIAL),
    ]
    for d in range(len(out) - 2):
        for n in ctx.blocks:
            pa, pb = (_broadcast_placement(s[:-2], out[:-2], d, n) for s in (a, b))
            found.append(Strategy((pa, pb), Shard(d, n)))
    return found


@rule(aten.baddbmm.default)
def baddbmm(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """beta * c + alpha * (a[B, m, k] @ b[B, k, n]), c broadcast to [B, m, n] (ALiBi scores).

    Splits the batch dim (blocked: [batch * heads] split by heads), m or n; c follows the
    output where it is not broadcast.  No k split: each rank would add its own c.
    """
    c, out = _shape(node.args[0]), _shape(node)
    found = []
    for n in ctx.blocks:
        found.append(Strategy((_broadcast_placement(c, out, 0, n), Shard(0, n), Shard(0, n)),
                              Shard(0, n)))  # fmt: skip
    found.append(Strategy((_broadcast_placement(c, out, 1, 1), Shard(1), R), Shard(1)))
    found.append(Strategy((_broadcast_placement(c, out, 2, 1), R, Shard(2)), Shard(2)))
    return found


@rule(aten.addmm.default)
def addmm(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    bias_n = len(_shape(node.args[0])) == 1 or _shape(node.args[0])[0] == 1
    return [
        Strategy((R if bias_n else Shard(0), Shard(0), R), Shard(0)),
        Strategy((Shard(len(_shape(node.args[0])) - 1), R, Shard(1)), Shard(1)),
    ]


@rule(aten.scaled_dot_product_attention.default)
def sdpa(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """q[b, a, s, d], k/v[b, g, s, d]: split batch or heads; heads with g < size replicate KV."""
    args = tensor_args(node)
    q, k = _shape(args[0]), _shape(args[1])
    masks = [_shape(m) for m in args[3:]]
    found = [Strategy((Shard(d),) * 3 + _mask_placements(masks, d), Shard(d)) for d in (0, 1)]
    heads_q, heads_kv = q[1], k[1]
    if heads_kv % ctx.size and ctx.size % heads_kv == 0 and heads_q % ctx.size == 0:
        ins = (Shard(1), R, R) + _mask_placements(masks, 1)
        found.append(Strategy(ins, Shard(1), "replicated_kv_heads"))
    return found


def _mask_placements(masks: list[torch.Size], d: int) -> tuple[Placement, ...]:
    """An attention mask broadcasts against [b, heads, s, s]: split it where it is not 1."""
    out: list[Placement] = []
    for m in masks:
        md = d - (4 - len(m))
        out.append(R if md < 0 or m[md] == 1 else Shard(md))
    return tuple(out)


@rule(aten.embedding.default)
def embedding(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """weight[V, h], ids[...]: split ids dims, the hidden dim, or the vocab (masked, partial)."""
    ids = _shape(node.args[1])
    found = [Strategy((R, Shard(d)), Shard(d)) for d in range(len(ids))]
    found.append(Strategy((Shard(1), R), Shard(len(ids))))
    found.append(Strategy((Shard(0), R), PARTIAL, "vocab_parallel_embedding"))
    return found


@rule(aten.cross_entropy_loss.default)
def cross_entropy(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """logits[N, V] split on V: max / sum-exp / target-logit all-reduces of [N] values."""
    args = tensor_args(node)
    if len(args) != 2 or len(node.args) > 5 and node.args[5]:
        return []  # class weights or label smoothing: replicated only
    logits = _shape(args[0])
    if len(logits) != 2:
        return []
    nbytes = logits[0] * 4
    comm = (("all_reduce", nbytes), ("all_reduce", 2 * nbytes))
    return [Strategy((Shard(1), R), R, "vocab_parallel_cross_entropy", comm)]


# ---------------------------------------------------------------- replicated-only ops

_REPLICATED_ONLY = [
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default,
    aten.ones.default, aten.full.default, aten.empty.memory_format, aten.scalar_tensor.default,
    aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
    aten.pad.default, aten.index_select.default, aten.gather.default,
    aten.nll_loss_forward.default, aten.nll_loss.default, aten.nll_loss_nd.default,
    aten.item.default, aten._local_scalar_dense.default, aten.constant_pad_nd.default,
    aten.repeat.default, aten.outer.default,
    torch.ops.higher_order.wrap_with_set_grad_enabled, torch.ops.higher_order.wrap_with_autocast,
    operator.getitem,
]  # fmt: skip
for _op in _REPLICATED_ONLY:
    RULES.setdefault(_op, lambda node, ctx: [])


# ---------------------------------------------------------------- mixture of experts
#
# Tensor parallelism inside every expert (no expert axis): a grouped matmul x[S, k] @ w[E, k, n]
# (rows of x grouped by expert through offsets) splits like a linear: column split on n, row
# split on k -> partial.  The routing around it (router softmax, top-k, sort, histogram,
# gathers) runs replicated, and the gathers and scatters of the combine are linear in their
# data, so the routed sum stays one partial sum until the residual add reduces it.

_NAMED_RULES: dict[str, Rule] = {}  # custom ops by qualified name: their library may load late


def _named_rule(target: object) -> Rule | None:
    """The rule of a custom op registered by name (``transformers::grouped_mm_fallback``)."""
    name = getattr(target, "name", None)
    return _NAMED_RULES.get(name()) if callable(name) else None


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
_NAMED_RULES["transformers::grouped_mm_fallback"] = grouped_mm


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
