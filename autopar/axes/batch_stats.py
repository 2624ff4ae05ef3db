"""Batch statistics made global: a loss term that is a non-linear function of means over the
batch (an MoE load-balancing loss: fraction of tokens per expert times mean routing
probability per expert, summed) computed on each data-like rank's slice is not the
single-device value, since a product of means is not the mean of per-rank products.

A data-like axis (dp, ep) runs the program of the rest of the mesh on B/size of the batch; a
linear loss (a mean of per-token terms) is made global at the output (``batch_loss`` for ep,
DDP's averaging for dp).  This pass finds, structurally, the reductions over the batch whose
result feeds a non-linear loss term (:func:`boundaries`); the ``global_batch`` pass
(passes/global_batch.py) makes each one global where it is computed.

Algorithm:
1. Rank-varying values: the forward cone of the user inputs (placeholders).  Batched values:
   user inputs with a dim, and everything computed from a batched value, except reductions
   over the batch: ``sum`` / ``mean`` / ``amax`` ... over dim 0 or over every dim,
   ``histc`` / ``bincount``, a loss with a mean or sum reduction, a scatter-add into a
   batch-free tensor.  The batch is dim 0 of the activations (the data axes split dim 0).
2. Statistics: floating batch-free rank-varying values whose every user is batch-free or the
   graph output (their forward cone never re-enters the batch: a loss head, not the MoE
   layer's own per-expert counts that group its tokens).  A boundary is a statistic with a
   batched input: a reduction over the batch.
3. A boundary whose forward cone is linear in the rank-varying values (adds, scalings by
   constants or parameters, views: a cross-entropy mean) is left to the output's reduction.
   Any other one (its cone multiplies two rank-varying values, divides by one, or applies a
   non-linear function) is a boundary the pass makes global (``batch_mean`` over the axis).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.plan import Collective

_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "logsumexp", "var", "std",
               "var_mean", "std_mean", "norm", "linalg_vector_norm", "prod", "nansum",
               "count_nonzero"}  # fmt: skip
_COUNTS = {"histc", "bincount"}
_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d_forward",
           "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "kl_div"}  # fmt: skip
_SCATTERS = {"scatter_add", "scatter_add_", "index_add", "index_add_", "scatter_reduce",
             "scatter_reduce_", "index_put", "index_put_"}  # fmt: skip
_LINEAR = {"add", "add_", "sub", "sub_", "neg", "view", "reshape", "unsqueeze", "squeeze",
           "expand", "to", "_to_copy", "clone", "alias", "contiguous", "getitem", "select",
           "slice", "cat", "stack", "transpose", "permute", "t", "sum", "mean", "batch_mean",
           "batch_loss"}  # fmt: skip
_SCALED = {"mul", "mul_", "div", "div_"}  # linear when one side is not rank-varying


@dataclass(frozen=True, kw_only=True)
class BatchDecisions:
    """What the ``global_batch`` pass reads (``PassContext.sections["batch"]``)."""

    axis: str  # the batch axis the statistics become global over (dp, ep)
    reduction: str  # the loss's reduction over the batch ("mean", "sum")
    model: str  # the model's name, for errors


def _name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def _tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _data(node: fx.Node) -> list[fx.Node]:
    """The inputs that carry tensor data (not a device or a size)."""
    return [a for a in node.all_input_nodes
            if any(isinstance(v, torch.Tensor) for v in _leaves(a.meta.get("val")))]  # fmt: skip


def _leaves(val: object) -> list:
    return list(val) if isinstance(val, (tuple, list)) else [val]


def rank_varying(graph: fx.Graph) -> set[fx.Node]:
    """Step 1: the values computed from the user inputs."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or any(a in out for a in _data(node)):
            if node.op != "output":
                out.add(node)
    return out


def batched(graph: fx.Graph) -> set[fx.Node]:
    """Step 1: the values that carry the batch (dim 0 of the activations)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor) and val.dim():
                out.add(node)
        elif node.op == "call_function" and any(a in out for a in _data(node)):
            if not _reduces_batch(node, out):
                out.add(node)
    return out


def _reduces_batch(node: fx.Node, found: set[fx.Node]) -> bool:
    name = _name(node)
    if name in _COUNTS:
        return True
    if name in _LOSSES:
        return _loss_reduces(node)
    if name in _SCATTERS:
        return node.args[0] not in found
    if name not in _REDUCTIONS or not isinstance(node.args[0], fx.Node):
        return False
    dims = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if dims is None or dims == []:
        return True
    rank = node.args[0].meta["val"].dim() if _tensor(node.args[0]) else 1
    dims = [dims] if isinstance(dims, int) else list(dims)
    return 0 in {d % max(rank, 1) for d in dims if isinstance(d, int)}


def _loss_reduces(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


def statistics(graph: fx.Graph, varying: set[fx.Node], batch: set[fx.Node]) -> set[fx.Node]:
    """Step 2: floating batch-free rank-varying values whose cone stays batch-free."""
    out: set[fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op != "call_function" or node not in varying or node in batch:
            continue
        val = node.meta.get("val")
        floating = isinstance(val, torch.Tensor) and val.is_floating_point()
        if floating and all(u in out or u.op == "output" for u in node.users):
            out.add(node)
    return out


def boundaries(graph: fx.Graph) -> list[fx.Node]:
    """Steps 1-3: the reductions over the batch that feed a non-linear loss term."""
    varying, batch = rank_varying(graph), batched(graph)
    stats = statistics(graph, varying, batch)
    found = []
    for node in graph.nodes:
        if node in stats and any(a in batch for a in _data(node)):
            if not _linear_cone(node, stats, varying):
                found.append(node)
    return found


def _linear_cone(start: fx.Node, stats: set[fx.Node], varying: set[fx.Node]) -> bool:
    todo, seen = [u for u in start.users if u.op != "output"], set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if not _linear(node, varying):
            return False
        todo.extend(u for u in node.users if u.op != "output")
    return True


def _linear(node: fx.Node, varying: set[fx.Node]) -> bool:
    name = _name(node)
    if name in _LINEAR:
        return True
    if name not in _SCALED:
        return False
    inputs = [a for a in node.args if isinstance(a, fx.Node) and a in varying]
    return len(inputs) == 1 and (name.startswith("mul") or node.args[0] is inputs[0])


def statistic_collectives(gm: fx.GraphModule, axis: str) -> list[Collective]:
    """The all-reduces the ``global_batch`` pass adds to ``gm`` (forward and backward
    per statistic), listed as part of the loss."""
    out = []
    for node in boundaries(gm.graph):
        val = node.meta["val"]
        for direction in ("fwd", "bwd"):
            out.append(Collective(kind="all_reduce", axis=axis, shape=tuple(val.shape),
                                  dtype=str(val.dtype).replace("torch.", ""),
                                  bytes=val.numel() * val.element_size(), direction=direction,
                                  where="loss"))  # fmt: skip
    return out
