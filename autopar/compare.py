"""compare: how a parallel program's tensor is judged against the single-device one.

verify (autopar.verify) runs the programs; this module holds the verdicts it returns.

Algorithm (:func:`check`):
1. A split tensor is reassembled from every rank's shard by its layout; a replicated one is
   checked on every replica (:func:`wholes`).
2. A shape that differs, or a NaN or infinity in ours or the reference, fails with that note.
3. Relative error = max |ours - ref| / (max |ref| + 1e-3 * S), S the largest finite reference
   magnitude among tensors of the same kind (:func:`scale_of`); it passes at ``rtol``.
4. :func:`bitwise_equal` compares two runs' tensors byte for byte (a race, uninitialised
   memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from autopar.codegen import unshard_tensors
from autopar.ir.layout import Layout
from autopar.mesh import Mesh


@dataclass(frozen=True, kw_only=True)
class TensorCheck:
    """One compared tensor."""

    name: str
    kind: str  # 'output' or 'grad'
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""  # why it failed beyond the error: non-finite, nondeterministic, shape

    def __str__(self) -> str:
        mark = "ok " if self.ok else "BAD"
        row = f"{mark} {self.kind:<6} {self.name:<52} abs {self.max_abs:9.2e}  rel {self.max_rel:9.2e}"
        return f"{row}  {self.note}" if self.note else row


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """Per-tensor comparison of the parallel program against the single-device model."""

    mesh: str
    rtol: float
    rows: tuple[TensorCheck, ...]
    recheck: VerifyReport | None = None  # the float64 re-run of a failed fp32 one (step 5)
    recheck_error: str = ""  # why that re-run could not run (an op with no float64 kernel)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows) or (self.recheck is not None and self.recheck.ok)

    @property
    def max_rel_error(self) -> float:
        return max((r.max_rel for r in self.rows), default=0.0)

    def __str__(self) -> str:
        head = (f"verify on {self.mesh}: {'OK' if self.ok else 'MISMATCH'} · "
                f"{len(self.rows)} tensors · max relative error {self.max_rel_error:.2e} "
                f"(tolerance {self.rtol:.0e})")  # fmt: skip
        lines = [head, *map(str, self.rows)]
        if self.recheck is not None:
            bad = sum(not r.ok for r in self.rows)
            verdict = ("the fp32 mismatch is rounding amplified by a non-smooth op (a relu or "
                       "max whose input is within rounding of its kink), not the program"
                       if self.recheck.ok else "the program is wrong in float64 too")  # fmt: skip
            lines += [f"fp32: {bad} tensor(s) over tolerance; re-run in float64: "
                      f"{'OK' if self.recheck.ok else 'MISMATCH'}, max relative error "
                      f"{self.recheck.max_rel_error:.2e}: {verdict}"]  # fmt: skip
            if not self.recheck.ok:
                lines += ["float64 run:", *map(str, self.recheck.rows)]
        if self.recheck_error:
            lines += [f"re-run in float64 not possible ({self.recheck_error}): the fp32 verdict "
                      "stands"]  # fmt: skip
        return "\n".join(lines)


def bitwise_equal(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (NaN payloads included); non-tensors by ``==``."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a is b or (type(a) is type(b) and a == b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return torch.equal(*as_bytes)


def scale_of(tensors: list) -> float:
    """Largest finite magnitude among floating tensors (non-finite ones fail on their own)."""
    return max((t.detach().abs().nan_to_num(nan=0.0, posinf=0.0).max().item() for t in tensors
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()),
               default=0.0)  # fmt: skip


def wholes(shards: list[torch.Tensor], lay: Layout | None, mesh: Mesh) -> list[torch.Tensor]:
    """Every rank's tensor (replicated: every replica is checked), or the split one
    reassembled from all ranks."""
    if lay is None or lay.is_replicated:
        return shards
    return [unshard_tensors(shards, lay, mesh, [mesh.coordinates(r) for r in range(len(shards))])]


def check(name: str, kind: str, ours: list[torch.Tensor], lay: Layout | None, ref: torch.Tensor,
           mesh: Mesh, rtol: float, kind_scale: float) -> TensorCheck:  # fmt: skip
    """Compare every replica of (``lay`` None or replicated), or the reassembled, ``ours``."""
    candidates = wholes(ours, lay, mesh)
    bad = [f"shape {tuple(c.shape)}, expected {tuple(ref.shape)}"
           for c in candidates if c.shape != ref.shape]  # fmt: skip
    if bad:
        return failed(name, kind, bad[0])
    where = [w for w, ts in (("ours", candidates), ("reference", [ref]))
             if not all(torch.isfinite(t).all() for t in ts)]  # fmt: skip
    if where:
        return failed(name, kind, f"non-finite (NaN/inf) in {' and '.join(where)}")
    scale = max(scale_of([ref]) + 1e-3 * kind_scale, 1e-30)
    worst = max((c.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
                for c in candidates)  # fmt: skip
    return TensorCheck(name=name, kind=kind, max_abs=worst, max_rel=worst / scale,
                       ok=worst / scale <= rtol)  # fmt: skip


def failed(name: str, kind: str, note: str) -> TensorCheck:
    inf = float("inf")
    return TensorCheck(name=name, kind=kind, max_abs=inf, max_rel=inf, ok=False, note=note)
