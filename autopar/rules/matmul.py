"""The matmul family (linear, mm/bmm/matmul, baddbmm, addmm, convolutions), attention (SDPA),
embedding and cross-entropy: Megatron's column/row splits, head-parallel attention,
vocab-parallel embedding and loss."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.frontend.trace import tensor_args
from autopar.ir.layout import PARTIAL, Placement, R, Shard
from autopar.rules.core import RuleContext, Strategy, _dim, _shape, aten, rule
from autopar.rules.pointwise import _broadcast_placement


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
        for b in (1, *ctx.groups):  # blocked: an interleaved head layout's output projection
            found.append(Strategy((Shard(nd - 1, b), Shard(1, b)), PARTIAL))
        found.append(Strategy((PARTIAL, R), PARTIAL))
    for d in range(nd - 1):  # rows are independent: a blocked split of a batch dim too (a
        for b in ctx.blocks[1:]:  # [b*s, h] token dim split by sequence is blocked by b)
            found.append(Strategy((Shard(d, b), R) + bias(R), Shard(d, b)))
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


_CONVS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
          aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding)  # fmt: skip


@rule(*_CONVS)
def conv(node: fx.Node, ctx: RuleContext) -> list[Strategy]:
    """x[b, c_in, *space] * w[c_out, c_in / groups, *kernel] (+ bias[c_out]): a linear over
    the channels at every output position, so it splits like one.

    Batch (x dim 0), output channels (w dim 0, the bias, output dim 1: column-parallel) and,
    without a bias, input channels (x dim 1, w dim 1: row-parallel, a partial sum; with a bias
    each rank would add it) or a partial x.  A grouped conv (depthwise: groups == channels)
    splits its groups when the ranks divide them: x dim 1, w dim 0 and output dim 1 together,
    each rank convolving whole groups (``localize`` divides the ``groups`` argument).  Spatial
    dims never split (a kernel wider than its stride reads across the cut).
    """
    has_bias = len(tensor_args(node)) == 3
    bias = lambda p: (p,) if has_bias else ()  # noqa: E731
    found = [Strategy((Shard(0), R) + bias(R), Shard(0))]
    groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    if groups != 1:
        if groups % ctx.size == 0:
            found.append(Strategy((Shard(1), Shard(0)) + bias(Shard(0)), Shard(1)))
        return found
    found += [Strategy((R, Shard(0, b)) + bias(Shard(0, b)), Shard(1, b)) for b in ctx.blocks]
    if not has_bias:
        found.append(Strategy((Shard(1), Shard(1)), PARTIAL))
        found.append(Strategy((PARTIAL, R), PARTIAL))
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
    """q[b, a, s, d], k/v[b, g, s, d]: split batch or heads.  Grouped-query attention with
    g < size K/V heads reads, on each rank, the K/V head its a/size query heads use: either
    from K/V replicated on every rank (``replicated_kv_heads``) or, when ``ctx.reps`` holds
    size/g (:func:`shared_kv_reps`), from K/V split into g pieces, each shared by size/g ranks
    (``S(1)x(size/g)``: no re-layout, no lowering)."""
    args = tensor_args(node)
    q, k = _shape(args[0]), _shape(args[1])
    masks = [_shape(m) for m in args[3:]]
    found = [Strategy((Shard(d, b),) * 3 + _mask_placements(masks, d, b), Shard(d, b))
             for d in (0, 1) for b in (1, *ctx.groups)]  # heads blocked: interleaved groups
    heads_q, heads_kv = q[1], k[1]
    if heads_kv % ctx.size and ctx.size % heads_kv == 0 and heads_q % ctx.size == 0:
        ins = (Shard(1), R, R) + _mask_placements(masks, 1)
        found.append(Strategy(ins, Shard(1), "replicated_kv_heads"))
    if ctx.size % heads_kv == 0 and ctx.size // heads_kv in ctx.reps:
        kv = Shard(1, rep=ctx.size // heads_kv)
        found.append(Strategy((Shard(1), kv, kv) + _mask_placements(masks, 1), Shard(1)))
    return found


def shared_kv_reps(nodes: list[fx.Node], size: int) -> tuple[int, ...]:
    """The replication counts of shared K/V splits in a graph: size/g for every grouped-query
    attention with 1 < g < size K/V heads dividing size (:func:`sdpa`; multi-query
    attention's one head is replicated, ``replicated_kv_heads``: one piece is no split), and
    for every head repeat written out (HF's ``repeat_kv`` before eager attention: ``expand``
    of [b, g, 1, s, d] to [b, g, n, s, d], reshaped to [b, g*n, s, d]; Falcon's
    ``broadcast_to`` then ``flatten`` of [b, s, g, 1, d] alike; litgpt's
    ``repeat_interleave(n, dim=1)`` of [b, g, s, d]): the shared piece is then read by its
    sharers as the plain split of the repeated heads (``unshare``)."""
    found = set()
    for n in nodes:
        if n.target is aten.scaled_dot_product_attention.default:
            q, k = _shape(n.args[0]), _shape(n.args[1])
            if 1 < k[1] < size and size % k[1] == 0 and q[1] % size == 0:
                found.add(size // k[1])
        elif (g := _repeated_groups(n) or _interleaved_groups(n)) is not None \
                and 1 < g[0] < size and size % g[0] == 0 and g[0] * g[1] % size == 0:
            found.add(size // g[0])
    return tuple(sorted(found))


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.flatten.using_ints)  # fmt: skip


def _repeated_groups(n: fx.Node) -> tuple[int, int] | None:
    """(g, n) when ``n`` merges dims (d, d+1) of an ``expand`` that repeats a size-1 dim d+1
    n times (a head repeat: [.., g, 1, ..] -> [.., g, n, ..] -> [.., g*n, ..])."""
    if n.op != "call_function" or n.target not in _VIEWS:
        return None
    src = n.args[0]
    if not isinstance(src, fx.Node) or src.target not in (aten.expand.default,
                                                          aten.broadcast_to.default):
        return None
    before, after, out = _shape(src.args[0]), _shape(src), _shape(n)
    if len(before) != len(after) or len(out) != len(after) - 1:
        return None
    for d in range(len(after) - 1):
        if (before[d + 1] == 1 and after[d + 1] > 1 and out[d] == after[d] * after[d + 1]
                and list(out[:d]) == list(after[:d]) and list(out[d + 1:]) == list(after[d + 2:])):
            return after[d], after[d + 1]
    return None


def _interleaved_groups(n: fx.Node) -> tuple[int, int] | None:
    """(g, n) when ``n`` repeats each of the g entries of a dim n times in place
    (``repeat_interleave`` by one integer: [.., g, ..] -> [.., g*n, ..])."""
    if n.op != "call_function" or n.target is not aten.repeat_interleave.self_int:
        return None
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim")
    repeats = n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
    if dim is None or not isinstance(repeats, int) or repeats < 2:
        return None
    src = _shape(n.args[0])
    return src[_dim(dim, len(src))], repeats


def _mask_placements(masks: list[torch.Size], d: int, b: int = 1) -> tuple[Placement, ...]:
    """An attention mask broadcasts against [b, heads, s, s]: split it where it is not 1."""
    out: list[Placement] = []
    for m in masks:
        md = d - (4 - len(m))
        out.append(R if md < 0 or m[md] == 1 else Shard(md, b))
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
