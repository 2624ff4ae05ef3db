"""global_batch: statistics over the batch made global over a batch axis (dp, ep).

A batch axis runs the program of the rest of the mesh on its slice of the batch; a loss term
that is a non-linear function of means over the batch (an MoE load-balancing loss) computed
on a slice is not the single-device value.  Runs on a materialized program (or, for dp, a
rank's) with ``ctx.sections["batch"]`` the batch axis and the loss reduction
(autopar.axes.batch_stats.BatchDecisions).

Algorithm:
1. The boundaries: reductions over the batch whose result feeds a non-linear loss term
   (autopar.axes.batch_stats.boundaries, which states how they are found).
2. A loss that is a sum over the batch (not a mean) would count a global term once per rank
   at the output: an error naming the statistic.
3. Each boundary is replaced by ``batch_mean`` over the axis: forward the mean over the ranks
   (each rank holds an equal slice, so a per-rank mean, or a per-rank sum later divided by
   the per-rank count, becomes the global one); backward the mean of the ranks' gradients
   (each rank's share of the global statistic's gradient, so the gradients sum right after
   the axis's reduction).
"""

from __future__ import annotations

import torch.fx as fx

from autopar.axes.batch_stats import BatchDecisions, boundaries
from autopar.errors import InputError
from autopar.ir import meta
from autopar.ops import collectives as C
from passes import PassContext


def global_batch(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Steps 1-3, in place."""
    decided: BatchDecisions = ctx.section("batch")
    globalize(gm, decided.axis, decided.reduction, decided.model)
    return gm


def globalize(gm: fx.GraphModule, axis: str, reduction: str, model: str = "the model") -> list[str]:
    """Steps 1-3 on ``gm`` in place; returns the names of the statistics made global."""
    graph = gm.graph
    found = boundaries(graph)
    if found and reduction == "sum":
        node = found[0]
        raise InputError(f"{model}: '{node.name}' ({meta.source(node)}) is a statistic over the "
                         "batch feeding a non-linear loss term, and the loss is a sum over the "
                         f"batch: the {axis} ranks would add the global term once each; use a "
                         "loss that is a mean over the batch")  # fmt: skip
    for node in found:
        with graph.inserting_after(node):
            mean = graph.call_function(C.batch_mean, (node, axis))
        mean.meta.update(node.meta)
        meta.update(mean, origin="global_batch")
        node.replace_all_uses_with(mean, delete_user_cb=lambda u, m=mean: u is not m)
    if found:
        graph.lint()
        gm.recompile()
    return [n.name for n in found]
