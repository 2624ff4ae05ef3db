"""Pickling of per-rank programs without re-tracing them.

fx's default pickling re-runs ``forward`` under symbolic tracing, which would execute a
collective on a buffer it does not proxy.  A :class:`RankModule` pickles its graph node by node
instead.

Algorithm:
1. Record every node as (op, name, target reference, args, kwargs) with node references
   replaced by names; targets are ATen overloads by qualified name, higher-order ops by name,
   Python functions by module and name.
2. Record parameters (with ``requires_grad``), buffers and nested graph submodules by dotted
   name; the call signature by its pytree in/out specs.
3. Loading rebuilds the graph in order, re-resolves targets, and re-creates the module.
"""

from __future__ import annotations

import importlib
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree


class RankModule(fx.GraphModule):
    """A per-rank program: an fx.GraphModule that pickles without re-tracing."""

    def __reduce__(self) -> tuple:
        return (load_module, (dump_module(self),))


class _Ref:
    """A reference to another node, by name (survives pickling)."""

    def __init__(self, name: str) -> None:
        self.name = name


def dump_module(gm: fx.GraphModule) -> dict[str, Any]:
    """Steps 1-2: a picklable description of ``gm``."""
    nodes = []
    for n in gm.graph.nodes:
        args, kwargs = pytree.tree_map(
            lambda a: _Ref(a.name) if isinstance(a, fx.Node) else a, (n.args, n.kwargs)
        )
        nodes.append((n.op, n.name, _target_ref(n.op, n.target), args, kwargs))
    params = {
        k: (v.detach(), v.requires_grad) for k, v in gm.named_parameters(remove_duplicate=False)
    }
    buffers = {k: v for k, v in gm.named_buffers()}
    subs = {k: dump_module(m) for k, m in gm.named_children() if isinstance(m, fx.GraphModule)}
    codegen = gm.graph._codegen
    specs = None
    if isinstance(codegen, _PyTreeCodeGen):
        info = codegen.pytree_info
        specs = (list(info.orig_args), info.in_spec, info.out_spec)
    return {"nodes": nodes, "params": params, "buffers": buffers, "subs": subs, "specs": specs,
            "name": type(gm).__name__, "meta": dict(getattr(gm, "meta", {}))}  # fmt: skip


def load_module(state: dict[str, Any]) -> RankModule:
    """Step 3: rebuild the module described by :func:`dump_module`."""
    root = nn.Module()
    for fqn, (t, grad) in state["params"].items():
        owner_module(root, fqn).register_parameter(
            fqn.rsplit(".", 1)[-1], nn.Parameter(t, requires_grad=grad)
        )
    for fqn, t in state["buffers"].items():
        owner_module(root, fqn).register_buffer(fqn.rsplit(".", 1)[-1], t)
    for name, sub in state["subs"].items():
        root.add_module(name, load_module(sub))
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs in state["nodes"]:
        args, kwargs = pytree.tree_map(
            lambda a: env[a.name] if isinstance(a, _Ref) else a, (args, kwargs)
        )
        node = graph.create_node(op, _resolve(op, target), tuple(args), dict(kwargs), name=name)
        env[name] = node
    if state["specs"] is not None:
        graph._codegen = _PyTreeCodeGen(_PyTreeInfo(*state["specs"]))
    module = RankModule(root, graph, class_name=state["name"])
    module.meta = state["meta"]
    return module


def owner_module(root: nn.Module, fqn: str) -> nn.Module:
    """The module that holds dotted name ``fqn`` under ``root``, created on the way if missing."""
    mod = root
    for part in fqn.split(".")[:-1]:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    return mod


def _target_ref(op: str, target: Any) -> Any:
    if op not in ("call_function",):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return ("aten_op", target.namespace, target._opname, target._overloadname)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return ("hop", target.__name__)
    if target is operator.getitem:
        return ("py", "operator", "getitem")
    return ("py", target.__module__, target.__name__)


def _resolve(op: str, ref: Any) -> Any:
    if op != "call_function":
        return ref
    kind = ref[0]
    if kind == "aten_op":
        _, ns, name, overload = ref
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    if kind == "hop":
        return getattr(torch.ops.higher_order, ref[1])
    return getattr(importlib.import_module(ref[1]), ref[2])
