"""tensor_parallel: write in the op lowerings that chosen strategies name.

Algorithm:
1. ``vocab_parallel_embedding``: the table is split by rows; the lookup masks ids that fall
   outside this rank's rows (partial-sum output).
2. ``vocab_parallel_cross_entropy``: logits split on the vocab; max and sum-exp are reduced
   over the axis, the logits are never gathered.
3. ``replicated_kv_heads``: attention with fewer KV heads than ranks reads, on each rank, the
   KV head its query heads use (``local_kv_heads``), with ``enable_gqa``.
4. ``partial_mean``: a mean over a split dim becomes the local sum divided by the global
   count, a partial sum of the mean.
5. ``distributed_norm``: rms_norm / layer_norm over a split normalized dim, written out in
   ATen ops: local sums over the normalized dims, one ``all_reduce`` of the [..., 1] sum of
   squares (layer_norm: first of the sum, for the mean), then the local normalisation with
   this rank's slice of the weight and bias.  The all-reduces also sum their gradients, since
   split consumers make those partial.
6. ``partial_moments``: var / std (/ var_mean / std_mean) over a split dim: the local sum,
   one ``all_reduce`` of it for the mean, the local sum of the centred squares, one
   ``all_reduce`` of it, divided by the global count less the correction (std: its root);
   the [..., 1] statistics are replicated, squeezed where the op does not keep the dims, and
   read through ``grad_partial`` (the all-reduces' backward sums partial gradients only).
7. ``add_once``: partial + replicated (a bias after a row split inside a routed expert):
   the replicated operand is kept on rank 0 only (``on_first_rank``), a partial sum itself.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from autopar.ir import meta
from autopar.ir.layout import PARTIAL, Layout, Placement, R
from autopar.ops import collectives, parallel_ops
from autopar.rules.reductions import moment_args
from passes import NodeError, PassContext

aten = torch.ops.aten


def tensor_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace nodes whose strategy names a lowering (steps 1-6)."""
    for node in list(gm.graph.nodes):
        strat = ctx.section("tp").choice.get(node.name)
        if strat is None or strat.lowering is None:
            continue
        lower = _LOWERINGS.get(strat.lowering)
        if lower is None:
            raise NodeError(node, f"unknown lowering {strat.lowering!r}")
        lower(gm.graph, node, ctx.section("tp").axis)
        meta.update(node, origin="tensor_parallel")
    gm.graph.lint()
    gm.recompile()
    return gm


def _embedding(graph: fx.Graph, node: fx.Node, axis: str) -> None:
    weight, ids = node.args[0], node.args[1]
    padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
    node.target = parallel_ops.vocab_parallel_embedding
    node.args, node.kwargs = (weight, ids, axis, padding_idx), {}


def _cross_entropy(graph: fx.Graph, node: fx.Node, axis: str) -> None:
    args = list(node.args) + [None] * (6 - len(node.args))
    reduction = node.kwargs.get("reduction", args[3] if args[3] is not None else 1)
    ignore = node.kwargs.get("ignore_index", args[4] if args[4] is not None else -100)
    node.target = parallel_ops.vocab_parallel_cross_entropy
    node.args, node.kwargs = (args[0], args[1], axis, reduction, ignore), {}


def _kv_heads(graph: fx.Graph, node: fx.Node, axis: str) -> None:
    args = list(node.args)
    for i in (1, 2):
        with graph.inserting_before(node):
            local = graph.call_function(parallel_ops.local_kv_heads, (args[i], axis))
        local.meta.update({k: v for k, v in args[i].meta.items() if k != "autopar"})
        val = args[i].meta["val"]
        local.meta["val"] = val.new_empty((val.shape[0], 1, *val.shape[2:]), device="meta")
        meta.update(local, layout=meta.layout(args[i]), origin="tensor_parallel")
        args[i] = local
    node.args = tuple(args)
    node.kwargs = {**node.kwargs, "enable_gqa": True}


_SUM_REDUCTION = 2  # torch's Reduction::Sum (the loss summed, not averaged)


def _partial_mean(graph: fx.Graph, node: fx.Node, axis: str) -> None:
    x = node.args[0].meta["val"]
    if node.target is aten.mse_loss.default:
        count = x.numel()
        node.args = (*node.args[:2], _SUM_REDUCTION)
    else:
        count = math.prod(x.shape[d] for d in _mean_dims(node, x.dim()))
        node.target = aten.sum.default if node.target is aten.mean.default else aten.sum.dim_IntList
    with graph.inserting_after(node):
        out = _emit(graph, node, aten.div.Scalar, (node, count), node.meta["val"], PARTIAL, axis)
    node.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)


def _mean_dims(node: fx.Node, ndim: int) -> list[int]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or dims == []:
        return list(range(ndim))
    return [d % ndim for d in ([dims] if isinstance(dims, int) else dims)]


def _distributed_norm(graph: fx.Graph, node: fx.Node, axis: str) -> None:
    rms = node.target is aten.rms_norm.default
    args = list(node.args) + [None] * (5 - len(node.args))
    x, normalized, weight = args[0], args[1], args[2]
    bias, eps = (None, args[3]) if rms else (args[3], args[4] if args[4] is not None else 1e-5)
    val = x.meta["val"]
    dims = list(range(val.dim() - len(normalized), val.dim()))
    count = math.prod(val.shape[d] for d in dims)
    dtype = torch.float32 if val.dtype in (torch.float16, torch.bfloat16) else val.dtype
    eps = torch.finfo(dtype).eps if eps is None else eps
    split = meta.layout(node).placement(axis)
    emit = _Emitter(graph, node, axis, val.shape, dtype, dims)
    with graph.inserting_before(node):
        xf = x if dtype == val.dtype else emit.op(aten._to_copy.default, (x,), split,
                                                  dtype=dtype)  # fmt: skip
        if not rms:
            mean = emit.op(aten.div.Scalar, (emit.total(xf), count), R, stats=True)
            xf = emit.op(aten.sub.Tensor, (xf, mean), split)
        square = emit.op(aten.mul.Tensor, (xf, xf), split)
        var = emit.op(aten.div.Scalar, (emit.total(square), count), R, stats=True)
        var = emit.op(aten.add.Scalar, (var, eps), R, stats=True)
        out = emit.op(aten.mul.Tensor, (xf, emit.op(aten.rsqrt.default, (var,), R, stats=True)),
                      split)  # fmt: skip
        if dtype != val.dtype:
            out = emit.op(aten._to_copy.default, (out,), split, dtype=val.dtype, out_dtype=True)
        for param, op in ((weight, aten.mul.Tensor), (bias, aten.add.Tensor)):
            if param is not None:
                out = emit.op(op, (out, param), split, out_dtype=True)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


_STD = (aten.std.correction, aten.std.dim, aten.std_mean.correction, aten.std_mean.dim)


def _partial_moments(graph: fx.Graph, node: fx.Node, axis: str) -> None:
    x = node.args[0]
    val = x.meta["val"]
    dims, keep, correction = moment_args(node)
    count = math.prod(val.shape[d] for d in dims)
    dtype = torch.float32 if val.dtype in (torch.float16, torch.bfloat16) else val.dtype
    split = meta.layout(x).placement(axis)
    emit = _Emitter(graph, node, axis, val.shape, dtype, dims)
    with graph.inserting_before(node):
        xf = x if dtype == val.dtype else emit.op(aten._to_copy.default, (x,), split,
                                                  dtype=dtype)  # fmt: skip
        mean = emit.op(aten.div.Scalar, (emit.total(xf), count), R, stats=True)
        centred = emit.op(aten.sub.Tensor, (xf, mean), split)
        square = emit.op(aten.mul.Tensor, (centred, centred), split)
        var = emit.op(aten.div.Scalar, (emit.total(square), count - correction), R, stats=True)
        if node.target in _STD:
            var = emit.op(aten.sqrt.default, (var,), R, stats=True)
        outs = [_moment_out(graph, node, emit, t, keep, axis) for t in (var, mean)]
    _replace_outputs(graph, node, outs)


def _moment_out(graph: fx.Graph, node: fx.Node, emit: _Emitter, t: fx.Node, keep: bool,
                axis: str) -> fx.Node:  # fmt: skip
    """``t`` in the op's dtype, its reduced dims squeezed unless the op keeps them; its
    consumers' whole gradient is made partial again (``grad_partial``), as the gradients of
    the split ops inside are, so the all-reduces' backward sums each exactly once."""
    if emit.dtype != emit.out_dtype:
        t = emit.op(aten._to_copy.default, (t,), R, stats=True, out_dtype=True,
                    dtype=emit.out_dtype)  # fmt: skip
    if not keep:
        shape = [n for d, n in enumerate(t.meta["val"].shape) if d not in emit.dims]
        val = torch.empty(shape, dtype=emit.out_dtype, device="meta")
        t = _emit(graph, node, aten.squeeze.dims, (t, emit.dims), val, R, axis)
    return _emit(graph, node, collectives.grad_partial, (t, axis), t.meta["val"], R, axis)


def _replace_outputs(graph: fx.Graph, node: fx.Node, outs: list[fx.Node]) -> None:
    """Point the users of ``node`` at ``outs[0]`` (a tuple op's ``getitem`` users at their
    element), then erase it."""
    if not isinstance(node.meta["val"], (tuple, list)):
        node.replace_all_uses_with(outs[0])
    for user in list(node.users):
        user.replace_all_uses_with(outs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)


class _Emitter:
    """Writes the ATen nodes of one lowering with their global ``val`` and layout."""

    def __init__(self, graph: fx.Graph, like: fx.Node, axis: str, shape: torch.Size,
                 dtype: torch.dtype, dims: list[int]) -> None:  # fmt: skip
        self.graph, self.like, self.axis = graph, like, axis
        self.shape, self.dtype, self.dims = shape, dtype, dims
        out = like.meta["val"]
        self.out_dtype = (out[0] if isinstance(out, (tuple, list)) else out).dtype

    def op(self, target: object, args: tuple, p: Placement, stats: bool = False,
           out_dtype: bool = False, **kwargs: object) -> fx.Node:  # fmt: skip
        shape = [1 if stats and d in self.dims else n for d, n in enumerate(self.shape)]
        dtype = self.out_dtype if out_dtype else self.dtype
        val = torch.empty(shape, dtype=dtype, device="meta")
        return _emit(self.graph, self.like, target, args, val, p, self.axis, kwargs)

    def total(self, x: fx.Node) -> fx.Node:
        """Sum over the normalized dims, all-reduced over the axis ([..., 1] statistics)."""
        local = self.op(aten.sum.dim_IntList, (x, self.dims, True), PARTIAL, stats=True)
        return self.op(collectives.all_reduce, (local, self.axis, "all_reduce"), R, stats=True)


def _emit(graph: fx.Graph, like: fx.Node, target: object, args: tuple, val: torch.Tensor,
          p: Placement, axis: str, kwargs: dict | None = None) -> fx.Node:  # fmt: skip
    """A new node at the graph's insertion point, with ``like``'s source and the layout ``p``."""
    node = graph.call_function(target, args, kwargs or {})
    for key in ("nn_module_stack", "stack_trace"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    node.meta["val"] = val
    meta.update(node, layout=Layout.from_placements(val.dim(), {axis: p}),
                origin="tensor_parallel")  # fmt: skip
    return node


def _add_once(graph: fx.Graph, node: fx.Node, axis: str) -> None:
    """``add`` / ``sub`` of a partial sum and a replicated value: the replicated operand goes
    through ``on_first_rank``, so the parts of the sum hold it once."""
    args = list(node.args)
    i = next(i for i in (0, 1) if meta.layout(args[i]).placement(axis) == R)
    with graph.inserting_before(node):
        once = graph.call_function(parallel_ops.on_first_rank, (args[i], axis))
    once.meta.update({k: v for k, v in args[i].meta.items() if k != "autopar"})
    meta.update(once, layout=Layout.from_placements(args[i].meta["val"].dim(), {axis: PARTIAL}),
                origin="tensor_parallel")  # fmt: skip
    args[i] = once
    node.args = tuple(args)


_LOWERINGS = {
    "add_once": _add_once,
    "vocab_parallel_embedding": _embedding,
    "vocab_parallel_cross_entropy": _cross_entropy,
    "replicated_kv_heads": _kv_heads,
    "partial_mean": _partial_mean,
    "distributed_norm": _distributed_norm,
    "partial_moments": _partial_moments,
}
