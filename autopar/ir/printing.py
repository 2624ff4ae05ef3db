"""Compact, deterministic text form of a graph: one line per node with local shape and layout.

This is what golden tests compare and what pass histories keep: no file paths, no memory
addresses, ops by short name (``aten.linear``, ``all_reduce``).

:func:`copy_module` is the one way a rewrite takes its own copy of a graph module: a deep copy
of the graph in a lazy GraphModule, whose Python code is generated when first needed (its
``forward`` is called or ``.code`` read) rather than at every ``recompile()``.  Generating the
code of a 2000-node graph costs ~50 ms, and the rewrites between trace and program recompile
half a dozen times a code nothing reads until the per-rank programs are built.
"""

from __future__ import annotations

import copy

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
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    return "\n".join(_line(n) for n in graph.nodes) + "\n"


def _line(node: fx.Node) -> str:
    if node.op == "output":
        return f"return {_fmt(node.args[0])}"
    lay = meta.layout(node)
    tail = (
        f"  # {', '.join(map(str, lay)) if isinstance(lay, tuple) else lay}"
        if lay is not None
        else ""
    )
    typed = f"{node.name}: {_type(node.meta.get('val'))}"
    if node.op == "placeholder":
        return f"{typed}{tail}"
    if node.op == "get_attr":
        return f"{typed} = self.{node.target}{tail}"
    args = ", ".join(
        [_fmt(a) for a in node.args] + [f"{k}={_fmt(v)}" for k, v in node.kwargs.items()]
    )
    return f"{typed} = {op_name(node.target)}({args}){tail}"


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
