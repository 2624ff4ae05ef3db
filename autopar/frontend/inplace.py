"""In-place writes through views become dataflow.

torch.export's training IR keeps in-place ops.  After ``x[:, :1] = y`` (``copy_`` into
``slice(x, 1, 0, 1)``) later readers still read the node ``x``: the write reaches them only
through shared storage, which no graph edge shows.  A planner that places ``x`` split and
its slice replicated reads the slice through a gather (a fresh tensor): the write lands there
and every reader of ``x`` misses it (a wrong answer, silently).  Here every such write
becomes a functional update of its storage's base tensor, the way torch's functionalisation
does it, so that every layout decision afterwards sees it as an ordinary value.

An *alias group* is a base tensor (a value no view op made) and the views of it (read off op
schemas, and confirmed by the traced values sharing storage).  Each group has a current value
and a version; each view remembers its path of view ops from the base and the version it was
made at.

Algorithm:
1. Walk the graph in order.  Every argument that is a value of a group written since it was
   made is read afresh: the group's current value, with the argument's path of view ops
   replayed on it (one replay per (view, version), shared by later readers).
2. A write into the base itself (``out.add_(y)``: the trace already reads ``out`` off the
   write) stays: the write becomes the group's current value.
3. A write into a view runs out of place on the view (``copy_`` -> its source, ``index_put_``
   -> ``index_put``, ``fill_`` -> ``fill``, ...) and the new view value is scattered back up
   its path: ``slice`` -> ``slice_scatter``, ``select`` / ``unbind`` -> ``select_scatter``,
   ``split`` / ``chunk`` pieces -> ``slice_scatter``, reshapes -> a reshape back, transposes
   and permutes -> their inverse.  The result is the group's new current value; a base that
   is a graph input (a buffer) gets it written back with ``copy_`` there, as in eager.
   An op that writes arguments other than its ``self`` (batch norm's running statistics)
   stays, while it writes bases.
4. A write that cannot be expressed so (through ``expand`` or ``unfold``, an op without an
   out-of-place twin, a write into a view by an op that writes more than its ``self``) raises :class:`~autopar.errors.TraceError` naming the
   op and the user's source line.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.errors import TraceError
from autopar.ir.meta import source

aten = torch.ops.aten
_RESHAPES = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                       aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
                       aten.squeeze.default, aten.flatten.using_ints, aten.unflatten.int})  # fmt: skip
_SAME = frozenset({aten.alias.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
                   aten.contiguous.default, aten.detach.default, aten.type_as.default})  # fmt: skip
_SCATTERS = {aten.slice.Tensor: aten.slice_scatter.default,
             aten.select.int: aten.select_scatter.default,
             aten.diagonal.default: aten.diagonal_scatter.default,
             aten.as_strided.default: aten.as_strided_scatter.default}  # fmt: skip
_PIECES = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                     aten.unbind.int})  # fmt: skip


def functionalize_view_writes(graph: fx.Graph) -> None:
    """Steps 1-4, in place; a graph without writes through views is left as it is."""
    views = _views(graph)
    _require_known_aliases(graph, views)
    groups = _Groups(graph, views)
    for node in list(graph.nodes):
        groups.refresh(node)
        written = _self_write(node)
        if written is not None:
            groups.write(node, written)
        elif _written(node):
            groups.write_elsewhere(node)
        else:
            groups.track(node)
    _erase_unread_views(graph, groups.dropped, views)


@dataclass
class _Groups:
    """The alias groups of one walk (step 1): current values, versions and view paths."""

    graph: fx.Graph
    views: set[fx.Node]  # the traced views (their first argument is the value they view)
    base: dict[fx.Node, fx.Node] = field(default_factory=dict)  # value -> its group's key
    path: dict[fx.Node, tuple[fx.Node, ...]] = field(default_factory=dict)
    made: dict[fx.Node, int] = field(default_factory=dict)  # value -> version it was made at
    current: dict[fx.Node, fx.Node] = field(default_factory=dict)
    version: dict[fx.Node, int] = field(default_factory=dict)
    replays: dict[tuple[fx.Node, int], fx.Node] = field(default_factory=dict)
    dropped: set[fx.Node] = field(default_factory=set)  # values no longer read where they were

    def _key(self, x: fx.Node) -> fx.Node:
        return self.base.get(x, x)

    def _stale(self, x: fx.Node) -> bool:
        return self.made.get(x, 0) < self.version.get(self._key(x), 0)

    def refresh(self, node: fx.Node) -> None:
        """Step 1: ``node`` reads every argument as it is now."""
        stale = [a for a in node.all_input_nodes if self._stale(a)]
        if stale:
            self.dropped.update(stale)
            with self.graph.inserting_before(node):
                node.args, node.kwargs = fx.node.map_arg(
                    (node.args, node.kwargs), lambda a: self._fresh(a) if self._stale(a) else a
                )

    def _fresh(self, x: fx.Node) -> fx.Node:
        key = self._key(x)
        value, version = self.current[key], self.version[key]
        for i, view in enumerate(self.path.get(x, ())):
            if (view, version) not in self.replays:
                args = (value, *view.args[1:])
                made = _call(self.graph, view.target, args, dict(view.kwargs), view)
                self._register(made, key, self.path[x][: i + 1], version)
                self.replays[(view, version)] = made
            value = self.replays[(view, version)]
        return value

    def _register(self, node: fx.Node, key: fx.Node, path: tuple, version: int) -> None:
        self.base[node], self.path[node], self.made[node] = key, path, version

    def track(self, node: fx.Node) -> None:
        """A view joins the group of the value it views, at the group's version."""
        if node not in self.views:
            return
        src = node.args[0]
        key = self._key(src)
        self._register(node, key, (*self.path.get(src, ()), node), self.version.get(key, 0))

    def write(self, node: fx.Node, target: fx.Node) -> None:
        """Steps 2-3: the written group's new current value."""
        key = self._key(target)
        path = self.path.get(target, ())
        if not path:
            self._advance(key, node)
            return
        with self.graph.inserting_before(node):
            value = _new_value(self.graph, node)
            value = self._scatter_up(key, path, value, node)
            if key.op == "placeholder":
                value = _call(self.graph, aten.copy_.default, (self.current.get(key, key), value),
                              {}, node)  # fmt: skip
        node.replace_all_uses_with(target)
        self.graph.erase_node(node)
        self.dropped.add(target)
        self._advance(key, value)

    def write_elsewhere(self, node: fx.Node) -> None:
        """An op that writes other arguments (batch norm's running statistics): left as it
        is while they are bases; step 4 for a view."""
        for target in _written(node):
            if self.path.get(target):
                raise _unsupported(node, f"it writes into a view ({source(target)})")
            self._advance(self._key(target), target)

    def _scatter_up(self, key: fx.Node, path: tuple, value: fx.Node, at: fx.Node) -> fx.Node:
        """Step 3: write the view's new value into each value up the path to the base."""
        steps = [v for v in path if v.target not in _PIECES]  # a piece is read off its getitem
        for view in reversed(steps):
            up = path.index(view) - (2 if view.target is operator.getitem else 1)
            parent = path[up] if up >= 0 else self.current.get(key, key)
            value = _unview(self.graph, view, parent, value, at)
        return value

    def _advance(self, key: fx.Node, value: fx.Node) -> None:
        self.version[key] = self.version.get(key, 0) + 1
        self.current[key] = value
        self._register(value, key, (), self.version[key])


def _erase_unread_views(graph: fx.Graph, dropped: set[fx.Node], views: set[fx.Node]) -> None:
    """Views that step 1 left unread (read afresh instead), and the views only they read."""
    todo, gone = list(dropped), set()
    while todo:
        node = todo.pop()
        if node in views and not node.users and node not in gone:
            todo += node.all_input_nodes
            gone.add(node)
            graph.erase_node(node)


def _views(graph: fx.Graph) -> set[fx.Node]:
    """The traced views: ops whose schema says their output aliases their first argument and
    whose traced value shares that argument's storage (a ``reshape`` that had to copy is no
    view); a piece of a split shares the storage of the tensor split."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.target is operator.getitem and node.args[0] in found:
            src = node.args[0].args[0]
        elif _aliasing(node):
            src = node.args[0]
        else:
            continue
        if node.target in _PIECES or _storage(node) == _storage(src) is not None:
            found.add(node)
    return found


def _require_known_aliases(graph: fx.Graph, views: set[fx.Node]) -> None:
    """Step 4 for storage written in place and shared with a value that is neither its base,
    a view step 3 can write back into, nor an in-place op's result."""
    by_storage: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        sid = _storage(node)
        if sid is not None and node.op != "output":
            by_storage.setdefault(sid, []).append(node)
    for node in graph.nodes:
        for target in _written(node):
            sharing = by_storage.get(_storage(target), [])
            odd = [n for n in sharing[1:] if n not in views and not _written(n) and _may_alias(n)]
            if odd:
                why = f"it writes storage that {odd[0].target} ({source(odd[0])}) also reads"
                raise _unsupported(node, why)


def _may_alias(node: fx.Node) -> bool:
    """Whether ``node``'s value may be a view: an op whose schema does not promise a fresh
    tensor (a value sharing storage with one that does is an artifact of how the trace
    split ``linear`` + bias)."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and (
        node.target is operator.getitem or schema is None or _aliasing(node)
    )


def _aliasing(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not node.args or schema.is_mutable:
        return False
    return isinstance(node.args[0], fx.Node) and any(
        r.alias_info is not None for r in schema.returns
    )


def _storage(node: fx.Node) -> int | None:
    val = node.meta.get("val")
    return StorageWeakRef(val.untyped_storage()).cdata if isinstance(val, torch.Tensor) else None


def _written(node: fx.Node) -> list[fx.Node]:
    """The values an op writes in place (read off its schema)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.is_mutable:
        return []
    names = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
    bound = dict(zip((a.name for a in schema.arguments), node.args, strict=False)) | node.kwargs
    return [bound[n] for n in names if isinstance(bound.get(n), fx.Node)]


def _self_write(node: fx.Node) -> fx.Node | None:
    """The value an in-place op writes when it writes only its ``self`` (``copy_``, ``add_``)."""
    written = _written(node)
    return written[0] if written and written == list(node.args[:1]) else None


def _new_value(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """The value in-place ``node`` leaves in its ``self`` (step 3); ``copy_``'s is its source
    cast and broadcast to ``self`` (``aten.copy`` has no derivative)."""
    if node.target is not aten.copy_.default:
        return _call(graph, _out_of_place(node), node.args, dict(node.kwargs), node)
    dst, value = node.args[0].meta["val"], node.args[1]
    if value.meta["val"].dtype != dst.dtype:
        value = _call(graph, aten._to_copy.default, (value,), {"dtype": dst.dtype}, node)
    if value.meta["val"].shape != dst.shape:
        value = _call(graph, aten.expand.default, (value, list(dst.shape)), {}, node)
    return value


def _out_of_place(node: fx.Node) -> object:
    """The functional twin of an in-place op (``copy_`` -> ``copy``), or step 4."""
    name, overload = node.target._opname, node.target._overloadname
    packet = getattr(aten, name[:-1], None) if name.endswith("_") else None
    twin = getattr(packet, overload, None) if packet is not None else None
    if twin is None:
        raise _unsupported(node, f"{node.target} has no out-of-place twin")
    return twin


def _unview(
    graph: fx.Graph, view: fx.Node, parent: fx.Node, value: fx.Node, at: fx.Node
) -> fx.Node:
    """``parent`` with ``value`` written where ``view`` reads it (step 3)."""
    target, rest = view.target, view.args[1:]
    if target in _SCATTERS:
        return _call(graph, _SCATTERS[target], (parent, value, *rest), dict(view.kwargs), at)
    if target in _RESHAPES:
        return _call(graph, aten.reshape.default, (value, list(parent.meta["val"].shape)), {}, at)
    if target in _SAME and view.meta["val"].dtype == parent.meta["val"].dtype:
        return value
    if target is aten.transpose.int:
        return _call(graph, target, (value, *rest), {}, at)
    if target is aten.t.default:
        return _call(graph, target, (value,), {}, at)
    if target is aten.permute.default:
        nd = len(rest[0])
        order = sorted(range(nd), key=lambda i: rest[0][i] % nd)
        return _call(graph, target, (value, order), {}, at)
    if target is operator.getitem:
        return _unpiece(graph, view, parent, value, at)
    raise _unsupported(at, f"it writes through a view made by {target} ({source(view)})")


def _unpiece(
    graph: fx.Graph, item: fx.Node, parent: fx.Node, value: fx.Node, at: fx.Node
) -> fx.Node:
    """Write piece ``i`` of a split / chunk / unbind back into the tensor it was cut from."""
    pieces, i = item.args
    nd = parent.meta["val"].dim()
    pos = 1 if pieces.target is aten.unbind.int else 2
    dim = pieces.args[pos] if len(pieces.args) > pos else pieces.kwargs.get("dim", 0)
    dim %= nd
    if pieces.target is aten.unbind.int:
        return _call(graph, aten.select_scatter.default, (parent, value, dim, i), {}, at)
    sizes = [v.shape[dim] for v in pieces.meta["val"]]
    start = sum(sizes[:i])
    args = (parent, value, dim, start, start + sizes[i])
    return _call(graph, aten.slice_scatter.default, args, {}, at)


def _call(graph: fx.Graph, target: object, args: tuple, kwargs: dict, like: fx.Node) -> fx.Node:
    """A new node computing ``target``, its traced value from the fake values of its inputs,
    and ``like``'s source line and module path."""
    node = graph.call_function(target, args, kwargs)
    vals = fx.node.map_arg((args, kwargs), lambda a: a.meta["val"])
    mode = detect_fake_mode(list(torch.utils._pytree.tree_leaves(vals)))
    with mode if mode is not None else torch.no_grad():
        node.meta["val"] = target(*vals[0], **vals[1])
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def _unsupported(node: fx.Node, why: str) -> TraceError:
    return TraceError(
        f"in-place write {node.target} at {source(node)}: {why}; autopar cannot turn it into "
        "a functional update. Write the value out of place (torch.cat, torch.where, "
        "Tensor.index_put) instead."
    )
