"""Pickling of per-rank programs without re-tracing them.

fx's default pickling re-runs ``forward`` under symbolic tracing, which would execute a
collective on a buffer it does not proxy.  A :class:`RankModule` pickles its graph node by node
instead.

Algorithm:
1. Record every node as (op, name, target reference, args, kwargs) with node references
   replaced by names; targets are operator overloads by qualified name, higher-order ops by
   name, Python functions by reference (pickled by module and qualified name).
2. For every operator outside torch's own namespaces (a custom op such as
   ``transformers::grouped_mm_fallback``), record what registers it: the module of the
   ``torch.library.custom_op`` function, else the Python file named by the dispatcher's
   registration record, else the namespace itself when it is an importable package; plus
   torch's loaded C++ operator libraries.
3. Record parameters (with ``requires_grad``), buffers and nested graph submodules (at any
   depth, each holding its own parameters) by dotted name; the call signature by its pytree in/out specs.
4. Loading (in another process, too) first imports the recorded modules and libraries, then
   rebuilds the graph in order, re-resolves targets, and re-creates the module.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree

from autopar.runtime.guards import GuardedCodeGen


class RankModule(_LazyGraphModule):
    """A per-rank program: an fx.GraphModule that pickles without re-tracing.  Its Python code
    is generated when first called or read (``.code``): planning builds rank programs only
    to count them (the search prices sub-mesh rank 0's), so most are never run."""

    def __reduce__(self) -> tuple:
        return (load_module, (dump_module(self),))

    def _lazy_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The first call: generate the code, then run it as ``forward`` (fx's own lazy
        forward calls the module again, so its hooks, FSDP2's gather and reshard, would run
        twice)."""
        self.real_recompile()
        return self.forward(*args, **kwargs)


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
    subs = {k: dump_module(m) for k, m in _graph_submodules(gm)}
    inside = tuple(f"{k}." for k in subs)
    params = {
        k: (v.detach(), v.requires_grad) for k, v in gm.named_parameters(remove_duplicate=False)
        if not k.startswith(inside)
    }
    buffers = {k: v for k, v in gm.named_buffers() if not k.startswith(inside)}
    codegen = gm.graph._codegen
    specs = None
    if isinstance(codegen, _PyTreeCodeGen):
        info = codegen.pytree_info
        specs = (list(info.orig_args), info.in_spec, info.out_spec)
    expected = getattr(codegen, "expected", ())
    return {"nodes": nodes, "params": params, "buffers": buffers, "subs": subs, "specs": specs,
            "expected": expected, "name": type(gm).__name__, "meta": dict(getattr(gm, "meta", {})),
            "providers": op_providers(gm)}  # fmt: skip


_TORCH_NAMESPACES = frozenset({"aten", "prims", "higher_order"})


def op_providers(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Step 2: the modules (by name) and C++ libraries (by path) that register the custom
    operators of ``gm``, and which op needs which module."""
    custom = {n.target for n in gm.graph.nodes if n.op == "call_function"
              and isinstance(n.target, torch._ops.OpOverload)
              and n.target.namespace not in _TORCH_NAMESPACES}  # fmt: skip
    modules = {op._schema.name: m for op in custom if (m := _registering_module(op))}
    return {"modules": sorted(set(modules.values())), "ops": sorted(modules.items()),
            "libraries": sorted(torch.ops.loaded_libraries) if custom else []}  # fmt: skip


def _registering_module(op: torch._ops.OpOverload) -> str | None:
    from torch._library.custom_ops import OPDEFS

    qualname = op._schema.name
    if qualname in OPDEFS:
        return OPDEFS[qualname]._init_fn.__module__
    path = _registration_file(qualname)
    torch_dir = Path(torch.__file__).parent
    if path is not None and path.suffix == ".py" and torch_dir not in path.parents:
        for name, mod in list(sys.modules.items()):
            if getattr(mod, "__file__", None) and Path(mod.__file__).resolve() == path:
                return name
    ns = op.namespace
    return ns if not ns.startswith("_") and importlib.util.find_spec(ns) else None


def _registration_file(qualname: str) -> Path | None:
    """The source file of the operator's schema registration, from the dispatcher's record."""
    try:
        dump = torch._C._dispatch_dump(qualname)
    except RuntimeError:
        return None
    found = re.search(r"^debug: registered at (.+):\d+$", dump, re.MULTILINE)
    return Path(found.group(1)).resolve() if found and Path(found.group(1)).is_file() else None


def _load_providers(providers: dict[str, list[str]]) -> None:
    for path in providers["libraries"]:
        if path not in torch.ops.loaded_libraries:
            torch.ops.load_library(path)
    for name in providers["modules"]:
        importlib.import_module(name)


def load_module(state: dict[str, Any]) -> RankModule:
    """Step 3: rebuild the module described by :func:`dump_module`."""
    _load_providers(state["providers"])
    root = nn.Module()
    for name, sub in state["subs"].items():  # nested (outlined blocks) first: they own params
        owner_module(root, name).add_module(name.rsplit(".", 1)[-1], load_module(sub))
    for fqn, (t, grad) in state["params"].items():
        owner_module(root, fqn).register_parameter(
            fqn.rsplit(".", 1)[-1], nn.Parameter(t, requires_grad=grad)
        )
    for fqn, t in state["buffers"].items():
        owner_module(root, fqn).register_buffer(fqn.rsplit(".", 1)[-1], t)
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs in state["nodes"]:
        args, kwargs = pytree.tree_map(
            lambda a: env[a.name] if isinstance(a, _Ref) else a, (args, kwargs)
        )
        target = _resolve(op, target, dict(state["providers"]["ops"]))
        node = graph.create_node(op, target, tuple(args), dict(kwargs), name=name)
        env[name] = node
    if state["specs"] is not None:
        graph._codegen = GuardedCodeGen(_PyTreeInfo(*state["specs"]), state["expected"])
    module = RankModule(root, graph, class_name=state["name"])
    module.meta = state["meta"]
    return module


def _graph_submodules(gm: fx.GraphModule) -> list[tuple[str, fx.GraphModule]]:
    """The outermost graph submodules of ``gm`` at any depth (``layers.0`` of an outlined
    program, a higher-order op's body), each with its dotted name."""
    found: list[tuple[str, fx.GraphModule]] = []
    for name, m in gm.named_modules():
        if name and isinstance(m, fx.GraphModule) and not any(
            name.startswith(f"{k}.") for k, _ in found
        ):
            found.append((name, m))
    return found


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
    return ("py", target)


def _resolve(op: str, ref: Any, providers: dict[str, str]) -> Any:
    if op != "call_function":
        return ref
    kind = ref[0]
    if kind == "aten_op":
        _, ns, name, overload = ref
        try:
            return getattr(getattr(getattr(torch.ops, ns), name), overload)
        except (AttributeError, RuntimeError) as exc:
            raise RuntimeError(_unregistered(f"{ns}::{name}", providers)) from exc
    if kind == "hop":
        return getattr(torch.ops.higher_order, ref[1])
    return ref[1]


def _unregistered(qualname: str, providers: dict[str, str]) -> str:
    module = providers.get(qualname)
    where = (f"its registering module {module!r} was imported but did not register it"
             if module else "no module registering it could be found when the program was saved")
    if module in ("__main__", "__mp_main__"):
        where = "it is registered by your script or notebook (__main__), which workers do not run"
    return (f"custom operator {qualname} is not registered in this process: {where}. Register "
            "the operator at import time of a module file (not in your script's __main__ or a "
            "notebook cell), and import that module from the code that defines your model.")
