"""Run-time ops of the context-parallel axis (``cp``): the sequence split into chunks.

Layout: the global sequence of length S is cut into 2·c chunks (c = cp ranks) and rank i
holds chunks i and 2·c−1−i, concatenated (``balanced``; causal attention work is then equal
on every rank), or into c chunks with rank i holding chunk i (not balanced).  Every op here
is autograd-aware and prints by name in a per-rank program:

- ``cp_localize(x, axis, dim, blocks, balanced)``: a replicated value -> this rank's chunks
  of dim ``dim`` (each of ``blocks`` blocks viewed as its chunks), a local index_select.  Backward:
  all-gather of the gradient (each rank holds the gradient of its own positions).
- ``cp_gather(x, ...)``: the inverse (all-gather, then the global order).  Backward: localize.
- ``cp_reorder(x, axis, dim, seq, inverse)``: the rank-major order of an all-gathered sequence
  <-> the global order (local, for all-to-all attention).
- ``cp_global_mean(total, count, axis)``: a mean over every rank's tokens from local sums.
- ``ring_attention(q, k, v, mask, axis, causal, scale, seq, balanced)``: attention of the local
  queries over every rank's keys, in one op.
- The same ring one graph node per step (what a cp program prints): ``ring_send([k, v])``
  starts an exchange, ``ring_block`` attends to the block in hand (no autograd), ``ring_recv``
  waits for the next block, and ``ring_attention_out`` turns the merged (o, lse) into the
  output; its backward is the ring's backward, so the received blocks are never saved.

Algorithm of :func:`ring_attention` (forward):
1. Expand the KV heads a query-head group shares (GQA) only for the block in hand; the ring
   carries the KV heads this rank holds, K and V fused into one message.
2. For step j = 0..c−1: start the exchange of the block in hand with the ring neighbours
   (isend to rank+1, irecv from rank−1, ``batch_isend_irecv``) unless it is the last step,
   attend the local queries to the block in hand (from rank − j), then wait: c−1 exchanges.
3. Attention of one block runs per pair of contiguous position runs (a chunk of queries, a
   chunk of keys): a pair whose keys all lie after its queries is skipped under a causal mask,
   a pair wholly before the diagonal needs no mask, a pair an explicit mask hides entirely (a
   sliding window) is skipped.  Block results merge by log-sum-exp.
Backward: c steps; each passes K, V and the dK, dV accumulated so far around the ring (the
accumulators return to their owner after the last step); dQ stays local.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from autopar.ops.collectives import _gather, axis_rank, axis_size, graph_op, group

# Blocks are computed and merged one precision up (as flash attention accumulates 16-bit
# inputs in fp32), so the merged result rounds once, like a single-kernel attention.
_ACCUMULATE = {torch.float16: torch.float32, torch.bfloat16: torch.float32,
               torch.float32: torch.float64}  # fmt: skip
OVERLAP = True  # benchmarks/bench_cp.py turns it off to time blocking exchanges
FUNCTIONAL = False  # ring steps by functional collectives in eager too (tests; bench_cp.py)
EXCHANGES: Counter[str] = Counter()  # ring exchanges issued, by direction ('fwd', 'bwd')


# ---------------------------------------------------------------- layout


def positions(seq: int, size: int, rank: int, balanced: bool) -> torch.Tensor:
    """The global positions rank ``rank`` holds, in its local order."""
    return torch.cat([torch.arange(a, b) for a, b in runs(seq, size, rank, balanced)])


def runs(seq: int, size: int, rank: int, balanced: bool) -> list[tuple[int, int]]:
    """The contiguous [start, end) position runs rank ``rank`` holds, in its local order."""
    if not balanced:
        n = seq // size
        return [(rank * n, (rank + 1) * n)]
    n = seq // (2 * size)
    return [(rank * n, (rank + 1) * n), ((2 * size - 1 - rank) * n, (2 * size - rank) * n)]


def pieces(size: int, rank: int, balanced: bool) -> list[int]:
    """The chunks (of ``2·size`` balanced, else ``size``) rank ``rank`` holds, in order."""
    return [rank, 2 * size - 1 - rank] if balanced else [rank]


def _select(x: torch.Tensor, dim: int, blocks: int, chunks: int,
            idx: list[int]) -> torch.Tensor:  # fmt: skip
    """Chunks ``idx`` of each block of dim ``dim`` (viewed as ``[blocks, chunks, n/...]``)."""
    shape = list(x.shape)
    y = x.reshape(*shape[:dim], blocks, chunks, shape[dim] // (blocks * chunks), *shape[dim + 1:])
    y = y.index_select(dim + 1, torch.tensor(idx, device=x.device))
    return y.reshape(*shape[:dim], -1, *shape[dim + 1:]).contiguous()


def _localize(x: torch.Tensor, axis: str, dim: int, blocks: int, balanced: bool) -> torch.Tensor:
    size = axis_size(axis)
    chunks = 2 * size if balanced else size
    return _select(x, dim, blocks, chunks, pieces(size, axis_rank(axis), balanced))


def _unlocalize(x: torch.Tensor, axis: str, dim: int, blocks: int,
                balanced: bool) -> torch.Tensor:  # fmt: skip
    size = axis_size(axis)
    chunks = 2 * size if balanced else size
    gathered = _gather(x.contiguous(), axis, dim, blocks)  # per block: rank 0's, rank 1's, ...
    order = [c for r in range(size) for c in pieces(size, r, balanced)]
    return _select(gathered, dim, blocks, chunks, sorted(range(chunks), key=order.__getitem__))


class _Localize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, blocks, balanced):
        ctx.args = (axis, dim, blocks, balanced)
        return _localize(x, axis, dim, blocks, balanced)

    @staticmethod
    def backward(ctx, g):
        return _unlocalize(g, *ctx.args), None, None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, axis, dim, blocks, balanced):
        ctx.args = (axis, dim, blocks, balanced)
        return _unlocalize(x, axis, dim, blocks, balanced)

    @staticmethod
    def backward(ctx, g):
        return _localize(g, *ctx.args), None, None, None, None


class _GlobalMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, total, count, axis):
        both = torch.stack([total.detach().float(), count.detach().float()])
        dist.all_reduce(both, group=group(axis))
        ctx.count = both[1]
        return (both[0] / both[1]).to(total.dtype)

    @staticmethod
    def backward(ctx, g):
        return g / ctx.count, None, None


@graph_op
def cp_localize(x: torch.Tensor, axis: str, dim: int, blocks: int,
                balanced: bool) -> torch.Tensor:  # fmt: skip
    """This rank's chunks of dim ``dim`` of a replicated value; backward all-gathers."""
    return _Localize.apply(x, axis, dim, blocks, balanced)


@graph_op
def cp_gather(x: torch.Tensor, axis: str, dim: int, blocks: int,
              balanced: bool) -> torch.Tensor:  # fmt: skip
    """The whole dim, in global order, of a sequence-split value; backward localizes."""
    return _Gather.apply(x, axis, dim, blocks, balanced)


@graph_op
def cp_reorder(x: torch.Tensor, axis: str, dim: int, seq: int, balanced: bool,
               to_global: bool) -> torch.Tensor:  # fmt: skip
    """Rank-major order of a gathered sequence (rank 0's positions, rank 1's, ...) <-> the
    global order, along ``dim`` (local; autograd differentiates the index_select)."""
    size = axis_size(axis)
    order = torch.cat([positions(seq, size, r, balanced) for r in range(size)]).to(x.device)
    return x.index_select(dim, torch.argsort(order) if to_global else order)


@graph_op
def cp_global_mean(total: torch.Tensor, count: torch.Tensor, axis: str) -> torch.Tensor:
    """sum(total) / sum(count) over ``axis``: the mean over every rank's tokens."""
    return _GlobalMean.apply(total, count, axis)


# ---------------------------------------------------------------- ring attention


def _neighbours(axis: str) -> tuple[int, int]:
    g, n, r = group(axis), axis_size(axis), axis_rank(axis)
    return dist.get_global_rank(g, (r + 1) % n), dist.get_global_rank(g, (r - 1) % n)


def _permute(x: torch.Tensor, axis: str) -> torch.Tensor:
    """The ring step as a functional collective: an all-to-all of ``x`` whose only non-empty
    splits are to rank + 1 and from rank − 1 (``permute_tensor``'s, without its wait, so
    the graph keeps the wait where the block is used)."""
    n, r = axis_size(axis), axis_rank(axis)
    send, recv = [0] * n, [0] * n
    send[(r + 1) % n] = recv[(r - 1) % n] = x.numel()
    return torch.ops._c10d_functional.all_to_all_single(x, recv, send, group(axis).group_name)


class _Exchange:
    """One ring step: send ``tensors`` (fused) to rank+1, receive rank−1's.

    Two mechanisms, the same message: eagerly ``batch_isend_irecv`` (point-to-point, waited
    in :meth:`result`); while dynamo traces (``torch.compile``, which cannot trace
    ``batch_isend_irecv`` or ``Work.wait``: a graph break each) or when :data:`FUNCTIONAL`
    is set, the functional collective :func:`_permute` (torch's own context parallel rotates
    K/V with ``permute_tensor`` too), traced into the graph as ``all_to_all_single`` here and
    ``wait_tensor`` in :meth:`result`, so the block's compute stays between them.
    """

    def __init__(self, tensors: list[torch.Tensor], axis: str, direction: str) -> None:
        self.shapes = [t.shape for t in tensors]
        self.send = torch.cat([t.reshape(-1) for t in tensors])
        self.reqs: list = []
        self.functional = FUNCTIONAL or torch.compiler.is_compiling()
        if self.functional:
            self.recv = _permute(self.send, axis)
        else:
            nxt, prv = _neighbours(axis)
            self.recv = torch.empty_like(self.send)
            g = group(axis)
            ops = [dist.P2POp(dist.isend, self.send, nxt, g),
                   dist.P2POp(dist.irecv, self.recv, prv, g)]  # fmt: skip
            self.reqs = dist.batch_isend_irecv(ops)
        if not torch.compiler.is_compiling():  # a count at trace time would mean nothing
            EXCHANGES[direction] += 1
        if not OVERLAP:
            self._wait()

    def _wait(self) -> None:
        for req in self.reqs:
            req.wait()
        self.reqs = []
        if self.functional:
            self.recv = torch.ops._c10d_functional.wait_tensor(self.recv)
            self.functional = False

    def result(self) -> list[torch.Tensor]:
        self._wait()
        sizes = [math.prod(s) for s in self.shapes]
        return [p.view(s) for p, s in zip(self.recv.split(sizes), self.shapes, strict=True)]


def _pairs(qruns: list[tuple[int, int]], kruns: list[tuple[int, int]],
           causal: bool) -> list[tuple[slice, slice, int, int, bool]]:  # fmt: skip
    """(local q slice, local k slice, q global start, k global start, needs causal mask) for
    every pair of runs that is not fully masked."""
    out, q0 = [], 0
    for qa, qb in qruns:
        k0 = 0
        for ka, kb in kruns:
            if not (causal and qb - 1 < ka):
                diag = causal and qa < kb - 1
                out.append((slice(q0, q0 + qb - qa), slice(k0, k0 + kb - ka), qa, ka, diag))
            k0 += kb - ka
        q0 += qb - qa
    return out


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, qa: int, ka: int,
            diag: bool, scale: float) -> torch.Tensor | None:  # fmt: skip
    """Masked scores of one pair of runs; None when an explicit mask (a sliding window)
    hides the whole pair."""
    lq, lk = q.shape[-2], k.shape[-2]
    m = mask
    if m is not None:
        m = m[..., qa:qa + lq, :] if m.shape[-2] != 1 else m
        m = m[..., ka:ka + lk] if m.shape[-1] != 1 else m
        if not (m.any() if m.dtype == torch.bool else (~torch.isneginf(m)).any()):
            return None
    s = (q @ k.transpose(-1, -2)) * scale
    if diag:
        keep = torch.arange(qa, qa + lq)[:, None] >= torch.arange(ka, ka + lk)[None, :]
        s = s.masked_fill(~keep.to(s.device), float("-inf"))
    if m is not None:
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m
    return s


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isinf(x), torch.zeros_like(x), x)


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(2)


def _attend(q, k, v, mask, qruns, kruns, causal, scale, o, lse) -> None:
    """Step 3: merge attention of q over one K/V block into (o, lse) in place."""
    for qs, ks, qa, ka, diag in _pairs(qruns, kruns, causal):
        s = _scores(q[..., qs, :], k[..., ks, :], mask, qa, ka, diag, scale)
        if s is None:
            continue
        blse = torch.logsumexp(s, dim=-1)
        ob = torch.exp(s - _finite(blse)[..., None]) @ v[..., ks, :]
        old = lse[..., qs]
        new = torch.logaddexp(old, blse)
        safe = _finite(new)
        o[..., qs, :] = (o[..., qs, :] * torch.exp(old - safe)[..., None]
                         + ob * torch.exp(blse - safe)[..., None])  # fmt: skip
        lse[..., qs] = new


def _attend_backward(q, k, v, do, delta, lse, mask, qruns, kruns, causal, scale, dq, dk, dv):
    for qs, ks, qa, ka, diag in _pairs(qruns, kruns, causal):
        s = _scores(q[..., qs, :], k[..., ks, :], mask, qa, ka, diag, scale)
        if s is None:
            continue
        p = torch.exp(s - _finite(lse[..., qs])[..., None])
        dv[..., ks, :] += p.transpose(-1, -2) @ do[..., qs, :]
        ds = p * (do[..., qs, :] @ v[..., ks, :].transpose(-1, -2) - delta[..., qs, None])
        dq[..., qs, :] += (ds @ k[..., ks, :]) * scale
        dk[..., ks, :] += (ds.transpose(-1, -2) @ q[..., qs, :]) * scale


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, axis, causal, scale, seq, balanced):
        n, r = axis_size(axis), axis_rank(axis)
        groups = q.shape[1] // k.shape[1]
        acc = _ACCUMULATE.get(q.dtype, q.dtype)
        qa = q.to(acc)
        o = torch.zeros_like(qa)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        qruns = runs(seq, n, r, balanced)
        block = [k, v]
        for step in range(n):
            ring = _Exchange(block, axis, "fwd") if step < n - 1 else None
            src = (r - step) % n
            _attend(qa, _expand(block[0].to(acc), groups), _expand(block[1].to(acc), groups),
                    mask, qruns, runs(seq, n, src, balanced), causal, scale, o, lse)  # fmt: skip
            if ring is not None:
                block = ring.result()
        ctx.save_for_backward(q, k, v, o, lse, mask)
        ctx.args = (axis, causal, scale, seq, balanced)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        dq, dk, dv = _ring_backward(ctx.saved_tensors, ctx.args, do)
        return dq, dk, dv, None, None, None, None, None, None


def _ring_backward(saved: tuple, args: tuple, do: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """dQ, dK, dV of the ring (module docstring): K/V and dK/dV pass around it again."""
    q, k, v, o, lse, mask = saved
    axis, causal, scale, seq, balanced = args
    n, r = axis_size(axis), axis_rank(axis)
    groups = q.shape[1] // k.shape[1]
    acc = o.dtype
    qa, do = q.to(acc), do.to(acc)
    delta = (do * o).sum(-1)
    dq = torch.zeros_like(qa)
    qruns = runs(seq, n, r, balanced)
    block = [k, v, torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)]
    for step in range(n):
        src = (r - step) % n
        ring = _Exchange(block[:2], axis, "bwd") if step < n - 1 else None
        dk = torch.zeros_like(qa)
        dv = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=acc, device=q.device)
        _attend_backward(qa, _expand(block[0].to(acc), groups),
                         _expand(block[1].to(acc), groups), do, delta, lse, mask, qruns,
                         runs(seq, n, src, balanced), causal, scale, dq, dk, dv)  # fmt: skip
        grads = _Exchange([block[2] + _fold(dk, groups), block[3] + _fold(dv, groups)],
                          axis, "bwd")  # fmt: skip
        kv = ring.result() if ring is not None else block[:2]
        block = [*kv, *grads.result()]
    return dq.to(q.dtype), block[2].to(k.dtype), block[3].to(v.dtype)


@graph_op
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   axis: str, causal: bool, scale: float, seq: int,
                   balanced: bool) -> torch.Tensor:  # fmt: skip
    """Attention of this rank's queries over every rank's keys (module docstring)."""
    return _RingAttention.apply(q, k, v, mask, axis, causal, scale, seq, balanced)


# ---------------------------------------------------------------- the ring, one node per step


class _RingOut(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, o, lse, mask, axis, causal, scale, seq, balanced):
        ctx.save_for_backward(q, k, v, o, lse, mask)
        ctx.args = (axis, causal, scale, seq, balanced)
        return o.to(q.dtype) if o.dtype != q.dtype else o.clone()

    @staticmethod
    def backward(ctx, do):
        dq, dk, dv = _ring_backward(ctx.saved_tensors, ctx.args, do)
        return dq, dk, dv, None, None, None, None, None, None, None, None


@graph_op
def ring_send(block: list[torch.Tensor], axis: str) -> _Exchange:
    """Start passing the K/V block in hand around the ring: to axis rank + 1, from rank − 1,
    fused into one message (``batch_isend_irecv``); :func:`ring_recv` waits for it."""
    return _Exchange([t.detach() for t in block], axis, "fwd")


@graph_op
def ring_recv(pending: _Exchange) -> list[torch.Tensor]:
    """Wait for the exchange :func:`ring_send` started: the block of rank − 1 (K, V)."""
    return pending.result()


@graph_op
def ring_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor | None,
               lse: torch.Tensor | None, mask: torch.Tensor | None, axis: str, step: int,
               causal: bool, scale: float, seq: int,
               balanced: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Step ``step`` of the ring forward: the local queries over the K/V block of rank
    r − step, merged into (o, lse) one precision up (no autograd: :func:`ring_attention_out`
    differentiates the whole ring, so no block is saved for backward)."""
    with torch.no_grad():
        n, r = axis_size(axis), axis_rank(axis)
        groups = q.shape[1] // k.shape[1]
        acc = _ACCUMULATE.get(q.dtype, q.dtype)
        qa = q.detach().to(acc)
        if o is None:
            o = torch.zeros_like(qa)
            lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        _attend(qa, _expand(k.to(acc), groups), _expand(v.to(acc), groups), mask,
                runs(seq, n, r, balanced), runs(seq, n, (r - step) % n, balanced), causal,
                scale, o, lse)  # fmt: skip
    return o, lse


@graph_op
def ring_attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, mask: torch.Tensor | None, axis: str, causal: bool,
                       scale: float, seq: int, balanced: bool) -> torch.Tensor:  # fmt: skip
    """The ring's result from its merged (o, lse); backward is the ring's backward: c steps
    passing K/V and dK/dV around again, so only this rank's q, k, v, o, lse are saved."""
    return _RingOut.apply(q, k, v, o, lse, mask, axis, causal, scale, seq, balanced)


def reset_exchanges() -> dict[str, Any]:
    """Clear and return the exchange counter (tests count p2p steps per attention)."""
    out = dict(EXCHANGES)
    EXCHANGES.clear()
    return out
