"""Recognise a causal attention mask from how it is built, without materialising it.

HF builds its causal mask from positions: ``kv_pos[j] <= q_pos[i]`` with ``arange`` positions,
and-ed with packed-sequence checks that are all true for one unpadded sequence.  At 32K tokens
that mask has 2^30 elements; evaluating it to compare with the lower triangle costs as much.
Here every value the mask is computed from is either *small* (a row or column of positions,
with batch dims: evaluated on the CPU) or *score-shaped* (its last two dims are the mask's
[Sq, Sk]: never evaluated, classified instead).

Algorithm (:func:`is_causal_mask`):
1. Walk the mask's ancestors (no input, no parameter) in graph order.  A node whose value is
   not score-shaped is evaluated concretely from its evaluated arguments.
2. A score-shaped node gets a class: ``Const(v)`` (every element ``v``), ``CAUSAL`` (bool,
   ``j <= i``) or ``CausalFill(a, b)`` (``a`` where ``j <= i`` else ``b``); any other op
   or operand makes the whole mask unknown (the caller may still evaluate a small one).
   - a comparison of a column vector ``c[j]`` with a row vector ``r[i]``: ``Const(True)``
     when it holds for every pair (checked on extremes), ``CAUSAL`` when ``c`` is strictly
     increasing and ``{j : c[j] <= r[i]}`` (or ``<``) is ``[0, i]`` for every ``i``: a
     ``searchsorted`` of ``r`` in ``c``, O(S log S);
   - ``and`` of classes: ``Const(True)`` is its identity, ``CAUSAL & CAUSAL`` is ``CAUSAL``;
   - ``tril`` of ``Const(True)``, ``triu(Const(-inf), 1)``, ``where(CAUSAL, a, b)``; creation
     ops (``full``, ``ones``) give ``Const``; expand / unsqueeze / alias / a same-dtype copy
     keep the class when they keep the last two dims.
3. The mask is causal when its class is ``CAUSAL`` or ``CausalFill(0, -inf)`` and it is square.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten

_KEEP = frozenset({aten.expand.default, aten.unsqueeze.default, aten.alias.default,
                   aten.clone.default, aten.contiguous.default, aten.to.dtype,
                   aten.to.dtype_layout, aten._to_copy.default, aten.detach.default})  # fmt: skip
_AND = frozenset({aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default,
                  aten.mul.Tensor})  # fmt: skip
_FULL = frozenset({aten.full.default, aten.ones.default, aten.new_ones.default,
                   aten.new_full.default, aten.full_like.default, aten.ones_like.default})  # fmt: skip
# comparison -> (operand holding the column c[j], strict): c[j] <= r[i] or c[j] < r[i]
_BELOW = {aten.le.Tensor: (0, False), aten.lt.Tensor: (0, True),
          aten.ge.Tensor: (1, False), aten.gt.Tensor: (1, True)}  # fmt: skip
_CMP = frozenset({*_BELOW, aten.eq.Tensor})


@dataclass(frozen=True)
class Const:
    """Every element equals ``value``."""

    value: float | bool


@dataclass(frozen=True)
class CausalFill:
    """``keep`` where ``j <= i``, else ``drop``."""

    keep: float
    drop: float


CAUSAL = "causal"  # bool: j <= i
SMALL_LIMIT = 2**26  # elements of the largest row / column value step 1 evaluates
_UNKNOWN = None


def is_causal_mask(mask: fx.Node, nodes: list[fx.Node]) -> bool:
    """Steps 1-3 for ``mask`` computed by ``nodes`` (its ancestors, in graph order)."""
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.shape[-1] != val.shape[-2]:
        return False
    score = tuple(val.shape[-2:])
    env: dict[fx.Node, object] = {}
    for node in nodes:
        out = node.meta.get("val")
        big = isinstance(out, torch.Tensor) and out.dim() >= 2 and tuple(out.shape[-2:]) == score
        if not big and isinstance(out, torch.Tensor) and out.numel() > SMALL_LIMIT:
            return False
        env[node] = _classify(node, env) if big else _evaluate(node, env)
        if env[node] is _UNKNOWN:
            return False
    kind = env[mask]
    if kind == CAUSAL:
        return val.dtype == torch.bool
    return kind == CausalFill(0.0, -math.inf) and val.is_floating_point()


def _evaluate(node: fx.Node, env: dict) -> object:
    """Step 1: a small value, on the CPU (None when an argument is classified, not known)."""
    known = True

    def get(a: fx.Node) -> object:
        nonlocal known
        v = env[a]
        known = known and isinstance(v, torch.Tensor | int | float | bool | tuple | list)
        return v

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), get)
    if not known:
        return _UNKNOWN
    args, kwargs = on_cpu(args, kwargs)
    try:
        return node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op we cannot run makes the mask unknown
        return _UNKNOWN


def on_cpu(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A node's evaluated ``args`` and ``kwargs`` with every device the CPU, positional
    (``aten.to.device(t, device, dtype)``: ``mask.to(x.device, torch.bool)``) or keyword
    (``arange(n, device=...)``): a model traced on the meta device has no data to copy out."""
    cpu = torch.device("cpu")
    return fx.node.map_aggregate((args, kwargs),
                                 lambda a: cpu if isinstance(a, torch.device) else a)  # fmt: skip


def _classify(node: fx.Node, env: dict) -> object:
    """Step 2: the class of a score-shaped value."""
    t = node.target
    ins = [env[a] if isinstance(a, fx.Node) else a for a in node.args]
    if t in _FULL:
        return _fill_value(node, ins)
    if t in _KEEP:
        src, out = node.args[0].meta["val"], node.meta["val"]
        if src.dtype != out.dtype:
            return _UNKNOWN
        if isinstance(ins[0], torch.Tensor) or src.shape[-2:] == out.shape[-2:]:
            return _as_class(ins[0])  # a constant broadcast, or a class carried
        return _UNKNOWN
    if t in _AND and node.meta["val"].dtype == torch.bool:
        return _and(_as_class(ins[0]), _as_class(ins[1]))
    if t in _CMP:
        return _compare(t, ins[0], ins[1])
    if t is aten.tril.default and _as_class(ins[0]) == Const(True) and _diag(node) == 0:
        return CAUSAL
    if t is aten.triu.default and _diag(node) == 1:
        c = _as_class(ins[0])
        return CausalFill(0.0, float(c.value)) if isinstance(c, Const) else _UNKNOWN
    if t is aten.where.self and _as_class(ins[0]) == CAUSAL:
        keep, drop = _as_class(ins[1]), _as_class(ins[2])
        if isinstance(keep, Const) and isinstance(drop, Const):
            return CausalFill(float(keep.value), float(drop.value))
    return _UNKNOWN


def _diag(node: fx.Node) -> int:
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("diagonal", 0)


def _fill_value(node: fx.Node, ins: list) -> object:
    t = node.target
    if t in (aten.ones.default, aten.new_ones.default, aten.ones_like.default):
        return Const(True if node.meta["val"].dtype == torch.bool else 1.0)
    value = ins[1] if t is aten.full_like.default else ins[-1]
    return Const(value) if isinstance(value, int | float | bool) else _UNKNOWN


def _as_class(v: object) -> object:
    """A class as is; a known tensor that is one constant (a scalar 0, a [] True) as Const."""
    if not isinstance(v, torch.Tensor):
        return v if isinstance(v, Const) or v == CAUSAL or isinstance(v, CausalFill) else _UNKNOWN
    if v.numel() == 0:
        return _UNKNOWN
    first = v.reshape(-1)[0]
    if not bool((v == first).all()):
        return _UNKNOWN
    return Const(first.item())


def _and(a: object, b: object) -> object:
    if a == Const(True):
        return b
    if b == Const(True):
        return a
    return CAUSAL if a == b == CAUSAL else _UNKNOWN


def _compare(t: object, a: object, b: object) -> object:
    """Step 2, a comparison of a column vector with a row vector."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return _UNKNOWN
    if a.dim() < 2 or b.dim() < 2:
        return _UNKNOWN
    if t is aten.eq.Tensor:
        both = torch.cat([a.reshape(-1), b.reshape(-1)])
        return Const(True) if bool((both == both[0]).all()) else _UNKNOWN
    col_at, strict = _BELOW[t]
    c, r = (a, b) if col_at == 0 else (b, a)
    if c.shape[-2] != 1 or r.shape[-1] != 1:
        return _UNKNOWN  # c must vary along j only, r along i only
    if (c.amax() < r.amin()) if strict else (c.amax() <= r.amin()):
        return Const(True)
    cols, rows = c.squeeze(-2), r.squeeze(-1)
    batch = torch.broadcast_shapes(cols.shape[:-1], rows.shape[:-1])
    cols = cols.expand(*batch, cols.shape[-1]).contiguous()
    rows = rows.expand(*batch, rows.shape[-1]).contiguous()
    if cols.shape[-1] != rows.shape[-1] or not bool((cols.diff(dim=-1) > 0).all()):
        return _UNKNOWN
    common = torch.promote_types(cols.dtype, rows.dtype)
    ends = torch.searchsorted(cols.to(common), rows.to(common), right=not strict)
    want = torch.arange(1, rows.shape[-1] + 1).expand_as(ends)
    return CAUSAL if bool((ends == want).all()) else _UNKNOWN
