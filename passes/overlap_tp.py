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
   linear, or a parameter read that can move there), keyed ``gather:<first linear>``; a
   ``reduce_scatter`` of one block whose input is a bias-free ``aten.linear`` with no other
   user, keyed ``scatter:<linear>``.
2. A chosen gather and its linears become one ``gather_linear(x, weights, biases, axis,
   dim)`` and one ``getitem`` per linear (each keeping the linear's name's meta: shape,
   layout); the gather and linears are erased.
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
            if not _movable(_late_inputs(users, order)):
                continue  # a later linear's weight is computed after the first one runs
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


def _late_inputs(users: list[fx.Node], order: dict) -> list[fx.Node]:
    """The weights and biases of ``users`` defined after the first of them, in order."""
    late = {a for u in users for a in _weight_and_bias(u) if order[a] > order[users[0]]}
    return sorted(late, key=order.__getitem__)


def _movable(late: list[fx.Node]) -> bool:
    """Whether ``late`` can move up before the first linear: each a read with no inputs (a
    stage graph's parameter placeholder or ``get_attr`` sits just before its use)."""
    return all(a.op in ("placeholder", "get_attr") for a in late)


def _reads_up_to(first: fx.Node, last: fx.Node, order: dict) -> list[fx.Node]:
    """The placeholders and ``get_attr`` reads after ``first`` up to ``last``, in order: they
    move up together, so the program's arguments keep their order."""
    nodes = list(order)
    return [n for n in nodes[order[first] + 1:order[last] + 1] if n.op in ("placeholder", "get_attr")]


def _weight_and_bias(lin: fx.Node) -> list[fx.Node]:
    return [a for a in (lin.args[1], _bias(lin)) if isinstance(a, fx.Node)]


def _bias(lin: fx.Node) -> fx.Node | None:
    return lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")


def overlap_tp(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Steps 1-4 for the candidates ``ctx.section("tp").overlap`` names."""
    chosen = set(ctx.section("tp").overlap)
    for cand in candidates(gm):
        if cand.key not in chosen:
            continue
        if cand.kind == "all_gather":
            _fuse_gather(gm.graph, cand)
        else:
            _fuse_scatter(gm.graph, cand)
    gm.graph.lint()
    gm.recompile()
    return gm


def _fuse_gather(graph: fx.Graph, cand: Candidate) -> None:
    """Step 2."""
    x = cand.collective.args[0]
    first = cand.linears[0]
    weights = [lin.args[1] for lin in cand.linears]
    biases = [_bias(lin) for lin in cand.linears]
    order = {n: i for i, n in enumerate(graph.nodes)}
    late = _late_inputs(list(cand.linears), order)
    for w in _reads_up_to(first, late[-1], order) if late else []:  # a stage's reads: up
        first.prepend(w)
    with graph.inserting_before(first):
        fused = graph.call_function(gather_linear, (x, weights, biases, cand.axis, cand.dim))
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
