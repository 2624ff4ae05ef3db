"""A checkpoint's files: safetensors shards and a JSON manifest.  Loading parses only JSON and
safetensors headers and bytes, so a checkpoint cannot run code however it was tampered with.

A committed ``step_N`` folder holds
- ``rank_RRRRR.safetensors``: the chunks rank R wrote (after DCP de-duplicated replicas), one
  safetensors entry each, named by the tensor's key and, for a part, its slice
  (``model.head.weight[45:90,0:64]``): the safetensors library reads the file as is;
- ``manifest.json``: per tensor key its dtype, global shape and chunks (offsets, sizes, file,
  entry, the sha256 of its bytes), and each file's size;
- ``trainer.json`` (autopar/runtime/checkpoints.py): the step, the caller's state, hyper-parameters.

Algorithm (:class:`SafetensorsWriter`, DCP's storage writer):
1. The coordinator names one file per rank in the global plan.
2. Each rank writes its chunks as one safetensors file (header, then the bytes, hashed as they
   are written) and returns, per chunk: file, entry, sha256, the file's size.
3. The coordinator's ``finish`` writes ``manifest.json`` from DCP's global metadata and those
   results.

Algorithm (:func:`read_manifest`, :func:`check_folder`, :class:`ShardReader`):
1. Parse ``manifest.json`` as JSON and check every field: a known dtype, shapes of non-negative
   ints, chunks inside their tensor that tile it exactly, files that are plain names listed
   with their size.
2. The folder holds every listed file and nothing else.
3. On a file's first use: its header's length lies inside the file, the header is JSON, every
   chunk the manifest puts there is an entry of the same dtype and shape whose byte range has
   the right length and lies inside the file (else: truncated inside the entry holding the
   cut), there is no other entry, the size is the recorded one.
4. A chunk's bytes must match their sha256 before they are viewed as the dtype and shape and
   copied into every target that overlaps them (resharding).
Every failure raises :class:`CheckpointError` naming the file and the entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import struct
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from autopar.errors import CheckpointError

MANIFEST, FORMAT, VERSION = "manifest.json", "autopar-safetensors", 1
_SHARD = re.compile(r"^rank_\d{5}\.safetensors$")
_SHA = re.compile(r"^[0-9a-f]{64}$")
_MAX_HEADER = 100 << 20  # the safetensors library's own limit
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
_CODES = {v: k for k, v in DTYPES.items()}


def shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


def entry_name(fqn: str, offsets: Sequence[int], sizes: Sequence[int],
               shape: Sequence[int]) -> str:  # fmt: skip
    """The safetensors entry of a chunk: the key itself when it is the whole tensor."""
    if all(o == 0 for o in offsets) and tuple(sizes) == tuple(shape):
        return fqn
    return fqn + "[" + ",".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes, strict=True)) + "]"


def dtype_code(dtype: torch.dtype, key: str) -> str:
    if dtype not in _CODES:
        raise CheckpointError(f"{key}: dtype {dtype} has no safetensors code; cannot save it")
    return _CODES[dtype]


# ---------------------------------------------------------------- writing (steps 1-3)


def write_safetensors(path: Path, named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Step 2: ``named`` as one safetensors file (fsynced); the sha256 of each entry's bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    end = 0
    for key, t in named:
        n = t.numel() * t.element_size()
        header[key] = {"dtype": dtype_code(t.dtype, key), "shape": list(t.shape),
                       "data_offsets": [end, end + n]}  # fmt: skip
        end += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digests = []
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, t in named:
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data
            digests.append(hashlib.sha256(data).hexdigest())
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return digests


class SafetensorsWriter(StorageWriter):
    """DCP's storage writer for this format: no pickle reaches the folder (steps 1-3)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = Path(path)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        del is_coordinator, args, kwargs

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.path.mkdir(parents=True, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=shard_name(i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        named, results = [], []
        for item in plan.items:
            data, td = planner.resolve_data(item), item.tensor_data
            if td is None or not isinstance(data, torch.Tensor):
                raise CheckpointError(f"{item.index.fqn}: only tensors are checkpointed, got "
                                      f"{type(data).__name__}")  # fmt: skip
            named.append((entry_name(item.index.fqn, td.chunk.offsets, td.chunk.sizes, td.size),
                          data))  # fmt: skip
        if named:
            path = self.path / plan.storage_data
            digests = write_safetensors(path, named)
            size = path.stat().st_size
            for item, (entry, t), sha in zip(plan.items, named, digests, strict=True):
                results.append(WriteResult(index=item.index, size_in_bytes=t.nbytes,
                                           storage_data={"file": plan.storage_data, "entry": entry,
                                                         "sha256": sha, "file_bytes": size}))  # fmt: skip
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Step 3: manifest.json (fsynced) from the global metadata and every rank's results."""
        written = {(r.index.fqn, tuple(r.index.offset)): r.storage_data
                   for rank in results for r in rank}  # fmt: skip
        files = {s["file"]: s["file_bytes"] for s in written.values()}
        tensors = {}
        for fqn, md in sorted(metadata.state_dict_metadata.items()):
            if not isinstance(md, TensorStorageMetadata):
                raise CheckpointError(f"{fqn}: only tensors are checkpointed")
            chunks = []
            for c in md.chunks:
                s = written[(fqn, tuple(c.offsets))]
                chunks.append({"offsets": list(c.offsets), "sizes": list(c.sizes),
                               "file": s["file"], "entry": s["entry"], "sha256": s["sha256"]})  # fmt: skip
            tensors[fqn] = {"dtype": dtype_code(md.properties.dtype, fqn),
                            "shape": list(md.size), "chunks": chunks}  # fmt: skip
        body = {"format": FORMAT, "version": VERSION, "files": dict(sorted(files.items())),
                "tensors": tensors}  # fmt: skip
        with (self.path / MANIFEST).open("w") as f:
            json.dump(body, f, indent=1)
            f.flush()
            os.fsync(f.fileno())

    def storage_meta(self) -> None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


# ---------------------------------------------------------------- the manifest (steps 1-2)


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """One saved block of a tensor: where it sits in the global tensor and in which file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    entry: str
    sha256: str


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """One checkpointed tensor (a parameter, an optimizer state, an RNG state)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What ``manifest.json`` says, every field checked (step 1)."""

    path: Path
    files: dict[str, int]
    tensors: dict[str, TensorEntry]

    def first_entry(self, file: str) -> str:
        """The first entry the manifest puts in ``file`` (for messages)."""
        for entry in self.tensors.values():
            for c in entry.chunks:
                if c.file == file:
                    return c.entry
        return "no entry"


def _need(ok: bool, where: str, what: str) -> None:
    if not ok:
        raise CheckpointError(f"{where}: {what} (tampered or damaged manifest)")


def _ints(value: Any, n: int | None, where: str, what: str) -> tuple[int, ...]:
    ok = isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)
    _need(ok and (n is None or len(value) == n), where, f"{what} must be a list of "
          f"{'' if n is None else f'{n} '}non-negative ints, got {value!r:.80}")  # fmt: skip
    return tuple(value)


def read_manifest(path: str | Path) -> Manifest:
    """Step 1: ``path/manifest.json`` parsed as JSON and checked field by field."""
    path = Path(path)
    file = path / MANIFEST
    if not file.is_file():
        legacy = (path / ".metadata").exists()
        raise CheckpointError(
            f"{file} is missing: " + ("this is a pickled torch.distributed.checkpoint folder, "
            "which autopar no longer loads (unpickling can run code); re-save it with this "
            "version from a run you trust" if legacy else "not a finished autopar checkpoint"))  # fmt: skip
    try:
        body = json.loads(file.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not JSON ({e}); tampered or damaged") from None
    where = str(file)
    _need(isinstance(body, dict) and body.get("format") == FORMAT
          and body.get("version") == VERSION, where, f"not a version-{VERSION} {FORMAT} manifest")  # fmt: skip
    files, tensors = body.get("files"), body.get("tensors")
    _need(isinstance(files, dict) and isinstance(tensors, dict), where, "no 'files' / 'tensors'")
    for name, size in files.items():
        _need(bool(_SHARD.match(name)), f"{where}: file {name!r}", "not a rank_NNNNN.safetensors "
              "name in this folder")  # fmt: skip
        _need(type(size) is int and size >= 8, f"{where}: file {name}", f"bad size {size!r}")
    out = {key: _tensor_entry(value, files, f"{where}: {key}") for key, value in tensors.items()}
    entries = Counter((c.file, c.entry) for t in out.values() for c in t.chunks)
    for (file, entry), n in entries.items():
        _need(n == 1, where, f"{n} chunks share entry {entry} of {file}")
    return Manifest(path=path, files=dict(files), tensors=out)


def _tensor_entry(value: Any, files: dict[str, int], where: str) -> TensorEntry:
    """One tensor's record: dtype, shape, and chunks that tile the shape exactly."""
    _need(isinstance(value, dict), where, "not an object")
    code = value.get("dtype")
    _need(isinstance(code, str) and code in DTYPES, where,
          f"dtype {code!r:.40} is not a tensor dtype ({', '.join(DTYPES)})")  # fmt: skip
    shape = _ints(value.get("shape"), None, where, "shape")
    raw = value.get("chunks")
    _need(isinstance(raw, list) and bool(raw), where, "no chunks")
    chunks = tuple(_chunk(c, shape, files, where) for c in raw)
    _tiles(chunks, shape, where)
    return TensorEntry(dtype=DTYPES[code], shape=shape, chunks=chunks)


def _chunk(c: Any, shape: tuple[int, ...], files: dict[str, int], where: str) -> Chunk:
    _need(isinstance(c, dict), where, "a chunk is not an object")
    entry = c.get("entry")
    _need(isinstance(entry, str), where, "a chunk has no entry name")
    at = f"{where}, chunk {entry}"
    offsets = _ints(c.get("offsets"), len(shape), at, "offsets")
    sizes = _ints(c.get("sizes"), len(shape), at, "sizes")
    _need(all(o + s <= n for o, s, n in zip(offsets, sizes, shape, strict=True)), at,
          f"offsets {offsets} + sizes {sizes} fall outside the shape {shape} (wrong size)")  # fmt: skip
    file = c.get("file")
    _need(isinstance(file, str) and file in files, at, f"file {file!r:.80} is not a listed shard")
    _need(isinstance(c.get("sha256"), str) and bool(_SHA.match(c["sha256"])), at, "bad sha256")
    return Chunk(offsets=offsets, sizes=sizes, file=c["file"], entry=entry, sha256=c["sha256"])


def _tiles(chunks: tuple[Chunk, ...], shape: tuple[int, ...], where: str) -> None:
    """The chunks cover the tensor once: no two overlap and their volumes add up."""
    for i, a in enumerate(chunks):
        for b in chunks[i + 1 :]:
            _need(_overlap(a.offsets, a.sizes, b.offsets, b.sizes) is None, where,
                  f"chunks {a.entry} and {b.entry} overlap")  # fmt: skip
    total = sum(math.prod(c.sizes) for c in chunks)
    _need(total == math.prod(shape), where, f"the chunks hold {total} elements of the shape "
          f"{shape}'s {math.prod(shape)}")  # fmt: skip


def _overlap(o1: Sequence[int], s1: Sequence[int], o2: Sequence[int], s2: Sequence[int]
             ) -> tuple[tuple[int, int], ...] | None:  # fmt: skip
    """The (lo, hi) per dim where two boxes intersect, or None when they do not."""
    box = tuple((max(a, b), min(a + m, b + n)) for a, m, b, n in zip(o1, s1, o2, s2, strict=True))
    return None if any(hi <= lo for lo, hi in box) else box


def _local(box: tuple[tuple[int, int], ...], offsets: Sequence[int]) -> tuple[slice, ...]:
    """``box`` (global) as slices of a block that starts at ``offsets``."""
    return tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(box, offsets, strict=True))


def check_folder(manifest: Manifest, also: Iterable[str] = ()) -> None:
    """Step 2: every listed shard is there and nothing else is (``also``: the other files a
    committed checkpoint holds)."""
    allowed = {MANIFEST, *also, *manifest.files}
    for p in sorted(manifest.path.iterdir()):
        if p.name not in allowed:
            raise CheckpointError(f"{p} is not part of the checkpoint (manifest.json does not "
                                  "list it): an extra or planted file; remove it")  # fmt: skip
    for name in manifest.files:
        if not (manifest.path / name).is_file():
            raise CheckpointError(f"{manifest.path / name} is missing (it holds "
                                  f"{manifest.first_entry(name)} and the rest of its rank's chunks)")  # fmt: skip


# ---------------------------------------------------------------- reading (steps 3-4)


class ShardReader:
    """Reads chunks of a checked manifest's files, checking each file once (step 3) and each
    chunk's bytes before using them (step 4)."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._ranges: dict[str, dict[str, tuple[int, int]]] = {}
        self._by_file: dict[str, list[tuple[TensorEntry, Chunk]]] = {}
        for t in manifest.tensors.values():
            for c in t.chunks:
                self._by_file.setdefault(c.file, []).append((t, c))

    def fill(self, key: str, targets: Sequence[tuple[Sequence[int], torch.Tensor]]) -> None:
        """Copy tensor ``key`` into each (global offset, view) target from every saved chunk
        that overlaps it."""
        entry = self.manifest.tensors[key]
        read: dict[str, torch.Tensor] = {}
        for offsets, view in targets:
            for c in entry.chunks:
                box = _overlap(offsets, view.shape, c.offsets, c.sizes)
                if box is None:
                    continue
                if c.entry not in read:
                    read[c.entry] = self.read(entry, c)
                view[_local(box, offsets)] = read[c.entry][_local(box, c.offsets)]

    def read(self, entry: TensorEntry, c: Chunk) -> torch.Tensor:
        """Step 4: one chunk's bytes, checked against their sha256, as a tensor."""
        begin, end = self._file_ranges(c.file)[c.entry]
        path = self.manifest.path / c.file
        data = bytearray(end - begin)
        with path.open("rb") as f:
            f.seek(begin)
            got = f.readinto(data)
        if got != end - begin:
            raise CheckpointError(f"{path}: truncated inside {c.entry} (changed while loading?)")
        if hashlib.sha256(data).hexdigest() != c.sha256:
            raise CheckpointError(f"{path}: the bytes of {c.entry} do not match the manifest's "
                                  "sha256 (damaged, or the file swapped with another)")  # fmt: skip
        if not data:
            return torch.empty(c.sizes, dtype=entry.dtype)
        return torch.frombuffer(data, dtype=entry.dtype).reshape(c.sizes)

    def _file_ranges(self, file: str) -> dict[str, tuple[int, int]]:
        """Step 3, once per file: entry -> (begin, end) absolute byte range, all checked."""
        if file not in self._ranges:
            path = self.manifest.path / file
            try:
                with path.open("rb") as f:
                    self._ranges[file] = self._check_file(path, f, os.fstat(f.fileno()).st_size)
            except FileNotFoundError:
                raise CheckpointError(f"{path} is missing (it holds "
                                      f"{self.manifest.first_entry(file)})") from None  # fmt: skip
        return self._ranges[file]

    def _check_file(self, path: Path, f: BinaryIO, size: int) -> dict[str, tuple[int, int]]:
        header, start = _read_header(path, f, size, self.manifest.first_entry(path.name))
        ranges = {}
        for t, c in self._by_file.get(path.name, []):
            ranges[c.entry] = _check_entry(path, header, t, c, start, size)
        past = sorted((b, e, entry) for entry, (b, e) in ranges.items() if e > size)
        if past:
            b, e, entry = past[0]
            raise CheckpointError(f"{path}: truncated inside {entry} (the file has {size} bytes, "
                                  f"the entry spans bytes {b}..{e})")  # fmt: skip
        extra = sorted(set(header) - set(ranges) - {"__metadata__"})
        if extra:
            raise CheckpointError(f"{path} holds entry {extra[0]}, which manifest.json does not "
                                  "put there (a file swapped with another rank's?)")  # fmt: skip
        want = self.manifest.files[path.name]
        if size != want:
            raise CheckpointError(f"{path} is {size} bytes, manifest.json says {want} (bytes "
                                  f"appended after its last entry, or a different file)")  # fmt: skip
        return ranges


def _read_header(path: Path, f: BinaryIO, size: int, first: str) -> tuple[dict, int]:
    """A safetensors header: its 8-byte length inside the file, then a JSON object."""
    at = f"{path} (holding {first}...)"
    head = f.read(8)
    if len(head) < 8:
        raise CheckpointError(f"{at}: truncated inside its header ({size} bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > min(size - 8, _MAX_HEADER):
        raise CheckpointError(f"{at}: header length {n} exceeds the file's {size} bytes: "
                              "truncated, or not a safetensors file")  # fmt: skip
    try:
        header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{at}: the header is not JSON ({e}): not a safetensors "
                              "file, or damaged") from None  # fmt: skip
    if not isinstance(header, dict):
        raise CheckpointError(f"{at}: the header is not a JSON object")
    return header, 8 + n


def _check_entry(path: Path, header: dict, t: TensorEntry, c: Chunk, start: int,
                 size: int) -> tuple[int, int]:  # fmt: skip
    """One header entry against its chunk in the manifest; its absolute byte range."""
    h = header.get(c.entry)
    if not isinstance(h, dict):
        raise CheckpointError(f"{path} lacks entry {c.entry}, which manifest.json puts there "
                              "(a file swapped with another rank's?)")  # fmt: skip
    at, want = f"{path}: entry {c.entry}", _CODES[t.dtype]
    if h.get("dtype") != want:
        raise CheckpointError(f"{at} has dtype {h.get('dtype')!r:.20}, manifest.json says "
                              f"{want} (wrong dtype)")  # fmt: skip
    if h.get("shape") != list(c.sizes):
        raise CheckpointError(f"{at} has shape {h.get('shape')!r:.80}, manifest.json says "
                              f"{list(c.sizes)} (wrong size)")  # fmt: skip
    span = h.get("data_offsets")
    ok = isinstance(span, list) and len(span) == 2 and all(type(v) is int for v in span)
    if not ok or not 0 <= span[0] <= span[1]:
        raise CheckpointError(f"{at}: bad data_offsets {span!r:.80}")
    need = math.prod(c.sizes) * t.dtype.itemsize
    if span[1] - span[0] != need:
        raise CheckpointError(f"{at} spans {span[1] - span[0]} bytes, its dtype and shape need "
                              f"{need} (wrong size)")  # fmt: skip
    return start + span[0], start + span[1]
