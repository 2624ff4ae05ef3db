"""lower_collectives: turn each abstract ``redistribute`` into named, autograd-aware collectives.

Algorithm (one mesh axis; ``pg`` = the consumers make the gradient partial):
1. R -> R with pg: ``grad_all_reduce`` (identity forward, all-reduce backward).
2. P -> R: ``all_reduce`` (backward all-reduce when pg, else identity).
3. S -> R: ``all_gather`` (backward reduce-scatter when pg, else the local slice).
4. R -> S: ``split`` (local; backward all-gather).  P -> S: ``reduce_scatter``.
   R -> a shared split (each piece on ``rep`` consecutive ranks: a replicated per-head norm
   weight read by shared K/V heads): each piece repeated ``rep`` times in place (a local
   view + expand + reshape), then ``split``: rank r takes copy r % rep of piece r // rep.
   Backward: the split's all-gather brings every sharer's part of its piece's gradient, the
   repeat's backward sums them.
5. S(i) -> S(j): ``all_to_all`` when neither dim is blocked, else all_gather then split.
   A shared split read as it is with pg (a parameter): ``grad_sum_shared`` (identity forward;
   backward sums the gradient over the ranks sharing the piece).  A shared split read as the
   plain split of its dim: ``unshare`` (local: each sharer keeps its 1/rep of the piece).
6. Hoist each ``grad_all_reduce`` above the replicated op feeding it while that op has no other
   user, one input that needs a gradient, and that input is not larger: a partial gradient
   stays partial through any op every rank repeats (its backward is linear in the gradient),
   so a routed gather ``x[index]`` reduces the [T, h] gradient of ``x``, not its [T*k, h] rows.
   Two reductions of the same value merge (the sum of partial sums is one partial sum).
7. Else hoist it through a whole replicated region (ops every rank repeats whose users all lie
   in the region, e.g. a rotary embedding and the key projection feeding attention) to the
   region's inputs that need a gradient, when each is a weight (its gradient reduction runs off
   the critical path, overlapped with the rest of backward like a data-parallel bucket) or
   already has a reduction to merge into (Megatron's f on the projection input).  A replicated
   key/value projection then costs no activation reduction at all.
8. An ``all_gather`` (slice backward) whose only user is a ``grad_all_reduce`` becomes an
   ``all_gather`` with a reduce-scatter backward (slice of a sum = reduce-scatter).
9. Else, when a chain of replicated ops above the reduction leads to an ``all_gather`` (slice
   backward), each op reading one non-weight value that needs a gradient and no larger than
   its output (weights beside it: a norm's scale), move the reduction onto that gather as its
   reduce-scatter backward (Megatron-SP's gather before a router and column-split experts):
   every other user of a chain value joins the partial gradient, a ``grad_all_reduce`` by
   merging into it, any other (its gradient is whole: a replicated router) through
   ``grad_partial`` (the whole gradient kept on rank 0 only); each weight beside the chain gets
   its own reduction (a weight bucket, step 7).  One reduce-scatter replaces an all-reduce.
10. Else, when the replicated region above the reduction reads, among values that need a
   gradient, only weights and one value ``f`` with no reduction, no larger than the reduced
   value, and another pending reduction's region reads exactly the same (sibling readers of
   one value: Falcon's two layer norms of one residual), reduce ``f`` once for all of them:
   one ``grad_all_reduce`` of ``f`` read by every sibling region (autograd sums the regions'
   partial gradients before it), each region then hoisted to it as in step 7.  ``f``'s other
   readers (the residual add, whose gradient is whole) keep reading ``f`` itself.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.frontend.trace import tensor_args
from autopar.ir import meta
from autopar.ir.layout import Layout, Partial, Placement, Replicate, Shard, parse_placement
from autopar.ops import collectives as C
from passes import NodeError, PassContext

aten = torch.ops.aten


def lower_collectives(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Replace every redistribute node by concrete collectives (steps 1-5)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is C.redistribute:
            x, axis, src, dst, pg = node.args
            _lower(gm.graph, node, x, axis, parse_placement(src), parse_placement(dst), pg,
                   ctx.mesh.sizes[axis])  # fmt: skip
    _hoist_grad_reductions(gm.graph, ctx)
    _fold_gather_reductions(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return gm


def _lower(graph: fx.Graph, node: fx.Node, x: fx.Node, axis: str, src: Placement,
           dst: Placement, pg: bool, size: int) -> None:  # fmt: skip
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
    if src == dst and dst.rep > 1 and pg:
        _become(node, C.grad_sum_shared, (x, axis, dst.rep))
    elif _unshares(src, dst):
        if pg:  # a parameter: its sharers' parts of the gradient are summed first
            with graph.inserting_before(node):
                x = graph.call_function(C.grad_sum_shared, (x, axis, src.rep))
            x.meta.update(node.meta)
            meta.update(x, layout=meta.layout(node.args[0]), origin="lower_collectives")
        _become(node, C.unshare, (x, axis, dst.dim, src.rep))
    elif isinstance(src, Replicate):
        if dst.rep > 1:
            x = _repeat_pieces(graph, node, x, size, dst)
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


def _repeat_pieces(graph: fx.Graph, node: fx.Node, x: fx.Node, size: int, dst: Shard) -> fx.Node:
    """Step 4b: replicated ``x`` with each of the size/rep pieces of each block of dim
    ``dst.dim`` repeated ``dst.rep`` times in place (``[.., b*p, L, ..]`` -> ``[.., b*p, rep,
    L, ..]`` -> ``[.., n*rep, ..]``), so a plain split of the result is the shared split."""
    shape, d = list(x.meta["val"].shape), dst.dim
    pieces = dst.blocks * (size // dst.rep)
    grouped = [*shape[:d], pieces, shape[d] // pieces, *shape[d + 1:]]
    steps = [(aten.view.default, grouped), (aten.unsqueeze.default, d + 1),
             (aten.expand.default, [*grouped[:d + 1], dst.rep, *grouped[d + 1:]]),
             (aten.reshape.default, [*shape[:d], shape[d] * dst.rep, *shape[d + 1:]])]  # fmt: skip
    for target, arg in steps:
        with graph.inserting_before(node):
            y = graph.call_function(target, (x, arg))
        y.meta.update(node.meta)
        val = target(torch.empty(x.meta["val"].shape, device="meta"), arg)
        y.meta["val"] = torch.empty(val.shape, dtype=x.meta["val"].dtype, device="meta")
        meta.update(y, layout=Layout.replicate(val.dim()), origin="lower_collectives")
        x = y
    return x


def _unshares(src: Placement, dst: Shard) -> bool:
    """Step 5b: a shared split read as the plain split of its dim (a local narrow)."""
    return (isinstance(src, Shard) and src.rep > 1 and dst.rep == 1 and src.dim == dst.dim
            and src.blocks == dst.blocks == 1)  # fmt: skip


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
        if getattr(g, "_erased", False):
            continue  # merged into a gather's reduce-scatter (step 9)
        x = _hoistable_input(y, g, ctx)
        if x is None:
            created = _hoist_region(graph, g, ctx)
            if created is None:
                created = _hoist_to_gather(graph, g, ctx)
            if created is None:
                created = _hoist_siblings(graph, g, ctx)
            work.extend(created or [])
            continue
        new = _reduction_of(x, axis)
        if new is None:
            with graph.inserting_after(x):
                new = _new_reduction(graph, x, axis)
            work.append(new)
        y.replace_input_with(x, new)
        g.replace_all_uses_with(y)
        graph.erase_node(g)


def _hoist_region(graph: fx.Graph, g: fx.Node, ctx: PassContext) -> list[fx.Node] | None:
    """Step 7: move ``g`` to the gradient-needing inputs of the replicated region ending at its
    input, when each input is a weight or already reduced; returns new reductions (None when
    ``g`` stays)."""
    y, axis = g.args
    region = _replicated_region(y, g, ctx)
    if region is None:
        return None
    frontier = [a for n in region for a in dict.fromkeys(tensor_args(n))
                if a not in region and _may_need_grad(a, ctx)]  # fmt: skip
    frontier = list(dict.fromkeys(frontier))
    merged = {f: _reduction_of(f, axis) for f in frontier}
    if not frontier or any(m is None and not _is_weight(f, ctx) for f, m in merged.items()):
        return None
    created = []
    for f, new in merged.items():
        if new is None:
            with graph.inserting_after(f):
                new = _new_reduction(graph, f, axis)
            created.append(new)
        for n in region:
            if f in n.all_input_nodes:
                n.replace_input_with(f, new)
    g.replace_all_uses_with(y)
    graph.erase_node(g)
    return created


def _hoist_to_gather(graph: fx.Graph, g: fx.Node, ctx: PassContext) -> list[fx.Node] | None:
    """Step 9: turn ``g`` into the reduce-scatter backward of the all_gather its replicated
    chain starts from; returns the weights' new reductions (None when ``g`` stays)."""
    y, axis = g.args
    chain = _chain_to_gather(y, axis, ctx)
    if chain is None:
        return None
    created: list[fx.Node] = []
    below = g
    for n in chain:
        for u in [u for u in n.users if u is not below]:
            _join_partial(graph, n, u, axis)
        for w in _beside(n, chain, ctx):
            new = _reduction_of(w, axis)
            if new is None:  # placed by its reader: inside the reader's block
                with graph.inserting_before(n):
                    new = _new_reduction(graph, w, axis)
                created.append(new)
            n.replace_input_with(w, new)
        below = n
    gather = chain[-1]
    gather.args = (*gather.args[:4], "reduce_scatter")
    g.replace_all_uses_with(y)
    graph.erase_node(g)
    return created


def _hoist_siblings(graph: fx.Graph, g: fx.Node, ctx: PassContext) -> list[fx.Node] | None:
    """Step 10: one reduction of the value ``f`` that ``g``'s region and its siblings' read
    (the only unreduced non-weight input of each); returns the new reductions (None when
    ``g`` stays)."""
    y, axis = g.args
    f = _blocker(y, g, ctx)
    if f is None:
        return None
    siblings = _sibling_reductions(f, g, axis, ctx)
    group = [g, *(h for h in siblings if _blocker(h.args[0], h, ctx) is f)]
    if len(group) < 2 or f.meta["val"].numel() > min(h.args[0].meta["val"].numel() for h in group):
        return None
    with graph.inserting_after(f):
        created = [_new_reduction(graph, f, axis)]
    for h in group:
        moved = _hoist_region(graph, h, ctx)
        if moved is None:
            raise NodeError(h, "internal: a sibling reduction did not hoist to its shared input")
        created.extend(moved)
    return created


def _blocker(y: fx.Node, g: fx.Node, ctx: PassContext) -> fx.Node | None:
    """The one input of the replicated region above ``y`` that needs a gradient and is
    neither a weight nor reduced already (None when there is not exactly one)."""
    region = _replicated_region(y, g, ctx)
    if region is None:
        return None
    axis = g.args[1]
    left = {a for n in region for a in tensor_args(n) if a not in region and _may_need_grad(a, ctx)
            and not _is_weight(a, ctx) and _reduction_of(a, axis) is None}  # fmt: skip
    return left.pop() if len(left) == 1 else None


def _sibling_reductions(f: fx.Node, g: fx.Node, axis: str, ctx: PassContext) -> list[fx.Node]:
    """The pending reductions other than ``g`` reached from ``f``'s readers through repeated
    ops only (at most _MAX_REGION of them per reader)."""
    found: dict[fx.Node, None] = {}
    for x in f.users:
        seen, todo = {x}, [x]
        while todo and len(seen) <= _MAX_REGION:
            n = todo.pop()
            if n.op == "call_function" and n.target is C.grad_all_reduce:
                if n is not g and n.args[1] == axis:
                    found[n] = None
                continue
            if not _repeated(n, ctx):
                continue
            for u in n.users:
                if u not in seen:
                    seen.add(u)
                    todo.append(u)
    return list(found)


_MAX_REGION = 64  # ops walked from a reader of a value to the sibling reductions (step 10)


def _chain_to_gather(y: fx.Node, axis: str, ctx: PassContext) -> list[fx.Node] | None:
    """``y`` and the replicated ops above it up to an all_gather with a slice backward (its
    last entry), each reading one non-weight value that needs a gradient, no larger."""
    chain = [y]
    while len(chain) <= _MAX_CHAIN:
        n = chain[-1]
        if n.op == "call_function" and n.target is C.all_gather:
            ok = n.args[1] == axis and n.args[4] == "split" and not _written(n)
            return chain if ok else None
        if not _repeated(n, ctx) or _written(n):
            return None
        ins = [a for a in dict.fromkeys(tensor_args(n))
               if _may_need_grad(a, ctx) and not _is_weight(a, ctx)]  # fmt: skip
        if len(ins) != 1 or ins[0].meta["val"].numel() > n.meta["val"].numel():
            return None
        chain.append(ins[0])
    return None


def _written(n: fx.Node) -> bool:
    """Whether an in-place op writes ``n`` or a view of it (autograd forbids writing a custom
    Function's view output, and a chain value must keep its gradient path)."""
    seen, todo = set(), [n]
    while todo:
        v = todo.pop()
        for u in v.users:
            schema = getattr(u.target, "_schema", None)
            if u.op != "call_function" or u in seen or schema is None:
                continue
            seen.add(u)
            if schema.is_mutable:
                return True
            if schema.returns and schema.returns[0].alias_info is not None:
                todo.append(u)  # a view of ``v``: its writes write ``v``
    return False


_MAX_CHAIN = 16  # replicated ops between a reduction and the gather it may become


def _beside(n: fx.Node, chain: list[fx.Node], ctx: PassContext) -> list[fx.Node]:
    """The weights ``n`` (on the chain) reads that need a gradient."""
    if n is chain[-1]:
        return []
    return [a for a in dict.fromkeys(tensor_args(n)) if _may_need_grad(a, ctx) and _is_weight(a, ctx)]


def _join_partial(graph: fx.Graph, n: fx.Node, u: fx.Node, axis: str) -> None:
    """Make the gradient ``u`` sends to ``n`` partial over ``axis``: a reduction of it merges
    into the one below; any other user's (whole) gradient is kept on rank 0 only."""
    if u.op == "call_function" and u.target is C.grad_all_reduce and u.args[1] == axis:
        u.replace_all_uses_with(n)
        graph.erase_node(u)
        return
    with graph.inserting_after(n):
        gp = graph.call_function(C.grad_partial, (n, axis))
    gp.meta.update({k: v for k, v in n.meta.items() if k != "val"}, val=n.meta["val"])
    meta.update(gp, origin="lower_collectives")
    u.replace_input_with(n, gp)


def _replicated_region(y: fx.Node, g: fx.Node, ctx: PassContext) -> set[fx.Node] | None:
    """The ops above ``y`` that every rank repeats and whose users all lie in the region."""
    if not _repeated(y, ctx) or list(y.users) != [g]:
        return None
    region = {y}
    grew = True
    while grew:
        grew = False
        for n in list(region):
            for a in tensor_args(n):
                if a in region or not _may_need_grad(a, ctx) or not _repeated(a, ctx):
                    continue
                if all(u in region for u in a.users):
                    region.add(a)
                    grew = True
    return region


def _repeated(n: fx.Node, ctx: PassContext) -> bool:
    strat = ctx.section("tp").choice.get(n.name)
    schema = getattr(n.target, "_schema", None)
    return (n.op == "call_function" and strat is not None and strat.redundant
            and schema is not None and not schema.is_mutable)  # fmt: skip


def _reduction_of(f: fx.Node, axis: str) -> fx.Node | None:
    return next((u for u in f.users if u.target is C.grad_all_reduce and u.args[1] == axis), None)


def _new_reduction(graph: fx.Graph, f: fx.Node, axis: str) -> fx.Node:
    """``grad_all_reduce(f, axis)`` at the graph's insertion point, with ``f``'s metadata."""
    new = graph.call_function(C.grad_all_reduce, (f, axis))
    new.meta.update({k: v for k, v in f.meta.items() if k != "val"}, val=f.meta["val"])
    meta.update(new, origin="lower_collectives")
    return new


def _is_weight(f: fx.Node, ctx: PassContext) -> bool:
    """A parameter, or a view / cast chain of one (its gradient is the weight's)."""
    while f.op == "call_function" and _repeated(f, ctx) and len(tensor_args(f)) == 1:
        f = tensor_args(f)[0]
    return f.op == "placeholder" and f.name in ctx.traced.params


def _fold_gather_reductions(graph: fx.Graph) -> None:
    """Step 8: all_gather(split backward) -> grad_all_reduce is one reduce-scatter backward."""
    for ag in list(graph.nodes):
        if ag.op != "call_function" or ag.target is not C.all_gather or ag.args[4] != "split":
            continue
        users = list(ag.users)
        if len(users) == 1 and users[0].target is C.grad_all_reduce and users[0].args[1] == ag.args[1]:
            ag.args = (*ag.args[:4], "reduce_scatter")
            users[0].replace_all_uses_with(ag)
            graph.erase_node(users[0])


def _hoistable_input(y: fx.Node, g: fx.Node, ctx: PassContext) -> fx.Node | None:
    """The one input of replicated ``y`` a reduction of ``y``'s gradient may move to."""
    strat = ctx.section("tp").choice.get(y.name)
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
    known = a.name in ctx.section("tp").choice
    return a.meta["val"].is_floating_point() and (a.name in ctx.grad or not known)
