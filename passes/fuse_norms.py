"""fuse_norms: HF's RMSNorm on a 16-bit input becomes one ``rms_norm_16`` call, which keeps the
16-bit input and the fp32 rstd for backward instead of the chain's fp32 copy of the input and
its normalized value (autopar.ops.norms; Megatron's fused norm keeps the same).

The last pass of :func:`passes.default_pipeline`, so both the graph the cost model prices and
the graph that runs have it.  What it matches is ``LlamaRMSNorm.forward`` (Qwen's, Mistral's
and every HF RMSNorm copied from it) and ``GemmaRMSNorm.forward`` as torch.export traces them
under ``param_dtype=bf16``::

    up = to(x, float32); sq = pow(up, 2) | mul(up, up); mean = mean(sq, [-1], True)
    add = add(mean, eps); rsqrt = rsqrt(add); scale = mul(up, rsqrt)
    down = to(scale, x.dtype); [out = mul(w, down) | mul(down, w)]     # Llama
    prod = mul(scale, w) | mul(w, scale); out = type_as(prod, x)       # Gemma: w = 1 + w.float()

with ``w`` any 1-D value of the last dim's size (a weight, its ``grad_all_reduce``, Gemma's
``1 + w``: it stays in the graph).

Algorithm:
1. Walk the graph's up-casts: ``x`` 16-bit (bf16 / fp16, also at run time: an fp32 program,
   or autocast's fp32 residual stream, has nothing to fuse and stays exactly as it is) cast
   to fp32, read whole along its last dim (a layout splitting it would make the mean a
   partial one).
2. Follow the chain above from it; each intermediate must have no other user (the fp32 copy
   and the normalized value read elsewhere would have to be kept anyway; torch.export's
   ``_assert_tensor_metadata`` checks on them do not count and go with them), the mean
   reduces the last dim with keepdim and is not partial, ``eps`` is a number, and nothing
   lies between the mean and the rsqrt (a distributed norm all-reduces there: it stays).
   The down-cast goes back to ``x``'s dtype.
3. The weight: the down-cast's one user multiplying it by a 1-D value joins the fusion
   (Llama's order), or the normalizing multiply's one user multiplies it by one and the
   down-cast follows (Gemma's, ``cast_last``).
4. The chain's last node becomes ``rms_norm_16(x, weight | None, eps, dtype[, cast_last=True])``
   in place (its name, value, layout and source line kept, so later passes, printing and the
   plan read it as before); the other nodes of the chain are erased.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.ir import meta
from autopar.ir.layout import Layout
from autopar.ops.norms import rms_norm_16
from passes import PassContext

aten = torch.ops.aten
ORIGIN = "fuse_norms"
ASSERT = aten._assert_tensor_metadata.default
LOW = (torch.bfloat16, torch.float16)
ENABLED = True  # tests compare programs built with the pass off


@dataclass(frozen=True)
class _Norm:
    """One matched chain: its input, weight, eps, the nodes it replaces (last one kept)."""

    x: fx.Node
    weight: fx.Node | None
    eps: float
    nodes: tuple[fx.Node, ...]
    cast_last: bool = False  # Gemma's order: the fp32 weight multiply before the down-cast


def fuse_norms(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    """Steps 1-4 on ``gm`` in place."""
    del ctx
    if not ENABLED:
        return gm
    found = [m for n in list(gm.graph.nodes) if (m := _match(n)) is not None]
    for norm in found:
        _rewrite(gm.graph, norm)
    if found:
        gm.graph.lint()
        gm.recompile()
    return gm


def _cast(node: fx.Node) -> tuple[fx.Node, torch.dtype] | None:
    """(source, dtype) of a dtype-only cast (``x.to(dtype)``, ``_to_copy(x, dtype=)``,
    ``x.type_as(y)``)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.target is aten.to.dtype and len(node.args) >= 2 and not node.kwargs:
        rest = node.args[2:]
        if all(not a for a in rest[:2]) and (len(rest) < 3 or rest[2] is None):
            return node.args[0], node.args[1]
    if node.target is aten._to_copy.default and len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.args[0], node.kwargs["dtype"]
    if node.target is aten.type_as.default and len(node.args) == 2 and not node.kwargs:
        other = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
        return (node.args[0], other.dtype) if isinstance(other, torch.Tensor) else None
    return None


def _users(node: fx.Node) -> list[fx.Node]:
    """``node``'s users but torch.export's dtype checks (``_assert_tensor_metadata``), which
    go with the chain."""
    return [u for u in node.users if u.target is not ASSERT]


def _only_user(node: fx.Node) -> fx.Node | None:
    users = _users(node)
    return users[0] if len(users) == 1 else None


def _runs_as_traced(node: fx.Node) -> bool:
    """A tensor whose run-time dtype is its traced one (no autocast annotation changes it)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and meta.dtype(node) == val.dtype


def _whole_last_dim(node: fx.Node) -> bool:
    lay = meta.layout(node)
    return not isinstance(lay, Layout) or (not lay.dims[-1] and not lay.partial)


def _is_call(node: fx.Node | None, *targets: object) -> bool:
    return node is not None and node.op == "call_function" and node.target in targets


def _square_of(sq: fx.Node | None, up: fx.Node) -> bool:
    """``up ** 2`` as pow or ``up * up``."""
    if _is_call(sq, aten.pow.Tensor_Scalar):
        return sq.args[0] is up and sq.args[1] == 2 and not sq.kwargs
    return _is_call(sq, aten.mul.Tensor) and tuple(sq.args) == (up, up) and not sq.kwargs


def _mean_last(mean: fx.Node | None, ndim: int) -> bool:
    if not _is_call(mean, aten.mean.dim) or mean.kwargs or len(mean.args) != 3:
        return False
    dims, keep = mean.args[1], mean.args[2]
    return keep is True and list(dims or []) in ([-1], [ndim - 1]) and _whole_last_dim(mean)


def _eps(add: fx.Node | None, mean: fx.Node) -> float | None:
    if not _is_call(add, aten.add.Tensor, aten.add.Scalar) or add.kwargs or len(add.args) != 2:
        return None
    eps = add.args[1]
    ok = add.args[0] is mean and isinstance(eps, numbers.Real) and not isinstance(eps, bool)
    return float(eps) if ok else None


def _match(up: fx.Node) -> _Norm | None:
    """Steps 1-3 from an up-cast ``up``; None when ``up`` does not start the chain."""
    x = _input(up)
    if x is None:
        return None
    head = _rstd(up, x.meta["val"].dim())
    if head is None:
        return None
    *chain, eps = head
    tail = _tail(chain[-1], x.meta["val"])
    if tail is None or not all(_runs_as_traced(n) for n in chain):
        return None
    weight, nodes, cast_last = tail
    return _Norm(x=x, weight=weight, eps=eps, nodes=(up, *chain, *nodes), cast_last=cast_last)


def _input(up: fx.Node) -> fx.Node | None:
    """Step 1: the 16-bit ``x`` that ``up`` casts to fp32, read whole along its last dim."""
    cast = _cast(up)
    if cast is None or cast[1] != torch.float32:
        return None
    val = cast[0].meta.get("val")
    ok = (isinstance(val, torch.Tensor) and val.dtype in LOW and _runs_as_traced(cast[0])
          and val.dim() >= 1 and _whole_last_dim(cast[0]) and _runs_as_traced(up))  # fmt: skip
    return cast[0] if ok else None


def _rstd(up: fx.Node, ndim: int) -> tuple | None:
    """Step 2 up to the normalizing multiply: (sq, mean, add, rsqrt, scale, eps)."""
    users = _users(up)
    sq = next((u for u in users if _square_of(u, up)), None)
    scale = next((u for u in users if u is not sq), None)
    if sq is None or len(users) != 2:
        return None
    mean = _only_user(sq)
    if not _mean_last(mean, ndim):
        return None
    add = _only_user(mean)
    eps = _eps(add, mean)
    rsqrt = _only_user(add) if eps is not None else None
    if not _is_call(rsqrt, aten.rsqrt.default) or _only_user(rsqrt) is not scale:
        return None
    if not (_is_call(scale, aten.mul.Tensor) and set(scale.args) == {up, rsqrt}
            and len(scale.args) == 2 and not scale.kwargs):  # fmt: skip
        return None
    return sq, mean, add, rsqrt, scale, eps


def _tail(scale: fx.Node, x: torch.Tensor) -> tuple | None:
    """Steps 2-3 after the normalizing multiply: (weight, the nodes, cast_last) for the
    down-cast and an optional 16-bit weight multiply after it, or (Gemma's order) an fp32
    weight multiply and the down-cast after it."""
    nxt = _only_user(scale)
    if nxt is None:
        return None
    if _cast(nxt) == (scale, x.dtype):
        mul = _only_user(nxt)
        w = _weight_of(mul, nxt, x)
        return (w, (nxt, mul), False) if w is not None else (None, (nxt,), False)
    w, down = _weight_of(nxt, scale, x), _only_user(nxt)
    if w is None or down is None or _cast(down) != (nxt, x.dtype):
        return None
    return w, (nxt, down), True


def _weight_of(mul: fx.Node | None, value: fx.Node, x: torch.Tensor) -> fx.Node | None:
    """Step 3: the 1-D weight that ``mul`` multiplies ``value`` (shaped as ``x``) by."""
    if not _is_call(mul, aten.mul.Tensor) or mul.kwargs or len(mul.args) != 2:
        return None
    a, b = mul.args
    w = b if a is value else a
    wv = w.meta.get("val") if isinstance(w, fx.Node) and w is not value else None
    out = mul.meta.get("val")
    ok = (isinstance(wv, torch.Tensor) and tuple(wv.shape) == (x.shape[-1],)
          and wv.is_floating_point() and _runs_as_traced(mul)
          and tuple(out.shape) == tuple(x.shape))  # fmt: skip
    return w if ok else None


def _rewrite(graph: fx.Graph, norm: _Norm) -> None:
    """Step 4."""
    last = norm.nodes[-1]
    last.target = rms_norm_16
    last.args = (norm.x, norm.weight, norm.eps, norm.x.meta["val"].dtype)
    last.kwargs = {"cast_last": True} if norm.cast_last else {}
    meta.update(last, origin=ORIGIN)
    for node in reversed(norm.nodes[:-1]):
        for check in [u for u in node.users if u.target is ASSERT]:
            graph.erase_node(check)
        graph.erase_node(node)
