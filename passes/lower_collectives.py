"""lower_collectives: turn each abstract ``redistribute`` into named, autograd-aware collectives.

Algorithm (one mesh axis; ``pg`` = the consumers make the gradient partial):
1. R -> R with pg: ``grad_all_reduce`` (identity forward, all-reduce backward).
2. P -> R: ``all_reduce`` (backward all-reduce when pg, else identity).
3. S -> R: ``all_gather`` (backward reduce-scatter when pg, else the local slice).
4. R -> S: ``split`` (local; backward all-gather).  P -> S: ``reduce_scatter``.
5. S(i) -> S(j): ``all_to_all`` when neither dim is blocked, else all_gather then split.
6. Hoist each ``grad_all_reduce`` above the replicated op feeding it while that op has no other
   user, one input that needs a gradient, and that input is not larger: a partial gradient
   stays partial through any op every rank repeats (its backward is linear in the gradient),
   so a routed gather ``x[index]`` reduces the [T, h] gradient of ``x``, not its [T*k, h] rows.
   Two reductions of the same value merge (the sum of partial sums is one partial sum).
"""

from __future__ import annotations

import torch.fx as fx

from autopar import collectives as C
from autopar import meta
from autopar.layout import Layout, Partial, Placement, Replicate, Shard, parse_placement
from autopar.trace import tensor_args
from passes import NodeError, PassContext


def lower_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace every redistribute node by concrete collectives (steps 1-5)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is C.redistribute:
            x, axis, src, dst, pg = node.args
            _lower(gm.graph, node, x, axis, parse_placement(src), parse_placement(dst), pg)
    _hoist_grad_reductions(gm.graph, ctx)
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


def _hoist_grad_reductions(graph: fx.Graph, ctx: PassContext) -> None:
    """Step 6: move each grad_all_reduce up to the cheapest point of its replicated chain."""
    work = [n for n in graph.nodes if n.op == "call_function" and n.target is C.grad_all_reduce]
    while work:
        g = work.pop()
        y, axis = g.args
        x = _hoistable_input(y, g, ctx)
        if x is None:
            continue
        new = next((u for u in x.users if u.target is C.grad_all_reduce and u.args[1] == axis),
                   None)  # fmt: skip
        if new is None:
            with graph.inserting_after(x):
                new = graph.call_function(C.grad_all_reduce, (x, axis))
            new.meta.update({k: v for k, v in x.meta.items() if k != "val"}, val=x.meta["val"])
            meta.update(new, origin="lower_collectives")
            work.append(new)
        y.replace_input_with(x, new)
        g.replace_all_uses_with(y)
        graph.erase_node(g)


def _hoistable_input(y: fx.Node, g: fx.Node, ctx: PassContext) -> fx.Node | None:
    """The one input of replicated ``y`` a reduction of ``y``'s gradient may move to."""
    strat = ctx.choice.get(y.name)
    schema = getattr(y.target, "_schema", None)
    if y.op != "call_function" or strat is None or not strat.redundant or list(y.users) != [g]:
        return None
    if schema is None or schema.is_mutable:
        return None
    ins = [a for a in dict.fromkeys(tensor_args(y)) if _may_need_grad(a, ctx)]
    if len(ins) != 1 or ins[0].meta["val"].numel() > y.meta["val"].numel():
        return None
    return ins[0]


def _may_need_grad(a: fx.Node, ctx: PassContext) -> bool:
    """Floating values the plan says need a gradient, and every value the plan does not know
    (collectives written by this pass carry their input's gradient)."""
    return a.meta["val"].is_floating_point() and (a.name in ctx.grad or a.name not in ctx.choice)
