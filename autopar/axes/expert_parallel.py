"""The expert axis: MoE layers found in the traced graph, experts placed across ``ep`` ranks.

ep ranks are data-parallel for the dense part of the model (each runs the program of the mesh
without ep on its slice of the batch) and model-parallel for the experts (each holds E/ep of
every MoE layer's stacked expert weights).  Tokens travel to their experts and back with
all-to-alls; the rest of the routing (router, top-k, grouping by expert, weighted combine)
runs on each rank's own tokens, exactly as on one device.

Algorithm (:func:`compile_expert_parallel`):
1. The driver splits the global batch over ep (dim 0 of every input, as for dp) and traces
   the slice once; the sub-mesh program (tp, pp, or nothing) is compiled from that trace.
2. Recognise each MoE layer structurally in the sub-mesh graph (:func:`find_moe_layers`): the
   grouped matmuls (``aten._grouped_mm``, ``transformers::grouped_mm_fallback``) sharing one
   offsets tensor (the cumulative rows per expert of the router's top-k, grouped by expert),
   each reading a stacked [E, ...] parameter; the experts' region is every op between the
   first grouped matmul's rows and the last one's output, which must be row-wise (each row
   computed alone by its expert).  A layout outside that is reported with its node and source
   line, its experts stay replicated (an error under ``strict=True``).
3. The rewrite is two passes on each stage's materialized program (:func:`ep_phase`, the
   program's first phase; autopar.codegen.materialize): ``expert_parallel``
   (passes/expert_parallel.py: dispatch / combine all-to-alls around each MoE region, the
   expert weights laid out ``S(0)`` over ep, the dense gradients summed over ep in buckets,
   the loss made global) reads this module's :class:`EpDecisions`; ``global_batch``
   (passes/global_batch.py) makes the statistics over the batch that feed a non-linear loss
   term (the model's own load-balancing loss) global; then the ``recompute`` pass in the
   program's mode.  Codegen's shard step gives each rank its E/ep experts like any other
   split: nothing is edited after codegen.
4. Price the expert axis's collectives on the link its groups ride (the cluster's NVLink when
   ep fits inside a node with the axes inside it, else the fabric; alpha-beta, cost.comm):
   per MoE layer the count exchange, dispatch and combine, and their backward.
5. ``capacity_factor`` c caps each expert at ceil(c * tokens * top_k / E) rows over the global
   batch: the rows of lower ep ranks first, each rank's in its grouped order; a dropped row's
   expert output is zero.  Dropped rows are counted, and each rank's experts' load is kept per
   forward (:func:`expert_load`: rows per expert, dropped rows, max/mean imbalance).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from autopar.axes.batch_stats import BatchDecisions, boundaries, statistic_collectives
from autopar.axes.data_parallel import _graph, _model_name, loss_reduction
from autopar.codegen import _param_block
from autopar.errors import InputError, NodeProblem, ShardingRuleError
from autopar.frontend.moe_loop import find_expert_loops
from autopar.ir import meta
from autopar.mesh import Mesh
from autopar.ops import collectives as C
from autopar.plan import Collective, EpSection
from autopar.program import Materialized, Phase, Program
from cost.comm import collective_time
from passes import PassContext, PassRecord, batch_pipeline

_ROWWISE = {"silu", "gelu", "relu", "sigmoid", "tanh", "mul", "add", "sub", "div", "neg",
            "exp", "pow", "square", "clamp", "chunk", "split", "split_with_sizes", "to",
            "_to_copy", "clone", "contiguous", "alias", "detach", "getitem", "minimum",
            "maximum", "where", "relu_", "mul_", "add_", "slice"}  # fmt: skip
_DIM_OPS = {"chunk": 2, "split": 2, "split_with_sizes": 2, "slice": 1}  # op -> index of its dim argument
BUCKET_BYTES = 25 * 2**20  # dense gradients per ep all-reduce at most (DDP's default bucket cap)
_TP_COLLECTIVES = {"grad_all_reduce", "all_reduce", "all_gather", "reduce_scatter", "split"}
_DIMMED = {"all_gather", "reduce_scatter", "split"}  # collectives with a dim (argument 2)
_WEIGHT_VIEWS = {"transpose", "permute", "to", "_to_copy", "alias", "contiguous", "clone",
                 "detach", "view", "reshape"}  # fmt: skip


def _grouped_ops() -> tuple[Any, ...]:
    ops = [torch.ops.aten._grouped_mm.default]
    try:
        import transformers.integrations.moe  # noqa: F401 - registers the fallback op

        ops.append(torch.ops.transformers.grouped_mm_fallback.default)
    except (ImportError, AttributeError):
        pass
    return tuple(ops)


@dataclass(frozen=True, kw_only=True)
class MoELayer:
    """One recognised MoE layer of a rank's graph (node names and parameter names)."""

    entry: str  # rows grouped by expert, the first grouped matmul's input
    exit: str  # the last grouped matmul's output
    offs: str  # cumulative rows per expert
    matmuls: tuple[str, ...]
    region: tuple[str, ...]  # every node the experts compute, in graph order
    weights: tuple[str, ...]  # stacked expert parameters ([E, ...])
    experts: int
    biases: tuple[str, ...] = ()  # per-row gathers param[expert id] of an [E, ...] parameter
    stacks: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (stack node, its per-expert params)
    where: str  # module path

    def __str__(self) -> str:
        members = {m for _, ms in self.stacks for m in ms}
        names = [w for w in self.weights if w not in members]
        names += [f"stack({ms[0]} .. {ms[-1]})" for _, ms in self.stacks]
        return (f"{self.where}: {self.experts} experts, {len(self.matmuls)} grouped matmuls "
                f"over {', '.join(names)}")  # fmt: skip


Unrecognised = NodeProblem  # grouped matmuls the recogniser could not turn into an MoE layer


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _offs_of(node: fx.Node) -> Any:
    return node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)


def find_moe_layers(gm: fx.GraphModule) -> tuple[list[MoELayer], list[Unrecognised]]:
    """Step 2: the MoE layers of ``gm`` and the grouped matmuls that are not one."""
    ops = _grouped_ops()
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ops:
            offs = _offs_of(node)
            if not isinstance(offs, fx.Node):
                continue  # a batched grouped matmul (no offsets): not a token grouping
            groups.setdefault(offs, []).append(node)
    layers, bad = [], []
    for offs, mms in groups.items():
        found = _layer(gm, offs, mms)
        (layers if isinstance(found, MoELayer) else bad).append(found)
    return layers, bad


def _layer(gm: fx.GraphModule, offs: fx.Node, mms: list[fx.Node]) -> MoELayer | Unrecognised:
    entry, exit_ = mms[0].args[0], mms[-1]
    weights, stacks = [], []
    for mm in mms:
        w, stack = _weight(gm, mm.args[1]), _stacked_weight(gm, mm.args[1])
        if w is None and stack is None:
            return _why(mm, "its weight operand is not a stacked parameter (a get_attr, or a "
                            "stack of per-expert get_attrs, through transposes/views with the "
                            "experts on dim 0)")  # fmt: skip
        if stack is not None:
            stacks.append(stack)
            weights += stack[1]
            continue
        weights.append(w)
    experts = offs.meta["val"].shape[0]
    for name, members in stacks:
        if len(members) != experts:
            return _why(mms[0], f"'{name}' stacks {len(members)} per-expert parameters but the "
                                f"offsets count {experts} experts")  # fmt: skip
    for w in (w for w in weights if not any(w in m for _, m in stacks)):
        if gm.get_parameter(w).shape[0] != experts:
            return _why(mms[0], f"parameter {w} has {gm.get_parameter(w).shape[0]} rows on dim 0 "
                                f"but the offsets count {experts} experts")  # fmt: skip
    region = _region(entry, exit_)
    cut = [m for m in mms if m not in region]
    if cut:
        return _why(cut[0], f"its rows do not reach the experts' last grouped matmul "
                            f"'{exit_.name}' (the layer is cut, e.g. by a pipeline stage "
                            "boundary)")  # fmt: skip
    order = [n for n in gm.graph.nodes if n in region]
    biases = _expert_biases(gm, region, offs, experts)
    for b in biases:
        stack = _stacked_weight(gm, b.args[0])
        if stack is not None:  # stacked from per-expert biases (autopar.frontend.moe_loop)
            stacks.append(stack)
            weights += stack[1]
        else:
            weights.append(b.args[0].target)
    for node in order:
        problem = _not_rowwise(node, region, {entry, offs, *biases}, mms)
        if problem:
            return _why(node, problem)
    return MoELayer(entry=entry.name, exit=exit_.name, offs=offs.name,
                    matmuls=tuple(m.name for m in mms), region=tuple(n.name for n in order),
                    weights=tuple(dict.fromkeys(weights)), experts=experts,
                    biases=tuple(b.name for b in biases), stacks=tuple(dict.fromkeys(stacks)),
                    where=meta.module_path(mms[0]))  # fmt: skip


def _why(node: fx.Node, why: str) -> Unrecognised:
    return Unrecognised(node=node.name, why=why, source=meta.source(node))


def _weight(gm: fx.GraphModule, node: Any) -> str | None:
    node = _under_views(node)
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        return None
    try:
        gm.get_parameter(node.target)
    except AttributeError:
        return None
    return node.target


def _stacked_weight(gm: fx.GraphModule, node: Any) -> tuple[str, tuple[str, ...]] | None:
    """A weight stacked in the graph from per-expert parameters (``autopar.frontend.moe_loop``):
    ``stack([p_0, ..., p_E-1], 0)`` of get_attrs, through views keeping dim 0: the stack
    node and the parameters, in expert order."""
    node = _under_views(node)
    if not isinstance(node, fx.Node) or _name(node) != "stack" or (node.args[1] if len(node.args) > 1 else 0) != 0:
        return None
    members = node.args[0]
    if not all(isinstance(m, fx.Node) and m.op == "get_attr" and _trainable_or_param(gm, m)
               and len(m.users) == 1 for m in members):  # fmt: skip
        return None
    return node.name, tuple(m.target for m in members)


def _under_views(node: Any) -> Any:
    """What ``node`` views, through the views that keep the experts on dim 0 (None when a
    view moves them)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and _name(node) != "stack":
        if _name(node) == "all_gather" and node.args[2] % node.meta["val"].dim() != 0:
            node = node.args[0]  # a tp gather of another dim: each rank gathers its experts
            continue
        if _name(node) not in _WEIGHT_VIEWS:
            return None
        if _name(node) == "permute" and node.args[1][0] not in (0, -node.meta["val"].dim()):
            return None
        if _name(node) in ("view", "reshape"):
            src = node.args[0].meta["val"].shape
            if node.meta["val"].shape[0] != src[0]:
                return None
        if _name(node) == "transpose" and 0 in {d % node.meta["val"].dim() for d in node.args[1:]}:
            return None
        node = node.args[0]
    return node


def _region(entry: fx.Node, exit_: fx.Node) -> set[fx.Node]:
    """Nodes on a path from ``entry`` (excluded) to ``exit_`` (included)."""
    ancestors, todo = set(), [exit_]
    while todo:
        n = todo.pop()
        if n in ancestors or n is entry:
            continue
        ancestors.add(n)
        todo.extend(n.all_input_nodes)
    region, todo = set(), list(entry.users)
    while todo:
        n = todo.pop()
        if n in region or n not in ancestors:
            continue
        region.add(n)
        todo.extend(n.users)
    return region


def _expert_biases(gm: fx.GraphModule, region: set[fx.Node], offs: fx.Node,
                   experts: int) -> list[fx.Node]:  # fmt: skip
    """Inputs of the region that gather an [E, ...] parameter by each row's expert id (the id
    tensor the offsets were counted from), read only inside the region: per-expert biases."""
    ids = offs
    while isinstance(ids, fx.Node) and _name(ids) in ("cumsum", "histc", "to", "_to_copy",
                                                      "bincount"):  # fmt: skip
        ids = ids.args[0]
    found, order = [], {n: i for i, n in enumerate(gm.graph.nodes)}
    inputs = {x for n in region for x in n.all_input_nodes if x not in region}
    for node in sorted(inputs, key=order.__getitem__):  # graph order: the same on every run
        if (_name(node) == "index" and len(node.args[1]) == 1 and node.args[1][0] is ids
                and (node.args[0].op == "get_attr" and _trainable_or_param(gm, node.args[0])
                     or _stacked_weight(gm, node.args[0]) is not None)
                and node.args[0].meta["val"].shape[0] == experts
                and all(u in region for u in node.users)):  # fmt: skip
            found.append(node)
    return found


def _trainable_or_param(gm: fx.GraphModule, node: fx.Node) -> bool:
    try:
        gm.get_parameter(node.target)
    except AttributeError:
        return False
    return True


def _not_rowwise(node: fx.Node, region: set[fx.Node], allowed: set[fx.Node],
                 mms: list[fx.Node]) -> str | None:  # fmt: skip
    """Why ``node`` cannot run on a rank's own experts' rows (None when it can)."""
    offs = _offs_of(mms[0])
    if node in mms:
        inputs = [node.args[0], offs]
    elif _name(node) in _TP_COLLECTIVES:
        inputs = node.all_input_nodes  # tp ranks of one ep rank hold the same dispatched rows
        if _name(node) in _DIMMED and node.args[2] % node.args[0].meta["val"].dim() == 0:
            return f"{_name(node)} over the rows (dim 0) inside the experts' region"
    elif _name(node) not in _ROWWISE:
        return f"{_name(node)} is not a row-wise op (between the grouped matmuls of the experts)"
    else:
        inputs = node.all_input_nodes
        dim = _DIM_OPS.get(_name(node))
        if dim is not None:
            d = node.args[dim] if len(node.args) > dim else node.kwargs.get("dim", 0)
            if d % node.args[0].meta["val"].dim() == 0:
                return f"{_name(node)} splits the rows (dim 0) inside the experts' region"
    for x in inputs:
        if x not in region and x not in allowed:
            return (f"its input '{x.name}' comes from outside the experts' region (only the "
                    "grouped rows and the expert weights may enter it)")  # fmt: skip
    if node in mms:
        return None
    leaks = [u for u in node.users if u not in region]
    if leaks and node is not mms[-1]:
        return f"its value is also read outside the experts' region (by '{leaks[0].name}')"
    return None


# ---------------------------------------------------------------- step 3: the pass's decisions


@dataclass(frozen=True, kw_only=True)
class EpDecisions:
    """What the ``expert_parallel`` pass reads for one stage (``PassContext.sections["ep"]``)."""

    axis: str  # the expert axis
    layers: tuple[MoELayer, ...]  # the stage's MoE layers
    reduction: str  # the loss's reduction over the batch
    capacity: float  # rows per expert over the global batch (0: dropless)
    bucket_bytes: int  # dense gradients per ep all-reduce at most
    micro: int  # pipeline micro-batches (1 without pp)


def _trainable(module: nn.Module, target: str) -> bool:
    try:
        return module.get_parameter(target).requires_grad
    except AttributeError:
        return False


def dense_buckets(gm: fx.GraphModule, experts: set[str], cap: int) -> list[list[fx.Node]]:
    """Step 3: the trainable non-expert parameters (get_attr nodes) in order of first use,
    cut from the last used (its gradient is computed first) into buckets of one dtype, one
    block (``layers.i``: a bucket's reduction reads its parameters, so a bucket spanning two
    blocks would tie them together and per-block recompute or ZeRO could not outline them)
    and at most ``cap`` bytes (a larger parameter alone); ``cap`` 0: one bucket per
    parameter.  Sizes are a rank's (each ``get_attr``'s local value), so a materialized
    program (whole parameters) gets the buckets of its rank programs."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    dense = [n for n in gm.graph.nodes
             if n.op == "get_attr" and n.users and n.target not in experts
             and _trainable(gm, n.target)]  # fmt: skip
    dense.sort(key=lambda n: min((order[u] for u in n.users), default=order[n]))
    buckets: list[list[fx.Node]] = []
    size = 0
    for node in reversed(dense):
        val = node.meta["val"]
        nbytes = val.numel() * val.element_size()
        last = buckets[-1][0] if buckets else None
        same = (last is not None and last.meta["val"].dtype == val.dtype
                and _param_block(last.target) == _param_block(node.target))  # fmt: skip
        if same and size + nbytes <= cap:
            buckets[-1].append(node)
            size += nbytes
        else:
            buckets.append([node])
            size = nbytes
    return [b[::-1] for b in reversed(buckets)]


@dataclass(frozen=True, kw_only=True)
class ExpertLoad:
    """One MoE layer's dispatch on this rank in one forward."""

    tokens: tuple[int, ...]  # rows each of this rank's experts took (from every ep rank)
    dropped: int  # rows this rank sent over capacity (0 dropless)

    @property
    def imbalance(self) -> float:
        """Max / mean rows per expert (1.0 is perfectly even; a hot expert is a straggler)."""
        mean = sum(self.tokens) / max(len(self.tokens), 1)
        return max(self.tokens) / mean if mean else 1.0


def expert_load(reset: bool = True) -> list[ExpertLoad]:
    """This rank's expert load since the last reset, one entry per MoE layer per forward in
    call order (``reset`` clears the record)."""
    return [ExpertLoad(tokens=tuple(t), dropped=d) for t, d in C.expert_load(reset)]


# ---------------------------------------------------------------- plan, program, compile


def ep_phase(mesh: Mesh, stage_layers: tuple[tuple[MoELayer, ...], ...], reduction: str,
             capacity: float, micro: int, model: str) -> Phase:  # fmt: skip
    """Step 3: the expert-axis passes (``expert_parallel``, ``global_batch`` over ep) on each
    materialized stage, its layouts now naming ``mesh`` (the ep mesh)."""
    batch = BatchDecisions(axis="ep", reduction=reduction, model=model)

    def run(i: int, stage: Materialized) -> tuple[Materialized, list[PassRecord]]:
        stage = dataclasses.replace(stage, mesh=mesh)
        decided = EpDecisions(axis="ep", layers=stage_layers[i], reduction=reduction,
                              capacity=capacity, bucket_bytes=BUCKET_BYTES, micro=micro)  # fmt: skip
        ctx = PassContext(mesh=mesh, grad=frozenset(), traced=stage.traced,
                          sections={"ep": decided, "batch": batch})  # fmt: skip
        return stage.rewritten(ctx, batch_pipeline("ep"))

    return Phase(name="expert_parallel", run=run)


def compile_expert_parallel(mesh: Mesh, batch: int, inner: Program, *, strict: bool = False,
                            capacity_factor: float | None = None) -> Program:  # fmt: skip
    """Steps 2-4 (see the module docstring) for a batch of ``batch`` rows over ep; the
    driver sliced and traced it (step 1) and compiled ``inner``, the program of the mesh
    without ep, from that one trace.  Returns the program of ``mesh``: ``inner``'s stages with
    the expert-axis phase run first."""
    ep = mesh.size("ep")
    samples = [st.module(0) for st in inner.stages]
    found_layers = [find_moe_layers(m) for m in samples]
    layers = [layer for ls, _ in found_layers for layer in ls]
    model = _model_name(inner)
    notes = _unrecognised([b for _, bad in found_layers for b in bad]
                          + _unrecognised_loops(samples, layers), strict, model)  # fmt: skip
    for layer in layers:
        if layer.experts % ep:
            raise InputError(f"{model}: the MoE layer at '{layer.where}' has "
                             f"{layer.experts} experts, which ep={ep} does not divide; use an "
                             "ep that divides the expert count")  # fmt: skip
    if not layers and not notes:
        notes.append("no MoE layer found: ep runs as a data axis (every weight replicated)")
    notes += _micro_batch_note(inner, samples)
    reduction = loss_reduction(_graph(inner), model)
    stage = next((i for i, (ls, _) in enumerate(found_layers) if ls), 0)
    capacity = _capacity(capacity_factor, found_layers[stage][0], samples[stage], ep)
    found = (Collective(kind="all_reduce", axis="ep", shape=(), dtype="float32", bytes=4,
                        direction="fwd", where="loss"),
             *(c for m in samples for c in statistic_collectives(m, "ep")),
             *(c for m, (ls, _) in zip(samples, found_layers, strict=True)
               for c in ep_collectives(m, ls, capacity > 0, BUCKET_BYTES)))  # fmt: skip
    link = mesh.cluster.axis_link(mesh.axes, "ep")
    times = [collective_time(c.kind, c.bytes, ep, link) for c in found]
    per_layer = sum(t for c, t in zip(found, times, strict=True)
                    if c.kind == "all_to_all" and layers and c.where == layers[0].where)  # fmt: skip
    section = EpSection(
        capacity_factor=capacity_factor, layers=tuple((x.where, x.experts) for x in layers),
        reduction=reduction, batch=batch, links=tuple(mesh.describe()), link=link.name,
        layer_s=per_layer, comm_s=sum(times), param_bytes=_param_bytes(samples, layers, ep),
        described=tuple(map(str, layers)), bucket_bytes=BUCKET_BYTES, notes=tuple(notes))  # fmt: skip
    plan = dataclasses.replace(inner.plan, mesh=mesh.axes, ep=section,
                               collectives=(*inner.plan.collectives, *found))  # fmt: skip
    stage_layers = tuple(tuple(ls) for ls, _ in found_layers)
    micro = inner.pipeline.config.n_microbatches if inner.pipeline else 1
    phase = ep_phase(mesh, stage_layers, reduction, capacity, micro, model)
    return inner.then(mesh, plan, phase, first=True, stage_layers=stage_layers)


def _micro_batch_note(inner: Any, samples: list[fx.GraphModule]) -> list[str]:
    """Under pp: torch's schedule computes the loss once per micro-batch, so statistics over
    the batch (a load-balancing loss) are global over ep within each micro-batch only."""
    micro = inner.pipeline.config.n_microbatches if inner.pipeline else 1
    found = sum(len(boundaries(m.graph)) for m in samples)
    if micro <= 1 or not found:
        return []
    return [f"{found} statistics over the batch feed the loss (a load-balancing loss): each is "
            f"global over ep within each of the {micro} micro-batches, so the step's loss is "
            "the mean of per-micro-batch terms (a one-device run over the same global "
            "micro-batches), not the global batch's; n_microbatches=1 (schedule='gpipe') "
            "computes that"]  # fmt: skip


def _param_bytes(modules: list[fx.GraphModule], layers: list[MoELayer], ep: int) -> tuple[int, int]:
    """Dense and expert parameter bytes an ep rank holds (every stage; experts 1/ep)."""
    experts = {w for layer in layers for w in layer.weights}
    dense = expert = 0
    for module in modules:
        for name, p in module.named_parameters():
            nbytes = p.numel() * p.element_size()
            if name in experts:
                expert += nbytes // ep
            else:
                dense += nbytes
    return dense, expert


def _unrecognised_loops(modules: list[fx.GraphModule],
                        layers: list[MoELayer]) -> list[Unrecognised]:  # fmt: skip
    """Per-expert loops (``autopar.frontend.moe_loop.find_expert_loops``) whose parameters no
    recognised MoE layer holds: their experts stay replicated."""
    held = {w for layer in layers for w in layer.weights}
    return [_why(loop.node, f"{loop.count} identical modules '{loop.prefix}.*' run side by side "
                            "(a per-expert loop) but not as routed experts autopar recognises "
                            "(torch.where(one_hot mask[e]) rows, index_add_ combine)")
            for m in modules for loop in find_expert_loops(m)
            if not set(loop.params) <= held]  # fmt: skip


def _unrecognised(bad: list[Unrecognised], strict: bool, model: str) -> list[str]:
    if not bad:
        return []
    text = "; ".join(map(str, bad))
    if strict:
        raise ShardingRuleError(f"{model}: an MoE layout autopar does not recognise: {text}")
    warnings.warn(f"{model}: an MoE layout autopar does not recognise, its experts stay "
                  f"replicated over ep: {text}", stacklevel=4)  # fmt: skip
    return [f"experts replicated (layout not recognised): {text}"]


def _capacity(factor: float | None, layers: list[MoELayer], gm: fx.GraphModule, ep: int) -> float:
    """Step 4: rows per expert over the global batch (0: dropless)."""
    if factor is None or not layers:
        return 0.0
    nodes = {n.name: n for n in gm.graph.nodes}
    rows = nodes[layers[0].entry].meta["val"].shape[0] * ep
    return float(math.ceil(factor * rows / layers[0].experts))


def ep_collectives(gm: fx.GraphModule, layers: Sequence[MoELayer], capped: bool = False,
                   bucket_bytes: int = BUCKET_BYTES) -> list[Collective]:  # fmt: skip
    """The expert axis's collectives of one step (local shapes of ep rank 0): per MoE layer
    the count exchange (with a capacity, also an all-gather of every rank's counts) and the
    dispatch and combine all-to-alls (each with its conjugate in backward, dropless sizes);
    one gradient all-reduce per bucket of dense parameters (:func:`dense_buckets`)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out = []
    for layer in layers:
        entry, exit_ = nodes[layer.entry].meta["val"], nodes[layer.exit].meta["val"]
        counts = torch.empty(layer.experts, dtype=torch.int64, device="meta")
        out.append(_record(counts, "fwd", layer.where))
        if capped:
            out.append(dataclasses.replace(out[-1], kind="all_gather"))
        for val in (entry, exit_):
            out += [_record(val, d, layer.where) for d in ("fwd", "bwd")]
    experts = {w for layer in layers for w in layer.weights}
    for bucket in dense_buckets(gm, experts, bucket_bytes):
        params = [gm.get_parameter(n.target) for n in bucket]
        numel = sum(p.numel() for p in params)
        shape = tuple(params[0].shape) if len(params) == 1 else (numel,)
        where = bucket[0].target.rsplit(".", 1)[0]
        out.append(Collective(kind="all_reduce", axis="ep", shape=shape,
                              dtype=str(params[0].dtype).replace("torch.", ""),
                              bytes=numel * params[0].element_size(), direction="bwd",
                              where=where if len(bucket) == 1 else
                              f"{where} .. {bucket[-1].target} ({len(bucket)} parameters)"))  # fmt: skip
    return out


def _record(val: torch.Tensor, direction: str, where: str) -> Collective:
    return Collective(kind="all_to_all", axis="ep", shape=tuple(val.shape),
                      dtype=str(val.dtype).replace("torch.", ""),
                      bytes=val.numel() * val.element_size(), direction=direction, where=where)  # fmt: skip
