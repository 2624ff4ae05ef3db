"""expert_parallel: MoE experts placed across the ``ep`` ranks, tokens sent to them and back.

Runs on a stage's materialized program (autopar.codegen.materialize: rank-independent, whole
parameters read by ``get_attr``), with the decisions the ep planner part made
(``ctx.sections["ep"]``, autopar.axes.expert_parallel.EpDecisions: the stage's MoE layers, the
loss reduction, the capacity, the dense-gradient bucket cap, the pipeline's micro-batches).
Every ep rank runs the program on its own slice of the batch.

Algorithm:
1. Each MoE layer's region reads ``expert_dispatch`` of the rows grouped by expert
   (per-expert counts exchanged, then the rows with variable splits) and this rank's experts'
   offsets; it ends with ``expert_combine`` (the inverse all-to-all, back to the region's
   row count).  A per-expert bias
   gathered by expert id is gathered by the local expert ids instead.
2. The expert weights are laid out ``S(0)`` over ep: each stacked [E, ...] parameter's
   ``get_attr`` and each ``stack`` of per-expert parameters; codegen's shard step keeps each
   rank's E/ep experts (the stacked slice, or its members by the user's names).
3. Every other trainable parameter's gradient is summed over ep: per bucket of dense
   parameters (autopar.axes.expert_parallel.dense_buckets) one ``grad_bucket_all_reduce``
   before its first use (with pipeline micro-batches: reduced once per step), a lone
   parameter's by ``grad_all_reduce``.
4. Each scalar output (the loss) becomes the global loss (``batch_loss``: its gradient stays
   the rank's, 1/ep of it for a mean), so the experts' gradients, summed by the all-to-alls'
   backward over every rank's tokens, are exact.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.axes.expert_parallel import EpDecisions, MoELayer, dense_buckets
from autopar.ir import meta
from autopar.ir.layout import Layout
from autopar.ops import collectives as C
from autopar.ops.parallel_ops import local_expert_ids
from passes import PassContext

ORIGIN = "expert_parallel"


def expert_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Steps 1-4, in place."""
    decided: EpDecisions = ctx.section("ep")
    graph, axis = gm.graph, decided.axis
    nodes = {n.name: n for n in graph.nodes}
    for layer in decided.layers:
        _rewrite_layer(graph, nodes, layer, axis, decided.capacity)
    _split_experts(graph, decided.layers, axis)
    experts = {w for layer in decided.layers for w in layer.weights}
    for bucket in dense_buckets(gm, experts, decided.bucket_bytes):
        if len(bucket) == 1 and decided.micro == 1:
            _reduce_grad(graph, bucket[0], axis)
        else:
            _reduce_bucket(graph, bucket, axis, decided.micro)
    _global_losses(graph, axis, decided.reduction)
    graph.lint()
    gm.recompile()
    return gm


def _made(node: fx.Node) -> fx.Node:
    meta.update(node, origin=ORIGIN)
    return node


def _rewrite_layer(graph: fx.Graph, nodes: dict[str, fx.Node], layer: MoELayer, axis: str,
                   capacity: float) -> None:  # fmt: skip
    """Step 1."""
    entry, offs, exit_ = nodes[layer.entry], nodes[layer.offs], nodes[layer.exit]
    region = [nodes[n] for n in layer.region]
    with graph.inserting_before(region[0]):
        sent = graph.call_function(C.expert_dispatch, (entry, offs, axis, capacity))
        rows = graph.call_function(operator.getitem, (sent, 0))
        local_offs = graph.call_function(operator.getitem, (sent, 1))
        counts = graph.call_function(operator.getitem, (sent, 2))
    for n in (sent, rows):
        n.meta.update({k: v for k, v in entry.meta.items() if k != "val"})
    for n in (sent, rows, local_offs, counts):
        _made(n)
    for node in region:
        node.replace_input_with(entry, rows)
        node.replace_input_with(offs, local_offs)
    for name in layer.biases:
        gather = nodes[name]
        first = next(n for n in region if n in gather.users)
        with graph.inserting_before(first):
            ids = _made(graph.call_function(local_expert_ids, (local_offs,)))
        first.prepend(gather)
        gather.replace_input_with(gather.args[1][0], ids)
        gather.meta.pop("val", None)
    with graph.inserting_after(exit_):
        count = exit_.meta["val"].shape[0]  # the region's rows, which the combine returns
        back = graph.call_function(C.expert_combine, (exit_, counts, offs, axis, count))
    back.meta.update(exit_.meta)
    _made(back)
    exit_.replace_all_uses_with(back, delete_user_cb=lambda u: u is not back)


def _split_experts(graph: fx.Graph, layers: Sequence[MoELayer], axis: str) -> None:
    """Step 2: ``S(0)`` over ``axis`` on the stacked expert parameters and on the stacks of
    per-expert ones."""
    stacks = {s for layer in layers for s, _ in layer.stacks}
    members = {m for layer in layers for _, ms in layer.stacks for m in ms}
    stacked = {w for layer in layers for w in layer.weights} - members
    for node in graph.nodes:
        if (node.op == "get_attr" and node.target in stacked) or node.name in stacks:
            lay = meta.layout(node) or Layout.replicate(node.meta["val"].dim())
            dims = ((*lay.dims[0], axis), *lay.dims[1:])
            meta.update(node, layout=Layout(dims=dims, blocks=lay.blocks, partial=lay.partial,
                                            shared=lay.shared))  # fmt: skip


def _reduce_grad(graph: fx.Graph, node: fx.Node, axis: str) -> None:
    """Step 3, one parameter."""
    with graph.inserting_after(node):
        red = graph.call_function(C.grad_all_reduce, (node, axis))
    red.meta.update(node.meta)
    _made(red)
    node.replace_all_uses_with(red, delete_user_cb=lambda u: u is not red)


def _reduce_bucket(graph: fx.Graph, nodes: list[fx.Node], axis: str, micro: int) -> None:
    """Step 3: one ``grad_bucket_all_reduce`` before the first use of any of ``nodes`` (with
    ``micro`` pipeline micro-batches: reduced once, after the last one's backward)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    users = {n: list(n.users) for n in nodes}
    first = min((u for us in users.values() for u in us), key=order.__getitem__)
    with graph.inserting_before(first):
        # this program's bucket, naming its partial sum over micro-batches; none without them
        # (so equal blocks stay equal and share one torch.compile)
        key = f"{uuid.uuid4().hex}:{nodes[0].target}" if micro > 1 else ""
        red = _made(graph.call_function(C.grad_bucket_all_reduce, (axis, key, micro, *nodes)))
        outs = [graph.call_function(operator.getitem, (red, i)) for i in range(len(nodes))]
    red.meta["val"] = tuple(n.meta.get("val") for n in nodes)
    for node, out in zip(nodes, outs, strict=True):
        if order[node] > order[first]:
            red.prepend(node)  # a parameter read later in forward: fetched before the bucket
        out.meta.update(node.meta)
        _made(out)
        for user in users[node]:
            user.replace_input_with(node, out)


def _global_losses(graph: fx.Graph, axis: str, reduction: str) -> None:
    """Step 4."""
    out = next(n for n in graph.nodes if n.op == "output")
    # in output order: a set's order differs between ranks and would pair their all-reduces
    for leaf in dict.fromkeys(a for a in pytree.tree_leaves(out.args[0])
                              if isinstance(a, fx.Node)):  # fmt: skip
        v = leaf.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point():
            with graph.inserting_before(out):
                loss = graph.call_function(C.batch_loss, (leaf, axis, reduction))
            loss.meta.update(leaf.meta)
            _made(loss)
            out.replace_input_with(leaf, loss)
