"""Collective matmuls: a tp gather or scatter decomposed into ring steps under its matmuls.

Megatron-SP's pairs, each decomposed into ``t`` chunks exchanged over the ring of the tp axis
(send to rank + 1, receive from rank - 1) while the partial matmuls run (Wang et al. 2023,
"Overlap communication with dependent computation via decomposition"; torch's async TP):

- ``gather_linear(x, weights, biases, axis, dim)``: ``linear(all_gather(x, dim), w_i, b_i)``
  for every column-split ``w_i`` that reads the gathered value.  Forward (:func:`_ring_gather`):
  step s multiplies the chunk of rank r - s while the next chunk travels; a chunk of a dim the
  matmul keeps fills its rows of each output, a chunk of the contracted (last) dim adds its
  partial product.  It keeps only this rank's shard ``x`` for backward (Megatron-SP's
  memory: s/t rows, not the gathered s).  Backward: the input's gradient as a ring
  reduce-scatter (:func:`_ring_scatter`) whose partial matmuls run under the accumulators'
  hops, then each weight's gradient over a ring re-gather of ``x`` (:func:`_regather_grads`),
  each step's partial weight gradient under the next chunk's hop.  ``ring=False`` keeps the
  gather and the input's reduce-scatter whole (the planner found decomposing them slower)
  and still keeps only the shard, re-gathered the same way.
- ``linear_scatter(h, w, axis, dim)``: ``reduce_scatter(linear(h, w), dim)`` of a row-split
  ``w`` (partial sums).  Forward: :func:`_ring_scatter` (step s computes this rank's partial of
  output block r - 1 - s while the accumulated block travels).  Backward: the gradient
  all-gathered over the ring under the input-gradient matmuls (:func:`_ring_gather`), the
  weight's gradient from the gathered gradient.

Every chunk is the same size (the dim divides by the axis size: the split it came from), so
the ring steps are equal.  The sums run in another order than the unfused collective's
(equal to round-off).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from autopar.ops.collectives import _gather, _scatter, axis_rank, axis_size, graph_op
from autopar.ops.cp_ops import _Exchange

EXCHANGES = "tp"  # the counter key of the ring steps (autopar.ops.cp_ops.reset_exchanges)


def _ring_gather(x: torch.Tensor, axis: str, use: Callable[[torch.Tensor, int], None]) -> list:
    """All-gather ``x`` over the ring of ``axis``, calling ``use(chunk, source rank)`` on each
    chunk while the next one is in flight; the chunks, by source rank."""
    n, r = axis_size(axis), axis_rank(axis)
    chunks: list[torch.Tensor | None] = [None] * n
    held = x.detach().contiguous()
    for s in range(n):
        src = (r - s) % n
        pending = _Exchange([held], axis, EXCHANGES) if s < n - 1 else None
        use(held, src)
        chunks[src] = held
        if pending is not None:
            held = pending.result()[0]
    return chunks


def _ring_scatter(axis: str, part: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """Reduce-scatter over the ring of ``axis`` where ``part(block)`` is this rank's partial of
    output block ``block``: at step s this rank computes block r - 1 - s, adds the sum that
    arrived for it and sends it on; the last step's is this rank's block, whole."""
    n, r = axis_size(axis), axis_rank(axis)
    pending, out = None, None
    for s in range(n):
        out = part((r - 1 - s) % n)
        if pending is not None:
            out = out + pending.result()[0]
        if s < n - 1:
            pending = _Exchange([out], axis, EXCHANGES)
    return out


def _block(t: torch.Tensor, dim: int, index: int, n: int) -> torch.Tensor:
    size = t.shape[dim] // n
    return t.narrow(dim, index * size, size)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _gather_matmuls(x: torch.Tensor, dim: int, n: int, weights: Sequence[torch.Tensor],
                    axis: str, transpose: bool) -> tuple[list[torch.Tensor], torch.Tensor]:  # fmt: skip
    """``gathered @ w_i.T`` (``transpose``) or ``gathered @ w_i`` for each weight, over the ring
    gather of ``x`` along ``dim``; (the products, the gathered ``x``)."""
    last = dim == x.dim() - 1
    width = [w.shape[0] if transpose else w.shape[1] for w in weights]
    full = list(x.shape)
    full[dim] *= n
    outs = [x.new_zeros(full[:-1] + [k]) if last else x.new_empty(full[:-1] + [k]) for k in width]

    def use(chunk: torch.Tensor, src: int) -> None:
        for out, w in zip(outs, weights, strict=True):
            if last:  # the contracted dim: a partial product over this chunk's columns
                part = _block(w, 1 if transpose else 0, src, n)
                out.add_(chunk @ (part.t() if transpose else part))
            else:
                _block(out, dim, src, n).copy_(chunk @ (w.t() if transpose else w))

    chunks = _ring_gather(x, axis, use)
    return outs, torch.cat(chunks, dim)


def _regather_grads(x: torch.Tensor, grads: Sequence[torch.Tensor], dim: int,
                    axis: str) -> list[torch.Tensor]:  # fmt: skip
    """``flat(g_i).T @ flat(all_gather(x, dim))`` for each output gradient ``g_i`` (the
    weights' gradients of a gathered linear), over a ring re-gather of the kept shard ``x``:
    each chunk's partial product while the next chunk travels (16-bit partials summed in
    fp32, as one matmul accumulates them)."""
    n = axis_size(axis)
    last = dim == x.dim() - 1
    k = x.shape[-1] * (n if last else 1)
    acc = torch.float32 if x.dtype.itemsize < 4 else x.dtype
    dws = [x.new_zeros(g.shape[-1], k, dtype=acc) for g in grads]

    def use(chunk: torch.Tensor, src: int) -> None:
        for dw, g in zip(dws, grads, strict=True):
            if last:  # the chunk holds columns src of the gathered input
                _block(dw, 1, src, n).copy_(_flat(g).t() @ _flat(chunk))
            else:  # the chunk holds rows src of dim: their gradient rows
                dw.add_(_flat(_block(g, dim, src, n)).t() @ _flat(chunk))

    _ring_gather(x, axis, use)
    return [dw.to(x.dtype) for dw in dws]


class _GatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, ring, has_bias, *tensors):  # noqa: ANN001, ANN205
        count = len(has_bias)
        weights, present = tensors[:count], iter(tensors[count:])
        biases = [next(present) if has else None for has in has_bias]
        n = axis_size(axis)
        if ring:
            outs, _ = _gather_matmuls(x, dim, n, weights, axis, transpose=True)
        else:
            gathered = _gather(x, axis, dim, 1)
            outs = [F.linear(gathered, w) for w in weights]
        for out, b in zip(outs, biases, strict=True):
            if b is not None:
                out.add_(b)
        ctx.save_for_backward(x, *weights)  # the shard: re-gathered in backward
        ctx.axis, ctx.dim, ctx.n, ctx.ring = axis, dim, n, ring
        ctx.has_bias = has_bias
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # noqa: ANN001, ANN205
        x, *weights = ctx.saved_tensors
        axis, dim, n = ctx.axis, ctx.dim, ctx.n
        last = dim == x.dim() - 1
        full = list(x.shape)
        full[dim] *= n
        grads = [x.new_zeros(*full[:-1], w.shape[0]) if g is None else g
                 for g, w in zip(grads, weights, strict=True)]  # fmt: skip

        def part(block: int) -> torch.Tensor:
            if last:
                return sum(g @ _block(w, 1, block, n) for g, w in zip(grads, weights, strict=True))
            return sum(_block(g, dim, block, n) @ w for g, w in zip(grads, weights, strict=True))

        dx = None
        if ctx.needs_input_grad[0]:
            if ctx.ring:
                dx = _ring_scatter(axis, part)
            else:
                dx = _scatter(sum(g @ w for g, w in zip(grads, weights, strict=True)), axis, dim, 1)
        dws = _regather_grads(x, grads, dim, axis)
        dbs = [_flat(g).sum(0) for g, has in zip(grads, ctx.has_bias, strict=True) if has]
        return (dx, None, None, None, None, *dws, *dbs)


class _LinearScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, axis, dim):  # noqa: ANN001, ANN205
        n = axis_size(axis)
        last = dim == h.dim() - 1

        def part(block: int) -> torch.Tensor:
            if last:
                return F.linear(h, _block(w, 0, block, n))
            return F.linear(_block(h, dim, block, n), w)

        ctx.save_for_backward(h, w)
        ctx.axis, ctx.dim, ctx.n = axis, dim, n
        return _ring_scatter(axis, part)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        h, w = ctx.saved_tensors
        (dh,), gathered = _gather_matmuls(g.contiguous(), ctx.dim, ctx.n, [w], ctx.axis,
                                          transpose=False)  # fmt: skip
        dw = _flat(gathered).t() @ _flat(h)
        return dh, dw, None, None


@graph_op
def gather_linear(x: torch.Tensor, weights: Sequence[torch.Tensor],
                  biases: Sequence[torch.Tensor | None], axis: str, dim: int,
                  ring: bool = True) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``tuple(linear(all_gather(x, axis, dim), w, b) for w, b in zip(weights, biases))``, the
    gather decomposed into ring steps under the matmuls (``ring``; else one whole gather);
    backward reduce-scatters the input's gradient the same way and re-gathers the kept shard
    for the weights' gradients (module docstring).  Only the biases present are the Function's
    inputs (dynamo, re-tracing it without autograd, misplaces a None among them)."""
    has_bias = tuple(b is not None for b in biases)
    return _GatherLinear.apply(x, axis, dim, ring, has_bias, *weights,
                               *(b for b in biases if b is not None))  # fmt: skip


@graph_op
def linear_scatter(h: torch.Tensor, w: torch.Tensor, axis: str, dim: int) -> torch.Tensor:
    """``reduce_scatter(linear(h, w), axis, dim)`` with the scatter decomposed into ring steps
    over the partial matmuls; backward all-gathers the gradient the same way."""
    return _LinearScatter.apply(h, w, axis, dim)
