"""Per-rank programs: fx.GraphModules holding only one rank's parameter shards, and their source.

Codegen is two steps with the rank-independent passes between them (:func:`materialize`, the
passes of a batch axis such as ``passes.expert_parallel``, then :func:`shard` per rank);
:func:`build_module` is the two steps back to back.

Algorithm:
1. Materialize (rank-independent): copy the lowered graph; each parameter / buffer
   placeholder becomes a ``get_attr`` of its original dotted name holding the whole tensor
   (the traced one, not copied), so ``module.named_parameters()`` reads like the user's model.
2. Copy attributes the graph reads (higher-order-op submodules, constants).
3. Ops that torch.export recorded with the tracing device (``arange(..., device=cpu)``)
   read the device from the first tensor input (else the first parameter) at run time, as
   the user's code reads ``input_ids.device``: the program runs where its inputs and
   parameters are (``module.to("cuda")``).  A parameter would tie the node to one block.
4. Call signature and return structure follow the user's model (pytree in/out specs).
5. Shard (per rank): copy the materialized module and slice every parameter and buffer to
   this rank's shard of its ``get_attr``'s layout (mesh coordinates of the rank; blocked
   dims take the rank's slice of every block; expert weights ``S(0)`` over ``ep``).  A
   ``stack`` of per-parameter ``get_attr``s whose layout splits dim 0 keeps this rank's
   members and drops the others (per-expert parameters stacked at run time).  Meta tensors
   stay meta.
6. The printed source carries a header (plan hash, rank, mesh coordinates) and each node's
   local shape and layout.
"""

from __future__ import annotations

import copy
import operator
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.graph import _PyTreeInfo
from torch.utils import _pytree as pytree

from autopar.frontend.trace import Traced
from autopar.ir import meta
from autopar.ir.layout import Layout
from autopar.mesh import Mesh
from autopar.runtime.guards import GuardedCodeGen
from autopar.runtime.serialize import RankModule, owner_module


def shard_tensor(
    t: torch.Tensor, layout: Layout, mesh: Mesh, coords: dict[str, int]
) -> torch.Tensor:
    """This rank's shard of ``t`` under ``layout`` (step 2; a shared split: piece r // rep)."""
    for dim, axes in enumerate(layout.dims):
        for axis in axes:
            rep = layout.rep(axis)
            n, blocks = mesh.size(axis) // rep, layout.blocks[dim]
            moved = t.movedim(dim, 0)
            size = moved.shape[0]
            piece = coords[axis] // rep
            part = moved.reshape(blocks, n, size // (blocks * n), *moved.shape[1:])[:, piece]
            t = part.reshape(size // n, *moved.shape[1:]).movedim(0, dim)
    return t.contiguous()


def unshard_tensors(shards: list[torch.Tensor], layout: Layout, mesh: Mesh,
                    coords: list[dict[str, int]]) -> torch.Tensor:  # fmt: skip
    """Reassemble a full tensor from every rank's shard (inverse of :func:`shard_tensor`)."""
    out = shards[0]
    for dim, axes in enumerate(layout.dims):
        for axis in axes:
            rep = layout.rep(axis)
            n, blocks = mesh.size(axis) // rep, layout.blocks[dim]
            parts = [next(s for s, c in zip(shards, coords, strict=True) if c[axis] == i * rep)
                     for i in range(n)]  # fmt: skip
            moved = [p.movedim(dim, 0) for p in parts]
            local = moved[0].shape[0]
            stacked = torch.stack(
                [m.reshape(blocks, local // blocks, *m.shape[1:]) for m in moved], 1
            )
            out = stacked.reshape(local * n, *moved[0].shape[1:]).movedim(0, dim)
    return out


def build_module(gm: fx.GraphModule, traced: Traced, mesh: Mesh, rank: int) -> fx.GraphModule:
    """The rank's GraphModule: :func:`materialize` then :func:`shard` (steps 1-5)."""
    return shard(materialize(gm, traced), traced, mesh, rank)


def ready(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with the Python code of it and of every graph module inside it generated
    (they are lazy: made on first call); what a caller that reads ``forward`` itself (a
    wrapper replacing it, ``torch.compile`` of the method) must have.  Returns ``module``."""
    for m in module.modules():
        if isinstance(m, _LazyGraphModule):
            m.real_recompile()
    return module


def materialize(gm: fx.GraphModule, traced: Traced) -> fx.GraphModule:
    """Steps 1-4: the rank-independent program of lowered graph ``gm``, whole parameters
    read by ``get_attr`` of their dotted names."""
    graph = copy.deepcopy(gm.graph)
    root = nn.Module()
    names = {**traced.params, **traced.buffers}
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.name in names:
            fqn = names[node.name]
            _assign(root, fqn, traced.tensors[fqn].detach(), param=node.name in traced.params,
                    trainable=fqn in traced.trainable)  # fmt: skip
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
    graph._codegen = GuardedCodeGen(_PyTreeInfo(user, traced.in_spec, traced.out_spec))
    out = RankModule(root, graph, class_name=f"{traced.model_name}Program")
    for name, sub in out.named_modules():
        if name and isinstance(sub, fx.GraphModule):  # higher-order ops' bodies (autocast...)
            _device_from_module(sub.graph)
            sub.recompile()
    return out


def copy_program(module: fx.GraphModule) -> fx.GraphModule:
    """A materialized program whose graph a pass may rewrite: ``module``'s graph copied, its
    tensors and submodules shared."""
    return RankModule(module, copy.deepcopy(module.graph), class_name=type(module).__name__)


def shard(module: fx.GraphModule, traced: Traced, mesh: Mesh, rank: int) -> fx.GraphModule:
    """Step 5: a copy of materialized ``module`` holding ``rank``'s shards only (a block a
    pass outlined, ``layers.0``, holds its own)."""
    coords = mesh.coordinates(rank)
    graph, root = _shard_graph(module, "", traced, _Cut(mesh, coords, _tensor_names(traced)))
    out = RankModule(root, graph, class_name=type(module).__name__)  # attributes in graph order
    out.meta = {**module.meta, "rank": rank, "coords": coords,
                "shards": shard_specs(out, traced, mesh),
                "pieces": {name: (p.fqn, p.dim, p.start, tuple(traced.tensors[p.fqn].shape),
                                  p.groups, p.stop)
                           for name, p in traced.pieces.items()}}  # fmt: skip
    return out


@dataclass(frozen=True)
class _Cut:
    """What slices one rank's parameters: the mesh, the rank's coordinates, the FQNs of the
    traced parameters and buffers."""

    mesh: Mesh
    coords: dict[str, int]
    names: frozenset[str]


def _shard_graph(module: fx.GraphModule, prefix: str, traced: Traced,
                 cut: _Cut) -> tuple[fx.Graph, nn.Module]:  # fmt: skip
    """Step 5 on one graph module (the program, or a block under ``prefix``): its graph
    copied and the attributes it reads, parameters sliced."""
    graph = copy.deepcopy(module.graph)
    _keep_stacked_members(graph, cut.mesh, cut.coords)
    root, params = nn.Module(), set(traced.params.values())
    for node in [n for n in graph.nodes if n.op in ("get_attr", "call_module")]:
        fqn, value = prefix + node.target, _attr(module, node.target)
        if fqn in cut.names:
            lay = meta.layout(node) or Layout.replicate(value.dim())
            local = shard_tensor(value.detach(), lay, cut.mesh, cut.coords).clone()
            _assign(root, node.target, local, param=fqn in params,
                    trainable=fqn in traced.trainable)  # fmt: skip
        elif isinstance(value, fx.GraphModule) and _reads_tensors(value, f"{fqn}.", cut.names):
            sub, sub_root = _shard_graph(value, f"{fqn}.", traced, cut)
            block = RankModule(sub_root, sub, class_name=type(value).__name__)
            owner_module(root, node.target).add_module(node.target.rsplit(".", 1)[-1], block)
        else:
            _copy_attr(module, root, node.target)
    return graph, root


def _tensor_names(traced: Traced) -> frozenset[str]:
    """The FQNs of the traced parameters and buffers."""
    return frozenset((*traced.params.values(), *traced.buffers.values()))


def _reads_tensors(module: fx.GraphModule, prefix: str, names: frozenset[str]) -> bool:
    """Whether ``module`` (a block) reads traced parameters or buffers."""
    return next(_param_reads(module, prefix, names), None) is not None


def _param_reads(module: fx.GraphModule, prefix: str,
                 names: frozenset[str]) -> Iterator[tuple[str, fx.Node]]:  # fmt: skip
    """(FQN, get_attr node) of each parameter and buffer ``module`` reads, in graph order,
    those of the blocks it calls included."""
    for node in module.graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        fqn, value = prefix + node.target, _attr(module, node.target)
        if fqn in names:
            yield fqn, node
        elif isinstance(value, fx.GraphModule):
            yield from _param_reads(value, f"{fqn}.", names)


def _keep_stacked_members(graph: fx.Graph, mesh: Mesh, coords: dict[str, int]) -> None:
    """Step 5: a ``stack`` of ``get_attr``s split on dim 0 keeps this rank's members; the
    others leave the graph (and so the rank's module)."""
    for node in list(graph.nodes):
        lay = meta.layout(node)
        if not (_op_name(node) == "stack" and isinstance(lay, Layout) and lay.dims[0]):
            continue
        members, dim = list(node.args[0]), node.args[1] if len(node.args) > 1 else 0
        if dim != 0 or any(m.op != "get_attr" for m in members):
            continue  # not a list of parameters along dim 0
        dim0 = Layout(dims=lay.dims[:1], blocks=lay.blocks[:1], shared=lay.shared)
        kept = shard_tensor(torch.arange(len(members)), dim0, mesh, coords).tolist()
        node.update_arg(0, [members[i] for i in kept])
        for i, member in enumerate(members):
            if i not in kept:
                graph.erase_node(member)


def _op_name(node: fx.Node) -> str:
    if node.op != "call_function":
        return ""
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def shard_specs(module: fx.GraphModule, traced: Traced, mesh: Mesh) -> dict[str, tuple]:
    """Per parameter (and persistent buffer) FQN: (global shape before vocab padding, padded
    shape, layout, axis sizes)
    -- what :mod:`autopar.runtime.checkpoints` needs to describe a local shard as part of the whole."""
    out, params = {}, set(traced.params.values()) | set(traced.persistent)
    for fqn, node in _param_reads(module, "", _tensor_names(traced)):
        if fqn in params:
            full = tuple(traced.tensors[fqn].shape)
            lay = meta.layout(node) or Layout.replicate(len(full))
            shape = (traced.padded[fqn], *full[1:]) if fqn in traced.padded else full
            out[fqn] = (shape, full, lay, dict(mesh.sizes))
    return out


def _assign(root: nn.Module, target: str, value: torch.Tensor, param: bool,
            trainable: bool) -> None:  # fmt: skip
    mod, leaf = owner_module(root, target), target.rsplit(".", 1)[-1]
    if param:
        mod.register_parameter(leaf, nn.Parameter(value, requires_grad=trainable))
    else:
        mod.register_buffer(leaf, value)


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
    """The device a rank program runs on: that of its first tensor input (or parameter)."""
    return t.device


def _device_from_module(graph: fx.Graph) -> None:
    """Step 4: constant devices in arguments (``arange(device=cpu)``, ``to.device(x, cpu)``)
    become ``device_of(first tensor input)`` (or of the first parameter without one)."""
    users = [n for n in graph.nodes if any(isinstance(a, torch.device) for a in _flat_args(n))]
    if not users:
        return
    source = next((n for n in graph.nodes if n.op == "placeholder" and _is_tensor(n)), None)
    source = source or next((n for n in graph.nodes if n.op == "get_attr" and _is_tensor(n)),
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
    notes = {n.name: n.meta["note"] for n in module.graph.nodes if n.meta.get("note")}
    lines = []
    for line in text.splitlines():
        m = _ASSIGN.match(line)
        lay = layouts.get(m.group(2)) if m else None
        if lay is not None and "#" not in line:
            shown = ", ".join(map(str, lay)) if isinstance(lay, tuple) else str(lay)
            line = f"{line}  # {shown}"
        if m and m.group(2) in notes:  # a node's own note (a point-to-point op's peers, bytes)
            line = f"{line}  # {notes[m.group(2)]}"
        lines.append(line)
    return header + "\n".join(lines) + "\n"


# ---------------------------------------------------------------- per-block submodules


def outline_blocks(gm: fx.GraphModule) -> fx.GraphModule | None:
    """A copy of rank program ``gm`` whose repeated blocks (``layers.0``, ``layers.1``, ...)
    are each one ``call_module`` of a submodule holding that block's parameters under their
    original names, so engines that act on module calls (FSDP2's hooks) act per block.  The
    parameters are shared with ``gm``.  None when no block is a contiguous run of nodes that
    alone reads its parameters.

    Algorithm:
    0. Ops on parameters alone (a replicated weight's gradient all-reduce, a cast) are laid
       out just before their first user: passes may place them at the program's top, where
       they would stretch their block's segment over the blocks before it.
    1. The block container is the indexed module path (``layers``) holding the most
       parameters' blocks; a parameter or buffer belongs to the block its name starts with.
    2. A node belongs to block ``i`` when it reads the block's parameters or its
       ``nn_module_stack`` (when the graph still has it) passes through ``<container>.i``; the
       block's segment is the run of nodes from its first to its last node in graph order
       (collectives that passes inserted inside it included).
    3. Segments must not overlap (no node in two) and a block's parameters must be read only
       inside its segment.
    4. Each segment becomes a GraphModule: placeholders for the values it reads from outside,
       ``get_attr`` of its own parameters (names relative to the block), outputs for the values
       used after it; the program calls it in the segment's place.
    """
    nodes = _at_first_use(list(gm.graph.nodes))
    container = _block_container(nodes)
    if container is None:
        return None
    owner = {n: _owning_block(n, container) for n in nodes}
    segments = _segments(nodes, owner)
    if segments is None:
        return None
    return _rebuild(gm, nodes, owner, container, segments)


def _at_first_use(nodes: list[fx.Node]) -> list[fx.Node]:
    """Step 0: ``nodes`` (in graph order) with each op on parameters alone moved to just
    before its first user; the order stays topological (last such op moved first)."""
    pure: set[fx.Node] = set()
    for n in nodes:
        if n.op == "call_function" and n.all_input_nodes and all(
            a.op == "get_attr" or a in pure for a in n.all_input_nodes
        ):
            pure.add(n)
    order = list(nodes)
    for n in reversed([n for n in nodes if n in pure and n.users]):
        order.remove(n)
        pos = {m: i for i, m in enumerate(order)}
        order.insert(min(pos[u] for u in n.users), n)
    return order


def _param_block(target: str) -> tuple[str, int] | None:
    """(container, index) of the outermost indexed module in a dotted name."""
    parts = target.split(".")
    for i in range(len(parts) - 1):
        if parts[i].isdigit():
            return ".".join(parts[:i]), int(parts[i])
    return None


def _block_container(nodes: list[fx.Node]) -> str | None:
    """Step 1."""
    found: dict[str, set[int]] = {}
    for n in nodes:
        if n.op == "get_attr" and (cb := _param_block(n.target)) is not None:
            found.setdefault(cb[0], set()).add(cb[1])
    return max(found, key=lambda c: (len(found[c]), -len(c))) if found else None


def _owning_block(n: fx.Node, container: str) -> int | None:
    """Step 2: the block index ``n`` belongs to (None outside every block)."""
    if n.op == "get_attr":
        cb = _param_block(n.target)
        return cb[1] if cb is not None and cb[0] == container else None
    if n.op != "call_function":
        return None
    readers = {_owning_block(a, container) for a in n.all_input_nodes if a.op == "get_attr"}
    readers.discard(None)
    if len(readers) == 1:
        return readers.pop()
    # a container at the root (an nn.Sequential model) is the path's first name, after the
    # "model." that tracing with a loss function can leave on nodes it split
    where = rf"(?:^|\.){re.escape(container)}\." if container else r"^(?:model\.)?"
    for path, _ in (n.meta.get("nn_module_stack") or {}).values():
        m = re.search(rf"{where}(\d+)(?:\.|$)", meta.clean_path(path))
        if m:
            return int(m.group(1))
    return None


def _segments(nodes: list[fx.Node], owner: dict[fx.Node, int | None],
              ) -> dict[int, list[fx.Node]] | None:  # fmt: skip
    """Steps 2-3: block -> its contiguous run of compute nodes, or None if not separable."""
    pos = {n: i for i, n in enumerate(nodes)}
    span: dict[int, list[int]] = {}
    for n, b in owner.items():
        if b is not None and n.op == "call_function":
            span.setdefault(b, []).append(pos[n])
    segments = {b: nodes[min(p): max(p) + 1] for b, p in span.items()}
    inside: dict[fx.Node, int] = {}
    for b, seg in segments.items():
        for n in seg:
            if inside.setdefault(n, b) != b:
                return None  # segments overlap (one block's run holds another's)
    for n, b in inside.items():
        if n.op != "call_function" or owner[n] not in (None, b):
            return None  # blocks interleave
    for n, b in owner.items():
        if n.op == "get_attr" and b is not None:
            if b not in segments or any(inside.get(u) != b for u in n.users):
                return None  # a block's parameter read outside its block
    held = {b for n, b in owner.items() if n.op == "get_attr" and b is not None}
    return {b: seg for b, seg in segments.items() if b in held}  # nothing to shard otherwise


def _rebuild(gm: fx.GraphModule, nodes: list[fx.Node], owner: dict[fx.Node, int | None],
             container: str, segments: dict[int, list[fx.Node]]) -> fx.GraphModule:  # fmt: skip
    """Step 4."""
    top = fx.Graph()
    top._codegen = copy.copy(gm.graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    root: dict[str, object] = {}
    starts = {seg[0]: b for b, seg in segments.items()}
    moved = {n for n in nodes if n.op == "get_attr" and owner[n] is not None}
    skip = moved | {n for seg in segments.values() for n in seg}
    for n in nodes:
        if n in starts:
            b = starts[n]
            name = f"{container}.{b}" if container else str(b)
            sub, inputs, outputs = _outline(gm, segments[b], moved, name)
            root[name] = sub
            call = top.call_module(name, tuple(env[a] for a in inputs))
            call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
            for i, o in enumerate(outputs):
                env[o] = top.call_function(operator.getitem, (call, i))
                env[o].meta.update(o.meta)
        if n in skip:
            continue
        if n.op == "get_attr":
            root[n.target] = _attr(gm, n.target)
        env[n] = top.node_copy(n, lambda a: env[a])
    out = RankModule(root, top, class_name=type(gm).__name__)
    out.meta = dict(getattr(gm, "meta", {}))
    return out


def _outline(gm: fx.GraphModule, seg: list[fx.Node], moved: set[fx.Node],
             name: str) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node]]:  # fmt: skip
    """One block's GraphModule, the outer values it reads, and the values it returns."""
    graph, inputs, outputs = segment_graph(seg, moved, name)
    block = gm.get_submodule(name)
    sub = RankModule(block, graph, class_name=f"Block{name.rsplit('.', 1)[-1]}")
    return sub, inputs, outputs


def segment_graph(seg: list[fx.Node], moved: set[fx.Node] = frozenset(), prefix: str = "",
                  ) -> tuple[fx.Graph, list[fx.Node], list[fx.Node]]:  # fmt: skip
    """A graph computing the run of nodes ``seg`` on its own: a placeholder per outer value it
    reads (in first-read order), a ``get_attr`` (its target less ``prefix.``) per node of
    ``moved`` it reads, an output tuple of its values used after it.  Returns the graph, the
    outer values (the placeholders' arguments) and the returned values."""
    members = set(seg)
    inputs: list[fx.Node] = []
    params: list[fx.Node] = []
    for n in seg:
        for a in n.all_input_nodes:
            if a in members:
                continue
            bucket = params if a in moved else inputs
            if a not in bucket:
                bucket.append(a)
    outputs = [n for n in seg if any(u not in members for u in n.users)]
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta.update(a.meta)
    for p in params:
        env[p] = graph.get_attr(_relative(p.target, prefix))
        env[p].meta.update(p.meta)
    for n in seg:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs))
    return graph, inputs, outputs


def _relative(target: str, prefix: str) -> str:
    """``target`` less its ``prefix.`` (``target`` itself without a prefix)."""
    if not prefix:
        return target
    if not target.startswith(f"{prefix}."):
        raise ValueError(f"segment_graph: {target!r} is read inside {prefix!r} but is not "
                         f"under it; a block's segment may read only its own parameters")  # fmt: skip
    return target[len(prefix) + 1:]


def _attr(gm: fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
