"""overlap_tp: decompose the chosen tp gathers and scatters into ring steps under their matmuls.

Megatron-SP's pairs (a gather of a split activation before column-split linears; a
reduce-scatter of a row-split linear's partial sums) become collective matmuls
(autopar.ops.overlap): the communication of each ring step runs while the previous chunk's
partial matmul does.  The overlap planner part (autopar.planner.overlap) prices each
candidate and names the chosen ones in ``TpDecisions.overlap``; this pass applies them.

Algorithm:
1. Candidates (:func:`candidates`, on the lowered graph): an ``all_gather`` of one block with a
   reduce-scatter backward (its consumers' gradients are partial sums) whose users are all
   ``aten.linear`` reading it as their input (each weight and bias defined before the first
   linear, or computed from reads that can move there), keyed ``gather:<first linear>``; a
   ``reduce_scatter`` of one block whose input is a bias-free ``aten.linear`` with no other
   user, keyed ``scatter:<linear>``.
2. A chosen gather and its linears become one ``gather_linear(x, weights, biases, axis,
   dim)`` and one ``getitem`` per linear (each keeping the linear's name's meta: shape,
   layout); the gather and linears are erased.  A gather only re-gathered (``regather``, not
   decomposed) becomes ``gather_linear(..., ring=False)``: one whole gather, the shard kept.
3. A chosen scatter and its linear become ``linear_scatter(h, w, axis, dim)``.
4. Lint and recompile.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.ir import meta
from autopar.ops import collectives as C
from autopar.ops.overlap import gather_linear, linear_scatter
from passes import PassContext

LINEAR = torch.ops.aten.linear.default


@dataclass(frozen=True)
class Candidate:
    """One collective the decomposition applies to: ``kind`` 'all_gather' or
    'reduce_scatter', the collective node, the linears it feeds (or is fed by)."""

    key: str
    kind: str
    collective: fx.Node
    linears: tuple[fx.Node, ...]

    @property
    def axis(self) -> str:
        return self.collective.args[1]

    @property
    def dim(self) -> int:
        return self.collective.args[2]


def candidates(gm: fx.GraphModule) -> list[Candidate]:
    """Step 1, in graph order."""
    out, order = [], {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is C.all_gather and _gather_fits(node):
            users = sorted(node.users, key=order.__getitem__)
            if _hoisted(users, order) is None:
                continue  # a later linear's weight needs the first one's output
            out.append(Candidate(f"gather:{users[0].name}", "all_gather", node, tuple(users)))
        elif node.target is C.reduce_scatter and _scatter_fits(node):
            lin = node.args[0]
            out.append(Candidate(f"scatter:{lin.name}", "reduce_scatter", node, (lin,)))
    return out


def _gather_fits(node: fx.Node) -> bool:
    _, _, _, blocks, grad = node.args
    return (blocks == 1 and grad == "reduce_scatter" and bool(node.users)
            and all(_linear_input(u, node) for u in node.users))  # fmt: skip


def _scatter_fits(node: fx.Node) -> bool:
    lin = node.args[0]
    return (node.args[3] == 1 and isinstance(lin, fx.Node) and lin.target is LINEAR
            and len(lin.users) == 1 and _bias(lin) is None)  # fmt: skip


def _linear_input(user: fx.Node, x: fx.Node) -> bool:
    """``user`` is a linear reading ``x`` as its input only (not as its weight or bias)."""
    return (user.target is LINEAR and user.args[0] is x
            and x not in (*user.args[1:], *user.kwargs.values()))  # fmt: skip


def _hoisted(users: list[fx.Node], order: dict) -> list[fx.Node] | None:
    """What must move up before the first of ``users`` so every weight and bias is defined
    there, in graph order: the ones defined after it with what computes them from there on
    (a stage graph reads each parameter, through ``grad_sum_shared`` for a shared split, just
    before its use), plus every placeholder in between (the program's arguments keep their
    order).  None when that would need one of ``users`` (or what reads them) first."""
    first, cone = users[0], set()
    todo = [a for u in users for a in _weight_and_bias(u) if order[a] > order[first]]
    while todo:
        n = todo.pop()
        if n in cone or order[n] < order[first]:
            continue
        if n is first or n.op not in ("placeholder", "get_attr", "call_function"):
            return None
        cone.add(n)
        todo += n.all_input_nodes
    if not cone:
        return []
    nodes = list(order)
    last = max(order[n] for n in cone)
    span = [n for n in nodes[order[first] + 1:last + 1] if n.op == "placeholder"]
    return sorted(cone.union(span), key=order.__getitem__)


def _weight_and_bias(lin: fx.Node) -> list[fx.Node]:
    return [a for a in (lin.args[1], _bias(lin)) if isinstance(a, fx.Node)]


def _bias(lin: fx.Node) -> fx.Node | None:
    return lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")


def overlap_tp(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Steps 1-4 for the candidates ``ctx.section("tp").overlap`` names."""
    chosen, regather = set(ctx.section("tp").overlap), set(ctx.section("tp").regather)
    for cand in candidates(gm):
        if cand.kind == "all_gather" and (cand.key in chosen or cand.key in regather):
            _fuse_gather(gm.graph, cand, ring=cand.key in chosen)
        elif cand.key in chosen:
            _fuse_scatter(gm.graph, cand)
    gm.graph.lint()
    gm.recompile()
    return gm


def _fuse_gather(graph: fx.Graph, cand: Candidate, ring: bool) -> None:
    """Step 2."""
    x = cand.collective.args[0]
    first = cand.linears[0]
    weights = [lin.args[1] for lin in cand.linears]
    biases = [_bias(lin) for lin in cand.linears]
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in _hoisted(list(cand.linears), order):  # a stage's parameter reads move up
        first.prepend(n)
    with graph.inserting_before(first):
        fused = graph.call_function(gather_linear, (x, weights, biases, cand.axis, cand.dim,
                                                    ring))  # fmt: skip
        fused.meta.update(first.meta)
        fused.meta["val"] = tuple(lin.meta["val"] for lin in cand.linears)
        meta.update(fused, layout=tuple(meta.layout(lin) for lin in cand.linears),
                    origin="overlap_tp")  # fmt: skip

        for i, lin in enumerate(cand.linears):
            item = graph.call_function(operator.getitem, (fused, i))
            item.meta.update(lin.meta)
            meta.update(item, origin="overlap_tp")
            lin.replace_all_uses_with(item)
    for lin in cand.linears:
        graph.erase_node(lin)
    graph.erase_node(cand.collective)


def _fuse_scatter(graph: fx.Graph, cand: Candidate) -> None:
    """Step 3."""
    rs, (lin,) = cand.collective, cand.linears
    with graph.inserting_before(rs):
        fused = graph.call_function(linear_scatter, (lin.args[0], lin.args[1], cand.axis, cand.dim))
    fused.meta.update(rs.meta)
    meta.update(fused, origin="overlap_tp")

    rs.replace_all_uses_with(fused)
    graph.erase_node(rs)
    graph.erase_node(lin)
