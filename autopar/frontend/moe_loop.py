"""Per-expert ``nn.ModuleList`` MoE loops rewritten into the stacked-expert form, at trace.

The common hand-written MoE (Mixtral's original HF code, many user models) routes with a
Python loop over an ``nn.ModuleList`` of identical expert MLPs::

    mask = one_hot(selected, E).permute(2, 1, 0)
    for e in range(E):
        slot, token = torch.where(mask[e])
        out.index_add_(0, token, experts[e](x[token]) * weights[token, slot, None])

torch.export unrolls the loop; each ``torch.where`` has a data-dependent size (an unbacked
symbol), which a fixed-shape plan cannot hold.  Because every (token, slot) pair belongs to
exactly one expert (a one-hot over the experts), the E ``where`` results, concatenated in
expert order, are the positions of a stable sort of the expert ids: a fixed size, N = tokens
x slots.  So the E unrolled bodies become one body over all N rows grouped by expert, and each
per-expert linear one grouped matmul over the experts' weights stacked in the graph
(``stack`` of the user's parameters: gradients stay on the user's per-expert names).  The
result is the stacked form ``autopar.axes.expert_parallel`` places across ep ranks.

Algorithm (:func:`stack_expert_loops`, on the traced graph, in place):
1. Find each chain of ``index_add`` on dim 0 (the loop's accumulation), one link per expert
   (``y[i] += v`` is one too, when i repeats no row: :func:`_puts_to_index_adds`).
2. Per link: the index and value are read from ``where(mask_e)``, one routing for the chain,
   each e in 0..E-1 once, where every position of the routing belongs to exactly one expert:
   ``select(permute(one_hot(ids, E)), 0, e)`` (class dim moved to the front) or ``ids == e``
   with ids a top-k's indices over E scores.
3. Each link's body is what only that link computes (its private ancestors); its placeholders
   are that expert's parameters.  The bodies must be structurally identical (op for op, the
   same shared inputs, parameters of equal shapes, no size read from the routing), and the
   template body row-wise in the routed rows (elementwise ops, gathers by the where's
   coordinates, linears, layout-keeping reshapes, splits off the row dim).
4. Rewrite: a stable sort of the ids (permuted as the mask was), counts per expert and their
   cumulative offsets; the template body reads the sorted coordinates; each per-expert
   linear becomes ``grouped_mm(rows, stack(W_0..W_E-1)^T, offs)`` (``P^T`` when the loop
   reads the rows ``P[e]`` of one [E, ...] parameter), a per-expert bias a gather of the
   stacked biases by each row's expert id; one ``index_add`` replaces
   the chain; the other bodies and the where's size checks go; shapes are re-inferred.
A chain that fails a check is left as it is and reported (node, source line, why): its
data-dependent shape is then refused by the trace with that reason.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from autopar.errors import NodeProblem
from autopar.ir.meta import module_path, source

aten = torch.ops.aten
_INDEX_ADD = (aten.index_add_.default, aten.index_add.default)
_ROWWISE = {"silu", "gelu", "relu", "sigmoid", "tanh", "mul", "add", "sub", "div", "neg",
            "exp", "pow", "square", "clamp", "to", "_to_copy", "clone", "contiguous", "alias",
            "detach", "minimum", "maximum", "where", "type_as", "rsqrt", "sqrt", "erf",
            "gelu_", "silu_", "mul_", "add_"}  # fmt: skip
_SPLITS = {"chunk": 2, "split": 2, "split_with_sizes": 2, "unbind": 1}  # op -> index of its dim
_RESHAPES = {"reshape", "view", "_unsafe_view", "unsqueeze", "squeeze"}


LoopProblem = NodeProblem  # an unrolled per-expert loop that could not be rewritten


class _Reject(Exception):
    def __init__(self, node: fx.Node, why: str) -> None:
        super().__init__(why)
        self.node, self.why = node, why


def stack_expert_loops(gm: fx.GraphModule) -> list[LoopProblem]:
    """Steps 1-4 on every index_add chain of ``gm``; the chains left as they were."""
    problems = []
    _puts_to_index_adds(gm.graph)
    for chain in _chains(gm.graph):
        try:
            loop = _match(chain)
        except _Reject as r:
            if any(_wheres(link) for link in chain):
                problems.append(LoopProblem(node=r.node.name, why=r.why, source=source(r.node)))
            continue
        _rewrite(gm, loop)
    gm.graph.lint()
    gm.recompile()
    return problems


# ---------------------------------------------------------------- steps 1-3: matching


def _name(node: Any) -> str:
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return ""
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _chains(graph: fx.Graph) -> list[list[fx.Node]]:
    """Step 1: maximal chains index_add(index_add(acc, ...), ...) on dim 0."""
    links = [n for n in graph.nodes if n.op == "call_function" and n.target in _INDEX_ADD
             and n.args[1] == 0 and "alpha" not in n.kwargs]  # fmt: skip
    chains = []
    for node in links:
        if node.args[0] in links:
            continue  # not a chain start
        chain = [node]
        while len(chain[-1].users) == 1 and next(iter(chain[-1].users)) in links \
                and next(iter(chain[-1].users)).args[0] is chain[-1]:  # fmt: skip
            chain.append(next(iter(chain[-1].users)))
        if len(chain) > 1:
            chains.append(chain)
    return chains


def _puts_to_index_adds(graph: fx.Graph) -> None:
    """Step 1: ``y[i] += v`` (``index_put_(y, [i], index(y, [i]) + v)``) is
    ``index_add_(y, 0, i, v)`` when i repeats no row: i is the token coordinate of a routing
    mask over top-k ids [tokens, k] (a top-k picks an expert at most once per token)."""
    for node in list(graph.nodes):
        if node.target is not aten.index_put_.default or len(node.args[1]) != 1 \
                or (node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate")):
            continue
        acc, (i,), total = node.args[:3]
        if _name(total) not in ("add", "add_") or "alpha" in total.kwargs \
                or not _unique_rows(i):  # fmt: skip
            continue
        read, v = total.args
        if not (_name(read) == "index" and read.args[0] is acc and list(read.args[1]) == [i]
                and len(read.users) == 1 and len(total.users) == 1):  # fmt: skip
            continue
        with graph.inserting_before(node):
            add = graph.call_function(aten.index_add_.default, (acc, 0, i, v))
        add.meta.update(node.meta)
        node.replace_all_uses_with(add)
        for dead in (node, total, read):
            graph.erase_node(dead)


def _unique_rows(i: fx.Node) -> bool:
    where = i.args[0] if i.target is operator.getitem else None
    if where is None or _name(where) != "where" or len(where.args) != 1:
        return False
    try:
        (ids, order), _, _ = _routing(where)
    except _Reject:
        return False
    top = ids.args[0] if ids.target is operator.getitem and ids.args[1] == 1 else None
    if _name(top) != "topk" or ids.meta["val"].dim() != 2:
        return False
    dim = top.args[2] if len(top.args) > 2 else top.kwargs.get("dim", -1)
    return order[i.args[1]] != dim % 2  # the coordinate of the tokens, not of the k picks


def _wheres(link: fx.Node) -> fx.Node | None:
    idx = link.args[2]
    if idx.target is operator.getitem and _name(idx.args[0]) == "where" \
            and len(idx.args[0].args) == 1:  # fmt: skip
        return idx.args[0]
    return None


@dataclass(frozen=True)
class _Loop:
    chain: list[fx.Node]
    ids: fx.Node  # the expert id of each (token, slot), before the one-hot
    order: tuple[int, ...]  # the permutation the mask applies to the ids' dims
    experts: int
    wheres: list[fx.Node]  # per expert id
    bodies: list[list[fx.Node]]  # per expert id, in graph order
    members: dict[fx.Node, list[fx.Node]]  # template parameter -> every expert's, by id
    links: list[fx.Node]  # per expert id


def _match(chain: list[fx.Node]) -> _Loop:
    """Steps 2-3: raise _Reject naming the node and the reason."""
    ids, order, experts, by_expert = None, None, 0, {}
    for link in chain:
        where = _wheres(link)
        if where is None:
            raise _Reject(link, "its index is not a coordinate of torch.where(mask)")
        routing, n, e = _routing(where)
        if ids is not None and (routing[0] is not ids or n != experts):
            raise _Reject(where, "the loop's masks come from different routings")
        (ids, order), experts = routing, n
        if e in by_expert:
            raise _Reject(where, f"expert {e} is accumulated twice")
        by_expert[e] = (link, where)
    if sorted(by_expert) != list(range(experts)):
        raise _Reject(chain[-1], f"the loop covers experts {sorted(by_expert)} of {experts}")
    links = [by_expert[e][0] for e in range(experts)]
    wheres = [by_expert[e][1] for e in range(experts)]
    bodies, params = _bodies(chain, links, wheres)
    members = _check_identical(bodies, params, wheres)
    _check_rowwise(bodies[0], wheres[0], links[0], members)
    return _Loop(chain=chain, ids=ids, order=order, experts=experts, wheres=wheres,
                 bodies=bodies, members=members, links=links)  # fmt: skip


def _routing(where: fx.Node) -> tuple[tuple[fx.Node, tuple[int, ...]], int, int]:
    """Step 2: ((expert ids, the permutation of their dims the mask applies), experts, e)
    for a mask in which every position belongs to exactly one of E experts:
    ``select(permute(one_hot(ids, E), (class dim, ...)), 0, e)`` or ``ids == e`` with ids the
    indices of a top-k over E scores."""
    mask = where.args[0]
    if _name(mask) == "eq" and isinstance(mask.args[1], int):
        ids = mask.args[0]
        top = ids.args[0] if ids.target is operator.getitem and ids.args[1] == 1 else None
        if _name(top) != "topk":
            raise _Reject(where, "the mask compares ids that are not a top-k's indices")
        scores = top.args[0].meta["val"]
        dim = top.args[2] if len(top.args) > 2 else top.kwargs.get("dim", -1)
        return (ids, tuple(range(ids.meta["val"].dim()))), scores.shape[dim], mask.args[1]
    if _name(mask) != "select" or mask.args[1] != 0:
        raise _Reject(where, "the mask is not mask[e] of one routing mask, nor ids == e")
    perm, e = mask.args[0], mask.args[2]
    if _name(perm) != "permute" or _name(perm.args[0]) != "one_hot":
        raise _Reject(where, "the routing mask is not a permuted one_hot of expert ids")
    hot = perm.args[0]
    dims = [d % (hot.meta["val"].dim()) for d in perm.args[1]]
    if dims[0] != hot.meta["val"].dim() - 1:
        raise _Reject(perm, "the one_hot's class dim is not moved to the front")
    return (hot.args[0], tuple(dims[1:])), hot.meta["val"].shape[-1], e


def _ancestors(roots: Iterable[fx.Node]) -> set[fx.Node]:
    seen, todo = set(), list(roots)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _bodies(chain: list[fx.Node], links: list[fx.Node],
            wheres: list[fx.Node]) -> tuple[list[list[fx.Node]], list[list[fx.Node]]]:  # fmt: skip
    """Each link's private ancestors (call_functions in graph order, placeholders apart)."""
    graph_order = {n: i for i, n in enumerate(chain[0].graph.nodes)}
    own = [_ancestors(link.args[2:4]) for link in links]
    shared = _ancestors([chain[0].args[0]])
    bodies, params = [], []
    for i, mine in enumerate(own):
        others = set().union(*(o for j, o in enumerate(own) if j != i)) | shared
        private = sorted(mine - others, key=graph_order.__getitem__)
        if wheres[i] not in private:
            raise _Reject(wheres[i], "the routing mask is shared by the expert bodies")
        bad = [n for n in private if n.op not in ("placeholder", "call_function")]
        if bad:
            raise _Reject(bad[0], "an expert body reads a module attribute")
        bodies.append([n for n in private if n.op == "call_function"])
        params.append([n for n in private if n.op == "placeholder"])
    return bodies, params


def _check_identical(bodies: list[list[fx.Node]], params: list[list[fx.Node]],
                     wheres: list[fx.Node]) -> dict[fx.Node, list[fx.Node]]:  # fmt: skip
    """Step 3: the bodies map node for node onto the first; returns, per placeholder of the
    template (or its ``P[0]`` of a stacked parameter P), the corresponding placeholder (or
    ``P[e]``) of every expert: the stacked members."""
    first = bodies[0]
    masks = {w.args[0] for w in wheres}
    members = {p: [p] for p in params[0]}
    members.update({n: [n] for n in first if _expert_row(n, 0)})
    for e, body in enumerate(bodies[1:], start=1):
        if len(body) != len(first) or len(params[e]) != len(params[0]):
            raise _Reject(body[0] if body else wheres[e],
                          f"expert {e}'s body differs from expert 0's ({len(body)} ops vs "
                          f"{len(first)})")  # fmt: skip
        same: dict[fx.Node, fx.Node] = dict(zip(body, first, strict=True))
        for a, b in zip(body, first, strict=True):
            if a.target != b.target:
                raise _Reject(a, f"expert {e} runs {_name(a)} where expert 0 runs {_name(b)}")
            if b in members and _expert_row(a, e) and a.args[0] is b.args[0]:
                members[b].append(a)
                continue
            _same_args(a, b, same, members, e, masks)
    for p, ms in members.items():
        if len(ms) != len(bodies):
            raise _Reject(p, "a parameter is not read by every expert alike")
    return members


def _expert_row(node: fx.Node, e: int) -> bool:
    """``P[e]`` of a parameter P stacked over the experts (``select(P, 0, e)``)."""
    return (_name(node) == "select" and node.args[0].op == "placeholder"
            and node.args[1] == 0 and node.args[2] == e)  # fmt: skip


def _same_args(a: fx.Node, b: fx.Node, same: dict[fx.Node, fx.Node],
               members: dict[fx.Node, list[fx.Node]], e: int, masks: set[fx.Node]) -> None:  # fmt: skip
    flat_a, spec_a = pytree.tree_flatten((a.args, a.kwargs))
    flat_b, spec_b = pytree.tree_flatten((b.args, b.kwargs))
    if spec_a != spec_b:
        raise _Reject(a, f"expert {e}'s {_name(a)} has other arguments than expert 0's")
    for x, y in zip(flat_a, flat_b, strict=True):
        if isinstance(x, torch.SymInt) or isinstance(y, torch.SymInt):
            raise _Reject(a, "a size read from the routing is used inside an expert")
        if not isinstance(x, fx.Node):
            if x != y and a not in masks:  # the mask of expert e: select(..., e)
                raise _Reject(a, f"expert {e}'s {_name(a)} has argument {x!r}, expert 0's {y!r}")
            continue
        if x.op == "placeholder" and y in members:
            if len(members[y]) != e or x.meta["val"].shape != y.meta["val"].shape:
                raise _Reject(a, f"expert {e}'s parameter {x.name} does not match {y.name}")
            members[y].append(x)
        elif same.get(x, x) is not y:
            raise _Reject(a, f"expert {e}'s {_name(a)} reads '{x.name}' where expert 0's "
                             f"reads '{y.name}'")  # fmt: skip


def _row_dim(node: fx.Node, symbol: Any) -> int | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    dims = [d for d, s in enumerate(val.shape)
            if isinstance(s, torch.SymInt) and symbol in s.node.expr.free_symbols]  # fmt: skip
    if len(dims) > 1 or (dims and val.shape[dims[0]].node.expr != symbol):
        raise _Reject(node, "a tensor of the expert body mixes its routed rows into other dims")
    return dims[0] if dims else None


def _check_rowwise(body: list[fx.Node], where: fx.Node, link: fx.Node,
                   members: dict[fx.Node, list[fx.Node]]) -> None:  # fmt: skip
    """Step 3: each row of the template body is computed alone."""
    coords = {u for u in where.users if u.target is operator.getitem}
    size = next(iter(coords)).meta["val"].shape[0]
    symbol = size.node.expr if isinstance(size, torch.SymInt) else None
    if symbol is None:
        raise _Reject(where, "the where's size is not data-dependent")
    skip = {where, *coords, where.args[0]}
    for node in body:
        if node in skip or node.target is operator.getitem and node.args[0] in skip:
            continue
        problem = _not_rowwise(node, symbol, coords, members)
        if problem:
            raise _Reject(node, problem)
    if _row_dim(link.args[3], symbol) != 0 or link.args[2] not in coords:
        raise _Reject(link, "the accumulated rows are not on dim 0 of the value")


def _not_rowwise(node: fx.Node, symbol: Any, coords: set[fx.Node],
                 members: dict[fx.Node, list[fx.Node]]) -> str | None:  # fmt: skip
    name = _name(node)
    out = _row_dim(node, symbol)
    params = [x for x in node.all_input_nodes if x in members]
    if name == "linear" and params == [node.args[1]] and len(node.args) == 2:
        if out != 0 or node.args[0].meta["val"].dim() != 2:
            return "a per-expert linear's input is not [rows, features]"
        return None
    if name == "add" and params == [node.args[1]] and _row_dim(node.args[0], symbol) == 0 \
            and node.args[1].meta["val"].dim() == 1 and node.meta["val"].dim() == 2:  # fmt: skip
        return None  # a per-expert bias: each row adds its expert's
    if params:
        return (f"a per-expert parameter is read by {name} (only linear weights and biases "
                "are stacked)")  # fmt: skip
    if node in members:
        return None  # P[0] of a stacked parameter, read as a linear weight (checked there)
    if name == "index_select":
        if node.args[1] != 0 or node.args[2] not in coords \
                or _row_dim(node.args[0], symbol) is not None:  # fmt: skip
            return "an index_select inside the expert body is not of rows by the routing"
        return None
    if name == "index":
        idx = [i for i in node.args[1] if i is not None]
        if _row_dim(node.args[0], symbol) is not None or not all(i in coords for i in idx):
            return "a gather inside the expert body is not by the routing's coordinates"
        return None
    if name in _RESHAPES:
        src = node.args[0]
        into = _row_dim(src, symbol)
        if into is None:
            return None
        if out is None or not _keeps_rows(src.meta["val"].shape, into,
                                          node.meta["val"].shape, out):  # fmt: skip
            return f"{name} moves the routed rows"
        return None
    if name in _SPLITS or node.target is operator.getitem:
        if node.target is operator.getitem:
            return None
        d = node.args[_SPLITS[name]] if len(node.args) > _SPLITS[name] \
            else node.kwargs.get("dim", 0)  # fmt: skip
        src = _row_dim(node.args[0], symbol)
        return f"{name} splits the routed rows" if src == d % node.args[0].meta["val"].dim() \
            else None  # fmt: skip
    if name in _ROWWISE or name == "linear":
        return None
    return f"{name} is not a row-wise op (inside the expert body)"


def _keeps_rows(src: torch.Size, d_in: int, dst: torch.Size, d_out: int) -> bool:
    before = (math.prod(src[:d_in]), math.prod(dst[:d_out]))
    after = (math.prod(src[d_in + 1:]), math.prod(dst[d_out + 1:]))
    return before[0] == before[1] and after[0] == after[1]


# ---------------------------------------------------------------- step 4: the rewrite


def _grouped_mm_op() -> Any:
    try:
        import transformers.integrations.moe  # noqa: F401 - registers the fallback op

        return torch.ops.transformers.grouped_mm_fallback.default
    except (ImportError, AttributeError):
        return aten._grouped_mm.default


def _rewrite(gm: fx.GraphModule, loop: _Loop) -> None:
    graph, body = gm.graph, loop.bodies[0]
    where, link = loop.wheres[0], loop.links[0]
    in_body, new = set(body), []

    def call(target: Any, args: tuple, like: fx.Node, **kwargs: Any) -> fx.Node:
        node = graph.call_function(target, args, kwargs)
        node.meta.update({k: v for k, v in like.meta.items() if k == "stack_trace"})
        node.meta["nn_module_stack"] = loop.chain[-1].meta.get("nn_module_stack", {})
        new.append(node)
        return node

    token = link.args[2].args[1]  # which coordinate of the where indexes the accumulator
    with graph.inserting_before(where):
        coords, offs, expert_of_row = _sorted_coordinates(call, loop, where)
    for u in list(where.users):
        if u.target is operator.getitem:
            u.replace_all_uses_with(coords[u.args[1]], delete_user_cb=in_body.__contains__)
    linears = []
    for node in body:
        if _name(node) == "linear" and node.args[1] in loop.members:
            rows = loop.members[node.args[1]]
            with graph.inserting_before(node):
                stacked = rows[0].args[0] if _whole(rows) else \
                    call(aten.stack.default, (list(rows), 0), node)  # fmt: skip
                weight = call(aten.transpose.int, (stacked, -2, -1), node)
                mm = call(_grouped_mm_op(), (node.args[0], weight, offs), node)
            node.replace_all_uses_with(mm)
            linears.append(node)
        elif _name(node) == "add" and node.args[1] in loop.members:
            with graph.inserting_before(node):
                stacked = call(aten.stack.default, (list(loop.members[node.args[1]]), 0), node)
                node.update_arg(1, call(aten.index.Tensor, (stacked, [expert_of_row]), node))
    last = loop.chain[-1]
    with graph.inserting_before(last):
        total = call(aten.index_add.default, (loop.chain[0].args[0], 0, coords[token],
                                              link.args[3]), last)  # fmt: skip
    last.replace_all_uses_with(total)
    for node in loop.members:
        if node.op == "call_function" and _whole(loop.members[node]):
            linears.append(node)  # P[0] of a stacked parameter: its linears read P now
    masks = [w.args[0] for w in loop.wheres]
    routing = masks[0].args[0]  # permute(one_hot(ids)), or the ids
    _erase(graph, [*loop.chain, *linears, *masks, *(n for b in loop.bodies[1:] for n in b)],
           loop.wheres)  # fmt: skip
    while _name(routing) in ("permute", "one_hot") and not routing.users:
        routing, dead = routing.args[0], routing
        graph.erase_node(dead)
    keep = set(new) | in_body
    _infer(gm, [n for n in graph.nodes if n in keep])


def _whole(rows: list[fx.Node]) -> bool:
    """The members are P[0], ..., P[E-1] of one parameter P of E rows: stacked, P itself."""
    if not _expert_row(rows[0], 0):
        return False
    whole = rows[0].args[0]
    return (all(_expert_row(r, e) and r.args[0] is whole for e, r in enumerate(rows))
            and whole.meta["val"].shape[0] == len(rows))  # fmt: skip


def _sorted_coordinates(call: Any, loop: _Loop,
                        like: fx.Node) -> tuple[list[fx.Node], fx.Node, fx.Node]:  # fmt: skip
    """Every expert's where coordinates, concatenated in expert order, the offsets, and each
    row's expert id (counted for the offsets)."""
    ids = loop.ids
    if loop.order != tuple(range(len(loop.order))):
        ids = call(aten.permute.default, (ids, list(loop.order)), like)
    shape = [loop.ids.meta["val"].shape[d] for d in loop.order]
    flat = call(aten.reshape.default, (ids, [-1]), like)
    ranked = call(aten.sort.stable, (flat,), like, stable=True)
    order = call(operator.getitem, (ranked, 1), like)
    expert_of_row = call(operator.getitem, (ranked, 0), like)
    as_float = call(aten._to_copy.default, (expert_of_row,), like, dtype=torch.float32)
    counts = call(aten.histc.default, (as_float, loop.experts, 0, loop.experts - 1), like)
    offs = call(aten.cumsum.default, (counts, 0), like, dtype=torch.int32)
    coords = []
    for d in range(len(shape)):
        stride = math.prod(shape[d + 1:])
        c = call(aten.floor_divide.default, (order, stride), like) if stride > 1 else order
        coords.append(call(aten.remainder.Scalar, (c, shape[d]), like) if d else c)
    return coords, offs, expert_of_row


def _erase(graph: fx.Graph, nodes: list[fx.Node], wheres: list[fx.Node]) -> None:
    """The chain, the other bodies and every where's size checks (sym_size, asserts)."""
    checks = []
    for where in wheres:
        todo = list(where.users)
        while todo:
            n = todo.pop()
            if n not in checks:
                checks.append(n)
                todo.extend(n.users)
    doomed = set(nodes) | set(checks) | set(wheres)
    while doomed:
        free = [n for n in doomed if not n.users]
        if not free:
            raise RuntimeError(f"cannot erase {sorted(n.name for n in doomed)}: still read")
        for n in free:
            graph.erase_node(n)
            doomed.discard(n)


def _infer(gm: fx.GraphModule, nodes: list[fx.Node]) -> None:
    """Re-infer ``meta['val']`` of ``nodes`` (graph order) on the graph's fake tensors."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(vals)
    with mode:
        for node in nodes:
            args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"],
                                                (node.args, node.kwargs))  # fmt: skip
            node.meta["val"] = node.target(*args, **kwargs)


# ---------------------------------------------------------------- loops left unrecognised


@dataclass(frozen=True, kw_only=True)
class ExpertLoop:
    """Sibling modules ``prefix.0`` .. ``prefix.N-1`` with parameters of identical shapes that
    compute side by side (none reads another's result): a per-expert loop."""

    prefix: str
    count: int
    params: tuple[str, ...]  # every sibling's parameters
    node: fx.Node  # the first node computed by sibling 0


def find_expert_loops(gm: fx.GraphModule) -> list[ExpertLoop]:
    """Per-expert loops of a rank's graph (get_attr parameters), by module structure:
    1. group parameters ``<prefix>.<i>.<rest>`` by prefix; keep the groups of >= 2 siblings
       whose ``rest -> shape`` maps are equal;
    2. keep a group when sibling 1 computes nothing from sibling 0's results (experts run
       side by side; stacked layers run one after the other)."""
    siblings: dict[str, dict[int, dict[str, tuple[int, ...]]]] = {}
    names: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        parts = node.target.split(".")
        for k in range(1, len(parts) - 1):
            if parts[k].isdigit():
                prefix, rest = ".".join(parts[:k]), ".".join(parts[k + 1:])
                siblings.setdefault(prefix, {}).setdefault(int(parts[k]), {})[rest] = \
                    tuple(node.meta["val"].shape)  # fmt: skip
                names.setdefault(prefix, []).append(node.target)
    found = []
    for prefix, by_index in siblings.items():
        shapes = list(by_index.values())
        if len(by_index) < 2 or any(s != shapes[0] for s in shapes):
            continue
        computed = [_computed_by(gm, f"{prefix}.{i}") for i in sorted(by_index)[:2]]
        if computed[0] and computed[1] and not _reaches(computed[0], computed[1]):
            found.append(ExpertLoop(prefix=prefix, count=len(by_index),
                                    params=tuple(names[prefix]), node=computed[0][0]))  # fmt: skip
    return found


def _computed_by(gm: fx.GraphModule, path: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and (module_path(n) == path or module_path(n).startswith(path + "."))]  # fmt: skip


def _reaches(sources: list[fx.Node], targets: list[fx.Node]) -> bool:
    seen, todo, goal = set(), list(sources), set(targets)
    while todo:
        n = todo.pop()
        if n in goal:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return False
