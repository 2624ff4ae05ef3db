"""Algebraic canonicalisation of the traced graph, before planning.

Parallel attention + MLP blocks (GPT-J, GPT-NeoX, CodeGen, Phi) end in one sum,
``attn_out + (mlp_out + bias) + residual``.  Row-parallel projections make ``attn_out`` and
``mlp_out`` partial sums over the tensor-parallel ranks; a partial value may only be added to
another partial value, so in the user's order each projection is reduced on its own (two
all-reduces, or two reduce-scatters).  Megatron sums the two projections first and reduces
once.  Adding the matmul terms first gives the planner that choice; it is only a reordering
of an addition (rounding differs in the last bit, as between any two summation orders).

Algorithm:
0. In-place writes through views become functional updates of their base
   (``autopar.frontend.inplace``): every later step, and the planner, then see the write as dataflow.
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
   size (autopar.frontend.mask_structure: positions compared, never materialised); one it does not
   recognise is evaluated when no value on its way is over ``MASK_LIMIT`` elements, on the
   CPU whatever device the model was traced on (every device argument becomes the CPU).
   A mask the layers share is judged once.
5. A tensor split into equal pieces along a dim, each piece normalised by its own
   ``layer_norm`` (same normalised shape and eps, parameters of equal shapes) and the
   results concatenated back in order along that dim (StableLM's per-head q/k norms), is one
   ``layer_norm`` without affine over the whole tensor times the stacked weights plus the
   stacked biases, broadcast along the split dim: the norm reduces over trailing dims only,
   so the pieces never mix.  A Python list of pieces cannot carry a split layout; the whole
   tensor can (each rank normalises its own heads).
6. Attention whose key and value both repeat their heads in place (HF's ``repeat_kv``:
   ``reshape(expand(unsqueeze(x, 2), [b, g, n, s, d]), [b, g * n, s, d])``) reads the
   unrepeated ``[b, g, s, d]`` tensors with ``enable_gqa=True``, which repeats the same way
   (query head j reads key/value head j // n).  The repeat hides the g heads from the
   planner: with fewer heads than ranks, the repeated heads cannot be split evenly through the
   reshape, while grouped-query attention can read each rank's own head locally.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.frontend.inplace import functionalize_view_writes
from autopar.frontend.mask_structure import is_causal_mask, on_cpu

_ADD = torch.ops.aten.add.Tensor
_MATMULS = frozenset({torch.ops.aten.linear.default, torch.ops.aten.mm.default,
                      torch.ops.aten.bmm.default, torch.ops.aten.matmul.default})  # fmt: skip
_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten.reshape.default,
                    torch.ops.aten._unsafe_view.default})  # fmt: skip


MASK_LIMIT = 2**28  # elements of the largest value step 4 evaluates (256 MB as bool)
_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def canonicalize(graph: fx.Graph) -> None:
    """Steps 0-6, in place."""
    functionalize_view_writes(graph)
    for node in list(graph.nodes):
        if node.target is torch.ops.aten.dropout.default and _inference_dropout(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    for node in list(graph.nodes):
        if _is_add(node) and not _is_inner(node):
            _sum_matmuls_first(graph, node)
    causal: dict[fx.Node, bool] = {}  # mask -> step 4's verdict (the layers share one mask)
    for node in list(graph.nodes):
        mask = _mask_arg(node) if node.target is _SDPA else None
        if not isinstance(mask, fx.Node):
            continue
        if mask not in causal:
            causal[mask] = constant_causal(mask)
        if causal[mask]:
            _make_causal(node)
            if not mask.users:  # the mask's computation, now unread
                for old in reversed(_ancestors(mask, limit=None) or []):
                    if not old.users:
                        graph.erase_node(old)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _SPLITS:
            pieces = _normed_pieces(node)
            if pieces is not None:
                _norm_whole(graph, node, *pieces)
    for node in list(graph.nodes):
        if node.target is _SDPA:
            _read_grouped_heads(graph, node)


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


def constant_causal(mask: fx.Node) -> bool:
    """Step 4: ``mask`` depends on no input and is the causal lower triangle."""
    built = _ancestors(mask, limit=None)
    if built is not None and is_causal_mask(mask, built):
        return True
    nodes = _ancestors(mask)
    if nodes is None:
        return False
    env: dict[fx.Node, object] = {}
    for node in nodes:
        args, kwargs = on_cpu(*fx.node.map_arg((node.args, node.kwargs), env.__getitem__))
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


# ---------------------------------------------------------------- step 5: per-piece norms

_SPLITS = frozenset({torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default})
_LAYER_NORM = torch.ops.aten.layer_norm.default


def _normed_pieces(split: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """Step 5: (the pieces' layer_norm nodes in order, the cat of them), or None."""
    x = split.args[0]
    dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor) or not isinstance(dim, int):
        return None
    dim %= val.dim()
    items = sorted(split.users, key=lambda u: u.args[1] if u.op == "call_function" else -1)
    if len(items) < 2 or any(u.target.__name__ != "getitem" or len(u.users) != 1
                             for u in items):  # fmt: skip
        return None
    if [u.args[1] for u in items] != list(range(len(items))):
        return None
    sizes = [u.meta["val"].shape[dim] for u in items]
    if not all(type(n) is int for n in sizes) or len(set(sizes)) != 1:
        return None  # unequal or data-dependent pieces
    norms = [next(iter(u.users)) for u in items]
    if any(n.target is not _LAYER_NORM or n.args[0] is not u for n, u in zip(norms, items, strict=True)):
        return None
    first = _norm_args(norms[0])
    if any(_norm_args(n)[::3] != first[::3] for n in norms):  # normalised shape, eps
        return None
    if dim >= val.dim() - len(first[0]):
        return None  # the split dim is normalised over: pieces do mix
    for i in (1, 2):  # weight, bias: all absent or all of one shape
        args = [_norm_args(n)[i] for n in norms]
        if any(a is None for a in args) and any(a is not None for a in args):
            return None
        shapes = {tuple(a.meta["val"].shape) for a in args if isinstance(a, fx.Node)}
        if len(shapes) > 1 or (args[0] is not None and not all(isinstance(a, fx.Node)
                                                                for a in args)):  # fmt: skip
            return None
    cats = {u for n in norms for u in n.users}
    if len(cats) != 1 or any(len(n.users) != 1 for n in norms):
        return None
    cat = cats.pop()
    cat_dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    if cat.target is not torch.ops.aten.cat.default or list(cat.args[0]) != norms:
        return None
    if cat_dim % val.dim() != dim or cat.meta["val"].dtype != val.dtype:
        return None
    return norms, cat


def _norm_args(node: fx.Node) -> tuple:
    """(normalized_shape, weight, bias, eps) of a layer_norm node."""
    names = ("input", "normalized_shape", "weight", "bias", "eps")
    given = {**dict(zip(names, node.args, strict=False)), **node.kwargs}
    return (tuple(given["normalized_shape"]), given.get("weight"), given.get("bias"),
            given.get("eps", 1e-5))  # fmt: skip


def _norm_whole(graph: fx.Graph, split: fx.Node, norms: list[fx.Node], cat: fx.Node) -> None:
    """Step 5's rewrite: ``layer_norm(x) * stack(weights) + stack(biases)``, broadcast."""
    x = split.args[0]
    val = x.meta["val"]
    dim = (split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)) % val.dim()
    shape, weight, bias, eps = _norm_args(norms[0])
    size = val.shape[dim] // len(norms)  # each piece's extent along the split dim
    aten = torch.ops.aten

    def call(target: object, args: tuple) -> fx.Node:
        node = graph.call_function(target, args)
        node.meta.update({k: v for k, v in norms[0].meta.items() if k != "val"})
        node.meta["val"] = target(*fx.node.map_arg(args, lambda a: a.meta["val"]))
        return node

    def broadcast(params: list[fx.Node]) -> fx.Node:
        """[n, *p] -> [n·size, 1, ..., *p]: one row per position of the split dim."""
        pshape = list(params[0].meta["val"].shape)
        stacked = call(aten.stack.default, (params, 0))
        if size > 1:
            stacked = call(aten.unsqueeze.default, (stacked, 1))
            stacked = call(aten.expand.default, (stacked, [len(params), size, *pshape]))
        ones = [1] * (val.dim() - dim - 1 - len(pshape))
        return call(aten.reshape.default, (stacked, [len(params) * size, *ones, *pshape]))

    with graph.inserting_before(cat):
        out = call(aten.layer_norm.default, (x, list(shape), None, None, eps))
        if weight is not None:
            out = call(aten.mul.Tensor, (out, broadcast([_norm_args(n)[1] for n in norms])))
        if bias is not None:
            out = call(aten.add.Tensor, (out, broadcast([_norm_args(n)[2] for n in norms])))
    cat.replace_all_uses_with(out)
    for node in [cat, *norms, *list(split.users), split]:
        graph.erase_node(node)


# ---------------------------------------------------------------- step 6: repeated K/V heads

_SDPA_ARGS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _read_grouped_heads(graph: fx.Graph, sdpa: fx.Node) -> None:
    """Step 6: ``sdpa`` reads the unrepeated key and value, with ``enable_gqa``.

    1. Match both the key and the value to a head repeat of one count ``n`` (None: leave).
    2. Rewrite the arguments, keeping the others as keywords, and erase the repeats when
       nothing else reads them.
    """
    kwargs = {**dict(zip(_SDPA_ARGS, sdpa.args[3:], strict=False)), **sdpa.kwargs}
    if kwargs.get("enable_gqa") or len(sdpa.args) < 3:
        return
    q, k, v = sdpa.args[:3]
    found = [_repeated_heads(x) for x in (k, v)]
    if None in found or found[0][1] != found[1][1]:
        return
    sdpa.args = (q, found[0][0], found[1][0])
    sdpa.kwargs = {**kwargs, "enable_gqa": True}
    for reshape in (k, v):
        if not reshape.users:
            expand = reshape.args[0]
            unsqueeze = expand.args[0]
            for old in (reshape, expand, unsqueeze):
                if not old.users:
                    graph.erase_node(old)


def _repeated_heads(node: object) -> tuple[fx.Node, int] | None:
    """``(x, n)`` when ``node`` is ``reshape(expand(unsqueeze(x, 2), [b, g, n, s, d]),
    [b, g * n, s, d])`` of a 4-D ``x`` (heads repeated in place), else None."""
    if not isinstance(node, fx.Node) or node.target not in _VIEWS:
        return None
    expand = node.args[0]
    if not _calls(expand, torch.ops.aten.expand.default):
        return None
    unsqueeze = expand.args[0]
    if not _calls(unsqueeze, torch.ops.aten.unsqueeze.default):
        return None
    x = unsqueeze.args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() != 4 or unsqueeze.args[1] not in (2, -3):
        return None
    b, g, s, d = val.shape
    wide = tuple(expand.meta["val"].shape)
    n = wide[2]
    if wide != (b, g, n, s, d) or tuple(node.meta["val"].shape) != (b, g * n, s, d):
        return None
    return x, n


def _calls(node: object, target: object) -> bool:
    return isinstance(node, fx.Node) and node.target is target
