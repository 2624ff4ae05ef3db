"""Autograd-aware collectives over the process group bound to a mesh axis.

Each op names its mesh axis and its backward, so a printed program says exactly what crosses
the wire in both directions:

- ``all_reduce(x, axis, grad)``: partial -> replicated.  Backward: identity, or an all-reduce
  when the consumers make the gradient partial (Megatron's g / f pair fused).
- ``all_gather(x, axis, dim, blocks, grad)``: split -> replicated.  Backward: take the local
  slice, or reduce-scatter when the gradient is partial (Megatron-SP's gather).
- ``reduce_scatter(x, axis, dim, blocks)``: partial -> split.  Backward: all-gather.
- ``split(x, axis, dim, blocks)``: replicated -> split, locally.  Backward: all-gather.
- ``all_to_all(x, axis, src_dim, dst_dim)``: split on one dim -> split on another.
- ``grad_all_reduce(x, axis)``: identity forward, all-reduce backward (Megatron's f).
- ``grad_sum_shared(x, axis, rep)``: identity forward on a shared split (each piece held by
  ``rep`` consecutive ranks); backward sums the gradient over the ranks sharing the piece
  (one all-reduce of the piece on the sub-group of those ``rep`` ranks, ``axis/rep``).
- ``unshare(x, axis, dim, rep)``: a shared split (each piece on ``rep`` consecutive ranks) ->
  the plain split of the same dim, locally: each sharer keeps its 1/rep of the piece (HF's
  ``repeat_kv`` of a shared K/V head into this rank's query heads).  Backward: the gradient
  padded with zeros (each sharer's part of the piece's gradient; their sum is whole).
- ``grad_partial(x, axis)``: identity forward; backward keeps a whole gradient on the axis'
  rank 0 only (zeros elsewhere), so it joins partial gradients one later reduction sums.
- ``expert_dispatch(rows, offs, axis)``: rows grouped by expert -> this rank's experts' rows
  from every rank (a count exchange, then a variable-split all-to-all).  Backward: the
  inverse all-to-all.  ``expert_combine`` is its inverse (backward: the dispatch's).
- ``batch_loss(x, axis, reduction)``: a per-rank scalar loss -> the global one (mean or sum of
  a scalar over ``axis``); backward keeps this rank's gradient (scaled 1/size for a mean).
- ``batch_mean(x, axis)``: a rank's statistic over its batch slice -> the mean over ``axis``
  (the global statistic).  Backward: the mean of the ranks' gradients (each rank's share).

A split dim with ``blocks`` > 1 is viewed as ``[blocks, n/blocks]`` and each block is split.
Groups are bound per axis with :func:`bind` (``autopar.runtime`` does it); the sub-groups of
the ranks sharing a piece are bound as ``"<axis>/<rep>"`` (:func:`shared_groups` lists them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as ft_c
import torch.fx as fx

_GROUPS: dict[str, dist.ProcessGroup] = {}
_LOAD: list[tuple[list[int], int]] = []  # per dispatch: rows per local expert, rows dropped


def bind(groups: Mapping[str, dist.ProcessGroup]) -> None:
    """Bind mesh axis names to process groups for the ops in this module."""
    _GROUPS.clear()
    _GROUPS.update(groups)


def group(axis: str) -> dist.ProcessGroup:
    if axis not in _GROUPS:
        raise RuntimeError(
            f"mesh axis {axis!r} is not bound to a process group; run the program through "
            "autopar.autoparallelize(model, device_mesh, ...) or autopar.runtime.bind_mesh()"
        )
    return _GROUPS[axis]


def shared_key(axis: str, rep: int) -> str:
    """The bound name of the sub-groups of ``rep`` consecutive ranks of ``axis``."""
    return f"{axis}/{rep}"


SHARED_AXES = ("tp",)  # the axes whose planner offers shared splits (K/V heads over tp)


def shared_groups(name: str, axis_groups: Sequence[Sequence[int]]) -> list[tuple[str, list[int]]]:
    """Every sub-group a shared split of axis ``name`` can reduce over: for each replication
    count ``rep`` properly dividing the axis size, each group's ranks (in axis order) cut into
    runs of ``rep`` (the ranks holding one piece).  Every worker creates them, in this order;
    none for an axis outside ``SHARED_AXES``."""
    out: list[tuple[str, list[int]]] = []
    if name not in SHARED_AXES:
        return out
    for ranks in axis_groups:
        size = len(ranks)
        for rep in range(2, size):
            if size % rep == 0:
                out += [(shared_key(name, rep), list(ranks[i:i + rep]))
                        for i in range(0, size, rep)]  # fmt: skip
    return out


def axis_rank(axis: str) -> int:
    return dist.get_rank(group(axis))


def axis_size(axis: str) -> int:
    return dist.get_world_size(group(axis))


def graph_op(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``fn`` a leaf for fx: symbolic tracing (e.g. unpickling a program) records a call
    to it instead of running it."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        proxy = next((a for a in (*args, *kwargs.values()) if isinstance(a, fx.Proxy)), None)
        if proxy is not None:
            return proxy.tracer.create_proxy("call_function", wrapper, args, kwargs)
        return fn(*args, **kwargs)

    return wrapper


# ---------------------------------------------------------------- raw (non-autograd) kernels


def _all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    y = x.contiguous().clone()
    dist.all_reduce(y, group=group(axis))
    return y


def _gather(x: torch.Tensor, axis: str, dim: int, blocks: int) -> torch.Tensor:
    if blocks == 1 and torch.compiler.is_compiling():  # the form inductor's async TP matches
        return ft_c.all_gather_tensor(x.contiguous(), dim, group(axis))
    t = axis_size(axis)
    xt = x.movedim(dim, 0)
    n, rest = xt.shape[0], xt.shape[1:]
    if blocks == 1 and dim == 0:  # every rank's shard lands in place: no re-arrangement
        out = xt.new_empty((t * n, *rest))
        dist.all_gather_single(out, xt.contiguous(), group=group(axis))
        return out
    xt = xt.reshape(blocks, n // blocks, *rest).contiguous()
    out = xt.new_empty((t * blocks, *xt.shape[1:]))
    dist.all_gather_single(out, xt, group=group(axis))
    out = out.view(t, *xt.shape).transpose(0, 1).reshape(n * t, *rest)
    return _fresh(out.movedim(0, dim))


def _scatter(x: torch.Tensor, axis: str, dim: int, blocks: int) -> torch.Tensor:
    if blocks == 1 and torch.compiler.is_compiling():  # the form inductor's async TP matches
        return ft_c.reduce_scatter_tensor(x.contiguous(), "sum", dim, group(axis))
    t = axis_size(axis)
    xt = x.movedim(dim, 0)
    n, rest = xt.shape[0], xt.shape[1:]
    send = xt.reshape(blocks, t, n // (blocks * t), *rest).transpose(0, 1).contiguous()
    out = xt.new_empty((n // t, *rest))  # this rank's blocks, in order
    dist.reduce_scatter_single(out, send.view(n, *rest), group=group(axis))
    return _fresh(out.movedim(0, dim)) if dim else out


def _slice(x: torch.Tensor, axis: str, dim: int, blocks: int) -> torch.Tensor:
    t, r = axis_size(axis), axis_rank(axis)
    xt = x.movedim(dim, 0)
    shape = xt.shape
    part = xt.reshape(blocks, t, shape[0] // (blocks * t), *shape[1:])[:, r]
    return _fresh(part.reshape(shape[0] // t, *shape[1:]).movedim(0, dim))


def _exchange(x: torch.Tensor, axis: str, src_dim: int, dst_dim: int) -> torch.Tensor:
    t = axis_size(axis)
    send = torch.stack(x.chunk(t, dim=dst_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group(axis))
    return _fresh(torch.cat(recv.unbind(0), dim=src_dim))


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous tensor that owns its memory.

    A collective's output feeds code written for the global tensor: a ``view`` there assumes
    row-major strides, and an in-place op is refused by autograd on a custom Function's output
    that is a view.  So raw kernels copy only when their result is strided or a view."""
    if not x.is_contiguous():
        return x.contiguous()
    return x.clone() if x._is_view() else x


# ---------------------------------------------------------------- autograd functions


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: str, grad: str) -> torch.Tensor:
        ctx.axis, ctx.grad = axis, grad
        return _all_reduce(x, axis)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return (_all_reduce(g, ctx.axis) if ctx.grad == "all_reduce" else g), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: str, dim: int, blocks: int, grad: str) -> torch.Tensor:
        ctx.args = (axis, dim, blocks)
        ctx.grad = grad
        return _gather(x, axis, dim, blocks)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        fn = _scatter if ctx.grad == "reduce_scatter" else _slice
        return fn(g, *ctx.args), None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: str, dim: int, blocks: int) -> torch.Tensor:
        ctx.args = (axis, dim, blocks)
        return _scatter(x, axis, dim, blocks)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _gather(g, *ctx.args), None, None, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: str, dim: int, blocks: int) -> torch.Tensor:
        ctx.args = (axis, dim, blocks)
        return _slice(x, axis, dim, blocks)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _gather(g, *ctx.args), None, None, None


class _Unshare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: str, dim: int, rep: int) -> torch.Tensor:
        n = x.shape[dim] // rep
        ctx.args = (dim, axis_rank(axis) % rep * n, x.shape[dim])
        return x.narrow(dim, ctx.args[1], n).contiguous()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        dim, start, whole = ctx.args
        shape = list(g.shape)
        shape[dim] = whole
        out = g.new_zeros(shape)
        out.narrow(dim, start, g.shape[dim]).copy_(g)
        return out, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: str, src_dim: int, dst_dim: int) -> torch.Tensor:
        ctx.args = (axis, src_dim, dst_dim)
        return _exchange(x, axis, src_dim, dst_dim)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        axis, src_dim, dst_dim = ctx.args
        return _exchange(g, axis, dst_dim, src_dim), None, None, None


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: str) -> torch.Tensor:
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _all_reduce(g, ctx.axis), None


class _GradSumShared(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: str, rep: int) -> torch.Tensor:
        ctx.axis, ctx.rep = axis, rep
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        total = g.contiguous().clone()
        dist.all_reduce(total, group=group(shared_key(ctx.axis, ctx.rep)))
        return total, None, None


_PENDING: dict[str, tuple[int, torch.Tensor]] = {}  # bucket key -> (backwards seen, their sum)


class _GradPartial(_GradAllReduce):  # the same identity forward
    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return (g if axis_rank(ctx.axis) == 0 else torch.zeros_like(g)), None


class _GradBucketAllReduce(torch.autograd.Function):
    """Identity forward on several tensors; backward, once all their gradients are ready, one
    all-reduce of them flattened into a bucket (a missing gradient counts as zeros).  With
    ``micro`` > 1 (pipeline micro-batches) the first micro - 1 backwards of the bucket (keyed
    by ``key``) only add up locally and return zeros; the last all-reduces the sum."""

    @staticmethod
    def forward(ctx, axis: str, key: str, micro: int, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.axis, ctx.key, ctx.micro = axis, key, micro
        ctx.shapes = [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        flat = torch.cat([(g if g is not None else torch.zeros(s, dtype=t, device=d)).reshape(-1)
                          for g, (s, t, d) in zip(grads, ctx.shapes, strict=True)])  # fmt: skip
        if ctx.micro == 1:
            dist.all_reduce(flat, group=group(ctx.axis))
        elif torch.compiler.is_compiling():  # the pending sum is state dynamo cannot trace
            flat = _bucket_sum_op(flat, ctx.axis, ctx.key, ctx.micro)
        else:
            flat = _bucket_sum(flat, ctx.axis, ctx.key, ctx.micro)
        parts = flat.split([s.numel() for s, _, _ in ctx.shapes])
        return None, None, None, *(p.view(s) for p, (s, _, _) in
                                   zip(parts, ctx.shapes, strict=True))  # fmt: skip


def _bucket_sum(flat: torch.Tensor, axis: str, key: str, micro: int) -> torch.Tensor:
    """One micro-batch's flat bucket gradient: zeros (kept in ``_PENDING``) until the last of
    ``micro``, which returns the all-reduced sum of them all."""
    seen, total = _PENDING.pop(key, (0, None))
    flat = flat if total is None else total + flat
    if seen + 1 < micro:
        _PENDING[key] = (seen + 1, flat)
        return torch.zeros_like(flat)
    dist.all_reduce(flat, group=group(axis))
    return flat


@torch.library.custom_op("autopar::bucket_sum", mutates_args=())
def _bucket_sum_op(flat: torch.Tensor, axis: str, key: str, micro: int) -> torch.Tensor:
    return _bucket_sum(flat.clone(), axis, key, micro)


@_bucket_sum_op.register_fake
def _(flat: torch.Tensor, axis: str, key: str, micro: int) -> torch.Tensor:
    return torch.empty_like(flat)


class _Route(NamedTuple):
    """How one MoE layer's rows travel, from its [2, size, experts/size] (received, sent)
    counts: the received rows' positions in expert-major order, the kept rows (None when
    nothing is dropped) and the all-to-all's send / receive splits per rank."""

    order: torch.Tensor
    kept: torch.Tensor | None
    sent: list[int]
    received: list[int]


def _route(counts: torch.Tensor, offs: torch.Tensor) -> _Route:
    recv, send = counts[0], counts[1]
    full = _counts(offs)
    kept = None if torch.equal(full, send.flatten()) else _kept_rows(full, send.flatten())
    return _Route(_expert_major(recv), kept, send.sum(1).tolist(), recv.sum(1).tolist())


def _exchange_counts(offs: torch.Tensor, axis: str, capacity: float) -> torch.Tensor:
    """The [2, size, experts/size] (received, sent) row counts of a dispatch (the count
    exchange, the capacity rule); records the rows per local expert and the dropped rows in
    ``_LOAD``."""
    full = _counts(offs).view(axis_size(axis), -1)
    send = _capped(full, capacity, axis) if capacity > 0 else full
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group(axis))
    _LOAD.append((recv.sum(0).tolist(), int((full - send).sum())))
    return torch.stack([recv, send])


def _local_offs(counts: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Cumulative offsets of this rank's experts' received rows."""
    return torch.cumsum(counts[0].sum(0), 0).to(offs.dtype)


def _send(x: torch.Tensor, route: _Route, axis: str) -> torch.Tensor:
    """Rows grouped by expert -> this rank's experts' rows from every rank, expert-major."""
    x = x if route.kept is None else x[route.kept]
    return _a2a(x, route.sent, route.received, axis)[route.order]


def _return(y: torch.Tensor, route: _Route, axis: str, rows: int) -> torch.Tensor:
    """The inverse of :func:`_send`: ``rows`` rows in the sender's order, dropped ones zero."""
    back = torch.empty_like(y).index_copy_(0, route.order, y)
    out = _a2a(back, route.received, route.sent, axis)
    if route.kept is None:
        return out
    return out.new_zeros((rows, *out.shape[1:])).index_copy_(0, route.kept, out)


class _ExpertDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, offs: torch.Tensor, axis: str, capacity: float):
        counts = _exchange_counts(offs, axis, capacity)
        ctx.route, ctx.axis, ctx.n = _route(counts, offs), axis, rows.shape[0]
        local_offs = _local_offs(counts, offs)
        ctx.mark_non_differentiable(local_offs, counts)
        return _send(rows, ctx.route, axis), local_offs, counts

    @staticmethod
    def backward(ctx, g: torch.Tensor, *_):
        return _return(g, ctx.route, ctx.axis, ctx.n), None, None, None


class _ExpertCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor, axis: str,
                rows: int):  # fmt: skip
        ctx.route, ctx.axis = _route(counts, offs), axis
        return _return(y, ctx.route, axis, rows)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _send(g.contiguous(), ctx.route, ctx.axis), None, None, None, None


# The same dispatch and combine as custom ops, for torch.compile: the host-side counts and
# the variable splits stay inside opaque ops (no graph break), the received row count is an
# unbacked size (``new_dynamic_size``), and each op's backward is the other one.


@torch.library.custom_op("autopar::expert_counts", mutates_args=())
def _counts_op(offs: torch.Tensor, axis: str, capacity: float) -> torch.Tensor:
    return _exchange_counts(offs, axis, capacity)


@_counts_op.register_fake
def _(offs: torch.Tensor, axis: str, capacity: float) -> torch.Tensor:
    size = axis_size(axis)
    return offs.new_empty((2, size, offs.shape[0] // size), dtype=torch.int64)


@torch.library.custom_op("autopar::expert_send", mutates_args=())
def _send_op(x: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor, axis: str,
             rows: int | None) -> torch.Tensor:  # fmt: skip
    return _send(x, _route(counts, offs), axis)


@_send_op.register_fake
def _(x: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor, axis: str,
      rows: int | None) -> torch.Tensor:  # fmt: skip
    n = torch.library.get_ctx().new_dynamic_size() if rows is None else rows
    return x.new_empty((n, *x.shape[1:]))


@torch.library.custom_op("autopar::expert_return", mutates_args=())
def _return_op(y: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor, axis: str,
               rows: int) -> torch.Tensor:  # fmt: skip
    return _return(y, _route(counts, offs), axis, rows)


@_return_op.register_fake
def _(y: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor, axis: str,
      rows: int) -> torch.Tensor:  # fmt: skip
    return y.new_empty((rows, *y.shape[1:]))


def _save_route(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, counts, offs, axis, _ = inputs
    ctx.save_for_backward(counts, offs)
    ctx.axis, ctx.rows = axis, x.shape[0]


def _send_backward(ctx: Any, g: torch.Tensor) -> tuple:
    counts, offs = ctx.saved_tensors
    return _return_op(g, counts, offs, ctx.axis, ctx.rows), None, None, None, None


def _return_backward(ctx: Any, g: torch.Tensor) -> tuple:
    counts, offs = ctx.saved_tensors
    return _send_op(g.contiguous(), counts, offs, ctx.axis, ctx.rows), None, None, None, None


_send_op.register_autograd(_send_backward, setup_context=_save_route)
_return_op.register_autograd(_return_backward, setup_context=_save_route)


def expert_load(reset: bool = True) -> list[tuple[list[int], int]]:
    """Per expert dispatch since the last reset, in call order (one per MoE layer per
    forward): the rows this rank's experts took, and the rows this rank dropped over
    capacity."""
    out = list(_LOAD)
    if reset:
        _LOAD.clear()
    return out


def _counts(offs: torch.Tensor) -> torch.Tensor:
    """Rows per expert from cumulative offsets."""
    ends = offs.to(torch.int64)
    return torch.diff(ends, prepend=ends.new_zeros(1))


def _capped(send: torch.Tensor, capacity: float, axis: str) -> torch.Tensor:
    """Per (destination rank, expert) counts after the capacity rule: each expert keeps at
    most ``capacity`` rows over all ranks, the lower ep ranks first, each rank its rows in
    order (its first rows kept)."""
    everyone = send.new_empty((axis_size(axis) * send.shape[0], *send.shape[1:]))
    dist.all_gather_into_tensor(everyone, send.contiguous(), group=group(axis))
    everyone = everyone.view(axis_size(axis), *send.shape)
    before = torch.cumsum(everyone, 0) - everyone  # rows of the lower ranks, per expert
    room = (int(capacity) - before[axis_rank(axis)]).clamp(min=0)
    return torch.minimum(send, room)


def _kept_rows(full: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Indices of the first ``kept[e]`` rows of each expert's ``full[e]``-row group."""
    starts = torch.cumsum(full, 0) - full
    total = int(kept.sum())
    seg = torch.cumsum(kept, 0) - kept
    return torch.arange(total) + torch.repeat_interleave(starts - seg, kept, output_size=total)


def _expert_major(recv: torch.Tensor) -> torch.Tensor:
    """Positions, in the received (source-major) buffer, of the rows grouped by local expert:
    the buffer holds [source][expert] blocks, the experts want [expert][source]."""
    lengths = recv.flatten()
    starts = (torch.cumsum(lengths, 0) - lengths).view_as(recv).t().flatten()
    lt = recv.t().flatten()
    total = int(lt.sum())
    shift = starts - (torch.cumsum(lt, 0) - lt)
    return torch.arange(total) + torch.repeat_interleave(shift, lt, output_size=total)


def _a2a(x: torch.Tensor, send: list[int], recv: list[int], axis: str) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group(axis))
    return out


class _BatchLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: str, reduction: str) -> torch.Tensor:
        ctx.scale = 1.0 / axis_size(axis) if reduction == "mean" else 1.0
        return _all_reduce(x, axis) * ctx.scale

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None, None


class _BatchMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, axis: str) -> torch.Tensor:
        ctx.axis = axis
        return _all_reduce(x, axis) / axis_size(axis)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return _all_reduce(g, ctx.axis) / axis_size(ctx.axis), None


# ---------------------------------------------------------------- graph-facing ops


@graph_op
def all_reduce(x: torch.Tensor, axis: str, grad: str = "identity") -> torch.Tensor:
    """Sum a partial value over ``axis``; ``grad='all_reduce'`` also sums the gradient."""
    return _AllReduce.apply(x, axis, grad)


@graph_op
def all_gather(
    x: torch.Tensor, axis: str, dim: int, blocks: int = 1, grad: str = "split"
) -> torch.Tensor:
    """Gather dim ``dim`` over ``axis``; backward slices (or reduce-scatters) the gradient."""
    return _AllGather.apply(x, axis, dim, blocks, grad)


@graph_op
def reduce_scatter(x: torch.Tensor, axis: str, dim: int, blocks: int = 1) -> torch.Tensor:
    """Sum a partial value over ``axis`` and keep this rank's slice of dim ``dim``."""
    return _ReduceScatter.apply(x, axis, dim, blocks)


@graph_op
def split(x: torch.Tensor, axis: str, dim: int, blocks: int = 1) -> torch.Tensor:
    """Keep this rank's slice of dim ``dim`` of a replicated value; backward all-gathers."""
    return _Split.apply(x, axis, dim, blocks)


@graph_op
def unshare(x: torch.Tensor, axis: str, dim: int, rep: int) -> torch.Tensor:
    """A shared split of dim ``dim`` (each piece on ``rep`` ranks) -> its plain split: keep
    this rank's 1/rep of the local piece; backward pads the gradient with zeros."""
    return _Unshare.apply(x, axis, dim, rep)


@graph_op
def all_to_all(x: torch.Tensor, axis: str, src_dim: int, dst_dim: int) -> torch.Tensor:
    """Re-split a value from dim ``src_dim`` to dim ``dst_dim`` over ``axis``."""
    return _AllToAll.apply(x, axis, src_dim, dst_dim)


@graph_op
def grad_all_reduce(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity forward; all-reduce the gradient over ``axis`` in backward."""
    return _GradAllReduce.apply(x, axis)


@graph_op
def grad_sum_shared(x: torch.Tensor, axis: str, rep: int) -> torch.Tensor:
    """Identity forward; backward sums the gradient over the ``rep`` ranks sharing a piece."""
    return _GradSumShared.apply(x, axis, rep)


@graph_op
def grad_partial(x: torch.Tensor, axis: str) -> torch.Tensor:
    """Identity forward; backward keeps the (whole) gradient on rank 0 of ``axis`` only, so
    it joins partial gradients that one later reduction over ``axis`` sums."""
    return _GradPartial.apply(x, axis)


@graph_op
def grad_bucket_all_reduce(axis: str, key: str, micro: int,
                           *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Identity forward on ``xs``; their gradients all-reduced over ``axis`` as one bucket
    in backward (one collective, launched when the last of them is computed); under a
    pipeline of ``micro`` micro-batches, once per step: the sum of the micro-batches'."""
    return _GradBucketAllReduce.apply(axis, key, micro, *xs)


@graph_op
def redistribute(
    x: torch.Tensor, axis: str, src: str, dst: str, partial_grad: bool
) -> torch.Tensor:
    """Abstract re-layout written by propagate_layout; lower_collectives replaces every one."""
    raise RuntimeError(
        f"redistribute({src} -> {dst} on {axis!r}) reached run time: the program was not "
        "lowered (passes.lower_collectives turns it into a named collective)"
    )


@graph_op
def expert_dispatch(rows: torch.Tensor, offs: torch.Tensor, axis: str,
                    capacity: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Send each expert's rows (``rows`` grouped by expert, cumulative ``offs``) to the
    ``axis`` rank holding it; returns this rank's experts' rows grouped by expert, their
    cumulative offsets, and the [2, size, experts/size] (received, sent) counts the combine
    reverses.  ``capacity`` > 0 keeps at most that many rows per expert (see ``_capped``).
    Under torch.compile: the custom ops (the received row count an unbacked size)."""
    if torch.compiler.is_compiling():
        counts = _counts_op(offs, axis, capacity)
        return _send_op(rows, counts, offs, axis, None), _local_offs(counts, offs), counts
    return _ExpertDispatch.apply(rows, offs, axis, capacity)


@graph_op
def expert_combine(y: torch.Tensor, counts: torch.Tensor, offs: torch.Tensor, axis: str,
                   rows: int) -> torch.Tensor:  # fmt: skip
    """Return the experts' output rows to the ranks their tokens came from, in the order the
    dispatch took them: ``rows`` rows, the dispatch's input count (dropped rows come back as
    zeros)."""
    if torch.compiler.is_compiling():
        return _return_op(y, counts, offs, axis, rows)
    return _ExpertCombine.apply(y, counts, offs, axis, rows)


@graph_op
def batch_loss(x: torch.Tensor, axis: str, reduction: str) -> torch.Tensor:
    """A rank's scalar loss over its batch slice -> the global loss; backward keeps the rank's
    own gradient (1/size of it for a mean)."""
    return _BatchLoss.apply(x, axis, reduction)


@graph_op
def batch_mean(x: torch.Tensor, axis: str) -> torch.Tensor:
    """A rank's statistic over its (equal) batch slice -> its mean over ``axis``, the global
    statistic; backward averages the ranks' gradients, so each rank gets its share."""
    return _BatchMean.apply(x, axis)
