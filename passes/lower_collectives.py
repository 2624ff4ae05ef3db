"""lower_collectives: turn each abstract ``redistribute`` into named, autograd-aware collectives.

Algorithm (one mesh axis; ``pg`` = the consumers make the gradient partial):
1. R -> R with pg: ``grad_all_reduce`` (identity forward, all-reduce backward).
2. P -> R: ``all_reduce`` (backward all-reduce when pg, else identity).
3. S -> R: ``all_gather`` (backward reduce-scatter when pg, else the local slice).
4. R -> S: ``split`` (local; backward all-gather).  P -> S: ``reduce_scatter``.
5. S(i) -> S(j): ``all_to_all`` when neither dim is blocked, else all_gather then split.
"""

from __future__ import annotations

import torch.fx as fx

from autopar import collectives as C
from autopar import meta
from autopar.layout import Layout, Partial, Placement, Replicate, Shard, parse_placement
from passes import NodeError, PassContext


def lower_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace every redistribute node by concrete collectives (steps 1-5)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is C.redistribute:
            x, axis, src, dst, pg = node.args
            _lower(gm.graph, node, x, axis, parse_placement(src), parse_placement(dst), pg)
    gm.graph.lint()
    gm.recompile()
    return gm


def _lower(graph: fx.Graph, node: fx.Node, x: fx.Node, axis: str, src: Placement,
           dst: Placement, pg: bool) -> None:  # fmt: skip
    if isinstance(dst, Replicate):
        if isinstance(src, Replicate):
            _become(node, C.grad_all_reduce, (x, axis))
        elif isinstance(src, Partial):
            _become(node, C.all_reduce, (x, axis, "all_reduce" if pg else "identity"))
        else:
            grad = "reduce_scatter" if pg else "split"
            _become(node, C.all_gather, (x, axis, src.dim, src.blocks, grad))
        return
    if not isinstance(dst, Shard):
        raise NodeError(node, f"cannot re-lay {src} as {dst}: nothing turns a value partial")
    if isinstance(src, Replicate):
        _become(node, C.split, (x, axis, dst.dim, dst.blocks))
    elif isinstance(src, Partial):
        _become(node, C.reduce_scatter, (x, axis, dst.dim, dst.blocks))
    elif src.blocks == 1 and dst.blocks == 1 and src.dim != dst.dim:
        _become(node, C.all_to_all, (x, axis, src.dim, dst.dim))
    else:
        with graph.inserting_before(node):
            full = graph.call_function(C.all_gather, (x, axis, src.dim, src.blocks, "split"))
        full.meta.update(node.meta)
        meta.update(full, layout=Layout.replicate(x.meta["val"].dim()))
        _become(node, C.split, (full, axis, dst.dim, dst.blocks))


def _become(node: fx.Node, target: object, args: tuple) -> None:
    node.target = target
    node.args = args
    node._rename(target.__name__)
    meta.update(node, origin="lower_collectives")
