"""compile_blocks: ``autoparallelize(..., compile=...)``, the last pass on each materialized
stage (after recompute) before codegen shards it.

Algorithm:
1. Outline the repeated blocks (:func:`autopar.codegen.outline_blocks`) unless the recompute
   pass already did (a "full" program: each block under ``checkpoint``).
2. Turn each block call into ``compiled(layers_0, ..., backend=...)`` (autopar.ops.compiled:
   the block's forward under ``torch.compile``, one compile per distinct block), a
   checkpointed one into ``compiled(..., recompute=True)``, and with
   ``micro_pipeline_tp=True`` where inductor's micro-pipelined TP runs the tp pairs
   (section "micro_pipeline_tp").  A program without separable blocks is left eager, with a
   warning naming the model.
"""

from __future__ import annotations

import warnings

import torch.fx as fx

from autopar.axes.recompute import checkpoint
from autopar.codegen import outline_blocks
from autopar.ir import meta
from autopar.ops.compiled import compiled
from passes import PassContext

ORIGIN = "compile_blocks"


def compile_blocks(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Steps 1-2 (a new module: the blocks outlined)."""
    backend = ctx.sections["compile"]
    pipelined = {"micro_pipeline_tp": True} if ctx.sections.get("micro_pipeline_tp") else {}
    recomputed = any(n.target is checkpoint for n in gm.graph.nodes)  # a "full" program
    outlined = gm if recomputed else outline_blocks(gm)
    if outlined is None:
        warnings.warn(f"compile=: no repeated blocks found in {ctx.traced.model_name} (an indexed "
                      "list of layers reading only their own parameters); its program runs "
                      "eagerly", stacklevel=2)  # fmt: skip
        return gm
    graph = outlined.graph
    for node in list(graph.nodes):
        if node.op == "call_module":
            with graph.inserting_before(node):
                region = graph.get_attr(node.target)
            args, extra = (region, *node.args), {}
        elif node.op == "call_function" and node.target is checkpoint:
            args, extra = node.args, {"recompute": True}
        else:
            continue
        with graph.inserting_before(node):
            call = graph.call_function(compiled, args, {"backend": backend, **extra, **pipelined})
        call.meta.update(node.meta)
        meta.update(call, origin=ORIGIN)
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    graph.lint()
    outlined.recompile()
    outlined.meta = {**outlined.meta, "compile": backend}
    return outlined
