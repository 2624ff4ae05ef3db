"""propagate_layout: give every node its layout; conflicts become explicit ``redistribute``.

Algorithm:
1. Write each node's chosen strategy and output layout into its record (getitem nodes take
   their element of the producer's tuple).
2. For every consumer input whose required placement differs from what its producer makes,
   insert one ``redistribute(x, axis, src, dst, partial_grad)`` per (producer, target),
   right after the producer, shared by all consumers that want the same target.  A split
   value that consumers read cast to 16 bits (autocast: a matmul's fp32 input) and that the
   re-layout only moves (a gather, an all-to-all) is cast first, so the cast copy moves.  A value
   written in place (``copy_`` into a slice of a ``new_empty`` buffer, ``index_put_``, ...)
   is read where its consumer reads it: after the last in-place write to it or to a view
   of it between the value's definition and the consumer, one redistribute per such write
   (a write before a view is taken is already in the view).
3. Replicated inputs of split ops get gradients that are partial sums: those consumers read
   the value through a redistribute with ``partial_grad=True`` (Megatron's f), kept apart from
   consumers that repeat the op on every rank (whose gradients are already whole).  So do
   parameters read as a shared split (``S(d)xrep``): the ranks sharing a piece each hold the
   part of its gradient their own query heads made.
4. Graph outputs that are still partial sums are reduced.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.frontend.precision import read_dtype
from autopar.frontend.trace import is_getitem, is_tensor, tensor_args
from autopar.ir import meta
from autopar.ir.layout import (
    Layout,
    Partial,
    Placement,
    R,
    Replicate,
    Shard,
)
from autopar.ops.collectives import redistribute
from autopar.rules import Strategy
from passes import PassContext


def propagate_layout(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Annotate layouts and insert abstract re-layouts (steps 1-4)."""
    graph = gm.graph
    have: dict[fx.Node, Placement] = {}
    for node in list(graph.nodes):
        _annotate(node, ctx, have)
    wants: dict[tuple, dict[tuple[Placement, bool], list[tuple[fx.Node, int]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    order = {n: i for i, n in enumerate(graph.nodes)}
    writes: dict[fx.Node, list[fx.Node]] = {}
    for node in list(graph.nodes):
        for slot, (arg, want, pg) in enumerate(_requirements(node, ctx, have)):
            if arg is not None and (want != have[arg] or pg):
                if arg not in writes:
                    writes[arg] = _writes(arg, order)
                last = [w for w in writes[arg] if order[arg] < order[w] < order[node]]
                cast = _cast(node, arg, have[arg], want)
                wants[(arg, last[-1] if last else None)][(want, pg, cast)].append((node, slot))
    for (arg, written), groups in wants.items():
        _insert(graph, arg, have[arg], groups, ctx, written)
    graph.lint()
    gm.recompile()
    return gm


def _annotate(node: fx.Node, ctx: PassContext, have: dict) -> None:
    if node.target is redistribute:
        have[node] = meta.layout(node).placement(ctx.section("tp").axis)
        return
    if is_getitem(node):
        parent = meta.layout(node.args[0])
        if isinstance(parent, tuple):
            lay = parent[node.args[1]]
            meta.update(node, layout=lay)
            have[node] = lay.placement(ctx.section("tp").axis)
        return
    strat = ctx.section("tp").choice.get(node.name)
    val = node.meta.get("val")
    if strat is None or not (isinstance(val, torch.Tensor) or isinstance(strat.output, tuple)):
        return  # a non-tensor value (a bool or int input such as HF's use_cache) has no layout
    if isinstance(strat.output, tuple):
        lay = tuple(_layout(v, p, ctx) for v, p in zip(val, strat.output, strict=True))
    else:
        lay = _layout(val, strat.output, ctx)
        have[node] = strat.output
    meta.update(node, layout=lay, strategy=str(strat))


def _layout(val: torch.Tensor, p: Placement, ctx: PassContext) -> Layout:
    return Layout.from_placements(val.dim(), {ctx.section("tp").axis: p})


def _requirements(node: fx.Node, ctx: PassContext, have: dict) -> list:
    """(producer, wanted placement, partial_grad) per tensor-argument slot of ``node``."""
    args = tensor_args(node)
    if node.op == "output":
        whole = lambda p: isinstance(p, Partial) or (ctx.replicate_outputs and isinstance(p, Shard))  # noqa: E731
        return [(a, R if whole(have[a]) else have[a], False) if a in have else (None, None, False)
                for a in args]  # fmt: skip
    strat: Strategy | None = ctx.section("tp").choice.get(node.name)
    if strat is None:
        return [(None, None, False)] * len(args)
    out = []
    for a, want in zip(args, strat.inputs, strict=True):
        pg = isinstance(want, Replicate) and not strat.redundant and a.name in ctx.grad
        shared = _shared(want) or _shared(have.get(a))  # read as it is, or unshared
        pg = pg or (shared and a.op == "placeholder" and a.name in ctx.grad)
        if a.target is redistribute and a.args[4]:
            pg = False  # already reads through a partial-gradient re-layout (idempotence)
        out.append((a, want, pg) if a in have else (None, None, False))
    return out


def _shared(p: Placement) -> bool:
    return isinstance(p, Shard) and p.rep > 1


def _writes(x: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node]:
    """In graph order, the nodes that write in place to ``x``'s storage: through ``x``, the
    value it is a view of, or any view of either (views and writes read off op schemas)."""
    root = x
    while _aliases_input(root):
        root = root.args[0]
    seen, todo, found = {root}, [root], []
    while todo:
        for user in todo.pop().users:
            if _writes_to(user, seen):
                found.append(user)
            if user not in seen and _aliases_input(user) and user.args[0] in seen:
                seen.add(user)
                todo.append(user)
    return sorted(set(found), key=order.__getitem__)


def _aliases_input(node: fx.Node) -> bool:
    """``node``'s output is a view of (or is) its first argument."""
    if is_getitem(node):
        return isinstance(node.args[0], fx.Node) and _aliases_input(node.args[0])
    schema = getattr(node.target, "_schema", None)
    return (node.op == "call_function" and schema is not None and bool(node.args)
            and isinstance(node.args[0], fx.Node)
            and any(r.alias_info is not None for r in schema.returns))  # fmt: skip


def _writes_to(node: fx.Node, values: set[fx.Node]) -> bool:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return False
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    bound = dict(zip((a.name for a in schema.arguments), node.args, strict=False)) | node.kwargs
    return any(isinstance(bound.get(n), fx.Node) and bound[n] in values for n in written)


def _cast(consumer: fx.Node, arg: fx.Node, src: Placement,
          want: Placement) -> torch.dtype | None:  # fmt: skip
    """Step 2: the 16-bit dtype a split ``arg`` is re-laid in for ``consumer``, when the
    consumer reads it cast (autocast: a matmul's fp32 input) and the re-layout only moves it
    (a gather or all-to-all, not a sum): the cast copy moves, half the bytes."""
    if not isinstance(src, Shard) or want == src:
        return None
    reads = read_dtype(consumer, arg)
    return reads if reads.itemsize < meta.dtype(arg).itemsize else None


def _insert(graph: fx.Graph, arg: fx.Node, src: Placement, groups: dict, ctx: PassContext,
            written: fx.Node | None = None) -> None:  # fmt: skip
    """One redistribute per target (and cast: a 16-bit copy for the consumers that read it
    so); replicated targets split by partial_grad (step 2-3), read after ``written``, the last
    in-place write before the consumers, when there is one."""
    made: dict[tuple[Placement, bool, torch.dtype | None], fx.Node] = {}
    for want, pg, cast in sorted(groups, key=lambda k: (str(k[0]), k[1], str(k[2]))):
        base, plain = arg, (want, False, cast)
        if pg and not isinstance(src, Replicate) and plain in groups:
            base = made[plain] if plain in made else _new(graph, arg, src, want, False, ctx,
                                                          written, cast)  # fmt: skip
            made[plain] = base
            new = _new(graph, base, want, want, True, ctx)
        else:
            new = _new(graph, arg, src, want, pg, ctx, written, cast)
        made[(want, pg, cast)] = new
    for key, consumers in groups.items():
        for consumer, slot in consumers:
            _replace_slot(consumer, slot, made[key])


def _new(graph: fx.Graph, x: fx.Node, src: Placement, dst: Placement, pg: bool,
         ctx: PassContext, written: fx.Node | None = None,
         cast: torch.dtype | None = None) -> fx.Node:  # fmt: skip
    if cast is not None:
        x = _cast_copy(graph, x, cast, written or _after(x))
        written = None
    with graph.inserting_after(written or _after(x)):
        axis = ctx.section("tp").axis
        node = graph.call_function(redistribute, (x, axis, str(src), str(dst), pg))
    node.meta["val"] = x.meta["val"]
    for key in ("nn_module_stack", "stack_trace"):
        if key in x.meta:
            node.meta[key] = x.meta[key]
    meta.update(node, layout=_layout(x.meta["val"], dst, ctx), origin="propagate_layout")
    return node


def _cast_copy(graph: fx.Graph, x: fx.Node, dtype: torch.dtype, where: fx.Node) -> fx.Node:
    """``x.to(dtype)`` after ``where``, keeping ``x``'s layout and module path."""
    with graph.inserting_after(where):
        node = graph.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": dtype})
    val = x.meta["val"]
    node.meta["val"] = torch.empty(tuple(val.shape), dtype=dtype, device="meta")
    for key in ("nn_module_stack", "stack_trace"):
        if key in x.meta:
            node.meta[key] = x.meta[key]
    meta.update(node, layout=meta.layout(x), origin="propagate_layout")
    return node


def _after(x: fx.Node) -> fx.Node:
    """Insert after ``x``, but never among the placeholders and attribute reads."""
    node = x
    while node.next.op in ("placeholder", "get_attr") and node.op in ("placeholder", "get_attr"):
        node = node.next
    return node


def _replace_slot(node: fx.Node, slot: int, new: fx.Node) -> None:
    """Replace the ``slot``-th tensor argument of ``node`` (duplicates counted) with ``new``."""
    count = -1

    def swap(a: object) -> object:
        nonlocal count
        if isinstance(a, fx.Node) and is_tensor(a):
            count += 1
            if count == slot:
                return new
        return a

    args, kwargs = pytree.tree_map(swap, (node.args, node.kwargs))
    node.args, node.kwargs = tuple(args), dict(kwargs)
