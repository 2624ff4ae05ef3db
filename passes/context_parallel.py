"""context_parallel: split every sequence-dim value over the ``cp`` mesh axis.

Runs on the graph the tp passes lowered (or the traced graph without tp), with the sequence
layout and attention choices the cp planner part decided (``ctx.sections["cp"]``,
autopar.axes.context_parallel.CpDecisions).

Algorithm:
1. Set the tp layouts aside, so the walk sees the cp axis alone.
2. Walk the graph (:class:`_SplitSequence`): inputs' sequence chunks
   are localized (a pipeline stage's boundary inputs that arrive split, ``arrive``, are this
   rank's chunks already), ops run split by their sharding rules on the cp axis, replicated
   operands get their gradient reduced, attention becomes ring or all-to-all attention, a
   mean loss over the sequence becomes a sum and a count all-reduced, split outputs are
   gathered (a pipeline stage's, ``keep_split``, leave as this rank's chunks).
3. Shape arguments become local over cp (passes.localize on the cp axis).
4. The tp layouts come back with cp added on the sequence dim (``P(None, ('cp', 'tp'),
   None)`` under Megatron-SP: cp outer, tp inner); each ring exchange is annotated with its
   peers and bytes.  The attention prices are left in ``gm.meta["cp_prices"]``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.axes.context_parallel import (
    _SDPA,
    AXIS,
    AttentionPrice,
    ContextParallelError,
    CpDecisions,
    SeqLayout,
    _causal,
    _nbytes,
    _price,
    _sdpa_args,
    aten,
)
from autopar.frontend.trace import Traced, is_getitem, tensor_args
from autopar.ir import meta
from autopar.ir.layout import Layout, Partial, Placement, R, Shard
from autopar.mesh import Mesh
from autopar.ops import collectives as C
from autopar.ops import cp_ops, parallel_ops
from autopar.plan import CpSection
from autopar.rules import RuleContext, Strategy, strategies
from passes import PassContext
from passes.localize import localize

_MEAN, _SUM = 1, 2  # aten's cross-entropy reduction enum
_CE = aten.cross_entropy_loss.default
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_TP_DIM_OPS = (C.all_gather, C.reduce_scatter, C.split, C.all_to_all)
_TP_OPS = (*_TP_DIM_OPS, C.all_reduce, C.grad_all_reduce, C.grad_partial, C.unshare,
           parallel_ops.local_kv_heads,
           parallel_ops.vocab_parallel_embedding)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Window:
    """A slice of a sequence-split activation kept at full length: along ``dim`` (viewed as
    ``[outer, seq, inner]``) positions ``[lo, seq - hi)`` are the slice's, the rest are
    marked invalid (a loss's target holds its ignore_index there)."""

    dim: int
    outer: int
    inner: int
    lo: int
    hi: int
    seq: int
    source: str  # where the user sliced

    def kept(self) -> int:
        """The dim's size as the user's program has it (the slice's length)."""
        return self.outer * (self.seq - self.lo - self.hi) * self.inner

    def full(self) -> int:
        return self.outer * self.seq * self.inner


def context_parallel(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Steps 1-4, in place."""
    decided: CpDecisions = ctx.sections["cp"]
    kept = {n: meta.layout(n) for n in gm.graph.nodes if meta.layout(n) is not None}
    for n in kept:
        meta.update(n, layout=None)
    split = _SplitSequence(gm, ctx.traced, decided.layout, ctx.grad, ctx.mesh, decided.attention,
                           decided.saved, kept, dict(decided.arrive),
                           decided.keep_split)  # fmt: skip
    split.run()
    for n in gm.graph.nodes:  # a gathered output (cut to the user's slice) keeps its tp split
        src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if src in kept and (n.target is cp_ops.cp_gather or src.target is cp_ops.cp_gather):
            kept[n] = kept[src]
    cp_only = Mesh.ordered(((AXIS, decided.layout.size),), ctx.mesh.cluster)
    gm = localize(gm, dataclasses.replace(ctx, mesh=cp_only))
    _merge_layouts(gm, kept)
    _note_exchanges(gm)
    gm.graph.lint()
    gm.recompile()
    gm.meta["cp_prices"] = split.prices
    gm.meta["cp_layout"] = decided.layout
    return gm


def _note_exchanges(gm: fx.GraphModule) -> None:
    """Each ring exchange prints its peers and local bytes (codegen.render shows the note)."""
    for n in gm.graph.nodes:
        if n.target is cp_ops.ring_send:
            kv = sum(_nbytes(b.meta["val"]) for b in n.args[0])
            n.meta["note"] = (f"p2p: send {kv / 2**10:.1f} KiB (K+V) to {AXIS} rank r+1, "
                              f"recv from r-1")  # fmt: skip


def _merge_layouts(gm: fx.GraphModule, kept: dict[fx.Node, Any]) -> None:
    """Put the tp layouts back, with cp added on the sequence dim of split values."""
    for n, tp_lay in kept.items():
        cp_lay = meta.layout(n)
        if not isinstance(cp_lay, Layout) or not isinstance(tp_lay, Layout):
            meta.update(n, layout=tp_lay)
            continue
        dims = tuple(c + t for c, t in zip(cp_lay.dims, tp_lay.dims, strict=True))
        blocks = tuple(max(a, b) for a, b in zip(cp_lay.blocks, tp_lay.blocks, strict=True))
        meta.update(n, layout=Layout(dims=dims, blocks=blocks, partial=tp_lay.partial,
                                     shared=tp_lay.shared))  # fmt: skip


class _SplitSequence:
    """Steps 2-4: one walk over the graph, rewriting as it goes."""

    def __init__(self, gm: fx.GraphModule, traced: Traced, lay: SeqLayout, grad: frozenset[str],
                 mesh: Mesh, forced: str | None, saved: CpSection | None = None,
                 tp_layouts: dict[fx.Node, Any] | None = None,
                 arrive: dict[str, Shard] | None = None,
                 keep_split: bool = False) -> None:  # fmt: skip
        self.gm, self.graph, self.traced, self.lay = gm, gm.graph, traced, lay
        self.arrive, self.keep_split = arrive or {}, keep_split
        self.tp_layouts = tp_layouts if tp_layouts is not None else {}
        self.replayed: list[fx.Node] = []  # tp-split values recomputed from cp's chunks
        self.grad, self.mesh, self.forced = grad, mesh, forced
        self.saved = dict(saved.attention) if saved is not None else {}
        self.place: dict[fx.Node, Placement | tuple] = {}
        self.localized: dict[tuple[fx.Node, Placement], fx.Node] = {}
        self.reduced: dict[fx.Node, fx.Node] = {}
        self.prices: list[AttentionPrice] = []
        self.window: dict[fx.Node, Window] = {}
        self.ctx = RuleContext(size=lay.chunks, blocks=_block_counts(traced))

    def run(self) -> None:
        nodes = list(self.graph.nodes)
        self.whole = _input_derived(nodes, self.traced, self.grad, frozenset(self.arrive))
        self._split_inputs(nodes)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for n in nodes:
                if n.op == "call_function" and n not in self.whole:
                    self._visit(n)
        self._gather_outputs()
        for n in reversed(self.replayed):  # the originals, when nothing else reads them
            if not n.users:
                self.graph.erase_node(n)
                self.place.pop(n, None)
        for n, p in self.place.items():
            _set_layout(n, p)

    # -- inputs and outputs

    def _split_inputs(self, nodes: list[fx.Node]) -> None:
        """Inputs with the sequence at dim 1 get this rank's chunks; a pipeline stage's
        boundary inputs that arrive split (``arrive``) are this rank's chunks already."""
        for n in nodes:
            val = n.meta.get("val")
            if n.op == "placeholder" and n.name in self.arrive:
                self.place[n] = self._arrived(n, self.arrive[n.name])
            elif (n.name in self.traced.user_inputs and isinstance(val, torch.Tensor)
                    and n not in self.whole and val.dim() >= 2
                    and val.shape[1] == self.lay.seq):  # fmt: skip
                users = list(n.users)
                loc = self._localize(n, Shard(1))
                for u in users:
                    u.replace_input_with(n, loc)

    def _arrived(self, n: fx.Node, p: Shard) -> Shard:
        """The placement of boundary input ``n`` arriving as this rank's chunks (the stage
        before sent it in the same sequence layout)."""
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or p.dim >= val.dim() \
                or val.shape[p.dim] % (self.lay.chunks * p.blocks):  # fmt: skip
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
            raise ContextParallelError(
                f"boundary input {n.name} (shape {shape}) cannot arrive split as {p} into "
                f"{self.lay.chunks} sequence chunks; the stage before must send it whole")  # fmt: skip
        return p

    def _gather_outputs(self) -> None:
        """Split outputs are gathered whole (a window cut to the user's slice), except, for a
        pipeline stage (``keep_split``), those sent on as this rank's chunks: every
        sequence-split value outside a window (the next stage takes it as arriving split)."""
        out = next(n for n in self.graph.nodes if n.op == "output")

        def whole(a: Any) -> Any:
            p = self.place.get(a) if isinstance(a, fx.Node) else None
            if not isinstance(p, Shard):
                return a
            if self.keep_split and a not in self.window and not self._tp_splits(a, p.dim):
                return a
            if self._tp_splits(a, p.dim):
                raise ContextParallelError(
                    f"output {a.name} ({meta.source(a)}) leaves the tp program split along dim "
                    f"{p.dim} by tp and by cp (sequence parallelism), which no gather of cp "
                    "makes whole; return a value tp gathers, or use a tp plan without sequence "
                    "parallelism at the output")  # fmt: skip
            with self.graph.inserting_before(out):
                g = self._call(cp_ops.cp_gather, (a, AXIS, p.dim, p.blocks, self.lay.balanced),
                               a.meta["val"])  # fmt: skip
                w = self.window.get(a)
                if w is not None:  # the user's slice, cut from the whole value
                    if (w.outer, w.inner) != (1, 1):
                        self._refuse(out, w)
                    shape = list(a.meta["val"].shape)
                    shape[w.dim] = w.kept()
                    g = self._call(aten.slice.Tensor, (g, w.dim, w.lo, w.seq - w.hi),
                                   _empty(a.meta["val"], shape))  # fmt: skip
            return g

        out.args = (pytree.tree_map(whole, out.args[0]),)

    # -- one op

    def _visit(self, n: fx.Node) -> None:
        if is_getitem(n):
            parent = self.place.get(n.args[0])
            if isinstance(parent, tuple) and isinstance(parent[n.args[1]], Shard):
                self.place[n] = parent[n.args[1]]
            return
        self._seed(n)
        args = tensor_args(n)
        have = [self.place.get(a, R) for a in args]
        if all(not isinstance(p, Shard) for p in have):
            return
        if n.target is aten.slice.Tensor and self._open_window(n, have[0]):
            return
        if any(a in self.window for a in args):
            self._widen(n, args)
            args = tensor_args(n)  # a padded partner replaced its input
            have = [self.place.get(a, R) for a in args]
        if n.target is _SDPA:
            self._attention(n)
        elif n.target in (_CE, parallel_ops.vocab_parallel_cross_entropy):
            self._loss(n, args, have)
        elif n.target in _TP_OPS:
            self._through_tp_op(n, have)
        else:
            self._by_rules(n, args, have)

    def _seed(self, n: fx.Node) -> None:
        """An op of the model reading an input-derived value with the sequence at dim 1 reads
        this rank's chunks of it (the split starts here, not at the input: what the model
        computes from its inputs alone, a label shift, ran whole on every rank)."""
        for a in tensor_args(n):
            val = a.meta["val"]
            if a in self.whole and val.dim() >= 2 and val.shape[1] == self.lay.seq:
                n.replace_input_with(a, self._localize(a, Shard(1), n))

    def _through_tp_op(self, n: fx.Node, have: list) -> None:
        """A tp collective or lowering keeps the sequence where it is.  On another dim it
        moves or splits that dim; on the sequence dim itself (Megatron-SP's gather before a
        column GEMM, reduce-scatter after a row GEMM) it acts within this rank's chunks: the
        dim is split cp outer, tp inner (``P(None, ('cp', 'tp'), None)``), every tp rank of
        a cp rank holding its tp piece of that cp rank's chunks."""
        p = next(q for q in have if isinstance(q, Shard))
        dims = n.args[2:4] if n.target is C.all_to_all else n.args[2:3]
        if n.target in _TP_DIM_OPS and p.dim in dims:
            self._check_nested(n, p)
        for a, q in zip(tensor_args(n), have, strict=True):
            if not isinstance(q, Shard):
                new = self._reduce_grad(a, n)
                if new is not a:
                    n.replace_input_with(a, new)
        self.place[n] = p

    def _check_nested(self, n: fx.Node, p: Shard) -> None:
        """A tp op on the cp-split dim runs on this rank's chunks: their length must divide
        into the tp pieces (per block), and a cp rank's pieces into its chunks."""
        ins = [a.meta["val"].shape[p.dim] for a in tensor_args(n)]
        whole = max([*ins, n.meta["val"].shape[p.dim]])
        tp, blocks = self.mesh.size("tp"), (1 if n.target is C.all_to_all else n.args[3])
        local = whole // self.lay.size
        if whole % self.lay.chunks or local % (blocks * tp) or (whole // tp) % self.lay.chunks:
            raise ContextParallelError(
                f"{_op(n)} at {meta.source(n)}: tp splits the sequence dim {p.dim} that cp "
                f"splits (sequence parallelism), within each cp rank's {local} positions, into "
                f"{tp} pieces of {blocks} block(s), which does not divide; use a sequence length "
                f"that is a multiple of {self.lay.chunks * blocks * tp}")  # fmt: skip

    def _by_rules(self, n: fx.Node, args: list[fx.Node], have: list) -> None:
        best = _pick(n, self.ctx, have)
        if best is None:
            split = ", ".join(f"{a.name} {p}" for a, p in zip(args, have, strict=True)
                              if isinstance(p, Shard))  # fmt: skip
            both = sum(isinstance(p, Shard) for p in have) > 1
            hint = ("two sequence-split operands: attention written out as matmul-softmax-matmul "
                    "is not split; cp rewrites aten.scaled_dot_product_attention (e.g. HF "
                    "attn_implementation='sdpa')") if both else (
                    "cp splits every sequence-dim tensor, so this op needs a rule in "
                    "autopar/rules/ (a mean over the split sequence has none: sum, then "
                    "divide)")  # fmt: skip
            raise ContextParallelError(
                f"{_op(n)} at {meta.source(n)} reads sequence-split values ({split}) and no "
                f"sharding strategy runs it split along the sequence; {hint}"
            )
        for a, want, p in zip(args, best.inputs, have, strict=True):
            if isinstance(p, Shard):
                continue
            new = (self._localize(a, want, n) if isinstance(want, Shard)
                   else self._reduce_grad(a, n))  # fmt: skip
            if new is not a:
                n.replace_input_with(a, new)
        out = best.output
        if isinstance(out, Partial):
            self._all_reduce_after(n)
        elif isinstance(out, tuple) or isinstance(out, Shard):
            self.place[n] = out

    # -- slices of split activations (step 2)

    def _open_window(self, n: fx.Node, p: Placement) -> bool:
        """``x[:, a:b]`` along the split sequence of an activation: kept at full length (an
        alias of ``x``, the dropped positions marked by a :class:`Window`): no exchange."""
        x, dim = n.args[0], n.args[1] if len(n.args) > 1 else 0
        dim = dim + x.meta["val"].dim() if isinstance(dim, int) and dim < 0 else dim
        seq = x.meta["val"].shape[dim] if isinstance(dim, int) else None
        step = n.args[4] if len(n.args) > 4 else 1
        if not (isinstance(p, Shard) and p.dim == dim and p.blocks == 1 and seq == self.lay.seq
                and step == 1 and x not in self.window):  # fmt: skip
            return False
        start = n.args[2] if len(n.args) > 2 and n.args[2] is not None else 0
        end = n.args[3] if len(n.args) > 3 and n.args[3] is not None else seq
        start, end = (min(max(i + seq if i < 0 else i, 0), seq) for i in (start, end))
        n.target, n.args, n.kwargs = aten.alias.default, (x,), {}
        n.meta["val"] = x.meta["val"]
        self.place[n] = p
        if (start, end) != (0, seq):
            self.window[n] = Window(dim=dim, outer=1, inner=1, lo=start, hi=seq - end, seq=seq,
                                    source=meta.source(n))  # fmt: skip
        return True

    def _widen(self, n: fx.Node, args: list[fx.Node]) -> None:
        """``n`` reads a windowed slice: give it the full length (views re-shaped, a loss's
        target padded with its ignore_index, an input-derived partner padded), or refuse."""
        ws = {self.window[a] for a in args if a in self.window}
        w = next(iter(ws))
        if len({(v.lo, v.hi, v.seq) for v in ws}) > 1:
            raise ContextParallelError(
                f"{_op(n)} at {meta.source(n)} combines differently shifted slices of "
                f"sequence-split activations ({', '.join(v.source for v in ws)}): that needs "
                "the neighbour rank's boundary tokens (a halo exchange), which cp does not "
                "build; shift an input instead (e.g. the labels)")  # fmt: skip
        src = next(a for a in args if a in self.window)
        if n.target in _VIEWS:
            self._widen_view(n, src, w)
        elif n.target in (_CE, parallel_ops.vocab_parallel_cross_entropy) and src is n.args[0] \
                and w.dim == 0 and n.args[1] not in self.window:  # fmt: skip
            ignore = n.args[4] if len(n.args) > 4 else n.kwargs.get("ignore_index", -100)
            n.replace_input_with(n.args[1], self._pad_partner(n.args[1], n, w, 0, ignore))
            reduction = n.args[3] if len(n.args) > 3 else n.kwargs.get("reduction", _MEAN)
            if reduction not in (_MEAN, _SUM):
                self._widen_positionwise(n, [src], w)
        else:
            self._widen_positionwise(n, args, w)

    def _widen_view(self, n: fx.Node, src: fx.Node, w: Window) -> None:
        old_in = list(src.meta["val"].shape)
        old_in[w.dim] = w.kept()
        old_out = list(n.meta["val"].shape)
        found = _view_window(old_in, old_out, w)
        if found is None:
            self._refuse(n, w)
        j, outer, inner = found
        new_out = list(old_out)
        new_out[j] = outer * w.seq * inner
        n.args = (n.args[0], new_out, *n.args[2:])
        n.meta["val"] = _empty(n.meta["val"], new_out)
        self.window[n] = Window(dim=j, outer=outer, inner=inner, lo=w.lo, hi=w.hi, seq=w.seq,
                                source=w.source)  # fmt: skip

    def _widen_positionwise(self, n: fx.Node, args: list[fx.Node], w: Window) -> None:
        """An op keeping every position where it is (same rank, same windowed dim): other
        operands along that dim must be input-derived (padded here) or broadcast."""
        val = n.meta["val"]
        if not isinstance(val, torch.Tensor) or val.dim() <= w.dim \
                or val.shape[w.dim] != w.kept():  # fmt: skip
            self._refuse(n, w)
        for a in args:
            av = a.meta["val"]
            k = w.dim - (val.dim() - av.dim())
            if a in self.window or k < 0 or av.shape[k] == 1:
                continue
            if a not in self.whole:
                self._refuse(n, w)
            n.replace_input_with(a, self._pad_partner(a, n, w, k, 0))
        self.window[n] = w
        n.meta["val"] = _empty(val, [*val.shape[:w.dim], w.full(), *val.shape[w.dim + 1:]])

    def _pad_partner(self, a: fx.Node, before: fx.Node, w: Window, dim: int,
                     value: float) -> fx.Node:  # fmt: skip
        """Input-derived ``a`` (computed whole) at full length along ``dim``: ``value`` at the
        window's dropped positions."""
        if a not in self.whole:
            self._refuse(before, w)
        shape = list(a.meta["val"].shape)
        split = [*shape[:dim], w.outer, w.seq - w.lo - w.hi, w.inner, *shape[dim + 1:]]
        wide = [*shape[:dim], w.outer, w.seq, w.inner, *shape[dim + 1:]]
        pad = [0, 0] * (len(shape) - dim) + [w.lo, w.hi]
        with self.graph.inserting_before(before):
            v = self._call(aten.view.default, (a, split), _empty(a.meta["val"], split), like=a)
            p = self._call(aten.constant_pad_nd.default, (v, pad, value),
                           _empty(a.meta["val"], wide), like=a)  # fmt: skip
            out_shape = [*shape[:dim], w.full(), *shape[dim + 1:]]
            out = self._call(aten.view.default, (p, out_shape), _empty(a.meta["val"], out_shape),
                             like=a)  # fmt: skip
        self.whole.update((v, p, out))
        return out

    def _refuse(self, n: fx.Node, w: Window) -> None:
        raise ContextParallelError(
            f"{_op(n)} at {meta.source(n)} reads a slice of a sequence-split activation "
            f"({w.source}); cp keeps such a slice at full length with the dropped positions "
            "marked, which position-wise ops, views and a cross-entropy (its target padded with "
            "ignore_index) can read; a reduction over the sequence or a whole-rank op cannot. "
            "Shift the labels instead of the activation")  # fmt: skip

    # -- attention (step 3)

    def _attention(self, n: fx.Node) -> None:
        a = _sdpa_args(n)
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        if a["dropout_p"]:
            raise ContextParallelError(f"attention with dropout_p={a['dropout_p']} at "
                                       f"{meta.source(n)}: cp needs dropout_p=0")  # fmt: skip
        qkv = []
        for t in (q, k, v):
            p = self.place.get(t, R)
            seq_dim = t.meta["val"].dim() - 2
            if p == R:
                t = self._localize(t, Shard(seq_dim), n)
            elif p != Shard(seq_dim):
                raise ContextParallelError(
                    f"attention at {meta.source(n)}: {t.name} is split as {p}, not along its "
                    f"sequence dim {seq_dim}; cp splits attention along the sequence only")  # fmt: skip
            qkv.append(t)
        if isinstance(mask, fx.Node) and isinstance(self.place.get(mask), Shard):
            raise ContextParallelError(
                f"attention at {meta.source(n)}: its mask {mask.name} is built from "
                "sequence-split inputs (a padding mask?); cp needs a mask the model builds "
                "whole (causal, sliding window) or no mask")  # fmt: skip
        price = _price(n, self.lay, self.mesh, self.saved.get(n.name, self.forced))
        self.prices.append(price)
        build = self._ring if price.chosen == "ring" else self._ulysses
        out = build(n, *qkv, mask, a)
        n.replace_all_uses_with(out)
        self.graph.erase_node(n)
        self.place[out] = Shard(out.meta["val"].dim() - 2)

    def _ring(self, n: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node, mask: Any,
              a: dict) -> fx.Node:  # fmt: skip
        """One node per ring step: start the exchange of the block in hand, attend to it,
        wait for the next (cp_ops: the exchanges print as ``ring_send`` / ``ring_recv``)."""
        scale = float(a["scale"] or q.meta["val"].shape[-1] ** -0.5)
        causal, lay = _causal(a), self.lay
        qv = q.meta["val"]
        acc = _meta(qv.shape, cp_ops._ACCUMULATE.get(qv.dtype, qv.dtype))
        state = (acc, _meta(qv.shape[:-1], acc.dtype))
        block, o, lse = (k, v), None, None
        with self.graph.inserting_before(n):
            for step in range(lay.size):
                pending = (self._call(cp_ops.ring_send, ([*block], AXIS), None, like=n)
                           if step < lay.size - 1 else None)  # fmt: skip
                merged = self._call(cp_ops.ring_block, (q, *block, o, lse, mask, AXIS, step,
                                                        causal, scale, lay.seq, lay.balanced),
                                    state, like=n)  # fmt: skip
                o, lse = self._items(merged, state, (Shard(2), Shard(2)))
                if pending is not None:
                    vals = (k.meta["val"], v.meta["val"])
                    got = self._call(cp_ops.ring_recv, (pending,), vals, like=n)
                    block = self._items(got, vals, (Shard(2), Shard(2)))
            return self._call(cp_ops.ring_attention_out,
                              (q, k, v, o, lse, mask, AXIS, causal, scale, lay.seq,
                               lay.balanced), n.meta["val"], like=n)  # fmt: skip

    def _items(self, node: fx.Node, vals: tuple, places: tuple) -> tuple[fx.Node, ...]:
        self.place[node] = places
        out = []
        for i, (val, p) in enumerate(zip(vals, places, strict=True)):
            item = self._call(operator.getitem, (node, i), val)
            self.place[item] = p
            out.append(item)
        return tuple(out)

    def _ulysses(self, n: fx.Node, q: fx.Node, k: fx.Node, v: fx.Node, mask: Any,
                 a: dict) -> fx.Node:  # fmt: skip
        size, gqa = self.lay.size, bool(a["enable_gqa"])
        heads_q, heads_kv = q.meta["val"].shape[1], k.meta["val"].shape[1]
        with self.graph.inserting_before(n):
            if heads_kv % size:  # give every rank the KV heads of its query heads
                k, v = (self._repeat_heads(t, heads_q // heads_kv) for t in (k, v))
                gqa = False
            heads = [self._to_heads(t) for t in (q, k, v)]
            if isinstance(mask, fx.Node) and mask.meta["val"].dim() == 4 \
                    and mask.meta["val"].shape[1] > 1:  # fmt: skip
                mask = self._call(C.split, (mask, AXIS, 1, 1), mask.meta["val"])
                self.place[mask] = Shard(1)
            kwargs = {"scale": a["scale"], "enable_gqa": gqa}
            attn = self.graph.call_function(_SDPA, (*heads, mask, 0.0, bool(a["is_causal"])),
                                            kwargs)  # fmt: skip
            attn.meta.update(n.meta)
            self.place[attn] = Shard(1)
            back = self._call(cp_ops.cp_reorder, (attn, AXIS, 2, self.lay.seq,
                                                  self.lay.balanced, False), n.meta["val"])  # fmt: skip
            self.place[back] = Shard(1)
            return self._call(C.all_to_all, (back, AXIS, 1, 2), n.meta["val"], like=n)

    def _to_heads(self, t: fx.Node) -> fx.Node:
        """Sequence-split [b, h, s/cp, d] -> head-split [b, h/cp, s, d] in global order."""
        x = self._call(C.all_to_all, (t, AXIS, 2, 1), t.meta["val"])
        self.place[x] = Shard(1)
        y = self._call(cp_ops.cp_reorder, (x, AXIS, 2, self.lay.seq, self.lay.balanced, True),
                       t.meta["val"])  # fmt: skip
        self.place[y] = Shard(1)
        return y

    def _repeat_heads(self, t: fx.Node, times: int) -> fx.Node:
        val = t.meta["val"]
        shape = (val.shape[0], val.shape[1] * times, *val.shape[2:])
        r = self._call(aten.repeat_interleave.self_int, (t, times, 1),
                       torch.empty(shape, dtype=val.dtype, device="meta"))  # fmt: skip
        self.place[r] = self.place[t]
        return r

    # -- loss (step 4)

    def _loss(self, n: fx.Node, args: list[fx.Node], have: list) -> None:
        p = self.place.get(n.args[0], R)
        if isinstance(p, Shard) and self.place.get(n.args[1], R) == R \
                and n.args[0].meta["val"].dim() == 2:  # fmt: skip
            n.replace_input_with(n.args[1], self._localize(n.args[1], p, n))
            args, have = tensor_args(n), [self.place.get(a, R) for a in tensor_args(n)]
        logits, target = n.args[0], n.args[1]
        if n.target is _CE:
            weight = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
            reduction = n.args[3] if len(n.args) > 3 else n.kwargs.get("reduction", _MEAN)
            ignore = n.args[4] if len(n.args) > 4 else n.kwargs.get("ignore_index", -100)
            smoothing = n.args[5] if len(n.args) > 5 else n.kwargs.get("label_smoothing", 0.0)
            summed = (logits, target, None, _SUM, ignore, smoothing)
        else:  # vocab-parallel cross-entropy of the tp program
            weight = None
            reduction = n.args[3] if len(n.args) > 3 else _MEAN
            ignore = n.args[4] if len(n.args) > 4 else -100
            summed = (logits, target, n.args[2], _SUM, ignore)
        if weight is not None or not isinstance(p, Shard) or p.dim != 0 \
                or logits.meta["val"].dim() != 2:  # fmt: skip
            self._by_rules(n, args, have)
            return
        if reduction not in (_MEAN, _SUM):
            self.place[n] = p
            return
        with self.graph.inserting_before(n):
            total = self.graph.call_function(n.target, summed)
            total.meta.update(n.meta)
            if reduction == _SUM:
                out = self._call(C.all_reduce, (total, AXIS, "identity"), n.meta["val"], like=n)
            else:
                tval = target.meta["val"]
                kept = self._call(aten.ne.Scalar, (target, ignore),
                                  torch.empty(tval.shape, dtype=torch.bool, device="meta"))  # fmt: skip
                self.place[kept] = p
                count = self._call(aten.sum.default, (kept,),
                                   torch.empty((), dtype=torch.int64, device="meta"))  # fmt: skip
                out = self._call(cp_ops.cp_global_mean, (total, count, AXIS), n.meta["val"],
                                 like=n)  # fmt: skip
        n.replace_all_uses_with(out)
        self.graph.erase_node(n)

    # -- helpers

    def _call(self, fn: Any, args: tuple, val: Any, like: fx.Node | None = None) -> fx.Node:
        node = self.graph.call_function(fn, args)
        if like is not None:
            node.meta.update({k: v for k, v in like.meta.items() if k != meta.KEY})
        node.meta["val"] = val
        return node

    def _localize(self, a: fx.Node, p: Placement, before: fx.Node | None = None) -> fx.Node:
        """This rank's chunks of replicated ``a`` (right after ``a``, or before its first split
        consumer ``before``: stage graphs interleave placeholders and ops)."""
        key = (a, p)
        if key not in self.localized:
            if isinstance(p, Shard) and self._tp_splits(a, p.dim):
                loc = self._localize_below_tp(a, p, before)
            else:
                ctx = (self.graph.inserting_before(before) if before
                       else self.graph.inserting_after(a))  # fmt: skip
                with ctx:
                    loc = self._call(cp_ops.cp_localize,
                                     (a, AXIS, p.dim, p.blocks, self.lay.balanced),
                                     a.meta["val"], like=a if a.op != "placeholder" else None)  # fmt: skip
            self.place[loc] = p
            self.localized[key] = loc
        return self.localized[key]

    def _tp_splits(self, a: fx.Node, dim: int) -> bool:
        lay = self.tp_layouts.get(a)
        return isinstance(lay, Layout) and "tp" in lay.dims[dim]

    def _localize_below_tp(self, a: fx.Node, p: Shard, before: fx.Node | None) -> fx.Node:
        """``a``, whole over cp, is split along dim ``p.dim`` by tp (sequence parallelism):
        cp's chunks are taken above tp's split and ``a`` recomputed from them (tp's split
        re-applied, the ops after it replayed by their sharding rules), so the dim is split
        cp outer, tp inner like the sequence-split activations ``a`` meets."""
        at = 3 if a.target is C.all_to_all else 2
        if a.target in (C.split, C.reduce_scatter, C.all_to_all) and a.args[at] == p.dim:
            wants = [Shard(p.dim, p.blocks)]
        else:
            found = self._strategy_giving(a, p)
            if found is None:
                raise ContextParallelError(
                    f"{_op(a)} at {meta.source(a)}: {a.name} is split along dim {p.dim} by tp "
                    "(sequence parallelism) and must be split there by cp too, but no sharding "
                    "strategy recomputes it from cp's chunks; use a tp plan without sequence "
                    "parallelism here")  # fmt: skip
            wants = list(found.inputs)
        args = tensor_args(a)
        new = [self._localize(x, w, before) if isinstance(w, Shard) else x
               for x, w in zip(args, wants, strict=True)]  # fmt: skip
        ctx = self.graph.inserting_before(before) if before else self.graph.inserting_after(a)
        with ctx:
            loc = self.graph.node_copy(a, dict(zip(args, new, strict=True)).get)
        for x, w in zip(args, wants, strict=True):
            if not isinstance(w, Shard) and x.name in self.grad:
                loc.replace_input_with(x, self._reduce_grad(x, loc))
        self.tp_layouts[loc] = self.tp_layouts[a]
        self.replayed.append(a)
        return loc

    def _strategy_giving(self, a: fx.Node, p: Shard) -> Strategy | None:
        """A strategy of ``a`` whose output is ``p``, its inputs split or whole (not partial)."""
        try:
            options = strategies(a, self.ctx)
        except Exception:  # noqa: BLE001 - an op the rules cannot describe has no split strategy
            return None
        return next((s for s in options if s.lowering is None and s.output == p
                     and not any(isinstance(w, Partial) for w in s.inputs)), None)  # fmt: skip

    def _reduce_grad(self, a: fx.Node, consumer: fx.Node) -> fx.Node:
        """A replicated input read whole by a split op: each rank's gradient is partial."""
        if a.name not in self.grad:
            return a
        if a not in self.reduced:
            with self.graph.inserting_before(consumer):
                self.reduced[a] = self._call(C.grad_all_reduce, (a, AXIS), a.meta["val"])
        return self.reduced[a]

    def _all_reduce_after(self, n: fx.Node) -> None:
        with self.graph.inserting_after(n):
            red = self._call(C.all_reduce, (n, AXIS, "identity"), n.meta["val"])
        n.replace_all_uses_with(red, delete_user_cb=lambda u: u is not red)


def _empty(like: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=like.dtype, device="meta")


def _meta(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _view_window(old_in: list[int], old_out: list[int],
                 w: Window) -> tuple[int, int, int] | None:  # fmt: skip
    """The output dim of a view holding the window's positions whole, with its (outer, inner)
    factors; None when the view cuts through the positions."""
    d = w.dim
    before = math.prod(old_in[:d]) * w.outer
    after = w.inner * math.prod(old_in[d + 1:])
    kept = w.seq - w.lo - w.hi
    for j, size in enumerate(old_out):
        pre, post = math.prod(old_out[:j]), math.prod(old_out[j + 1:])
        if before % pre or after % post:
            continue
        outer, inner = before // pre, after // post
        if size == outer * kept * inner:
            return j, outer, inner
    return None


def _input_derived(nodes: list[fx.Node], traced: Traced, grad: frozenset[str],
                   arrive: frozenset[str] = frozenset()) -> set[fx.Node]:  # fmt: skip
    """User inputs off the gradient path and what is computed from them and constants alone
    (no parameter): run whole on every rank, like the inputs they come from.  Boundary
    inputs that ``arrive`` split are not whole."""
    const: set[fx.Node] = set()
    out: set[fx.Node] = set()
    for n in nodes:
        if n.name in grad:
            continue
        if n.op == "placeholder":
            if n.name in traced.user_inputs and n.name not in arrive:
                out.add(n)
            continue
        if n.op != "call_function":
            continue
        ins = n.all_input_nodes
        if all(a in const for a in ins):
            const.add(n)
        elif all(a in const or a in out for a in ins):
            out.add(n)
    return out


def _pick(n: fx.Node, ctx: RuleContext, have: list) -> Strategy | None:
    """The strategy keeping split inputs where they are, localizing the fewest others."""
    try:
        options = strategies(n, ctx)
    except Exception:  # noqa: BLE001 - an op the rules cannot describe has no split strategy
        return None
    best, best_key = None, None
    for s in options:
        if s.lowering is not None:
            continue
        ok = all(want == p if isinstance(p, Shard) else not isinstance(want, Partial)
                 for want, p in zip(s.inputs, have, strict=True))  # fmt: skip
        if not ok:
            continue
        outs = s.output if isinstance(s.output, tuple) else (s.output,)
        if all(o == R for o in outs):
            continue
        key = (sum(isinstance(w, Shard) for w in s.inputs), isinstance(s.output, Partial))
        if best_key is None or key < best_key:
            best, best_key = s, key
    return best


def _block_counts(traced: Traced) -> tuple[int, ...]:
    """1, and the batch size: a view merging [b, s] into one dim splits it per batch block."""
    inputs = [n for n in traced.gm.graph.nodes if n.name in traced.user_inputs
              and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() >= 2]  # fmt: skip
    return tuple(sorted({1, *(n.meta["val"].shape[0] for n in inputs[:1])}))


def _set_layout(n: fx.Node, p: Placement | tuple) -> None:
    val = n.meta.get("val")
    if isinstance(p, tuple):
        lays = tuple(Layout.from_placements(v.dim(), {AXIS: q}) if isinstance(v, torch.Tensor)
                     else None for v, q in zip(val, p, strict=False))  # fmt: skip
        meta.update(n, layout=lays)
    elif isinstance(val, torch.Tensor):
        meta.update(n, layout=Layout.from_placements(val.dim(), {AXIS: p}))


def _op(n: fx.Node) -> str:
    return getattr(n.target, "__name__", str(n.target))
