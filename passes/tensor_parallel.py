"""tensor_parallel: write in the op lowerings that chosen strategies name.

Algorithm:
1. ``vocab_parallel_embedding``: the table is split by rows; the lookup masks ids that fall
   outside this rank's rows (partial-sum output).
2. ``vocab_parallel_cross_entropy``: logits split on the vocab; max and sum-exp are reduced
   over the axis, the logits are never gathered.
3. ``replicated_kv_heads``: attention with fewer KV heads than ranks reads, on each rank, the
   KV head its query heads use (``local_kv_heads``), with ``enable_gqa``.
"""

from __future__ import annotations

import torch.fx as fx

from autopar import meta, parallel_ops
from passes import NodeError, PassContext


def tensor_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace nodes whose strategy names a lowering (steps 1-3)."""
    for node in list(gm.graph.nodes):
        strat = ctx.choice.get(node.name)
        if strat is None or strat.lowering is None:
            continue
        lower = _LOWERINGS.get(strat.lowering)
        if lower is None:
            raise NodeError(node, f"unknown lowering {strat.lowering!r}")
        lower(gm.graph, node, ctx.axis)
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


_LOWERINGS = {
    "vocab_parallel_embedding": _embedding,
    "vocab_parallel_cross_entropy": _cross_entropy,
    "replicated_kv_heads": _kv_heads,
}
