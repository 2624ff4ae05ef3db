"""Per-rank programs: fx.GraphModules holding only one rank's parameter shards, and their source.

Algorithm:
1. Copy the lowered graph; each parameter / buffer placeholder becomes a ``get_attr`` of its
   original dotted name, so ``module.named_parameters()`` reads like the user's model.
2. Slice every parameter and buffer to this rank's shard of its layout (mesh coordinates of
   the rank; blocked dims take the rank's slice of every block).  Meta tensors stay meta.
3. Copy attributes the graph reads (higher-order-op submodules, constants).
4. Ops that torch.export recorded with the tracing device (``arange(..., device=cpu)``)
   read the device from the module's first parameter (or first tensor input) at run time, so
   ``module.to("cuda")`` moves the whole program, as it moves the user's model.
5. Call signature and return structure follow the user's model (pytree in/out specs).
6. The printed source carries a header (plan hash, rank, mesh coordinates) and each node's
   local shape and layout.
"""

from __future__ import annotations

import copy
import re

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo
from torch.utils import _pytree as pytree

from autopar import meta
from autopar.layout import Layout
from autopar.mesh import Mesh
from autopar.serialize import RankModule, owner_module
from autopar.trace import Traced


def shard_tensor(
    t: torch.Tensor, layout: Layout, mesh: Mesh, coords: dict[str, int]
) -> torch.Tensor:
    """This rank's shard of ``t`` under ``layout`` (step 2)."""
    for dim, axes in enumerate(layout.dims):
        for axis in axes:
            n, blocks = mesh.size(axis), layout.blocks[dim]
            moved = t.movedim(dim, 0)
            size = moved.shape[0]
            part = moved.reshape(blocks, n, size // (blocks * n), *moved.shape[1:])[:, coords[axis]]
            t = part.reshape(size // n, *moved.shape[1:]).movedim(0, dim)
    return t.contiguous()


def unshard_tensors(shards: list[torch.Tensor], layout: Layout, mesh: Mesh,
                    coords: list[dict[str, int]]) -> torch.Tensor:  # fmt: skip
    """Reassemble a full tensor from every rank's shard (inverse of :func:`shard_tensor`)."""
    out = shards[0]
    for dim, axes in enumerate(layout.dims):
        for axis in axes:
            n, blocks = mesh.size(axis), layout.blocks[dim]
            parts = [next(s for s, c in zip(shards, coords, strict=True) if c[axis] == i)
                     for i in range(n)]  # fmt: skip
            moved = [p.movedim(dim, 0) for p in parts]
            local = moved[0].shape[0]
            stacked = torch.stack(
                [m.reshape(blocks, local // blocks, *m.shape[1:]) for m in moved], 1
            )
            out = stacked.reshape(local * n, *moved[0].shape[1:]).movedim(0, dim)
    return out


def build_module(gm: fx.GraphModule, traced: Traced, mesh: Mesh, rank: int) -> fx.GraphModule:
    """The rank's GraphModule: local parameter shards plus a copy of the program (steps 1-4)."""
    coords = mesh.coordinates(rank)
    graph = copy.deepcopy(gm.graph)
    root = nn.Module()
    names = {**traced.params, **traced.buffers}
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.name in names:
            fqn = names[node.name]
            lay = meta.layout(node) or Layout.replicate(traced.tensors[fqn].dim())
            local = shard_tensor(traced.tensors[fqn].detach(), lay, mesh, coords)
            _assign(root, fqn, local, param=node.name in traced.params, traced=traced)
            with graph.inserting_before(node):
                attr = graph.get_attr(fqn)
            attr.meta.update(node.meta)
            node.replace_all_uses_with(attr)
            graph.erase_node(node)
        elif node.op == "get_attr":
            _copy_attr(gm, root, node.target)
    _move_attrs_first(graph)
    _device_from_module(graph)
    user = [n.name for n in graph.nodes if n.op == "placeholder"]
    graph._codegen = _PyTreeCodeGen(_PyTreeInfo(user, traced.in_spec, traced.out_spec))
    out = RankModule(root, graph, class_name=f"{traced.model_name}Program")
    for name, sub in out.named_modules():
        if name and isinstance(sub, fx.GraphModule):  # higher-order ops' bodies (autocast...)
            _device_from_module(sub.graph)
            sub.recompile()
    out.meta = {"rank": rank, "coords": coords, "shards": shard_specs(graph, traced, mesh)}
    return out


def shard_specs(graph: fx.Graph, traced: Traced, mesh: Mesh) -> dict[str, tuple]:
    """Per parameter FQN: (global shape before vocab padding, padded shape, layout, axis sizes)
    -- what :mod:`autopar.checkpoint` needs to describe a local shard as part of the whole."""
    out, params = {}, set(traced.params.values())
    for node in graph.nodes:
        if node.op == "get_attr" and node.target in params:
            fqn, full = node.target, tuple(traced.tensors[node.target].shape)
            lay = meta.layout(node) or Layout.replicate(len(full))
            shape = (traced.padded[fqn], *full[1:]) if fqn in traced.padded else full
            out[fqn] = (shape, full, lay, dict(mesh.sizes))
    return out


def _assign(root: nn.Module, fqn: str, value: torch.Tensor, param: bool, traced: Traced) -> None:
    mod, leaf = owner_module(root, fqn), fqn.rsplit(".", 1)[-1]
    if param:
        mod.register_parameter(
            leaf, nn.Parameter(value.clone(), requires_grad=fqn in traced.trainable)
        )
    else:
        mod.register_buffer(leaf, value.clone())


def _copy_attr(src: nn.Module, dst: nn.Module, target: str) -> None:
    obj = src
    for part in target.split("."):
        obj = getattr(obj, part)
    mod, leaf = owner_module(dst, target), target.rsplit(".", 1)[-1]
    if isinstance(obj, nn.Module):
        mod.add_module(leaf, copy.deepcopy(obj))
    else:
        setattr(mod, leaf, obj)


def _move_attrs_first(graph: fx.Graph) -> None:
    """Parameter reads go right after the placeholders, in a stable order."""
    anchor = next((n for n in graph.nodes if n.op != "placeholder"), None)
    for node in [n for n in graph.nodes if n.op == "get_attr"]:
        if anchor is not None and node is not anchor:
            anchor.prepend(node)


def device_of(t: torch.Tensor) -> torch.device:
    """The device a rank program runs on: that of its first parameter (or input)."""
    return t.device


def _device_from_module(graph: fx.Graph) -> None:
    """Step 4: constant devices in arguments (``arange(device=cpu)``, ``to.device(x, cpu)``)
    become ``device_of(first parameter)`` (in a nested body, of its first tensor input)."""
    users = [n for n in graph.nodes if any(isinstance(a, torch.device) for a in _flat_args(n))]
    if not users:
        return
    source = next((n for n in graph.nodes if n.op == "get_attr" and _is_tensor(n)), None)
    source = source or next((n for n in graph.nodes if n.op == "placeholder" and _is_tensor(n)),
                            None)  # fmt: skip
    if source is None:
        return
    with graph.inserting_after(source):
        device = graph.call_function(device_of, (source,))
    for node in users:
        node.args, node.kwargs = pytree.tree_map(
            lambda a: device if isinstance(a, torch.device) else a, (node.args, node.kwargs)
        )


def _flat_args(node: fx.Node) -> list:
    return pytree.tree_leaves((node.args, node.kwargs))


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


_ASSIGN = re.compile(r"^(\s+)(\w+)(: \"[^\"]*\")? = ")


def render(module: fx.GraphModule, header: str) -> str:
    """Readable source of a rank's program: header, then each line with its layout."""
    text = module.print_readable(print_output=False, include_stride=False, include_device=False)
    layouts = {n.name: meta.layout(n) for n in module.graph.nodes}
    lines = []
    for line in text.splitlines():
        m = _ASSIGN.match(line)
        lay = layouts.get(m.group(2)) if m else None
        if lay is not None and "#" not in line:
            shown = ", ".join(map(str, lay)) if isinstance(lay, tuple) else str(lay)
            line = f"{line}  # {shown}"
        lines.append(line)
    return header + "\n".join(lines) + "\n"
