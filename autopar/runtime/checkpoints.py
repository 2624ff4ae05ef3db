"""Sharded, asynchronous, atomically committed checkpoints that reshard across plans.

A checkpoint is keyed by the model's own parameter names and *global* shapes, never by rank:
each rank describes what it holds as chunks of the global tensor, so torch.distributed.checkpoint
(DCP) can load it under any other plan (Mesh(tp=2) -> Mesh(tp=4), dp x tp -> pp x tp, one
device).  Keys: ``model.<fqn>``, ``optim.<fqn>.<state>`` (AdamW's exp_avg, exp_avg_sq, step),
``rng.<rank>``; the step, the data position and the optimizer's hyper-parameters go to a small
JSON file.

Algorithm (:meth:`Checkpointer.save`):
1. Chunks: every local tensor (a tp shard of a parameter, an FSDP2 dp shard of that, a ZeRO-1
   rank's optimizer state) is cut where the plan's layout makes it non-contiguous in the global
   tensor (a blocked split ``S(0:3)`` holds 3 pieces); each piece gets its global offset.  Rows a
   padded vocabulary added (autopar/frontend/pad.py) are clipped off, so they never reach the file.
   A piece of a fused parameter (autopar/frontend/fused.py: ``qkv.weight.1``) is saved as its part of
   the user's parameter (``qkv.weight`` at its row offset), so any plan, or one device, reads it.
2. Stage: the pieces are copied (the staging copy; :attr:`Checkpointer.staged_bytes`), so
   training may update the parameters while the copy is written.
3. Write ``step_N.tmp`` with DCP in a background thread, over a Gloo group of its own (its
   collectives never interleave with training's); DCP de-duplicates replicas across ranks.
   The files are safetensors shards and a JSON manifest (autopar/runtime/checkpoint_format.py): no
   pickle.
4. Commit: DCP's coordinator finishes only after every rank's writes; rank 0 then writes
   ``trainer.json`` and renames ``step_N.tmp`` to ``step_N``; a barrier ends the save on every
   rank.  A job killed part-way leaves only a ``.tmp`` that loading ignores.

Algorithm (:meth:`Checkpointer.load`):
1. Pick the newest committed ``step_N`` (or the one asked for); check ``trainer.json``, the
   manifest and the folder (autopar/runtime/checkpoint_format.py steps 1-2).
2. Targets are views of the live parameters and optimizer state (created first when the
   optimizer has not stepped yet), described as in save step 1; the checkpoint must hold each
   with the same global shape and dtype.
3. Every target piece is copied from the saved chunks that overlap it (resharding), each
   chunk's file and bytes checked before use; no collective, no pickle, no ``torch.load``.
4. The ranks agree: when any rank failed, every rank raises :class:`CheckpointError` naming
   that rank's file and entry (none trains on alone).
5. Restore this rank's RNG state (a rank the saved world did not have, e.g. after the job
   grew, is seeded from the saved lowest rank's state and its own rank number, so a resumed
   run is reproducible), the optimizer's hyper-parameters; return the step and the caller's
   extra state.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from autopar.errors import CheckpointError
from autopar.ir.layout import Layout
from autopar.runtime.checkpoint_format import (
    Manifest,
    SafetensorsWriter,
    ShardReader,
    check_folder,
    read_manifest,
)

_STEP_DIR = re.compile(r"^step_(\d+)$")
TRAINER = "trainer.json"


# ---------------------------------------------------------------- step 1: chunks of the global


@dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """How one local tensor sits in its global tensor: the plan's layout over the sub-mesh."""

    shape: tuple[int, ...]  # the global shape the checkpoint records (vocab padding removed)
    padded: tuple[int, ...]  # the global shape the program computes with
    layout: Layout
    sizes: dict[str, int]
    coords: dict[str, int]
    saved: tuple[int, ...] = ()  # the saved tensor's shape when this one is a piece of it
    base: tuple[int, ...] = ()  # this tensor's offset in the saved tensor (a piece's rows)
    # a piece of every group of the saved tensor's dim: (dim, rows per group here, there)
    grouped: tuple[int, int, int] = ()

    @staticmethod
    def whole(shape: Sequence[int]) -> ShardSpec:
        shape = tuple(shape)
        return ShardSpec(shape=shape, padded=shape, layout=Layout.replicate(len(shape)),
                         sizes={}, coords={})  # fmt: skip


def global_pieces(local: torch.Tensor, spec: ShardSpec, row0: int = 0
                  ) -> list[tuple[tuple[int, ...], torch.Tensor]]:  # fmt: skip
    """``local`` (rows ``row0..`` of this rank's shard) as (global offset, view) pieces, each
    contiguous in the global tensor and clipped to ``spec.shape`` (step 1)."""
    per_dim = []
    for d, axes in enumerate(spec.layout.dims):
        start = row0 if d == 0 else 0
        per_dim.append(_segments(start, local.shape[d], spec, d, axes))
    out = []
    for segs in itertools.product(*per_dim):
        view, offsets = local, []
        for d, (lo, n, g) in enumerate(segs):
            n = min(n, spec.shape[d] - g)  # rows added by vocab padding are not saved
            if n <= 0:
                break
            view, offsets = view.narrow(d, lo, n), [*offsets, g]
        else:
            out.append((tuple(offsets), view))
    return out


def _segments(start: int, length: int, spec: ShardSpec, d: int,
              axes: tuple[str, ...]) -> list[tuple[int, int, int]]:  # fmt: skip
    """Dim ``d`` of a local range ``[start, start + length)`` as (local index in the piece,
    length, global offset) runs; a blocked split breaks runs at every block."""
    if not axes:
        return [(0, length, start)] if length else []
    if len(axes) > 1:
        raise CheckpointError(f"dim {d} is split by several mesh axes {axes}; not supported")
    rep = spec.layout.rep(axes[0])  # a shared split: piece r // rep, the same on rep ranks
    n, r, blocks = spec.sizes[axes[0]] // rep, spec.coords[axes[0]] // rep, spec.layout.blocks[d]
    m = spec.padded[d] // (n * blocks)  # rows of one block on one rank
    out, i = [], start
    while i < start + length:
        run = min(m - i % m, start + length - i)
        out.append((i - start, run, (i // m) * (spec.padded[d] // blocks) + r * m + i % m))
        i += run
    return out


class Pieces:
    """A global tensor of which this rank holds some pieces: what DCP saves and loads."""

    def __init__(self, shape: Sequence[int], pieces: list[tuple[tuple[int, ...], torch.Tensor]],
                 dtype: torch.dtype) -> None:  # fmt: skip
        self.shape, self.dtype = torch.Size(shape), dtype
        self.pieces = {tuple(o): t for o, t in pieces}

    def size(self) -> torch.Size:
        return self.shape

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.pieces.values())

    def staged(self) -> Pieces:
        """Step 2: a host copy that training cannot change under the writer (on a GPU it also
        frees the device of the staging copy)."""
        return Pieces(self.shape, [(o, t.detach().to("cpu", copy=True))
                                   for o, t in self.pieces.items()], self.dtype)  # fmt: skip

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        del obj
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape),
                              properties=TensorProperties(dtype=self.dtype), size=self.shape))
                for o, t in self.pieces.items()]  # fmt: skip

    def piece(self, offsets: Sequence[int]) -> torch.Tensor:
        return self.pieces[tuple(offsets)]


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.piece(index.offset) if isinstance(obj, Pieces) else super().lookup_object(index)


# ---------------------------------------------------------------- what a rank holds


def rank_modules(model: Any) -> list[torch.nn.Module]:
    """The modules holding this rank's parameters: a per-rank program, a data-parallel wrapper's
    module, a pipeline runner's stage modules, or a plain single-device model."""
    if hasattr(model, "share") and hasattr(model, "modules") and isinstance(model.modules, dict):
        return list(model.modules.values())
    if hasattr(model, "local") and isinstance(model.local, torch.nn.Module):
        return [model.local]
    return [model]


def named_specs(model: Any) -> Iterator[tuple[str, torch.Tensor, ShardSpec]]:
    """(fqn, tensor, its ShardSpec) for every parameter and persistent buffer this rank holds
    (a rank program lists its persistent buffers in ``meta["shards"]``; a plain model in its
    ``state_dict``)."""
    for module in rank_modules(model):
        info = getattr(module, "meta", None)
        info = info if isinstance(info, dict) else {}
        shards, coords = info.get("shards", {}), info.get("coords", {})
        pieces = info.get("pieces", {})
        keep = set(shards) if "shards" in info else set(module.state_dict())
        buffers = [(n, b) for n, b in module.named_buffers() if n in keep]
        for fqn, p in [*module.named_parameters(), *buffers]:
            if fqn in pieces:
                name, dim, start, whole, groups, stop = (*pieces[fqn], 1, 0)[:6]
                shape, padded, layout, sizes = shards[fqn]
                base = tuple(start if d == dim else 0 for d in range(len(whole)))
                grouped = (dim, stop - start, whole[dim] // groups) if groups > 1 else ()
                yield name, p, ShardSpec(shape=shape, padded=padded, layout=layout, sizes=sizes,
                                         coords=coords, saved=whole, base=base,
                                         grouped=grouped)  # fmt: skip
            elif fqn in shards:
                shape, padded, layout, sizes = shards[fqn]
                yield fqn, p, ShardSpec(shape=shape, padded=padded, layout=layout, sizes=sizes,
                                        coords=coords)  # fmt: skip
            else:
                yield fqn, p, ShardSpec.whole(tuple(p.shape))


def tensor_pieces(t: torch.Tensor, spec: ShardSpec) -> Pieces:
    """A (possibly FSDP2 dp-sharded DTensor) local tensor as pieces of the global one."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if any(offset[1:]):
            raise CheckpointError("only dim-0 (FSDP2) sharding of a rank's shard is supported")
        local = t.to_local().detach()
        return _placed(spec, global_pieces(local, spec, offset[0]), t.dtype)
    return _placed(spec, global_pieces(t.detach(), spec), t.dtype)


def _placed(spec: ShardSpec, pieces: list, dtype: torch.dtype) -> Pieces:
    """Pieces of ``spec.shape``, or of the saved tensor when this one is a piece of it."""
    if not spec.saved:
        return Pieces(spec.shape, pieces, dtype)
    if spec.grouped:
        pieces = [cut for off, t in pieces for cut in _ungrouped(off, t, spec.grouped)]
    moved = [(tuple(o + b for o, b in zip(off, spec.base, strict=True)), t) for off, t in pieces]
    return Pieces(spec.saved, moved, dtype)


def _ungrouped(off: tuple[int, ...], t: torch.Tensor, grouped: tuple[int, int, int]
               ) -> list[tuple[tuple[int, ...], torch.Tensor]]:  # fmt: skip
    """A run of a grouped piece's rows (``Piece.groups``) cut at its groups, each cut at its
    offset in the saved tensor (before the piece's ``base``): row i of the piece is row
    ``(i // here) * there + i % here`` there."""
    dim, here, there = grouped
    out, i, end = [], off[dim], off[dim] + t.shape[dim]
    while i < end:
        run = min(here - i % here, end - i)
        at = (*off[:dim], (i // here) * there + i % here, *off[dim + 1 :])
        out.append((at, t.narrow(dim, i - off[dim], run)))
        i += run
    return out


def _add(out: dict[str, Any], key: str, value: Any) -> None:
    """``out[key] = value``; the pieces of one fused parameter share a key and are merged (a
    scalar state, the same in every piece, is kept once; :func:`spread_scalars`)."""
    have = out.get(key)
    if isinstance(have, Pieces) and isinstance(value, Pieces):
        out[key] = Pieces(have.shape, [*have.pieces.items(), *value.pieces.items()], have.dtype)
    elif have is None:
        out[key] = value


def _base(opt: Any) -> torch.optim.Optimizer:
    """ZeroRedundancyOptimizer keeps this rank's partition in ``.optim``."""
    return getattr(opt, "optim", opt)


def model_state(model: Any) -> dict[str, Pieces]:
    out: dict[str, Any] = {}
    for fqn, p, spec in named_specs(model):
        _add(out, f"model.{fqn}", tensor_pieces(p, spec))
    return out


def optimizer_state(model: Any, opt: Any) -> dict[str, Any]:
    """``optim.<fqn>.<key>``: per-parameter state shaped like the parameter as pieces, scalars
    (Adam's step) whole.  Only parameters this rank's optimizer holds state for."""
    base, out = _base(opt), {}
    for fqn, p, spec in named_specs(model):
        for key, value in base.state.get(p, {}).items():
            name = f"optim.{fqn}.{key}"
            if isinstance(value, torch.Tensor) and value.shape == p.shape and value.dim():
                _add(out, name, tensor_pieces(value, spec))
            elif isinstance(value, torch.Tensor):
                _add(out, name, value)
    return out


def spread_scalars(model: Any, opt: Any, state: dict[str, Any]) -> None:
    """After loading, every piece of a fused parameter gets the scalar state (Adam's step)
    that ``state`` holds once for the whole parameter."""
    base = _base(opt)
    for fqn, p, _ in named_specs(model):
        for key, value in base.state.get(p, {}).items():
            loaded = state.get(f"optim.{fqn}.{key}")
            scalar = isinstance(value, torch.Tensor) and not value.dim()
            if scalar and loaded is not value and isinstance(loaded, torch.Tensor):
                value.copy_(loaded)


def init_optimizer_state(opt: Any) -> None:
    """Create the optimizer's lazily made state (one step with zero gradients and lr 0) so a
    checkpoint can be loaded into it; gradients and hyper-parameters are restored."""
    base = _base(opt)
    params = [p for g in base.param_groups for p in g["params"] if p not in base.state]
    if not params:
        return
    grads = {p: p.grad for p in params}
    lrs = [g["lr"] for g in base.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in base.param_groups:
        g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else torch.zeros_like(g["lr"])
    with torch.no_grad():
        base.step()
    for g, lr in zip(base.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p in params:
        p.grad = grads[p]


# ---------------------------------------------------------------- the checkpointer


@dataclass(frozen=True, kw_only=True)
class Resumed:
    """What :meth:`Checkpointer.load` restored."""

    step: int
    extra: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def committed_steps(root: str | Path) -> list[int]:
    """Steps with a committed (renamed) checkpoint under ``root``, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for d in root.iterdir() if (m := _STEP_DIR.match(d.name)))


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


class Checkpointer:
    """Save and load one rank's share of model, optimizer, RNG and trainer state.

    ``model``: what autoparallelize returned on this rank (or the single-device model);
    ``optimizer``: its optimizer (or None); ``group``: the process group the checkpoint's own
    collectives use (default: a new Gloo group of the whole job, created collectively here);
    ``keep``: committed checkpoints to keep; ``writer``: a factory for DCP's storage writer
    (loading reads only what :class:`SafetensorsWriter` writes).
    """

    def __init__(self, root: str | Path, model: Any, optimizer: Any = None, *,
                 group: Any = None, keep: int = 2,
                 writer: Callable[[str], Any] = SafetensorsWriter) -> None:  # fmt: skip
        self.root, self.model, self.optimizer = Path(root), model, optimizer
        self.keep, self.writer = keep, writer
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed and group is None:
            group = dist.new_group(backend="gloo")
        self.group = group
        self.rank = dist.get_rank() if self.distributed else 0
        self.staged_bytes = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def is_writer(self) -> bool:
        """Rank 0 of the checkpoint group commits."""
        return not self.distributed or dist.get_rank(self.group) == 0

    # ------------------------------------------------------------ save

    def save(self, step: int, extra: dict[str, Any] | None = None, *,
             blocking: bool = False) -> None:  # fmt: skip
        """Stage this rank's state and write checkpoint ``step`` (steps 1-4); returns once the
        copy is staged unless ``blocking``.  A previous save is waited for first."""
        self.wait()
        state = {k: v.staged() if isinstance(v, Pieces) else v.detach().to("cpu", copy=True)
                 for k, v in self._state().items()}  # fmt: skip
        self.staged_bytes = sum(v.nbytes if isinstance(v, Pieces) else v.nbytes
                                for v in state.values())  # fmt: skip
        info = {"step": step, "extra": extra or {}, "param_groups": self._param_groups()}
        if blocking:
            self._write(step, state, info)
            return
        self._thread = threading.Thread(target=self._background, args=(step, state, info),
                                        name=f"autopar-checkpoint-{step}", daemon=True)  # fmt: skip
        self._thread.start()

    def wait(self) -> None:
        """Block until the save in flight is committed; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the background checkpoint save failed: {error}") from error

    def _background(self, step: int, state: dict, info: dict) -> None:
        try:
            self._write(step, state, info)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait() on the training thread
            self._error = e

    def _write(self, step: int, state: dict, info: dict) -> None:
        """Steps 3-4: DCP into step_N.tmp, then rank 0 commits by rename."""
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        if self.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
        self._barrier()
        with _quiet():
            dcp.save(state, storage_writer=self.writer(str(tmp)), planner=_SavePlanner(),
                     process_group=self.group, no_dist=not self.distributed)  # fmt: skip
        if self.is_writer:
            (tmp / TRAINER).write_text(json.dumps(info))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _fsync_dir(self.root)
            for old in committed_steps(self.root)[: -self.keep]:
                shutil.rmtree(step_dir(self.root, old), ignore_errors=True)
        self._barrier()

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def _state(self) -> dict[str, Any]:
        state: dict[str, Any] = model_state(self.model)
        if self.optimizer is not None:
            state.update(optimizer_state(self.model, self.optimizer))
        state[f"rng.{self.rank}"] = torch.get_rng_state()
        return state

    def _param_groups(self) -> list[dict[str, Any]]:
        if self.optimizer is None:
            return []
        return [{k: v for k, v in g.items() if k != "params" and _jsonable(v)}
                for g in _base(self.optimizer).param_groups]  # fmt: skip

    # ------------------------------------------------------------ load

    def latest(self) -> int | None:
        steps = committed_steps(self.root)
        return steps[-1] if steps else None

    def load(self, step: int | None = None) -> Resumed | None:
        """Load checkpoint ``step`` (default: the newest committed) into the live model and
        optimizer (steps 1-5); None when there is none.  Any failure, on any rank, raises
        :class:`CheckpointError` on every rank."""
        self.wait()
        step = self.latest() if step is None else step
        if step is None:
            return None
        path = step_dir(self.root, step)
        try:
            resumed, error = self._load(path, step), None
        except Exception as e:  # noqa: BLE001 - step 4: shared with the other ranks, re-raised
            resumed, error = None, e
        self._agree(path, error)
        return resumed

    def _load(self, path: Path, step: int) -> Resumed:
        """Steps 1-3 and 5 on this rank."""
        info = read_trainer(path, step)
        manifest = read_manifest(path)
        check_folder(manifest, also=(TRAINER,))
        if self.optimizer is not None:
            init_optimizer_state(self.optimizer)
        state = {k: v for k, v in self._state().items() if not k.startswith("rng.")}
        missing = sorted(k for k in state if k not in manifest.tensors)
        if missing:
            raise CheckpointError(f"{path} lacks {len(missing)} tensors this model holds, e.g. "
                                  f"{missing[:3]}: a checkpoint of a different model?")  # fmt: skip
        rng = f"rng.{self.rank}"
        if rng in manifest.tensors:
            state[rng] = torch.empty_like(torch.get_rng_state())
        _check_fits(state, manifest)
        reader = ShardReader(manifest)
        for key, target in state.items():
            reader.fill(key, _targets(target))
        if rng in state:
            torch.set_rng_state(state[rng])
        else:
            _seed_new_rank(manifest, reader, self.rank)
        if self.optimizer is not None:
            spread_scalars(self.model, self.optimizer, state)
        self._restore_groups(info["param_groups"])
        return Resumed(step=info["step"], extra=info["extra"], path=path)

    def _agree(self, path: Path, error: Exception | None) -> None:
        """Step 4: raise on every rank when any rank failed (its own error first)."""
        if isinstance(error, CheckpointError):
            mine: CheckpointError | None = error
        elif error is not None:
            mine = CheckpointError(f"loading {path} failed: {type(error).__name__}: {error}")
            mine.__cause__ = error
        else:
            mine = None
        if self.distributed:
            world = dist.get_world_size(self.group)
            notes: list[str | None] = [None] * world
            dist.all_gather_object(notes, None if mine is None else str(mine), group=self.group)
            failed = [(r, n) for r, n in enumerate(notes) if n is not None]
            if mine is None and failed:
                rank, note = failed[0]
                raise CheckpointError(f"rank {rank} of the checkpoint group could not load "
                                      f"{path}: {note}")  # fmt: skip
        if mine is not None:
            raise mine

    def _restore_groups(self, groups: list[dict[str, Any]]) -> None:
        if self.optimizer is None:
            return
        current = _base(self.optimizer).param_groups
        if len(groups) == len(current):
            for g, saved in zip(current, groups, strict=True):
                g.update(saved)


def read_trainer(path: Path, step: int) -> dict[str, Any]:
    """``trainer.json``, parsed as JSON and checked: the step, the caller's extra state, the
    optimizer's hyper-parameters."""
    file = path / TRAINER
    if not file.is_file():
        raise CheckpointError(f"{path} is not a committed checkpoint: {file} is missing")
    try:
        info = json.loads(file.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not JSON ({e}); tampered or damaged") from None
    kinds = {"step": int, "extra": dict, "param_groups": list}
    for key, kind in kinds.items():
        value = info.get(key) if isinstance(info, dict) else None
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CheckpointError(f"{file}: '{key}' is missing or not of type {kind.__name__} "
                                  "(tampered or damaged)")  # fmt: skip
    if info["step"] != step or not all(isinstance(g, dict) for g in info["param_groups"]):
        raise CheckpointError(f"{file}: 'step' {info['step']} is not the folder's {step}, or "
                              "'param_groups' holds a non-object (tampered or damaged)")  # fmt: skip
    return info


def _check_fits(state: dict[str, Any], manifest: Manifest) -> None:
    """Every target has the global shape and dtype the checkpoint holds."""
    where = manifest.path / "manifest.json"
    for k, v in state.items():
        saved = manifest.tensors[k]
        have = tuple(v.size() if isinstance(v, Pieces) else v.shape)
        if saved.shape != have:
            raise CheckpointError(f"{k}: {where} holds shape {saved.shape}, the model {have} "
                                  "(wrong size)")  # fmt: skip
        if saved.dtype != v.dtype:
            raise CheckpointError(f"{k}: {where} holds {saved.dtype}, the model {v.dtype} (wrong "
                                  "dtype; to convert, cast what export_state_dict returns)")  # fmt: skip


def _seed_new_rank(manifest: Any, reader: Any, rank: int) -> None:
    """Step 5 for a rank without a saved RNG state: a seed hashed from the lowest saved rank's
    state and ``rank`` (nothing when the checkpoint holds no RNG state)."""
    import hashlib

    saved = sorted(int(k[4:]) for k in manifest.tensors
                   if k.startswith("rng.") and k[4:].isdigit())  # fmt: skip
    if not saved:
        return
    state = torch.empty_like(torch.get_rng_state())
    reader.fill(f"rng.{saved[0]}", _targets(state))
    digest = hashlib.sha256(state.numpy().tobytes() + f"|rank {rank}".encode()).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "little"))


def _targets(value: Any) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(global offset, view) of each piece of ``value`` this rank holds."""
    if isinstance(value, Pieces):
        return list(value.pieces.items())
    return [((0,) * value.dim(), value)]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that a single process saves or loads alone: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
    except TypeError:
        return False
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_state_dict(path: str | Path, model: torch.nn.Module | None = None
                      ) -> dict[str, torch.Tensor]:  # fmt: skip
    """A committed checkpoint as a plain single-device state dict (whole tensors, the model's
    own names and shapes): ``model.load_state_dict(export_state_dict(path, model))``.  With
    ``model``, every alias of a tied weight gets the tensor too (a checkpoint holds it once).
    Reads and checks the files like :meth:`Checkpointer.load` (steps 1 and 3)."""
    manifest = read_manifest(path)
    check_folder(manifest, also=(TRAINER,))
    reader, out = ShardReader(manifest), {}
    for k, v in manifest.tensors.items():
        if k.startswith("model."):
            t = torch.empty(v.shape, dtype=v.dtype)
            reader.fill(k, _targets(t))
            out[k.removeprefix("model.")] = t
    if model is not None:
        first: dict[int, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            canonical = first.setdefault(id(p), name)
            if name not in out and canonical in out:
                out[name] = out[canonical]
    return out
