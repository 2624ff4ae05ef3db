"""Layouts: how a tensor is laid out over the named axes of a device mesh.

A layout says, for each tensor dim, which mesh axes split it, plus the mesh axes on which the
value is still a pending partial sum.  It prints compactly, e.g. ``P(None, 'tp')`` or
``P(None, None, partial=('tp',))``.  A split dim may be *blocked*: ``'tp:3'`` means the dim is
viewed as ``[3, n/3]`` and the inner part is split, so each rank holds its slice of each of the
three blocks (a fused QKV projection's q, k and v columns).  A split dim may be *shared*:
``'tp'x2`` means the dim is split into size/2 pieces, each held by 2 consecutive ranks (rank r
holds piece r // 2): grouped-query attention with fewer K/V heads than ranks, where each
rank holds the K/V head its query heads read.

The planner reasons about one mesh axis at a time through :class:`Placement` values (the
per-axis view of a layout):

1. ``Replicate()`` -- every rank along the axis holds the whole value.
2. ``Shard(dim, blocks, rep)`` -- dim ``dim`` is split evenly along the axis (per block);
   with ``rep`` > 1 into size/rep pieces, each on ``rep`` consecutive ranks.
3. ``Partial()`` -- every rank holds a summand; the value is their sum.

:class:`Layout` is the per-dim form stored on graph nodes and printed in plans and code.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Replicate:
    """Every rank along the axis holds the whole value."""

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Tensor dim ``dim`` split evenly along the axis; ``blocks`` > 1 splits each block;
    ``rep`` > 1 splits it into size/rep pieces, piece r // rep on rank r."""

    dim: int
    blocks: int = 1
    rep: int = 1

    def __str__(self) -> str:
        text = f"S({self.dim})" if self.blocks == 1 else f"S({self.dim}:{self.blocks})"
        return text if self.rep == 1 else f"{text}x{self.rep}"


@dataclass(frozen=True)
class Partial:
    """Every rank holds a summand; the value is the sum over the axis."""

    def __str__(self) -> str:
        return "P"


Placement = Replicate | Shard | Partial
R = Replicate()
PARTIAL = Partial()


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Per tensor dim: the mesh axes splitting it (with block count); plus partial axes."""

    dims: tuple[tuple[str, ...], ...]
    blocks: tuple[int, ...]
    partial: tuple[str, ...] = ()
    shared: tuple[tuple[str, int], ...] = ()  # (axis, rep) of the shared splits (rep > 1)

    @staticmethod
    def replicate(ndim: int) -> Layout:
        return Layout(dims=((),) * ndim, blocks=(1,) * ndim)

    @staticmethod
    def from_placements(ndim: int, placements: Mapping[str, Placement]) -> Layout:
        """Build the per-dim layout from one placement per mesh axis (mesh order)."""
        dims: list[tuple[str, ...]] = [()] * ndim
        blocks = [1] * ndim
        partial: list[str] = []
        shared: list[tuple[str, int]] = []
        for axis, p in placements.items():
            if isinstance(p, Shard):
                dims[p.dim] = (*dims[p.dim], axis)
                blocks[p.dim] = p.blocks
                if p.rep > 1:
                    shared.append((axis, p.rep))
            elif isinstance(p, Partial):
                partial.append(axis)
        return Layout(dims=tuple(dims), blocks=tuple(blocks), partial=tuple(partial),
                      shared=tuple(shared))  # fmt: skip

    def rep(self, axis: str) -> int:
        """How many consecutive ranks of ``axis`` hold each piece (1: a plain split)."""
        return dict(self.shared).get(axis, 1)

    def placement(self, axis: str) -> Placement:
        """The per-axis view of this layout."""
        if axis in self.partial:
            return PARTIAL
        for d, axes in enumerate(self.dims):
            if axis in axes:
                return Shard(d, self.blocks[d], self.rep(axis))
        return R

    def local_shape(self, shape: Sequence[int], sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The per-rank shape of a tensor of global ``shape`` under this layout."""
        out = []
        for n, axes in zip(shape, self.dims, strict=True):
            for a in axes:
                n //= sizes[a] // self.rep(a)
            out.append(n)
        return tuple(out)

    @property
    def is_replicated(self) -> bool:
        return not self.partial and all(not a for a in self.dims)

    def __str__(self) -> str:
        return self._text

    @functools.cached_property
    def _text(self) -> str:
        """``str(self)``, made once: pass histories and plans print every node's layout."""
        parts = []
        for axes, b in zip(self.dims, self.blocks, strict=True):
            if not axes:
                parts.append("None")
                continue
            names = [f"{a}:{b}" if b > 1 and i == len(axes) - 1 else a for i, a in enumerate(axes)]
            text = repr(names[0]) if len(names) == 1 else repr(tuple(names))
            reps = [f"x{self.rep(a)}" for a in axes if self.rep(a) > 1]
            parts.append(text + "".join(reps))
        if self.partial:
            parts.append(f"partial={self.partial!r}")
        return f"P({', '.join(parts)})"

    __repr__ = __str__


def parse_placement(text: str) -> Placement:
    """Inverse of ``str(placement)``: 'R', 'P', 'S(2)', 'S(2:3)' or 'S(1)x2'."""
    if text == "R":
        return R
    if text == "P":
        return PARTIAL
    body, _, rep = text.partition(")x")
    body = body + ")" if rep else body
    if body.startswith("S(") and body.endswith(")"):
        dim, _, blocks = body[2:-1].partition(":")
        return Shard(int(dim), int(blocks or 1), int(rep or 1))
    raise ValueError(f"not a placement: {text!r} (expected R, P, S(d), S(d:blocks) or S(d)xrep)")
