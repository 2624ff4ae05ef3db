"""Collectives return fresh row-major tensors: a local ``view`` written for the global tensor and
an in-place op on the output both work, for every dim and block count, forward and backward."""

from __future__ import annotations

import pytest
import torch

from autopar.ops import collectives as C
from autopar.runtime.pool import get_pool

SHAPE = (4, 8, 12)  # every dim divides by 2 ranks x 2 blocks


def _global(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _shard(x: torch.Tensor, dim: int, blocks: int, rank: int, t: int) -> torch.Tensor:
    parts = [b.chunk(t, dim=dim)[rank] for b in x.chunk(blocks, dim=dim)]
    return torch.cat(parts, dim=dim)


def _check(name: str, y: torch.Tensor, want: torch.Tensor) -> list[str]:
    bad = []
    if not y.is_contiguous() or y._is_view():
        bad.append(f"{name}: output is {'a view' if y._is_view() else 'strided'}")
    if not torch.allclose(y, want):
        bad.append(f"{name}: wrong values")
    y.mul_(2.0)  # autograd refuses this on a custom Function's view output
    y.view(-1).sum().backward()
    return bad


def _rank_checks(rank: int, groups: dict, dim: int, blocks: int) -> list[str]:
    C.bind(groups)
    t = C.axis_size("tp")
    full = _global(0)
    local = _shard(full, dim, blocks, rank, t)
    bad = []
    x = local.clone().requires_grad_()
    bad += _check("all_gather", C.all_gather(x, "tp", dim, blocks), full)
    x = full.clone().requires_grad_()
    bad += _check("split", C.split(x, "tp", dim, blocks), local)
    x = (full / t).requires_grad_()
    bad += _check("reduce_scatter", C.reduce_scatter(x, "tp", dim, blocks), local)
    if blocks == 1:
        dst = (dim + 1) % len(SHAPE)
        x = local.clone().requires_grad_()
        want = _shard(full, dst, 1, rank, t)
        bad += _check("all_to_all", C.all_to_all(x, "tp", dim, dst), want)
    return bad


@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_collective_outputs_are_fresh_and_row_major(dim, blocks):
    results = get_pool(2).run(_rank_checks, (("tp", 2),), [(dim, blocks)] * 2)
    assert results == [[], []]
