"""Op lowerings that a split needs beyond moving data: each runs on local shards and knows its
rank along the axis at run time, so every rank along an axis runs the same program.

- ``vocab_parallel_embedding``: each rank owns a contiguous V/t slice of the table; ids outside
  it read zeros, so the output is a partial sum.
- ``vocab_parallel_cross_entropy``: logits split on the vocab; one all-reduce(max) and one
  all-reduce(sum) of [N, 2] values give the loss; the backward needs no communication.
- ``local_kv_heads``: with fewer KV heads than ranks, each rank keeps the KV head its query
  heads attend to.
- ``local_expert_ids``: under expert parallelism, each dispatched row's index among this
  rank's experts (a per-expert bias gathered by it).
- ``on_first_rank``: a replicated addend of a partial sum, kept on rank 0 (zeros elsewhere),
  so the sum's parts add it once; its gradient is rank 0's, a partial sum too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopar.ops.collectives import axis_rank, axis_size, graph_op, group


@graph_op
def vocab_parallel_embedding(
    weight: torch.Tensor, ids: torch.Tensor, axis: str, padding_idx: int = -1
) -> torch.Tensor:
    """Look up ``ids`` in this rank's rows of the table; other rows contribute zeros."""
    rows = weight.shape[0]
    start = axis_rank(axis) * rows
    local = ids - start
    mask = (local >= 0) & (local < rows)
    pad = padding_idx - start if 0 <= padding_idx - start < rows else -1
    out = F.embedding(local.clamp(0, rows - 1), weight, padding_idx=pad if pad >= 0 else None)
    return out * mask.unsqueeze(-1).to(out.dtype)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, axis: str, ignore_index: int, reduction: str):
        x = logits.float()
        rows = x.shape[1]
        start = axis_rank(axis) * rows
        m = x.max(dim=1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group(axis))
        e = torch.exp(x - m[:, None])
        local = target - start
        hit = (local >= 0) & (local < rows) & (target != ignore_index)
        idx = local.clamp(0, rows - 1)
        picked = torch.where(hit, x.gather(1, idx[:, None]).squeeze(1), 0.0)  # -inf pads
        both = torch.stack([e.sum(dim=1), picked], dim=1)
        dist.all_reduce(both, group=group(axis))
        lse = torch.log(both[:, 0]) + m
        valid = target != ignore_index
        per_row = (lse - both[:, 1]) * valid
        count = valid.sum().clamp(min=1).to(x.dtype)
        ctx.save_for_backward(e, both[:, 0], idx, hit, valid, count)
        ctx.reduction, ctx.dtype = reduction, logits.dtype
        if reduction == "mean":
            return per_row.sum() / count
        return per_row.sum() if reduction == "sum" else per_row

    @staticmethod
    def backward(ctx, g):
        e, total, idx, hit, valid, count = ctx.saved_tensors
        grad = e / total[:, None]
        grad.scatter_add_(1, idx[:, None], -hit.to(grad.dtype)[:, None])
        grad = grad * valid[:, None]
        scale = g / count if ctx.reduction == "mean" else g
        grad = grad * (scale[:, None] if scale.dim() == 1 else scale)
        return grad.to(ctx.dtype), None, None, None, None


_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


@graph_op
def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    axis: str,
    reduction: int = 1,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy of vocab-split logits [N, V/t] without gathering them."""
    return _VocabParallelCE.apply(logits, target, axis, ignore_index, _REDUCTIONS[reduction])


@graph_op
def on_first_rank(x: torch.Tensor, axis: str) -> torch.Tensor:
    """``x`` on rank 0 of ``axis``, zeros on the others (and so its gradient); the autograd
    graph stays connected on every rank, so a collective in ``x``'s backward runs on all."""
    return _OnFirstRank.apply(x, axis)


class _OnFirstRank(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor, axis: str) -> torch.Tensor:  # noqa: D102
        ctx.first = axis_rank(axis) == 0
        return x.clone() if ctx.first else torch.zeros_like(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return (grad if ctx.first else torch.zeros_like(grad)), None


@graph_op
def local_kv_heads(kv: torch.Tensor, axis: str) -> torch.Tensor:
    """The KV head (dim 1) that this rank's query heads use, when heads < ranks."""
    heads, t = kv.shape[1], axis_size(axis)
    return kv.narrow(1, axis_rank(axis) // (t // heads), 1)


def local_expert_ids(offs: torch.Tensor) -> torch.Tensor:
    """Each row's (local) expert index, from cumulative rows per expert."""
    counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
    return torch.repeat_interleave(torch.arange(counts.numel()), counts)
