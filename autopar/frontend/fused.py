"""Fused projections whose blocks need different layouts become one projection per block.

A fused weight ``W[n, k]`` whose output features are read back as contiguous blocks of
unequal widths -- multi-query attention's ``[q (a*d) | k (d) | v (d)]`` (GPT-BigCode, Falcon),
GQA's ``[q (a*d) | k (g*d) | v (g*d)]`` (Phi-3) -- cannot be laid out with one placement per
tensor dim: REFERENCE.md splits q's heads and replicates a single KV head (or splits the g KV
heads), and a blocked split ``S(0:b)`` only cuts b equal blocks.  Equal blocks keep their
blocked split; unequal ones are cut here, before planning, into one projection per block on a
*piece* of the weight (and of its bias), so the solver gives each piece its own layout.

Algorithm (:func:`split_fused_projections`):
1. Projections: ``linear(x, W)``, ``matmul(x, W.T)`` (W's features on dim 0) or
   ``mm/matmul(x, W)`` (dim 1), W a 2-D parameter read only there, optionally followed by
   ``add(., b)`` with a 1-D parameter bias read only there.
2. Follow the output through single-user reshapes (view, reshape, unsqueeze) that keep the
   features a suffix of the shape whose sizes multiply to n (the feature group).
3. Every reader of the last value must take a contiguous range of whole rows of one dim of
   the group, the same for all: ``slice`` (step 1) or ``split`` / ``split_with_sizes`` (each
   part read).  Falcon's ``qkv[..., [-2], :]`` is a slice too: trace.py records a list index
   of consecutive ints as a copied slice.  The dims of the group before the one read are its
   *groups* (Falcon's ``new_decoder_architecture`` views its fused QKV as ``[.., g, a/g + 2,
   d]``: per K/V head its query heads, key and value); the ranges, per group, must tile it
   with at least two different widths; otherwise the projection is left as it is.  Grouped
   projections are cut only when the axis ``size`` does not divide the groups (otherwise
   each rank holds whole groups of the fused weight).
4. Rewrite, per range: a parameter placeholder for its rows in every group (and bias
   entries), the projection on it, the reshapes replayed at the narrower width; each
   reader's value is replaced by its range's result; the old nodes are erased.  A grouped
   piece's last reshape and the reshapes reading it become one reshape (Falcon's query:
   ``[.., g, a/g, d]`` then ``flatten`` is ``[.., a, d]``, which splits by heads).
5. Record each piece (``Traced.pieces``: ``<fqn>.<i>`` -> user parameter, dim, range,
   groups); its tensor is a view of the user's parameter (a copy when grouped), so a rank
   program holds ``c_attn.weight.0``, ``.1``, ... and verify / checkpoints map the pieces
   back to ``c_attn.weight``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.frontend.trace import Piece, Traced
from autopar.ir.printing import copy_module

aten = torch.ops.aten
_TRANSPOSES = (aten.t.default, aten.numpy_T.default)
_MATMULS = (aten.matmul.default, aten.mm.default)
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.unsqueeze.default)  # fmt: skip
_SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


@dataclass(frozen=True)
class _Fused:
    """One fused projection found by steps 1-3."""

    weight: fx.Node
    dim: int  # the weight's feature dim
    ops: tuple[fx.Node, ...]  # [transpose,] projection [, bias add]: weight -> head
    bias: fx.Node | None
    chain: tuple[fx.Node, ...]  # reshapes after the head
    ranges: tuple[tuple[int, int], ...]  # feature ranges per group, in order, tiling it
    readers: tuple[tuple[fx.Node, ...], ...]  # per range: the values its result replaces
    dead: tuple[fx.Node, ...]  # split nodes read only by the readers
    groups: int = 1  # the features are [groups, n / groups]; each range is in every group


def split_fused_projections(traced: Traced, size: int | None = None) -> Traced:
    """``traced`` with every fused projection of unequal blocks cut per block (steps 1-5);
    grouped ones only where ``size`` ranks do not divide the groups (None: every one)."""
    if not _find(traced.gm.graph, traced, size):
        return traced
    gm = copy_module(traced.gm)
    params, tensors = dict(traced.params), dict(traced.tensors)
    pieces, trainable = dict(traced.pieces), set(traced.trainable)
    for fused in _find(gm.graph, traced, size):
        made = _rewrite(gm.graph, fused)
        for ph, old, dim, (start, stop), i in made:
            fqn = traced.params[old]
            name = f"{fqn}.{i}"
            params[ph.name] = name
            pieces[name] = Piece(fqn=fqn, dim=dim, start=start, stop=stop, groups=fused.groups)
            tensors[name] = pieces[name].of(tensors[fqn].detach())
            if fqn in traced.trainable:
                trainable.add(name)
        for ph in (fused.weight, fused.bias):
            if ph is not None:
                params.pop(ph.name)
    gm.graph.lint()
    gm.recompile()
    return dataclasses.replace(traced, gm=gm, params=params, tensors=tensors, pieces=pieces,
                               trainable=frozenset(trainable))  # fmt: skip


# ---------------------------------------------------------------- steps 1-3: find


def _find(graph: fx.Graph, traced: Traced, size: int | None) -> list[_Fused]:
    found = []
    for w in graph.nodes:
        if w.op == "placeholder" and w.name in traced.params:
            fused = _fused(w, traced)
            if fused is not None and (fused.groups == 1 or not size or fused.groups % size):
                found.append(fused)
    return found


def _fused(w: fx.Node, traced: Traced) -> _Fused | None:
    proj = _projection(w)
    if proj is None:
        return None
    ops, dim = proj
    n = w.meta["val"].shape[dim]
    bias = _bias(ops[-1], n, traced)
    if bias is not None:
        ops = (*ops, next(iter(ops[-1].users)))
    chain, last = _chain(ops[-1], n)
    read = _ranges(last, n)
    if read is None:
        return None
    ranges, readers, dead, groups = read
    values = (ops[-1], *chain)
    whole_rows = all(_piece_shape(_shape(v), n, b - a, groups) is not None
                     for v in values for a, b in ranges)  # fmt: skip
    fits = whole_rows and all(_shape(r) == _piece_shape(_shape(last), n, b - a, groups)
                              for (a, b), rs in zip(ranges, readers, strict=True) for r in rs)  # fmt: skip
    if len({b - a for a, b in ranges}) < 2 or not fits:
        return None
    return _Fused(weight=w, dim=dim, ops=ops, bias=bias, chain=chain, ranges=ranges,
                  readers=readers, dead=dead, groups=groups)  # fmt: skip


def _projection(w: fx.Node) -> tuple[tuple[fx.Node, ...], int] | None:
    """Step 1: the ops from the weight to the projection, and the weight's feature dim."""
    if w.meta["val"].dim() != 2 or len(w.users) != 1:
        return None
    user = next(iter(w.users))
    if user.target is aten.linear.default and len(user.args) == 2 and user.args[1] is w:
        return ((user,), 0) if user.args[0] is not w else None
    if user.target in _TRANSPOSES and len(user.users) == 1:
        mm = next(iter(user.users))
        if mm.target in _MATMULS and mm.args[1] is user and mm.args[0] is not user:
            return (user, mm), 0
        return None
    if user.target in _MATMULS and user.args[1] is w and user.args[0] is not w:
        return (user,), 1
    return None


def _bias(proj: fx.Node, n: int, traced: Traced) -> fx.Node | None:
    """Step 1: the 1-D parameter added to the projection's output and read nowhere else."""
    if len(proj.users) != 1:
        return None
    add = next(iter(proj.users))
    if add.target is not aten.add.Tensor or len(add.args) != 2 or add.args[0] is not proj:
        return None
    b = add.args[1]
    ok = (isinstance(b, fx.Node) and b.op == "placeholder" and b.name in traced.params
          and len(b.users) == 1 and tuple(_shape(b)) == (n,))  # fmt: skip
    return b if ok else None


def _chain(head: fx.Node, n: int) -> tuple[tuple[fx.Node, ...], fx.Node]:
    """Step 2: single-user reshapes after ``head`` that keep a feature group; the last value."""
    chain, last = [], head
    while len(last.users) == 1:
        user = next(iter(last.users))
        if user.target not in _RESHAPES or user.args[0] is not last:
            break
        if _suffix(_shape(user), n) is None:
            break
        chain.append(user)
        last = user
    return tuple(chain), last


def _suffix(shape: Sequence[int], n: int) -> int | None:
    """The first dim of the shortest suffix of ``shape`` whose sizes multiply to ``n``."""
    p = 1
    for j in range(len(shape) - 1, -1, -1):
        p *= shape[j]
        if p == n:
            return j
        if p > n:
            return None
    return None


def _ranges(last: fx.Node, n: int) -> tuple | None:
    """Step 3: (ranges per group in order, readers per range, dead nodes, groups), or None."""
    shape = _shape(last)
    fd = _suffix(shape, n)
    read_dims = {_read_dim(user, len(shape)) for user in last.users}
    if len(read_dims) != 1 or None in read_dims or min(read_dims) < fd:
        return None
    k = read_dims.pop()
    inner, groups = math.prod(shape[k + 1 :]), math.prod(shape[fd:k])
    by_range: dict[tuple[int, int], list[fx.Node]] = {}
    dead: list[fx.Node] = []
    for user in last.users:
        got = _read(user, last, k, shape[k])
        if got is None:
            return None
        parts, extra = got
        for (a, b), node in parts:
            by_range.setdefault((a * inner, b * inner), []).append(node)
        dead += extra
    ranges = sorted(by_range)
    if len(ranges) < 2 or ranges[0][0] != 0 or ranges[-1][1] != n // groups:
        return None
    if any(r[1] != s[0] for r, s in zip(ranges, ranges[1:], strict=False)):
        return None  # overlapping or with a gap
    return tuple(ranges), tuple(tuple(by_range[r]) for r in ranges), tuple(dead), groups


def _read_dim(user: fx.Node, nd: int) -> int | None:
    """The dim a step-3 reader (slice / split) takes its rows of."""
    if user.target is aten.slice.Tensor:
        return _norm(user.args[1] if len(user.args) > 1 else 0, nd)
    if user.target in _SPLITS:
        return _norm(user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0), nd)
    return None


def _read(user: fx.Node, src: fx.Node, fd: int, width: int) -> tuple | None:
    """Step 3 for one reader: ([((start, stop) rows of dim fd, value node)], dead nodes)."""
    nd = len(_shape(src))
    if user.target is aten.slice.Tensor and user.args[0] is src:
        dim, start, end, step = (list(user.args[1:]) + [0, None, None, 1][len(user.args) - 1 :])
        if _norm(dim, nd) != fd or step != 1:
            return None
        a, b, _ = slice(start, end).indices(width)
        return ([((a, b), user)], []) if b > a else None
    if user.target in _SPLITS and user.args[0] is src:
        dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
        if _norm(dim, nd) != fd:
            return None
        bounds = [0]
        for v in user.meta["val"]:
            bounds.append(bounds[-1] + v.shape[fd])
        parts = []
        for get in user.users:
            if get.target is not operator.getitem or not isinstance(get.args[1], int):
                return None
            i = get.args[1]
            parts.append(((bounds[i], bounds[i + 1]), get))
        if {g.args[1] for _, g in parts} != set(range(len(bounds) - 1)):
            return None
        return parts, [user]
    return None


def _piece_shape(shape: Sequence[int], n: int, width: int, groups: int = 1) -> torch.Size | None:
    """``shape`` with its feature group (sizes multiplying to ``n``, viewed as ``[groups, n /
    groups]``) narrowed to ``width`` features of each group: the first dim of the group past
    the groups shrinks (None: the piece is not whole rows of that dim)."""
    fd = _suffix(shape, n)
    if fd is None:
        return None
    outer, j = 1, fd
    while groups > 1 and j < len(shape) and outer * shape[j] <= groups:
        outer, j = outer * shape[j], j + 1  # dims holding whole groups
    if j == len(shape) or groups % outer or shape[j] % (groups // outer):
        return None
    if shape[j] * width * groups % n:
        return None
    return torch.Size([*shape[:j], shape[j] * width * groups // n, *shape[j + 1 :]])


def _norm(dim: int, nd: int) -> int:
    return dim + nd if dim < 0 else dim


def _shape(node: fx.Node) -> torch.Size:
    return node.meta["val"].shape


# ---------------------------------------------------------------- step 4: rewrite


def _rewrite(graph: fx.Graph, f: _Fused) -> list[tuple]:
    """Step 4; returns (new placeholder, old placeholder name, dim, range, index) per piece."""
    n = _shape(f.weight)[f.dim]
    made = []
    old_nodes = [*f.ops, *f.chain]
    anchor = f.chain[-1].next if f.chain else f.ops[-1].next
    for i, (a, b) in enumerate(f.ranges):
        rows = (b - a) * f.groups
        w_i = _piece_placeholder(graph, f.weight, f.dim, rows, i)
        made.append((w_i, f.weight.name, f.dim, (a, b), i))
        env = {f.weight: w_i}
        if f.bias is not None:
            b_i = _piece_placeholder(graph, f.bias, 0, rows, i)
            made.append((b_i, f.bias.name, 0, (a, b), i))
            env[f.bias] = b_i
        with graph.inserting_before(anchor):
            for old in old_nodes:
                env[old] = _replay(graph, old, env, n, b - a, i, f.groups)
        for reader in f.readers[i]:
            reader.replace_all_uses_with(env[old_nodes[-1]])
        if f.groups > 1:
            _fold_reshapes(graph, env[old_nodes[-1]])
    erase = [r for rs in f.readers for r in rs] + list(f.dead) + old_nodes[::-1]
    erase += [f.weight] + ([f.bias] if f.bias is not None else [])
    for node in erase:
        if not node.users:
            graph.erase_node(node)
    return made


def _piece_placeholder(graph: fx.Graph, ph: fx.Node, dim: int, rows: int, i: int) -> fx.Node:
    with graph.inserting_before(ph):
        new = graph.placeholder(f"{ph.name}_{i}")
    new.meta.update({k: v for k, v in ph.meta.items() if k not in ("autopar", "tensor_meta")})
    new.meta["val"] = _narrowed(ph.meta["val"], dim, rows)
    return new


def _fold_reshapes(graph: fx.Graph, last: fx.Node) -> None:
    """Step 4: each reshape reading the grouped piece's last reshape ``last`` reads what
    ``last`` reads instead (one reshape of the projection's output)."""
    if last.target not in _VIEWS:
        return
    for user in list(last.users):
        if user.target in (*_VIEWS, aten.flatten.using_ints) and user.args[0] is last:
            with graph.inserting_before(user):
                new = graph.call_function(aten.reshape.default,
                                          (last.args[0], list(_shape(user))))  # fmt: skip
            new.meta.update({k: v for k, v in user.meta.items() if k not in ("autopar",)})
            user.replace_all_uses_with(new)
            graph.erase_node(user)
    if not last.users:
        graph.erase_node(last)


def _replay(graph: fx.Graph, old: fx.Node, env: dict, n: int, width: int,
            index: int, groups: int = 1) -> fx.Node:  # fmt: skip
    """``old`` on its inputs' pieces: its feature group (sizes multiplying to ``n``) narrowed
    to the piece's ``width`` features of each of ``groups`` (`_piece_shape`)."""
    shape = list(_piece_shape(_shape(old), n, width, groups))
    args = fx.node.map_arg(old.args, lambda a: env.get(a, a))
    if old.target in _VIEWS:
        args = (args[0], shape, *args[2:])
    new = graph.create_node("call_function", old.target, args, dict(old.kwargs),
                            name=f"{old.name}_block{index}")  # fmt: skip
    new.meta.update({k: v for k, v in old.meta.items() if k not in ("autopar", "tensor_meta")})
    new.meta["val"] = torch.empty(shape, dtype=old.meta["val"].dtype, device="meta")
    return new


def _narrowed(val: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(val.shape)
    shape[dim] = size
    return torch.empty(shape, dtype=val.dtype, device="meta")
