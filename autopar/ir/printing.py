"""Compact, deterministic text form of a graph: one line per node with local shape and layout.

This is what golden tests compare and what pass histories keep: no file paths, no memory
addresses, ops by short name (``aten.linear``, ``all_reduce``).  A pass history keeps a
:class:`GraphSnapshot` and prints it only when read: taking one records per node what its
line shows (cheap references: rewrites replace a node's args, target, ``val`` and frozen
record, and never mutate them) and each node's name then (``lower_collectives`` renames
nodes), and printing a 6,000-node graph costs ~25 ms, five times per compile, for text a
compile never shows.

:func:`copy_module` is the one way a rewrite takes its own copy of a graph module: a deep copy
of the graph in a lazy GraphModule, whose Python code is generated when first needed (its
``forward`` is called or ``.code`` read) rather than at every ``recompile()``.  Generating the
code of a 2000-node graph costs ~50 ms, and the rewrites between trace and program recompile
half a dozen times a code nothing reads until the per-rank programs are built.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from autopar.ir import meta


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A lazy GraphModule over a deep copy of ``gm``'s graph (submodules shared with ``gm``)."""
    return _LazyGraphModule(gm, copy.deepcopy(gm.graph))


def lazy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` itself when lazy, else a lazy GraphModule over the same graph."""
    return _LazyGraphModule.from_graphmodule(gm)


def format_graph(gm: fx.GraphModule | fx.Graph) -> str:
    return GraphSnapshot.of(gm).text()


# what one node's line shows: op, name, target, args, kwargs, meta["val"], meta[meta.KEY]
_Row = tuple[str, str, Any, tuple, dict, Any, Any]


@dataclass(frozen=True, eq=False)
class GraphSnapshot:
    """A graph's printed form as of when it was taken, printed on demand (:meth:`text`);
    compared by identity (its rows hold tensors)."""

    rows: tuple[_Row, ...]
    names: dict[fx.Node, str]  # each node's name when taken (args print by these)

    @staticmethod
    def of(gm: fx.GraphModule | fx.Graph) -> GraphSnapshot:
        graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
        nodes = list(graph.nodes)
        rows = tuple((n.op, n.name, n.target, n.args, n.kwargs, n.meta.get("val"),
                      n.meta.get(meta.KEY)) for n in nodes)  # fmt: skip
        return GraphSnapshot(rows=rows, names={n: n.name for n in nodes})

    def text(self) -> str:
        return "\n".join(self._line(row) for row in self.rows) + "\n"

    def _line(self, row: _Row) -> str:
        op, name, target, args, kwargs, val, info = row
        if op == "output":
            return f"return {self._fmt(args[0])}"
        lay = info.layout if info is not None else None
        tail = (
            f"  # {', '.join(map(str, lay)) if isinstance(lay, tuple) else lay}"
            if lay is not None
            else ""
        )
        typed = f"{name}: {_type(val)}"
        if op == "placeholder":
            return f"{typed}{tail}"
        if op == "get_attr":
            return f"{typed} = self.{target}{tail}"
        printed = ", ".join(
            [self._fmt(a) for a in args] + [f"{k}={self._fmt(v)}" for k, v in kwargs.items()]
        )
        return f"{typed} = {op_name(target)}({printed}){tail}"

    def _fmt(self, a: object) -> str:
        if isinstance(a, fx.Node):
            return self.names.get(a, a.name)
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self._fmt(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        return _fmt(a)


def op_name(target: object) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
           torch.int64: "i64", torch.bool: "b8", torch.int32: "i32"}  # fmt: skip


def _type(val: object) -> str:
    if isinstance(val, torch.Tensor):
        dtype = _DTYPES.get(val.dtype) or str(val.dtype)
        return f"{dtype}[{','.join(map(str, val.shape))}]"
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(_type(v) for v in val) + ")"
    return type(val).__name__ if val is not None else "?"


def _fmt(a: object) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return str(a).replace("torch.", "")
    return repr(a)
