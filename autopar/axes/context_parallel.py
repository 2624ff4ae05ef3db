"""The context-parallel axis (``cp``): every sequence-dimension tensor split over cp ranks.

The model is traced at its global shape, so positions, RoPE tables and masks it builds inside
(``arange`` ...) are whole; the program then keeps each rank's part of the sequence.  Layout:
2·cp chunks, rank i holds chunks i and 2·cp−1−i (load-balanced causal attention), or cp chunks
when no attention is causal (autopar.ops.cp_ops).  Parameters are replicated over cp; their
gradients are summed over cp, or, under dp, left partial for the data axis to reduce once
over dp x cp (:func:`leave_grads_to_data_axis`: ZeRO then shards over dp x cp).

This module is the axis's planner part (the sequence layout, each attention's price and
choice, the plan, ``fit_sequence``); the rewrite, steps 2-4, is the ``context_parallel`` pass
(passes/context_parallel.py).

Algorithm (:func:`compile_traced_cp`):
1. The driver traces at the global shape.  The sequence length S is dim 1 of the first user input.
   What the model computes from its inputs alone, off the gradient path (a label shift, a
   ``labels[..., 1:]``), runs whole on every rank like the inputs; the first op of the model
   reading such a value with S at dim 1 reads this rank's chunks of it (``cp_localize``: no
   communication).  Attention is causal if any SDPA says so; S must divide into the chunks.
2. Walk the graph.  An op reading a sequence-split value runs split when its sharding rules
   (autopar.rules, on an axis of one rank per chunk) offer a strategy whose split inputs are
   where they are: replicated inputs it needs split are localized (their gradient is gathered
   back), replicated inputs it reads whole get ``grad_all_reduce`` (each rank's gradient is
   the sum over its own tokens), a partial sum is all-reduced.  No strategy: an error naming
   the op and the user's source line.  A slice of a split activation along the sequence
   (``logits[:, :-1]``) stays at full length, its dropped positions marked (a ``Window``):
   views and position-wise ops carry it, an input-derived partner is padded, and a
   cross-entropy's target gets its ignore_index there, so the loss is exact with no exchange.
   Differently shifted slices meeting (which needs a halo exchange) are refused.
3. Attention (``aten.scaled_dot_product_attention``) with split q, k, v becomes ring attention
   (one node per ring step: ``ring_send`` / ``ring_block`` / ``ring_recv``, then
   ``ring_attention_out``, cp_ops) or all-to-all (Ulysses) attention: each priced on the
   link cp rides, the cheaper chosen unless ``cp_attention`` forces one.
4. A mean cross-entropy becomes a sum plus the count of counted tokens, both all-reduced
   (``cp_global_mean``): the loss over the global sequence keeps its meaning.  Split graph
   outputs are gathered whole, except a pipeline stage's sends (left as this rank's chunks).
5. Shape arguments become local (passes.localize); the plan lists the collectives, the
   attention choice with its prices, and the activation memory per rank.

Composition: with tp, the tp program is compiled first at the global sequence (autopar.axes.tensor_parallel)
and steps 2-5 split it (tp collectives and lowerings on other dims pass the sequence through;
on the sequence dim, Megatron-SP's gather and reduce-scatter, they act within this rank's
chunks: the dim is split cp outer, tp inner, ``P(None, ('cp', 'tp'), None)``, and a value
whole over cp that tp splits there is recomputed from cp's chunks); with pp, every stage is split
this way in the whole model's sequence layout and a sequence-split boundary value travels as
each cp rank's chunks (``keep_split`` / ``arrive``: no gather, no re-split; values without a
split sequence dim travel whole); with dp, autopar.axes.data_parallel wraps the cp
program like any sub-mesh program, its dense gradients reduced by the data axis over dp x cp
(under pp too: every stage leaves them, its boundaries crossing split).  :func:`fit_sequence` searches the (tp, cp, pp)
factorisations of a cluster with the cost model for a sequence that must fit in HBM.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopar.axes.expert_parallel import find_moe_layers
from autopar.axes.tensor_parallel import compile_traced
from autopar.errors import InputError, MeshError, PlanError
from autopar.frontend.canonical import constant_causal
from autopar.frontend.precision import annotate_autocast
from autopar.frontend.trace import Traced, tensor_args
from autopar.ir import meta
from autopar.ir.analysis import needs_grad
from autopar.ir.layout import Layout, Shard
from autopar.ir.printing import copy_module
from autopar.mesh import Mesh
from autopar.ops import collectives as C
from autopar.ops import cp_ops
from autopar.plan import Collective, CpSection, Plan
from autopar.planner.tp import PlanOptions, run_node_time
from autopar.program import StageProgram, collectives_of
from cost.comm import collective_time
from cost.compute import attention_time, backward_factor, train_factor
from passes import PassContext

aten = torch.ops.aten
AXIS = "cp"
_SDPA = aten.scaled_dot_product_attention.default
_SDPA_NAME = "scaled_dot_product_attention"  # its cost.compute name (ring attention prices)
_AND = (aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default)
_MASK_VIEWS = (aten.expand.default, aten.unsqueeze.default, aten.alias.default, aten.clone.default,
               aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout,
               aten._to_copy.default)  # fmt: skip
_RING_STEPS = (cp_ops.ring_send, cp_ops.ring_recv, cp_ops.ring_block)


class ContextParallelError(PlanError):
    """The model cannot run split along the sequence as written."""


@dataclass(frozen=True, kw_only=True)
class SeqLayout:
    """The sequence split of one program."""

    size: int  # cp ranks
    seq: int  # global sequence length
    balanced: bool  # 2·cp chunks (causal) or cp chunks

    @property
    def chunks(self) -> int:
        return 2 * self.size if self.balanced else self.size


@dataclass(frozen=True, kw_only=True)
class AttentionPrice:
    """Predicted seconds of one attention's cp communication, per strategy (fwd + bwd)."""

    node: str
    ring: float
    all_to_all: float | None  # None: heads do not divide by cp
    chosen: str




def check_cp_mesh(mesh: Mesh) -> None:
    """The axes a cp program composes with inside (dp, ep and pp wrap it)."""
    other = [a for a in mesh.sizes if a != AXIS]
    if set(other) - {"tp"}:
        raise MeshError(f"{mesh}: cp composes with dp, tp and pp (Mesh(dp=2, cp=2), "
                        f"Mesh(cp=2, tp=2), Mesh(pp=2, cp=2)); not with {', '.join(other)}")  # fmt: skip


def compile_traced_cp(traced: Traced, mesh: Mesh, cp_attention: str | None = None,
                      options: PlanOptions | None = None,
                      saved: CpSection | None = None, *, layout: SeqLayout | None = None,
                      arrive: Sequence[tuple[str, Shard]] = (),
                      keep_split: bool = False) -> StageProgram:  # fmt: skip
    """Steps 1-5 for an already traced graph (a whole model or one pipeline stage).
    ``saved`` (a reloaded plan's cp section) fixes each attention's choice; ``options.fixed``
    the tp program's.  A pipeline stage gives the whole model's sequence ``layout`` (every
    stage splits the same sequence alike), the boundary inputs that ``arrive`` as this rank's
    chunks (no re-split; their gradients go back split) and ``keep_split``: its
    sequence-split outputs leave as this rank's chunks, not gathered whole."""
    lay = layout or seq_layout(traced, mesh.size(AXIS))
    _refuse_moe(traced)
    base, tp_notes, tp_choice, tp_history = traced.gm, (), (), []
    if "tp" in mesh.sizes:  # the tp program, traced whole, is what cp splits
        no_overlap = dataclasses.replace(options or PlanOptions(), tp_overlap="none",
                                         overlap_fixed=None)  # the cp pass reads whole pairs
        tp = compile_traced(traced, Mesh.ordered((("tp", mesh.size("tp")),), mesh.cluster),
                            no_overlap, lambda _: None)  # fmt: skip
        traced, base, tp_notes, tp_choice = tp.traced, tp.graph_module, tp.plan.notes, tp.plan.choice
        tp_history = tp.history
    from passes import run_pipeline
    from passes.context_parallel import context_parallel

    gm = copy_module(base)
    grad = frozenset(n.name for n in needs_grad(traced, gm))
    decided = CpDecisions(layout=lay, attention=cp_attention, saved=saved, arrive=tuple(arrive),
                          keep_split=keep_split)  # fmt: skip
    ctx = PassContext(mesh=mesh, grad=grad, traced=traced, sections={AXIS: decided})
    gm, history = run_pipeline(gm, ctx, [context_parallel])
    prices = gm.meta["cp_prices"]
    if saved is not None:
        _check_saved_attention(saved, prices, traced.model_name)
    dtype = (options or PlanOptions()).param_dtype
    annotate_autocast(gm, dtype)  # priced as it runs
    plan = _plan(traced, gm, mesh, lay, prices, grad, tp_notes, tp_choice, dtype)
    return StageProgram(plan=plan, mesh=mesh, graph_module=gm, traced=traced,
                   history=[*tp_history, *history])  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class CpDecisions:
    """What the context_parallel pass applies (``PassContext.sections["cp"]``)."""

    layout: SeqLayout  # the sequence's chunks per cp rank
    attention: str | None  # 'ring' / 'all_to_all' forced, None: each attention by its price
    saved: CpSection | None  # a reloaded plan's cp section (its attention choices)
    # a pipeline stage's boundary inputs that arrive as this rank's chunks (name, placement)
    arrive: tuple[tuple[str, Shard], ...] = ()
    keep_split: bool = False  # sequence-split outputs leave split (a pipeline stage's sends)




def _refuse_moe(traced: Traced) -> None:
    """cp splits the graph traced at the global sequence by propagation; an MoE layer groups
    every token of the batch by expert (a sort of all b·s·k routed rows, a histogram, the
    inverse permutation), which no sharding rule splits along the sequence.  ep, in contrast,
    splits the batch before tracing, so each rank traces its own tokens' routing."""
    layers, bad = find_moe_layers(traced.gm)
    if layers or bad:
        where = layers[0].where if layers else bad[0].source
        raise ContextParallelError(
            f"{traced.model_name}: the MoE layer at {where} routes every token of the sequence "
            "together (tokens sorted by expert, grouped matmuls over the groups), which cp "
            "cannot split along the sequence; split the tokens by the batch instead "
            "(Mesh(ep=...), Mesh(dp=...), with tp or pp), and cp only dense models")  # fmt: skip


def _check_saved_attention(saved: CpSection, prices: list[AttentionPrice], model: str) -> None:
    """A reloaded plan's attention choices must name exactly this graph's attention nodes."""
    mine, found = {n for n, _ in saved.attention}, {p.node for p in prices}
    if mine != found:
        raise PlanError(
            f"the plan's cp section does not fit {model}: it decides attention "
            f"{sorted(mine - found) or 'nodes'} the model does not have"
            f"{f' and not {sorted(found - mine)}' if found - mine else ''}; re-plan without plan="
        )


def leave_grads_to_data_axis(prog: StageProgram) -> StageProgram | None:
    """``prog`` with the cp reductions of its dense parameters' gradients left to the data
    axis, which then reduces every parameter gradient once over dp x cp (torchtitan's FSDP
    over ``dp_shard_cp``); None when some parameter's gradient cannot be left partial.

    Algorithm:
    1. Walk forward from each trainable parameter along the gradient path: every path must
       end at a ``grad_all_reduce`` over cp or a ``cp_localize`` (a position table's chunks)
       before it meets another cp op or the output (there the gradient would arrive whole
       on every cp rank, and a reduction over cp would count it cp times).
    2. Each exit reached must see only parameters and non-cp ops above it on the gradient
       path (a pipeline stage's incoming activation that arrives whole needs its gradient
       whole; one that arrives split over cp is never above an exit).
    3. Drop those reductions, and let a localize's gathered gradient continue from cp rank 0
       only (``grad_partial``): each cp rank's parameter gradient is then a partial sum whose
       sum over cp is the gradient (linear ops carry a partial gradient through unchanged);
       the plan lists the remaining collectives and says where the reduction went.
    """
    gm = copy_module(prog.graph_module)
    grad = frozenset(n.name for n in needs_grad(prog.traced, gm))
    exits = _dense_exits(gm, prog.traced, grad)
    if exits is None:
        return None
    dropped = [e for e in exits if e.target is C.grad_all_reduce]
    for e in exits:
        if e.target is C.grad_all_reduce:
            e.replace_all_uses_with(e.args[0])
            gm.graph.erase_node(e)
        else:
            with gm.graph.inserting_before(e):
                partial = gm.graph.call_function(C.grad_partial, (e.args[0], AXIS))
            partial.meta.update({k: v for k, v in e.args[0].meta.items() if k != meta.KEY})
            meta.update(partial, layout=meta.layout(e.args[0]), origin="context_parallel")
            e.replace_input_with(e.args[0], partial)
    gm.graph.lint()
    gm.recompile()
    mesh, traced = prog.mesh, prog.traced
    names = {**traced.params, **traced.buffers}
    lay = prog.graph_module.meta.get("cp_layout") or seq_layout(traced, mesh.size(AXIS))
    found = collectives_of(gm, set(grad), mesh.sizes, names) + _cp_collectives(gm, lay, grad)
    note = (f"dense parameter gradients not reduced over cp ({len(dropped)} reductions "
            "left to the data axis: one reduction over dp x cp)")  # fmt: skip
    plan = dataclasses.replace(prog.plan, collectives=tuple(found), comm_s=_comm_s(found, mesh),
                               notes=(*prog.plan.notes, note))  # fmt: skip
    return StageProgram(plan=plan, mesh=mesh, graph_module=gm, traced=traced,
                        history=prog.history, recompute=prog.recompute,
                        recompute_effect=prog.recompute_effect)  # fmt: skip


def _dense_exits(gm: fx.GraphModule, traced: Traced,
                 grad: frozenset[str]) -> list[fx.Node] | None:  # fmt: skip
    """Steps 1-2: the cp reductions and localizes where parameters' gradients (only) enter
    the sequence-split program, if every path of every trainable parameter meets one."""
    params = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in traced.params
              and n.name in grad}  # fmt: skip
    found: dict[fx.Node, None] = {}
    todo, seen = list(params), set(params)
    while todo:
        for u in todo.pop().users:
            if u in seen or (u.op != "output" and u.name not in grad):
                continue
            seen.add(u)
            if u.target in (C.grad_all_reduce, cp_ops.cp_localize) and u.args[1] == AXIS:
                found[u] = None
            elif u.op == "output" or _on_cp(u):
                return None
            else:
                todo.append(u)
    for r in found:
        if not _above_are_dense(r.args[0], params, grad):
            return None
    return list(found)


def _above_are_dense(node: fx.Node, params: set[fx.Node], grad: frozenset[str]) -> bool:
    """Step 2: only parameters and non-cp ops above ``node`` on the gradient path."""
    todo, seen = [node], {node}
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            if n not in params:
                return False
            continue
        if _on_cp(n):
            return False
        for a in n.all_input_nodes:
            if a.name in grad and a not in seen:
                seen.add(a)
                todo.append(a)
    return True


def _on_cp(n: fx.Node) -> bool:
    """A cp op (autopar.ops.cp_ops) or a collective over cp."""
    return n.op == "call_function" and (
        getattr(n.target, "__module__", None) == cp_ops.__name__
        or any(isinstance(a, str) and a == AXIS for a in n.args))


def _comm_s(found: Sequence[Collective], mesh: Mesh) -> float:
    """Seconds of the collectives on the links their axes ride."""
    return sum(collective_time(c.kind, c.bytes, 2 if c.kind == "send_recv" else mesh.size(c.axis),
                               mesh.cluster.axis_link(mesh.axes, c.axis)) for c in found)  # fmt: skip






# ---------------------------------------------------------------- step 1


def seq_layout(traced: Traced, size: int) -> SeqLayout:
    """Step 1: the sequence (dim 1 of the first input with two dims) split over ``size`` cp
    ranks, balanced when some attention is causal; S must divide into the chunks."""
    inputs = [n for n in traced.gm.graph.nodes if n.name in traced.user_inputs
              and isinstance(n.meta.get("val"), torch.Tensor)]  # fmt: skip
    shaped = [n for n in inputs if n.meta["val"].dim() >= 2]
    if not shaped:
        raise InputError(f"{traced.model_name}: cp splits the sequence (dim 1 of the first "
                         "input), but no input has two dims; pass token ids [batch, seq]")  # fmt: skip
    seq = shaped[0].meta["val"].shape[1]
    causal = any(_causal(_sdpa_args(n)) for n in traced.gm.graph.nodes if n.target is _SDPA)
    lay = SeqLayout(size=size, seq=seq, balanced=causal)
    if seq % lay.chunks:
        why = f"2·cp = {lay.chunks} chunks (causal attention)" if causal else f"cp = {size}"
        raise InputError(f"the sequence length {seq} of {traced.model_name} (dim 1 of "
                         f"{shaped[0].name}) does not divide into {why}; use a sequence "
                         f"length that is a multiple of {lay.chunks}")  # fmt: skip
    return lay


def _causal(a: dict[str, Any]) -> bool:
    """Attention is causal: ``is_causal``, or a bool mask and-ed with the constant causal
    triangle (HF's mask of a padded batch, ``causal & attention_mask[b, key]``), which hides
    at least what causal hides: the ring skips the pairs above the diagonal and the chunks
    are balanced, the mask still applied."""
    if a["is_causal"]:
        return True
    mask = a["attn_mask"]
    if not isinstance(mask, fx.Node) or mask.meta["val"].dtype != torch.bool:
        return False
    score = tuple(mask.meta["val"].shape[-2:])
    todo = [mask]
    while todo:
        n = todo.pop()
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or n.op != "call_function":
            continue
        if val.dim() >= 2 and tuple(val.shape[-2:]) == score and constant_causal(n):
            return True
        if n.target in _AND:
            todo.extend(tensor_args(n))
        elif n.target in _MASK_VIEWS and tuple(val.shape[-2:]) == score:
            todo.append(n.args[0])
    return False


def _sdpa_args(n: fx.Node) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    defaults = (None, None, None, None, 0.0, False, None, False)
    out = dict(zip(names, defaults, strict=True))
    out.update(zip(names, n.args, strict=False))
    out.update(n.kwargs)
    return out


# ---------------------------------------------------------------- steps 2-4




















# ---------------------------------------------------------------- pricing (step 3)


def _price(n: fx.Node, lay: SeqLayout, mesh: Mesh, forced: str | None) -> AttentionPrice:
    """Ring: per step the K/V block moves while a block of attention runs (only the excess is
    exposed); backward also moves dK/dV.  All-to-all: 4 all-to-alls each way, nothing hidden."""
    a = _sdpa_args(n)
    q, k, v = (a[x].meta["val"] for x in ("query", "key", "value"))
    size, link, gpu = lay.size, mesh.cluster.axis_link(mesh.axes, AXIS), mesh.cluster.gpu
    elt = q.element_size()
    kv = (k.numel() + v.numel()) * elt / size
    step_flops = 4 * q.numel() / size * (k.shape[-2] / size) / (2 if a["is_causal"] else 1)
    step_s = step_flops / gpu.sustained_flops(min(elt, 2))
    p2p = collective_time("send_recv", kv, 2, link)
    ring = (size - 1) * max(0.0, p2p - step_s) + (size - 1) * max(0.0, p2p - 2 * step_s) \
        + size * collective_time("send_recv", kv, 2, link)  # fmt: skip
    heads_ok = q.shape[1] % size == 0
    a2a = None
    if heads_ok:
        kv_heads = k.shape[1] if k.shape[1] % size == 0 else q.shape[1]
        kv_one = k.shape[0] * kv_heads * k.shape[2] * k.shape[3] * elt / size
        per = [q.numel() * elt / size, kv_one, kv_one, q.numel() * elt / size]
        a2a = 2 * sum(collective_time("all_to_all", b, size, link) for b in per)
    if forced == "all_to_all" and not heads_ok:
        raise InputError(f"cp_attention='all_to_all' at {meta.source(n)}: {q.shape[1]} query "
                         f"heads do not divide by cp={size}; use cp_attention='ring'")  # fmt: skip
    chosen = forced or ("all_to_all" if a2a is not None and a2a < ring else "ring")
    return AttentionPrice(node=n.name, ring=ring, all_to_all=a2a, chosen=chosen)


# ---------------------------------------------------------------- the plan (step 5)


def _plan(traced: Traced, gm: fx.GraphModule, mesh: Mesh, lay: SeqLayout,
          prices: list[AttentionPrice], grad: frozenset[str],
          tp_notes: tuple[str, ...] = (),
          tp_choice: tuple[tuple[str, str], ...] = (),
          param_dtype: torch.dtype = torch.float32) -> Plan:  # fmt: skip
    """The plan: ``choice`` the tp program's strategies, the cp section each attention's."""
    names = {**traced.params, **traced.buffers}
    params = tuple((names[n.name], str(meta.layout(n) or Layout.replicate(n.meta["val"].dim())))
                   for n in gm.graph.nodes if n.op == "placeholder" and n.name in traced.params)  # fmt: skip
    found = collectives_of(gm, set(grad), mesh.sizes, names) + _cp_collectives(gm, lay, grad)
    rings = ring_comm_s(gm, mesh, param_dtype)  # K/V exchanges, overlapped as the search prices
    comm = _comm_s([c for c in found if c.kind != "send_recv"], mesh) + rings
    state = sum(meta.state_bytes(n) for n in gm.graph.nodes
                if n.op == "placeholder" and n.name in traced.params)  # fmt: skip
    act = activation_bytes(gm, traced)
    chunks = (f"{lay.chunks} chunks, rank i holds chunks i and {lay.chunks - 1}-i (causal: equal "
              "attention work)" if lay.balanced else f"{lay.size} chunks, rank i holds chunk i")  # fmt: skip
    notes = [f"cp={lay.size} splits the sequence of {lay.seq} tokens into {chunks}",
             f"activations per rank {act / 2**20:.2f} MiB (1/cp of the sequence-split values)"]
    for p in prices:
        a2a = f"{p.all_to_all * 1e6:.1f} us" if p.all_to_all is not None else "invalid (heads)"
        notes.append(f"attention {p.node}: {p.chosen} (ring {p.ring * 1e6:.1f} us, all-to-all "
                     f"{a2a} of exposed cp communication per step)")  # fmt: skip
    return Plan(model=traced.model_name, mesh=mesh.axes,
                hardware=f"{mesh.cluster.gpu.name} ×{mesh.cluster.gpus_per_node}/node",
                params=params, collectives=tuple(found), choice=tp_choice,
                cp=CpSection(attention=tuple((p.node, p.chosen) for p in prices)),
                compute_s=compute_time(gm, grad, mesh.cluster.gpu, param_dtype), comm_s=comm,
                memory_bytes=state + act, notes=(*notes, *tp_notes))  # fmt: skip


def compute_time(gm: fx.GraphModule, grad: frozenset[str], gpu: Any,
                 param_dtype: torch.dtype = torch.float32) -> float:  # fmt: skip
    """Seconds of one rank's forward + backward at its local shapes, priced as the tp planner
    prices them (roofline per node, `cost.compute.train_factor` for the backward).  A ring
    attention is the attention of this rank's queries over every key (`ring_forward_s`)."""
    total = 0.0
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in _RING_STEPS:
            continue  # priced whole at ring_attention_out
        if n.target in (cp_ops.ring_attention, cp_ops.ring_attention_out):
            t = ring_forward_s(n, gpu, _compute_bytes(param_dtype, n)) * (
                1 + backward_factor(_SDPA_NAME, n.name in grad))
        else:
            t = run_node_time(n, gpu) * train_factor(n, n.name in grad)
        total += t
    return total


def ring_forward_s(n: fx.Node, gpu: Any, compute_bytes: int = 2) -> float:
    """Forward seconds of ring attention node ``n``: 4·b·h·s_local·S·d FLOPs (half under a
    causal mask) at the whole sequence's attention efficiency and the peak of
    ``compute_bytes`` elements (its block matmuls run under the program's autocast, as the
    SDPA it replaces), reading q, k, v and writing o in their run-time dtypes
    (`cost.compute.attention_time`, as the search prices SDPA)."""
    at = 0 if n.target is cp_ops.ring_attention else 2
    q = n.args[0].meta["val"]
    causal, seq = n.args[5 + at], n.args[7 + at]
    b, h, s, d = q.shape
    flops = 4.0 * b * h * s * seq * d * (0.5 if causal else 1.0)
    moved = 2 * meta.nbytes(n.args[0]) + meta.nbytes(n.args[1]) + meta.nbytes(n.args[2])
    return attention_time(flops, moved, gpu, compute_bytes, seq, seq, d)


def _compute_bytes(param_dtype: torch.dtype, n: fx.Node | None = None) -> int:
    """Element size a ring attention's block matmuls compute in: the autocast dtype, else
    (no autocast: fp32, or a graph traced in its 16-bit dtype) its query's own dtype."""
    dtype = meta.dtype(n.args[0]) if n is not None and param_dtype == torch.float32 else param_dtype
    return min(max(dtype.itemsize, 2), 4)


def ring_comm_s(gm: fx.GraphModule, mesh: Mesh, param_dtype: torch.dtype = torch.float32,
                recompute: str = "none") -> float:  # fmt: skip
    """Exposed seconds of every ring attention's K/V exchanges in one micro-batch, by the
    search's `cost.step.ring_attention` (each send hides behind one step's block; launches
    and the log-sum-exp merges added)."""
    from cost.step import AttentionWork, ring_attention

    link, gpu, c = mesh.cluster.axis_link(mesh.axes, AXIS), mesh.cluster.gpu, mesh.size(AXIS)
    total = 0.0
    for n in _rings(gm):
        kv = meta.nbytes(n.args[1]) + meta.nbytes(n.args[2])
        work = AttentionWork(attn_fwd_s=ring_forward_s(n, gpu, _compute_bytes(param_dtype, n)),
                             attn_out_bytes=meta.nbytes(n.args[0]))  # fmt: skip
        ring = ring_attention(work, c, collective_time("send_recv", kv, 2, link),
                              collective_time("send_recv", 2 * kv, 2, link), gpu.hbm_bw)  # fmt: skip
        total += (2 if recompute == "full" else 1) * ring.fwd + ring.bwd
    return total


def _rings(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (cp_ops.ring_attention, cp_ops.ring_attention_out)]  # fmt: skip


def ring_work(gm: fx.GraphModule, work: Any, gpu: Any,
              param_dtype: torch.dtype = torch.float32) -> Any:  # fmt: skip
    """``work`` (`cost.graph`'s Workload of rank graph ``gm``, which prices no ring op) with
    its ring attentions added per layer: their forward seconds (`ring_forward_s`) in the
    layer's forward, attention and backward (`cost.compute.backward_factor`) seconds, their
    local K/V bytes as the cp message and their output bytes as the merge."""
    rings, per = _rings(gm), work.layers
    if not rings:
        return work
    fwd = sum(ring_forward_s(n, gpu, _compute_bytes(param_dtype, n)) for n in rings) / per
    kv = sum(meta.nbytes(n.args[1]) + meta.nbytes(n.args[2]) for n in rings) / per
    out = sum(meta.nbytes(n.args[0]) for n in rings) / per
    return dataclasses.replace(
        work, layer_fwd_s=work.layer_fwd_s + fwd, attn_fwd_s=work.attn_fwd_s + fwd,
        layer_bwd_s=work.layer_bwd_s + backward_factor(_SDPA_NAME, True) * fwd,
        recompute_s={**work.recompute_s, "full": work.recompute_s["full"] + fwd},
        cp_bytes=kv, attn_out_bytes=out)  # fmt: skip


def activation_bytes(gm: fx.GraphModule, traced: Traced) -> float:
    """Bytes of every floating intermediate value at its local shape (an upper bound on the
    activations saved for backward, per rank)."""
    total = 0.0
    for n in gm.graph.nodes:
        if n.op != "call_function" or _transient(n):
            continue
        vals = n.meta.get("val")
        for v in vals if isinstance(vals, (tuple, list)) else (vals,):
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                total += v.numel() * v.element_size()
    return total


def _transient(n: fx.Node) -> bool:
    """A ring step's block or running (o, lse): freed by the next step, never saved."""
    src = n.args[0] if n.target is operator.getitem else n
    return isinstance(src, fx.Node) and src.target in _RING_STEPS


def _cp_collectives(gm: fx.GraphModule, lay: SeqLayout, grad: frozenset[str]) -> list[Collective]:
    """The cp ops collectives_of does not know: ring exchanges, localize / gather, the loss."""
    out: list[Collective] = []
    for n in gm.graph.nodes:
        where = meta.module_path(n)
        if n.target is cp_ops.ring_send:
            k, v = (b.meta["val"] for b in n.args[0])
            kv = (k.numel() + v.numel()) * k.element_size()
            out.append(_rec("send_recv", (2, *k.shape), kv, "fwd", where, k.dtype))
        elif n.target in (cp_ops.ring_attention, cp_ops.ring_attention_out):
            k, v = n.args[1].meta["val"], n.args[2].meta["val"]
            kv = (k.numel() + v.numel()) * k.element_size()
            shape = (2, *k.shape)
            if n.target is cp_ops.ring_attention:
                out += [_rec("send_recv", shape, kv, "fwd", where, k.dtype)] * (lay.size - 1)
            out += [_rec("send_recv", shape, kv, "bwd", where, k.dtype)] * (2 * lay.size - 1)
        elif n.target is cp_ops.cp_gather:
            val = n.meta["val"]
            out.append(_rec("all_gather", tuple(val.shape), _nbytes(val), "fwd", where, val.dtype))
        elif n.target is cp_ops.cp_localize and n.args[0].name in grad:
            val = n.args[0].meta["val"]
            out.append(_rec("all_gather", tuple(val.shape), _nbytes(val), "bwd", where, val.dtype))
        elif n.target is cp_ops.cp_global_mean:
            out.append(_rec("all_reduce", (2,), 8, "fwd", where))
    return out


def _nbytes(v: torch.Tensor) -> int:
    return v.numel() * v.element_size()


def _rec(kind: str, shape: tuple, nbytes: int, direction: str, where: str,
         dtype: torch.dtype = torch.float32) -> Collective:  # fmt: skip
    """A cp collective as the plan lists it: ``dtype`` the values' (the bytes priced), a K/V
    ring step's the K/V's (the backward's dK/dV accumulators travel in fp32, priced at K/V's
    dtype: NOTES, "bf16 like the anchors")."""
    return Collective(kind=kind, axis=AXIS, shape=tuple(shape), dtype=str(dtype).removeprefix("torch."),
                      bytes=nbytes, direction=direction, where=where)  # fmt: skip


# ---------------------------------------------------------------- long sequences on a cluster


@dataclass(frozen=True, kw_only=True)
class SequenceFit:
    """The fastest (tp, cp, pp) plan of a model shape that fits, and why."""

    seq: int
    best: Any  # cost.estimate.Estimate
    tried: tuple[Any, ...]  # every priced candidate (recompute chosen by the cost model)
    why: tuple[str, ...]

    def __str__(self) -> str:
        c = self.best.config
        return "\n".join([f"{self.best.model} at {self.seq} tokens: tp={c.tp} cp={c.cp} "
                          f"pp={c.pp} dp={c.dp} recompute={c.recompute}, "
                          f"{self.best.memory_per_rank / 2**30:.1f} GiB per rank, "
                          f"{self.best.step_time_s:.2f} s per step", *self.why])  # fmt: skip


def fit_sequence(shape: Any, cluster: Any, global_batch: int = 1) -> SequenceFit:
    """Price every (tp, cp, pp) factorisation of the cluster (dp fills the rest; micro-batch
    and recompute chosen by the cost model) and keep the fastest that fits HBM; the why-lines
    say which axis made it fit: the best plan without each axis (and without recompute)."""
    tried = _factorisations(shape, cluster, global_batch, None)
    fitting = [e for e in tried if e.fits]
    if not fitting:
        least = min(tried, key=lambda e: e.memory_per_rank)
        raise PlanError(f"no (tp, cp, pp) plan of {shape.name} at {shape.seq} tokens fits "
                        f"{cluster.gpu.name}: the least memory is "
                        f"{least.memory_per_rank / 2**30:.1f} GiB per rank "
                        f"(tp={least.config.tp} cp={least.config.cp} pp={least.config.pp})")  # fmt: skip
    best = min(fitting, key=lambda e: e.step_time_s)
    why = _fit_why(best, tried)
    if best.config.recompute not in (None, "none"):
        plain = _factorisations(shape, cluster, global_batch, "none")
        fits = [e for e in plain if e.fits]
        least = min(plain, key=lambda e: e.memory_per_rank)
        why.append(f"{best.config.recompute} activation recompute (the cost model's choice): "
                   + ("without it the least memory is "
                      f"{least.memory_per_rank / 2**30:.1f} GiB per rank ({_axes(least)})"
                      if not fits else f"without it {_axes(min(fits, key=_time))} fits, slower"))  # fmt: skip
    return SequenceFit(seq=shape.seq, best=best, tried=tuple(tried), why=tuple(why))


def _factorisations(shape: Any, cluster: Any, global_batch: int, recompute: str | None) -> list:
    from cost.config import ParallelConfig
    from cost.errors import CostInputError
    from cost.estimate import estimate

    gpus, out = cluster.gpus_per_node * cluster.nodes, []
    for tp in _divisors(min(gpus, cluster.gpus_per_node)):
        for cp in _divisors(gpus // tp):
            for pp in _divisors(gpus // (tp * cp)):
                cfg = ParallelConfig(tp=tp, cp=cp, pp=pp, global_batch=global_batch,
                                     recompute=recompute)  # fmt: skip
                try:
                    out.append(estimate(shape, cluster, cfg))
                except CostInputError:
                    continue
    return out


def _axes(e: Any) -> str:
    return f"tp={e.config.tp} cp={e.config.cp} pp={e.config.pp}"


def _time(e: Any) -> float:
    return e.step_time_s


def _fit_why(best: Any, tried: list) -> list[str]:
    out = []
    for axis in ("cp", "tp", "pp"):
        if getattr(best.config, axis) == 1:
            continue
        without = [e for e in tried if getattr(e.config, axis) == 1]
        fits = [e for e in without if e.fits]
        gib = best.memory_per_rank / 2**30
        degree = f"{axis}={getattr(best.config, axis)}"
        if not fits:
            least = min(without, key=lambda e: e.memory_per_rank)
            out.append(f"{degree} made it fit: without {axis} the least memory is "
                       f"{least.memory_per_rank / 2**30:.1f} GiB per rank ({_axes(least)}); "
                       f"this plan {gib:.1f} GiB")  # fmt: skip
        else:
            alt = min(fits, key=_time)
            out.append(f"{degree} is faster: the best plan without {axis} ({_axes(alt)}) fits "
                       f"but takes {alt.step_time_s:.2f} s per step vs {best.step_time_s:.2f} s")  # fmt: skip
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
