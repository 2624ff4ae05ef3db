"""pipeline_split: cut the traced graph into stage sub-graphs and their boundary tensors.

Algorithm:
1. Cuttable units: the prologue (nodes before the first repeated block), each repeated block
   (``layers.0``, ``layers.1``, ...; contiguous in execution order) and the epilogue.  A cut
   can only fall between units -- never inside attention.
2. Stage s holds the nodes between its cuts.  Its inputs are the values live across the cut
   before it (for stage 0: the model inputs); its outputs the values live across the cut after
   it, so a value needed two stages later passes through the stage between (residual streams,
   masks built from the inputs, the loss target).  A value computed from buffers and
   constants alone, off the gradient path (:func:`recomputable`: RoPE cos/sin tables from
   ``arange`` and ``inv_freq``, a constant causal mask), is never sent: each stage that reads
   it recomputes it (as Megatron's stages do).  Parameters go to every stage that reads them
   (a tied weight to two).  The last stage returns the scalar loss.
3. Each stage becomes a stand-alone graph with lifted parameters, ready for the tensor-parallel
   planner and passes.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils import _pytree as pytree

from autopar.frontend.trace import Traced, is_tensor
from autopar.ir.analysis import find_blocks


@dataclass(frozen=True, kw_only=True)
class Unit:
    """A run of consecutive call nodes that a stage cut may not split."""

    name: str  # 'prologue', 'layers.3', 'epilogue'
    nodes: tuple[fx.Node, ...]


def cuttable_units(traced: Traced) -> list[Unit]:
    """Step 1: prologue, each repeated block, epilogue."""
    body = [n for n in traced.gm.graph.nodes if n.op == "call_function"]
    blocks = find_blocks(list(traced.gm.graph.nodes), traced)
    owner = {n: i for i, block in enumerate(blocks) for n in block}
    last = max((i for i, n in enumerate(body) if n in owner), default=-1)
    names = [_block_name(block, i) for i, block in enumerate(blocks)]  # once per block
    units: list[tuple[str, list[fx.Node]]] = []
    for i, n in enumerate(body):
        if n in owner:
            label = names[owner[n]]
        elif not units or (units[-1][0] == "prologue"):
            label = "prologue"
        elif i > last:
            label = "epilogue"
        else:
            label = units[-1][0]  # glue between blocks stays with the block before it
        if units and units[-1][0] == label:
            units[-1][1].append(n)
        else:
            units.append((label, [n]))
    return [Unit(name=name, nodes=tuple(nodes)) for name, nodes in units]


def _block_name(block: list[fx.Node], i: int) -> str:
    from autopar.ir.meta import module_path

    paths = [module_path(n) for n in block if n.op == "call_function" and module_path(n)]
    return min(paths, key=len) if paths else f"block.{i}"


@dataclass(frozen=True, kw_only=True)
class StageGraph:
    """One stage (or the loss tail) as a stand-alone traced graph."""

    index: int
    traced: Traced
    inputs: tuple[str, ...]  # names (in the full graph) of values received
    outputs: tuple[str, ...]  # names of values sent on
    units: tuple[str, ...]


def split_stages(traced: Traced, units: Sequence[Unit], cuts: Sequence[int],
                 loss: fx.Node) -> list[StageGraph]:  # fmt: skip
    """Steps 2-3: one StageGraph per stage; ``cuts`` are the unit indices where stages start.
    Boundary inputs that depend on a weight carry a gradient back to the stage before."""
    from autopar.ir.analysis import needs_grad

    grad = frozenset(n.name for n in needs_grad(traced))
    free = recomputable(traced, grad)
    bounds = [0, *cuts, len(units)]
    groups = [
        [n for u in units[a:b] for n in u.nodes] for a, b in zip(bounds, bounds[1:], strict=False)
    ]
    stage_of = {n: i for i, g in enumerate(groups) for n in g}
    live_in = [
        n for n in traced.gm.graph.nodes if n.op == "placeholder" and n.name in traced.user_inputs
    ]
    stages = []
    for i, nodes in enumerate(groups):
        if i == len(groups) - 1:
            outs = [loss]
        else:
            later = {a for g in groups[i + 1 :] for n in g for a in n.all_input_nodes}
            outs = [n for n in _ordered(set(nodes) | set(live_in), traced)
                    if n in later and stage_of.get(n, -1) <= i and n not in free]  # fmt: skip
        names = [u.name for u in units[bounds[i] : bounds[i + 1]]]
        stages.append(_stage_graph(i, traced, nodes, live_in, outs, names, grad, free))
        live_in = outs
    return stages


def recomputable(traced: Traced, grad: frozenset[str]) -> frozenset[fx.Node]:
    """Step 2: call nodes computed from buffers, constants and each other alone, off the
    gradient path: what a stage can recompute instead of receiving."""
    lifted = set(traced.buffers)
    free: set[fx.Node] = set()
    for n in traced.gm.graph.nodes:
        if n.op != "call_function" or n.name in grad:
            continue
        sources = n.all_input_nodes
        if all(a in free or a.op == "get_attr" or (a.op == "placeholder" and a.name in lifted)
               for a in sources):  # fmt: skip
            free.add(n)
    return frozenset(free)


def _order(traced: Traced):
    index = {n: i for i, n in enumerate(traced.gm.graph.nodes)}
    return lambda n: index[n]


def _ordered(nodes: set[fx.Node], traced: Traced) -> list[fx.Node]:
    return sorted(nodes, key=_order(traced))


def _stage_graph(index: int, traced: Traced, nodes: list[fx.Node], ins: list[fx.Node],
                 outs: list[fx.Node], units: list[str], grad: frozenset[str],
                 free: frozenset[fx.Node] = frozenset()) -> StageGraph:  # fmt: skip
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    lifted = {**traced.params, **traced.buffers}
    for n in ins:
        env[n] = _placeholder(graph, n)

    def copy_in(n: fx.Node) -> None:
        for a in n.all_input_nodes:
            if a not in env and a.op == "placeholder" and a.name in lifted:
                env[a] = _placeholder(graph, a)
            elif a not in env and a.op == "get_attr":
                env[a] = graph.node_copy(a)
            elif a not in env and a in free:  # made by an earlier stage: recomputed here
                copy_in(a)
        env[n] = graph.node_copy(n, lambda a: env[a])

    for n in nodes:
        copy_in(n)
    graph.output(tuple(_contiguous(graph, env[n]) for n in outs))
    gm = _LazyGraphModule(traced.gm, graph)
    names = {n.name for n in graph.nodes if n.op == "placeholder"}
    user = tuple(n.name for n in ins)
    in_spec = pytree.tree_flatten((tuple(range(len(ins))), {}))[1]
    out_spec = pytree.tree_flatten(tuple(range(len(outs))))[1]
    stage = Traced(
        gm=gm,
        params={k: v for k, v in traced.params.items() if k in names},
        buffers={k: v for k, v in traced.buffers.items() if k in names},
        user_inputs=user,
        tensors=traced.tensors,
        trainable=traced.trainable,
        in_spec=in_spec,
        out_spec=out_spec,
        model_name=f"{traced.model_name}Stage{index}",
        grad_inputs=frozenset(n.name for n in ins) & grad,
    )
    return StageGraph(index=index, traced=stage, inputs=user,
                      outputs=tuple(n.name for n in outs), units=tuple(units))  # fmt: skip


def _contiguous(graph: fx.Graph, n: fx.Node) -> fx.Node:
    """Values are sent between stages as dense buffers (expanded views are not)."""
    if not is_tensor(n) or n.op == "placeholder":
        return n
    out = graph.call_function(torch.ops.aten.contiguous.default, (n,))
    out.meta = copy.copy(n.meta)
    return out


def _placeholder(graph: fx.Graph, n: fx.Node) -> fx.Node:
    ph = graph.placeholder(n.name)
    ph.meta = copy.copy(n.meta)
    ph.meta.pop("autopar", None)
    return ph


def boundary_dtype(dtype: torch.dtype, shape: Sequence[int], grad: bool,
                   param_dtype: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype a boundary value crosses the pipeline axis in: under mixed precision
    (``param_dtype`` narrower than the value's floating dtype) an activation that carries a
    gradient is sent in ``param_dtype`` (its gradient comes back in it too); scalars, integer
    values and side inputs without a gradient (masks, position tables) keep their dtype."""
    narrower = dtype.is_floating_point and param_dtype.itemsize < dtype.itemsize
    return param_dtype if narrower and grad and len(shape) > 0 else dtype


def boundary_bytes(traced: Traced, units: Sequence[Unit], *,
                   grad: frozenset[str] = frozenset(),
                   param_dtype: torch.dtype = torch.float32) -> list[float]:  # fmt: skip
    """Bytes of the values live across the boundary before each unit (index 0: model inputs),
    each in its :func:`boundary_dtype` (``grad``: names of the values that carry a gradient)."""
    unit_of = {n: i for i, u in enumerate(units) for n in u.nodes}
    later = len(units)  # the graph output reads after every unit
    free = recomputable(traced, grad)  # recomputed by each stage, never sent
    uses: dict[fx.Node, int] = {}
    for n in traced.gm.graph.nodes:
        at = unit_of.get(n, later)
        for a in n.all_input_nodes:
            if is_tensor(a) and a not in free and (a in unit_of or a.name in traced.user_inputs):
                uses[a] = max(uses.get(a, -1), at)

    def nbytes(a: fx.Node) -> float:
        v = a.meta["val"]
        dtype = boundary_dtype(v.dtype, v.shape, a.name in grad, param_dtype)
        return float(v.numel() * dtype.itemsize)

    out = []
    for cut in range(len(units) + 1):
        live = [a for a, last in uses.items() if unit_of.get(a, -1) < cut <= last]
        out.append(float(sum(nbytes(a) for a in live)))
    return out
