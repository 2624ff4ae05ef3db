"""Algebraic canonicalisation of the traced graph, before planning.

Parallel attention + MLP blocks (GPT-J, GPT-NeoX, CodeGen, Phi) end in one sum,
``attn_out + (mlp_out + bias) + residual``.  Row-parallel projections make ``attn_out`` and
``mlp_out`` partial sums over the tensor-parallel ranks; a partial value may only be added to
another partial value, so in the user's order each projection is reduced on its own (two
all-reduces, or two reduce-scatters).  Megatron sums the two projections first and reduces
once.  Adding the matmul terms first gives the planner that choice; it is only a reordering
of an addition (rounding differs in the last bit, as between any two summation orders).

Algorithm:
1. Drop inference-mode dropout (``dropout(x, p, train=False)`` is ``x``): it hides the
   terms of a sum behind an op.
2. For every root of an add tree (``add.Tensor`` without ``alpha``, whose add operands have
   no other user and the root's dtype), collect its terms.
3. A term is *heavy* when it is a matmul output (through views) with the root's shape.
   With two or more heavy terms that are not already summed first, rebuild the tree as
   ``((h1 + h2) + ...) + other terms`` in their original order; every new add keeps the
   root's metadata (shape, source line, module path).
4. An attention mask computed from nothing but shapes (HF builds its causal mask from
   ``arange`` with packed-sequence checks, because a traced model cannot skip it) is
   evaluated once on the CPU; when it is exactly the causal lower triangle of a square
   score matrix, ``scaled_dot_product_attention(q, k, v, mask)`` becomes
   ``scaled_dot_product_attention(q, k, v, is_causal=True)``: the flash kernel on GPUs
   (seen: HF Llama 16% slower than eager on an H200 with the mask), and a mask context
   parallelism can balance.  A mask is first recognised from how it is built, whatever its
   size (autopar.mask_structure: positions compared, never materialised); one it does not
   recognise is evaluated when no value on its way is over ``MASK_LIMIT`` elements.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.mask_structure import is_causal_mask

_ADD = torch.ops.aten.add.Tensor
_MATMULS = frozenset({torch.ops.aten.linear.default, torch.ops.aten.mm.default,
                      torch.ops.aten.bmm.default, torch.ops.aten.matmul.default})  # fmt: skip
_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                    torch.ops.aten._unsafe_view.default})  # fmt: skip


MASK_LIMIT = 2**28  # elements of the largest value step 4 evaluates (256 MB as bool)
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def canonicalize(graph: fx.Graph) -> None:
    """Steps 1-4, in place."""
    for node in list(graph.nodes):
        if node.target is torch.ops.aten.dropout.default and _inference_dropout(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    for node in list(graph.nodes):
        if _is_add(node) and not _is_inner(node):
            _sum_matmuls_first(graph, node)
    for node in list(graph.nodes):
        mask = _mask_arg(node) if node.target is _SDPA else None
        if isinstance(mask, fx.Node) and _constant_causal(mask):
            dead = _ancestors(mask, limit=None) or []
            _make_causal(node)
            for old in reversed(dead):  # the mask's computation, now unread
                if not old.users:
                    graph.erase_node(old)


def _inference_dropout(node: fx.Node) -> bool:
    train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
    return train is False


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is _ADD and "alpha" not in node.kwargs
            and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args)
            and isinstance(node.meta.get("val"), torch.Tensor))  # fmt: skip


def _is_inner(node: fx.Node) -> bool:
    """An add whose only user is another add of the same dtype: part of a bigger tree."""
    users = list(node.users)
    return (len(users) == 1 and _is_add(users[0])
            and users[0].meta["val"].dtype == node.meta["val"].dtype)  # fmt: skip


def _terms(node: fx.Node, root: fx.Node) -> list[fx.Node]:
    """Step 2: the leaves of the add tree under ``node``, left to right."""
    if node is root or (_is_add(node) and _is_inner(node)):
        return [t for a in node.args for t in _terms(a, root)]
    return [node]


def _heavy(node: fx.Node, shape: torch.Size) -> bool:
    """Step 3: a matmul's output (possibly viewed) of the sum's full shape."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.shape != shape:
        return False
    while node.target in _VIEWS and len(node.users) == 1:
        node = node.args[0]
    return node.op == "call_function" and node.target in _MATMULS


def _sum_matmuls_first(graph: fx.Graph, root: fx.Node) -> None:
    shape = root.meta["val"].shape
    terms = _terms(root, root)
    heavy = [t for t in terms if _heavy(t, shape)]
    ordered = heavy + [t for t in terms if t not in heavy]
    if len(heavy) < 2 or _left_deep(root, root) == ordered:
        return
    if any(t.meta["val"].dtype != root.meta["val"].dtype for t in terms):
        return
    old = _inner_adds(root)
    with graph.inserting_before(root):
        total = ordered[0]
        for term in ordered[1:]:
            total = graph.call_function(_ADD, (total, term))
            total.meta.update(root.meta)
    root.replace_all_uses_with(total)
    for node in [root, *reversed(old)]:
        graph.erase_node(node)


def _left_deep(node: fx.Node, root: fx.Node) -> list[fx.Node] | None:
    """The terms of a tree ``((t1 + t2) + t3) + ...``, or None for another shape."""
    if not (node is root or (_is_add(node) and _is_inner(node))):
        return [node]
    left, right = node.args
    if right is not root and _is_add(right) and _is_inner(right):
        return None
    terms = _left_deep(left, root)
    return None if terms is None else [*terms, right]


def _inner_adds(root: fx.Node) -> list[fx.Node]:
    """The tree's inner adds in graph order (erased after the rebuild, users first)."""
    inner = []
    for arg in root.args:
        if _is_add(arg) and _is_inner(arg):
            inner.extend(_inner_adds(arg))
            inner.append(arg)
    return inner


def _mask_arg(node: fx.Node) -> object:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def _constant_causal(mask: fx.Node) -> bool:
    """Step 4: ``mask`` depends on no input and is the causal lower triangle."""
    built = _ancestors(mask, limit=None)
    if built is not None and is_causal_mask(mask, built):
        return True
    nodes = _ancestors(mask)
    if nodes is None:
        return False
    env: dict[fx.Node, object] = {}
    for node in nodes:
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
        if "device" in kwargs:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        env[node] = node.target(*args, **kwargs)
    value = env[mask]
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    q, k = value.shape[-2:]
    if q != k:
        return False
    causal = torch.ones(q, k, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        return bool((value == causal).all())
    if value.is_floating_point():
        allowed = torch.where(causal, 0.0, float("-inf")).to(value.dtype)
        return bool((value == allowed).all())
    return False


def _ancestors(mask: fx.Node, limit: int | None = MASK_LIMIT) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order; None when one is an input or
    a parameter, not a plain op, or over ``limit`` elements."""
    seen, todo = set(), [mask]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        val = node.meta.get("val")
        if node.op != "call_function" or not callable(node.target) or (
            limit is not None and isinstance(val, torch.Tensor) and val.numel() > limit
        ):
            return None
        seen.add(node)
        todo.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(mask.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _make_causal(node: fx.Node) -> None:
    q, k, v = node.args[:3]
    names = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    kwargs = {**dict(zip(names, node.args[3:], strict=False)), **node.kwargs}
    kwargs.update(attn_mask=None, is_causal=True)
    node.args, node.kwargs = (q, k, v), {k_: v_ for k_, v_ in kwargs.items() if k_ != "attn_mask"}
