"""recompute: activation recomputation (``autoparallelize(..., recompute=...)``), the last
pass on each materialized stage before codegen shards it.

Runs with the mode the program was compiled to (``ctx.sections["recompute"]``,
autopar.axes.recompute.RecomputeDecisions; that module checks and prices the mode).

Algorithm:
1. "full": outline the repeated blocks (:func:`autopar.codegen.outline_blocks`: each block
   one submodule holding its parameters under their own names, ops on parameters alone such
   as a replicated weight's ``grad_all_reduce`` moved into their block) and turn each block
   call into ``checkpoint(layers_0, ...)`` (``torch.utils.checkpoint``, non-reentrant).  A
   program without separable blocks is an error naming the model.  Codegen's shard step
   slices each block's parameters by the layouts its graph carries.
2. "selective": group the attention-core nodes into connected regions
   (autopar.axes.recompute.core_regions); each region whose values are used only after its
   last node becomes a submodule (``layers.0.attention_core``) called as ``checkpoint(...)``.
   A fused SDPA has no core (it never keeps the scores): nothing to do.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.axes.recompute import (
    RecomputeDecisions,
    RecomputeError,
    _no_blocks,
    check_mode,
    checkpoint,
    core_regions,
)
from autopar.codegen import _block_container, _owning_block, outline_blocks, segment_graph
from autopar.ir import meta
from passes import PassContext

ORIGIN = "recompute"


def recompute(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Step 1 or 2: ``gm`` with its recomputed regions under ``checkpoint`` (``gm`` itself
    for "none", or "selective" without an unfused attention core)."""
    decided: RecomputeDecisions = ctx.sections["recompute"]
    if check_mode(decided.mode) == "none":
        return gm
    if decided.mode == "full":
        return _checkpoint_blocks(gm, decided.model)
    return _checkpoint_cores(gm)


def _checkpoint_blocks(gm: fx.GraphModule, model: str) -> fx.GraphModule:
    """Step 1 (a new module: the blocks outlined)."""
    outlined = outline_blocks(gm)
    if outlined is None:
        raise RecomputeError(_no_blocks(model))
    graph = outlined.graph
    for node in [n for n in graph.nodes if n.op == "call_module"]:
        with graph.inserting_before(node):
            call = graph.call_function(checkpoint, node.args)
        call.meta.update(node.meta)
        meta.update(call, origin=ORIGIN)
        node.replace_all_uses_with(call)
        name = node.name
        graph.erase_node(node)
        used = getattr(graph._graph_namespace, "_used_names", set())
        used.discard(name)  # the freed name: the block's read prints as layers_0
        with graph.inserting_before(call):
            region = graph.get_attr(node.target)
        call.args = (region, *call.args)
    outlined.recompile()
    outlined.meta = {**outlined.meta, "recompute": "full"}
    return outlined


def _checkpoint_cores(gm: fx.GraphModule) -> fx.GraphModule:
    """Step 2, in place."""
    if not core_regions(gm):
        return gm
    container = _block_container(list(gm.graph.nodes))
    for k, region in enumerate(core_regions(gm)):
        block = _owning_block(region[-1], container) if container is not None else None
        prefix = "" if block is None else (f"{container}.{block}." if container else f"{block}.")
        name = f"{prefix}attention_core" if block is not None else f"attention_core_{k}"
        if _has(gm, name):
            name = f"{name}_{k}"
        _outline_region(gm, region, name)
    gm.graph.lint()
    gm.recompile()
    return gm


def _outline_region(gm: fx.GraphModule, region: list[fx.Node], name: str) -> None:
    """Replace ``region`` by ``checkpoint(<name>, inputs...)`` and getitems of its outputs."""
    members = set(region)
    sub, inputs, outputs = segment_graph(region)
    gm.add_submodule(name, fx.GraphModule(gm, sub, class_name="AttentionCore"))
    graph = gm.graph
    first = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
    with graph.inserting_before(first):  # with the parameter reads (outline_blocks wants so)
        attr = graph.get_attr(name)
    with graph.inserting_after(region[-1]):
        call = graph.call_function(checkpoint, (attr, *inputs))
    call.meta.update({k: v for k, v in region[-1].meta.items() if k != "val"})
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    meta.update(call, origin=ORIGIN)
    prev = call
    for i, o in enumerate(outputs):
        with graph.inserting_after(prev):
            got = graph.call_function(operator.getitem, (call, i))
        got.meta.update(o.meta)
        meta.update(got, origin=ORIGIN)
        o.replace_all_uses_with(got, delete_user_cb=lambda u: u not in members)
        prev = got
    for n in reversed(region):
        graph.erase_node(n)


def _has(gm: torch.nn.Module, name: str) -> bool:
    try:
        gm.get_submodule(name)
    except AttributeError:
        return False
    return True
