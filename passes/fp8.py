"""fp8: ``autoparallelize(..., fp8="tensorwise" | "rowwise")``, a pass on each materialized
stage (after recompute, before compile_blocks): every eligible layer linear runs its three
training GEMMs in float8 by torchao's recipe (autopar.ops.fp8.fp8_linear).

Algorithm:
1. Find the linears (``aten.linear``) of the program and of the blocks a pass outlined into
   submodules (recompute="full").
2. Keep in high precision, with the reason: the output head (``Fp8Decisions.heads``: the
   module paths of the last stage's root-graph linears no linear follows, the LM head; found
   by :func:`head_paths`), an MoE router (its output reaches ``topk``), a linear whose
   local dims (tokens M, in K, out N) are not all multiples of 16 (``torch._scaled_mm``'s
   alignment), and one whose input or weight is still a pending partial sum (an amax of a
   partial sum is not the sum's).
3. Every other linear becomes ``fp8_linear(x, w, b, recipe, axes)``: ``axes`` holds, per cast
   of the recipe (autopar.ops.fp8.CASTS), the mesh axes that split the dims its scale covers
   (tensorwise: any dim of the tensor; rowwise: the dims the amax reduces over), read off the
   layouts of x, w and the output (whose split, not partial, axes the output gradient has).
   The batch axes (dp, ep: not in these layouts, they slice the batch before the trace) join
   every cast whose scale covers the token dims (tensorwise: the input and output gradient;
   rowwise: their weight-gradient casts).  So each rank's scale is the one a single device
   running the whole batch computes (torchao under FSDP2 scales each replica's batch alone;
   this costs one all-reduce of a scalar or a [1, n] amax per such cast).
4. Record one row per linear (module path, FP8 or the reason it stays, and the predicted
   seconds it saves: the node at its run dtype vs. ``cost.workload.fp8_gemm_seconds``) in
   ``module.meta["fp8"]``; the driver runs the pass at compile time and :func:`fp8_plan`
   prints the rows in the plan's notes and takes the savings off its compute time.
5. Under ZeRO-2/3 and tensorwise the runtime all-gathers the FP8 linears' weights in float8
   (autopar.ops.fp8 step 4): :func:`fp8_gathers` makes the plan's data-axis gathers of those
   weights float8 (1 byte an element: half of bf16, a quarter of fp32), says so, and gives
   the bytes per parameter the driver re-prices the dp step's exposed traffic with.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx

from autopar.ir import meta
from autopar.ir.layout import Layout
from autopar.ops.fp8 import CASTS, fp8_linear, recipe_config
from autopar.plan import _fmt_bytes
from passes import PassContext

ORIGIN = "fp8"
LINEAR = torch.ops.aten.linear.default
ALIGN = 16


@dataclass(frozen=True, kw_only=True)
class Fp8Decisions:
    """``PassContext.sections["fp8"]``: the torchao recipe, the output head (step 2), the
    program's batch axes (step 3) and the GPU the savings are priced on (None: not
    priced)."""

    recipe: str
    heads: frozenset[str] = frozenset()  # module paths of the output head's linears
    batch: tuple[str, ...] = ()
    gpu: object = None  # cost.hardware.GPU


@dataclass(frozen=True, kw_only=True)
class Fp8Row:
    """One linear of the program: its module path, whether it runs FP8 and why not, and the
    seconds per step FP8 saves on it (forward + backward)."""

    path: str
    fp8: bool
    reason: str = ""
    saved_s: float = 0.0


def fp8(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Steps 1-4 (``gm`` rewritten in place, blocks included)."""
    decided: Fp8Decisions = ctx.sections["fp8"]
    rows: list[Fp8Row] = []
    for owner in _graph_modules(gm):
        for node in [n for n in owner.graph.nodes if n.target is LINEAR]:
            reason = _kept(node, decided.heads)
            rows.append(Fp8Row(path=meta.module_path(node) or node.name, fp8=not reason,
                               reason=reason, saved_s=0.0 if reason else _saved(node, decided)))  # fmt: skip
            if not reason:
                _rewrite(owner.graph, node, decided)
        owner.graph.lint()
        owner.recompile()
    gm.meta = {**gm.meta, "fp8": (decided.recipe, tuple(rows))}
    return gm


def _graph_modules(gm: fx.GraphModule) -> Iterator[fx.GraphModule]:
    """Step 1: the program and every graph submodule (its outlined blocks)."""
    yield gm
    for name, sub in gm.named_modules():
        if name and isinstance(sub, fx.GraphModule):
            yield sub


def head_paths(gm: fx.GraphModule) -> frozenset[str]:
    """Module paths of the root-graph linears of ``gm`` (the last stage's program) that no
    other linear (nor an outlined block, checkpointed or not) follows."""
    from autopar.axes.recompute import checkpoint

    below: dict[fx.Node, bool] = {}
    for node in reversed(gm.graph.nodes):
        below[node] = any(u.target in (LINEAR, checkpoint) or u.op == "call_module"
                          or below.get(u, False) for u in node.users)  # fmt: skip
    return frozenset(meta.module_path(n) for n in gm.graph.nodes
                     if n.target is LINEAR and not below[n])  # fmt: skip


def _kept(node: fx.Node, heads: frozenset[str]) -> str:
    """Step 2: why ``node`` stays in high precision ('' if it runs FP8)."""
    if meta.module_path(node) in heads:
        return "the output head (LM head)"
    if _routes(node):
        return "the MoE router"
    x, w = node.args[0], node.args[1]
    xv, wv = x.meta["val"], w.meta["val"]
    k, n = xv.shape[-1], wv.shape[0]
    m = xv.numel() // max(k, 1)
    if any(d % ALIGN for d in (m, k, n)):
        return f"local dims M={m} K={k} N={n} not all multiples of {ALIGN}"
    for what, arg in (("input", x), ("weight", w)):
        lay = meta.layout(arg)
        if isinstance(lay, Layout) and lay.partial:
            return f"its {what} is a pending partial sum over {', '.join(lay.partial)}"
    return ""


def _routes(node: fx.Node, depth: int = 8) -> bool:
    """Whether the linear's output reaches a ``topk`` within ``depth`` ops (a router)."""
    frontier, seen = [node], set()
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u not in seen]
        seen.update(frontier)
        if any(u.target is torch.ops.aten.topk.default for u in frontier):
            return True
    return False


def _rewrite(graph: fx.Graph, node: fx.Node, decided: Fp8Decisions) -> None:
    """Step 3."""
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else None
    axes = cast_axes(decided.recipe, _layout(x), _layout(w), _layout(node), decided.batch)
    with graph.inserting_before(node):
        call = graph.call_function(fp8_linear, (x, w, b, decided.recipe, axes))
    call.meta.update(node.meta)
    meta.update(call, origin=ORIGIN)
    node.replace_all_uses_with(call)
    graph.erase_node(node)


def _layout(node: fx.Node) -> Layout:
    lay = meta.layout(node)
    return lay if isinstance(lay, Layout) else Layout.replicate(node.meta["val"].dim())


def cast_axes(recipe: str, x: Layout, w: Layout, out: Layout,
              batch: tuple[str, ...] = ()) -> tuple[tuple[str, ...], ...]:  # fmt: skip
    """Step 3: per cast, the axes splitting the dims its scale covers (``batch`` splitting
    the token dims of x and of the output).  Rowwise reduces the input and output gradient
    along their last dim (forward / input-gradient GEMMs) or their token dims
    (weight-gradient GEMM), the weight along its in (forward) or out dim."""
    from torchao.float8.config import ScalingGranularity

    c, _ = recipe_config(recipe)
    lead_x, lead_o = tuple(range(len(x.dims) - 1)), tuple(range(len(out.dims) - 1))
    rowwise = {"input": (x, (-1,)), "weight": (w, (1,)), "grad_output": (out, (-1,)),
               "input_for_grad_weight": (x, lead_x), "weight_for_grad_input": (w, (0,)),
               "grad_output_for_grad_weight": (out, lead_o)}  # fmt: skip
    axes = []
    for which in CASTS:
        lay, dims = rowwise[which]
        if getattr(c, f"cast_config_{which}").scaling_granularity is ScalingGranularity.TENSORWISE:
            dims = tuple(range(len(lay.dims)))
        split = [a for d in dims for a in lay.dims[d]]
        tokens = lay is not w and any(d % len(lay.dims) != len(lay.dims) - 1 for d in dims)
        axes.append(tuple(dict.fromkeys([*split, *(batch if tokens else ())])))
    return tuple(axes)


def _saved(node: fx.Node, decided: Fp8Decisions) -> float:
    """Step 4: predicted forward + backward seconds FP8 saves on ``node``."""
    if decided.gpu is None:
        return 0.0
    from autopar.planner.tp import run_node_time
    from cost.compute import train_factor
    from cost.workload import fp8_gemm_seconds

    xv, wv = node.args[0].meta["val"], node.args[1].meta["val"]
    k, n = xv.shape[-1], wv.shape[0]
    before = run_node_time(node, decided.gpu) * train_factor(node, True)
    return before - fp8_gemm_seconds(xv.numel() // k, n, k, decided.gpu)


def fp8_plan(plan: Any, recipe: str, rows: list[Fp8Row]) -> Any:
    """``plan`` (autopar.plan.Plan) with the pass's rows said (which linears run FP8, which
    stay and why) and its compute priced with them: each FP8 linear's saving off the
    compute time (and off the data axis's sub-mesh step)."""
    c, _ = recipe_config(recipe)
    fwd, bwd = (str(getattr(c, f"cast_config_{w}").target_dtype).replace("torch.", "")
                for w in ("input", "grad_output"))  # fmt: skip
    on = _patterns(r.path for r in rows if r.fp8)
    kept = _patterns(f"{r.path} ({r.reason})" for r in rows if not r.fp8)
    saved = sum(r.saved_s for r in rows)
    after = max(plan.compute_s - saved, 0.0)
    notes = [f"fp8 (torchao {recipe!r}): {sum(r.fp8 for r in rows)} of {len(rows)} linears run "
             f"float8 GEMMs (torch._scaled_mm; {fwd} forward, {bwd} gradients, dynamic "
             "scales reduced over the axes splitting them and the batch axes): "
             f"{', '.join(on) or 'none'}",
             f"fp8: kept in high precision: {', '.join(kept) or 'none'}",
             f"fp8: compute {plan.compute_s * 1e3:.3f} ms -> {after * 1e3:.3f} ms per step with "
             "the FP8 GEMMs priced at the GPU's FP8 peak (their casts included)"]  # fmt: skip
    changes: dict[str, Any] = {"compute_s": after,
                               "notes": (*plan.notes, *notes)}  # fmt: skip
    if plan.dp is not None and plan.dp.step is not None:
        step = replace(plan.dp.step, sub_mesh=max(plan.dp.step.sub_mesh - saved, 0.0))
        changes["dp"] = replace(plan.dp, step=step)
    return replace(plan, **changes)


def fp8_gathers(plan: Any, recipe: str, rows: list[Fp8Row]) -> tuple[Any, float | None]:
    """Step 5: under ZeRO-2/3 and tensorwise, ``plan`` with the data axis's all-gathers of the
    FP8 linears' weights in float8 (what autopar.ops.fp8 step 4 gathers: 1 byte an element)
    and said, and the bytes per parameter of a layer's gather for the dp step's pricing (2
    for the rest, `cost.config.ParallelConfig.gather_bytes`); ``(plan, None)`` when nothing
    is gathered in float8 (no ZeRO-2/3, or rowwise: torchao gathers tensorwise weights only)."""
    if recipe != "tensorwise" or plan.dp is None or plan.dp.zero < 2:
        return plan, None
    c, _ = recipe_config(recipe)
    dtype = str(c.cast_config_weight.target_dtype).replace("torch.", "")
    on = {r.path for r in rows if r.fp8} - {r.path for r in rows if not r.fp8}
    data = ("_".join(plan.dp.zero_axes),)
    gathers = [c for c in plan.collectives if c.kind == "all_gather" and c.axis in data
               and c.direction != "step"]  # fmt: skip
    float8 = [c for c in gathers if c.where in on]
    if not float8:
        return plan, None
    changed = {id(c): replace(c, dtype=dtype, bytes=math.prod(c.shape)) for c in float8}
    before = sum(c.bytes for c in gathers)
    after = before - sum(c.bytes - changed[id(c)].bytes for c in float8)
    layer = [c for c in gathers if _LAYER.search(c.where)]
    elems = sum(math.prod(c.shape) for c in layer)
    per_param = 2.0 - sum(math.prod(c.shape) for c in float8) / max(elems, 1)
    note = (f"fp8: ZeRO-{plan.dp.zero} all-gathers the weights of the float8 linears in {dtype} "
            "(torchao's FSDP2 float8 all-gather: each shard cast before the gather with the "
            "whole weight's scale, amax all-reduced over the data axis and the axes splitting "
            f"it): the data axis's gathers {_fmt_bytes(before)} -> {_fmt_bytes(after)} of whole "
            "tensors per step")  # fmt: skip
    collectives = tuple(changed.get(id(c), c) for c in plan.collectives)
    return replace(plan, collectives=collectives, notes=(*plan.notes, note)), max(per_param, 1.0)


_LAYER = re.compile(r"\.\d+(\.|$)")  # a module path inside a repeated block (layers.3.wq)


def _patterns(paths: Iterable[str]) -> list[str]:
    """Module paths with layer indices as ``*`` (``layers.*.wq``), each once, in order."""
    return list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$| )", ".*", p) for p in paths))
