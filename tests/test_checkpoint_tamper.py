"""Tampering with every file of a saved checkpoint: loading never runs code, and every failure
is a CheckpointError (an ``Exception``) naming the file and the entry.

One 2-rank tp=2 checkpoint (GPT with a fused QKV saved as blocked pieces, one AdamW step, so
parameters, optimizer state and both ranks' RNG states) is saved once for the module; each
case tampers with a copy and loads it on one device (which reads every rank's file) with
``Checkpointer.load`` and ``export_state_dict``.  The payloads write a marker file when
unpickled (``test_the_payloads_run_when_unpickled`` shows they do); it must never appear.
"""

from __future__ import annotations

import json
import pickle
import shlex
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from autopar import Mesh, autoparallelize
from autopar.runtime.checkpoints import Checkpointer, CheckpointError, export_state_dict, step_dir
from autopar.runtime.pool import get_pool
from autopar.tools.testing import Config, build, lm_loss, tokens

GPT = Config(layers=1, vocab=90, fused_qkv=True, batch=4)
_GROUP: dict[int, object] = {}  # the checkpoint's own Gloo group of ranks 0, 1 (pool worker)
R0, R1 = "rank_00000.safetensors", "rank_00001.safetensors"


def _make_group(rank, groups):
    """On every pool worker (new_group is collective over the whole pool)."""
    import torch.distributed as dist

    if 2 not in _GROUP:
        _GROUP[2] = dist.new_group([0, 1], backend="gloo")


def _save_rank(rank, groups, module, root):
    from autopar.ops import collectives

    collectives.bind(groups)
    x, y = tokens(GPT)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(x, y).backward()
    opt.step()
    Checkpointer(root, module, opt, group=_GROUP[2]).save(1, {"data_position": 1}, blocking=True)


def _load_rank(rank, groups, module, root):
    from autopar.ops import collectives

    collectives.bind(groups)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    try:
        Checkpointer(root, module, opt, group=_GROUP[2]).load()
    except CheckpointError as e:
        return str(e)
    return None


def _pool():
    pool = get_pool(2)
    pool.run(_make_group, (), [()] * pool.world)
    return pool


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("saved")
    prog = autoparallelize(build("gpt", GPT), Mesh(tp=2), tokens(GPT), loss_fn=lm_loss)
    _pool().run(_save_rank, prog.mesh.axes, [(prog.module(r), root) for r in range(2)])
    names = {p.name for p in step_dir(root, 1).iterdir()}
    assert names == {R0, R1, "manifest.json", "trainer.json"}
    return root


def _load_one_device(root: Path) -> None:
    model = build("gpt", GPT, seed=7)
    Checkpointer(root, model, torch.optim.AdamW(model.parameters(), lr=1e-2)).load()


# ---------------------------------------------------------------- payloads and file surgery


def _command(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def dotted_pickle(marker: Path) -> bytes:
    """Protocol 4: ``os.system`` reached through a dotted name in a DCP module."""

    def s(text: str) -> bytes:
        raw = text.encode()
        return b"\x8c" + bytes([len(raw)]) + raw  # SHORT_BINUNICODE

    return (
        b"\x80\x04"
        + s("torch.distributed.checkpoint.filesystem")
        + s("os.system")
        + b"\x93"
        + s(_command(marker))
        + b"\x85R."
    )  # STACK_GLOBAL, TUPLE1, REDUCE, STOP


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (_command(self.marker),))


def torch_save_payload(marker: Path) -> bytes:
    """A torch.save zip whose data.pkl runs ``os.system``."""
    import io

    buf = io.BytesIO()
    torch.save({"rng.0": _Payload(marker)}, buf)
    return buf.getvalue()


def bytes_metadata(marker: Path) -> bytes:
    """DCP metadata of DCP's own classes declaring ``rng.0`` as bytes (read by torch.load with
    weights_only=False) and pointing it at a torch.save payload file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    md = Metadata(state_dict_metadata={"rng.0": BytesStorageMetadata()},
                  storage_data={MetadataIndex("rng.0"): _StorageInfo(R0, 0, 10**6)})  # fmt: skip
    return pickle.dumps(md, protocol=4)


def header(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header and the bytes after it (an independent reader)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def rewrite_header(path: Path, edit: Callable[[dict], None]) -> None:
    h, data = header(path)
    edit(h)
    raw = json.dumps(h).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def span(path: Path, entry: str) -> tuple[int, int]:
    """An entry's absolute byte range in its file."""
    h, data = header(path)
    start = path.stat().st_size - len(data)
    b, e = h[entry]["data_offsets"]
    return start + b, start + e


def manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text())


def edit_manifest(d: Path, edit: Callable[[dict], None]) -> None:
    body = manifest(d)
    edit(body)
    (d / "manifest.json").write_text(json.dumps(body))


def piece(d: Path, file: str = R0) -> tuple[str, str]:
    """A matrix's key and the entry of one of its parts (not the whole matrix) in ``file``."""
    for key, t in manifest(d)["tensors"].items():
        for c in t["chunks"]:
            two_d = len(t["shape"]) == 2 and key.startswith("model.")
            if c["file"] == file and "[" in c["entry"] and two_d:
                return key, c["entry"]
    raise AssertionError("no partial chunk in the checkpoint")


def truncate(path: Path, at: int) -> None:
    path.write_bytes(path.read_bytes()[:at])


# ---------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    """``tamper(folder, marker)`` returns the file and the entry the error must name; ``why``
    is a phrase the message must hold; ``export``: export_state_dict reads that file too."""

    name: str
    tamper: Callable[[Path, Path], tuple[str, str]]
    why: str
    export: bool = True


def _plant_metadata(d: Path, payload: Callable[[Path], bytes], marker: Path) -> tuple[str, str]:
    (d / ".metadata").write_bytes(payload(marker))
    return ".metadata", ".metadata"


def _replace(d: Path, name: str, data: bytes, entry: str) -> tuple[str, str]:
    (d / name).write_bytes(data)
    return name, entry


def _first_entry(d: Path, file: str) -> str:
    return next(c["entry"] for t in manifest(d)["tensors"].values() for c in t["chunks"]
                if c["file"] == file)  # fmt: skip


def _truncate_in(d: Path, file: str, entry: str) -> tuple[str, str]:
    b, e = span(d / file, entry)
    truncate(d / file, (b + e) // 2)
    return file, entry


def _header_edit(d: Path, field: str, value: object) -> tuple[str, str]:
    _, entry = piece(d)
    rewrite_header(d / R0, lambda h: h[entry].update({field: value}))
    return R0, entry


def _past_the_end(d: Path) -> tuple[str, str]:
    _, entry = piece(d)
    rewrite_header(d / R0, lambda h: h[entry].update(
        data_offsets=[v + 10**9 for v in h[entry]["data_offsets"]]))  # fmt: skip
    return R0, entry


def _manifest_tensor_edit(d: Path, field: str, value: object) -> tuple[str, str]:
    key, _ = piece(d)
    edit_manifest(d, lambda m: m["tensors"][key].update({field: value}))
    return "manifest.json", key


def _rows(d: Path) -> int:
    return manifest(d)["tensors"][piece(d)[0]]["shape"][0]


def _cols(d: Path) -> int:
    return manifest(d)["tensors"][piece(d)[0]]["shape"][1]


def _manifest_chunk_edit(d: Path, field: str, value: object) -> tuple[str, str]:
    key, entry = piece(d)

    def edit(m: dict) -> None:
        chunk = next(c for c in m["tensors"][key]["chunks"] if c["entry"] == entry)
        chunk[field] = value

    edit_manifest(d, edit)
    return "manifest.json", entry


def _swap(d: Path) -> tuple[str, str]:
    entry = _first_entry(d, R0)  # the first chunk checked: not in rank 1's file
    (d / R0).rename(d / "tmp")
    (d / R1).rename(d / R0)
    (d / "tmp").rename(d / R1)
    return R0, entry


def _flip_byte(d: Path) -> tuple[str, str]:
    _, entry = piece(d)
    b, _ = span(d / R0, entry)
    raw = bytearray((d / R0).read_bytes())
    raw[b + 3] ^= 0x40
    (d / R0).write_bytes(bytes(raw))
    return R0, entry


def _point_at_planted(d: Path, marker: Path) -> tuple[str, str]:
    (d / "evil.distcp").write_bytes(torch_save_payload(marker))
    key, entry = piece(d)

    def edit(m: dict) -> None:
        m["files"]["evil.distcp"] = (d / "evil.distcp").stat().st_size
        next(c for c in m["tensors"][key]["chunks"] if c["entry"] == entry)["file"] = "evil.distcp"

    edit_manifest(d, edit)
    return "manifest.json", "evil.distcp"


def _point_outside(d: Path) -> tuple[str, str]:
    return _manifest_chunk_edit(d, "file", "../rank_00000.safetensors")


def _stray_shard(d: Path) -> tuple[str, str]:
    shutil.copy(d / R1, d / "rank_00002.safetensors")
    return "rank_00002.safetensors", "rank_00002.safetensors"


def _delete(d: Path, name: str) -> tuple[str, str]:
    entry = _first_entry(d, name) if name.endswith(".safetensors") else name
    (d / name).unlink()
    return name, entry


def _append(d: Path) -> tuple[str, str]:
    with (d / R1).open("ab") as f:
        f.write(b"\0" * 16)
    return R1, R1


def _swap_checksums(d: Path) -> tuple[str, str]:
    key, entry = piece(d)

    def edit(m: dict) -> None:
        a, b = m["tensors"][key]["chunks"][:2]
        a["sha256"], b["sha256"] = b["sha256"], a["sha256"]

    edit_manifest(d, edit)
    first = manifest(d)["tensors"][key]["chunks"][0]
    return first["file"], first["entry"]


def _bytes_in_manifest(d: Path) -> tuple[str, str]:
    edit_manifest(d, lambda m: m["tensors"]["rng.0"].update({"dtype": "bytes"}))
    return "manifest.json", "rng.0"


def _trainer(d: Path, data: bytes) -> tuple[str, str]:
    (d / "trainer.json").write_bytes(data)
    return "trainer.json", "trainer.json"


def _trainer_step(d: Path) -> tuple[str, str]:
    info = json.loads((d / "trainer.json").read_text())
    info["step"] = "1"
    (d / "trainer.json").write_text(json.dumps(info))
    return "trainer.json", "'step'"


CASES = [
    Case(".metadata: protocol-4 pickle, os.system by a dotted name",
         lambda d, m: _plant_metadata(d, dotted_pickle, m), "not part of the checkpoint"),
    Case(".metadata: DCP classes declaring rng.0 as bytes",
         lambda d, m: _plant_metadata(d, bytes_metadata, m), "not part of the checkpoint"),
    Case("manifest.json replaced by the dotted pickle",
         lambda d, m: _replace(d, "manifest.json", dotted_pickle(m), "manifest.json"),
         "not JSON"),
    Case("manifest.json: rng.0 declared as bytes", lambda d, m: _bytes_in_manifest(d),
         "not a tensor dtype"),
    Case("manifest.json: a chunk pointed at a planted torch.save file",
         _point_at_planted, "not a rank_NNNNN.safetensors name"),
    Case("manifest.json: a chunk's file outside the folder", lambda d, m: _point_outside(d),
         "not a listed shard"),
    Case("manifest.json: wrong dtype", lambda d, m: _manifest_tensor_edit(d, "dtype", "F64"),
         "wrong dtype"),
    Case("manifest.json: wrong size",
         lambda d, m: _manifest_tensor_edit(d, "shape", [_rows(d) + 1, _cols(d)]),
         "elements of the shape"),
    Case("manifest.json: a chunk outside its tensor",
         lambda d, m: _manifest_chunk_edit(d, "offsets", [_rows(d) - 1, 0]), "outside the shape"),
    Case("manifest.json: non-int offsets",
         lambda d, m: _manifest_chunk_edit(d, "offsets", ["0", 0]), "non-negative ints"),
    Case("manifest.json: two chunks' checksums swapped", lambda d, m: _swap_checksums(d),
         "sha256"),
    Case("manifest.json missing", lambda d, m: _delete(d, "manifest.json"), "missing"),
    Case("shard replaced by a torch.save zip (payload in data.pkl)",
         lambda d, m: _replace(d, R1, torch_save_payload(m), _first_entry(d, R1)),
         "not a safetensors file"),
    Case("shard truncated inside a tensor",
         lambda d, m: _truncate_in(d, R0, piece(d)[1]), "truncated inside"),
    Case("shard truncated inside the RNG state",
         lambda d, m: _truncate_in(d, R0, "rng.0"), "truncated inside"),
    Case("shard truncated inside its header",
         lambda d, m: (truncate(d / R0, 40), (R0, _first_entry(d, R0)))[1], "truncated"),
    Case("shards of rank 0 and rank 1 swapped", lambda d, m: _swap(d), "swapped"),
    Case("shard header: wrong dtype", lambda d, m: _header_edit(d, "dtype", "F16"),
         "wrong dtype"),
    Case("shard header: wrong size", lambda d, m: _header_edit(d, "shape", [3, 3]),
         "wrong size"),
    Case("shard header: data_offsets past the end", lambda d, m: _past_the_end(d),
         "truncated"),
    Case("shard bytes changed inside a tensor", lambda d, m: _flip_byte(d), "sha256"),
    Case("shard with bytes appended", lambda d, m: _append(d), "appended"),
    Case("shard missing", lambda d, m: _delete(d, R1), "missing"),
    Case("extra shard file", lambda d, m: _stray_shard(d), "not part of the checkpoint"),
    Case("trainer.json replaced by the dotted pickle",
         lambda d, m: _trainer(d, dotted_pickle(m)), "not JSON", export=False),
    Case("trainer.json: step not an int", lambda d, m: _trainer_step(d), "of type int",
         export=False),
    Case("trainer.json missing", lambda d, m: _delete(d, "trainer.json"), "not a committed",
         export=False),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_tampered_checkpoint_raises_naming_file_and_entry(saved, tmp_path, case):
    root, marker = tmp_path / "ckpt", tmp_path / "marker"
    shutil.copytree(saved, root)
    d = step_dir(root, 1)
    file, entry = case.tamper(d, marker)
    loaders = [lambda: _load_one_device(root)]
    if case.export:
        loaders.append(lambda: export_state_dict(d))
    for load in loaders:
        with pytest.raises(CheckpointError) as err:
            load()
        message = str(err.value)
        assert file in message and entry in message and case.why in message, message
    assert not marker.exists()


def test_the_payloads_run_when_unpickled(tmp_path):
    """The payloads are live: an unpickler without an allow-list runs each (so the marker
    staying absent above means loading never unpickled them)."""
    for i, make in enumerate((dotted_pickle, torch_save_payload)):
        marker = tmp_path / f"marker{i}"
        data = make(marker)
        if data[:2] == b"PK":
            import io

            torch.load(io.BytesIO(data), weights_only=False)
        else:
            pickle.loads(data)
        assert marker.exists()


def test_loading_unpickles_nothing_and_the_shards_are_plain_safetensors(saved, monkeypatch):
    """With pickle and torch.load disabled, load and export still work; the safetensors
    library reads every shard and its pieces equal what export_state_dict assembles."""
    from safetensors import safe_open

    d = step_dir(saved, 1)
    with safe_open(str(d / R0), framework="pt") as f0, safe_open(str(d / R1), framework="pt") as f1:
        shards = {k: f.get_tensor(k) for f in (f0, f1) for k in f.keys()}  # noqa: SIM118

    def refuse(*args, **kwargs):
        raise AssertionError("loading a checkpoint unpickled something")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    model = build("gpt", GPT, seed=7)
    resumed = Checkpointer(saved, model).load()
    state = export_state_dict(d)
    assert resumed.step == 1 and resumed.extra == {"data_position": 1}
    for chunk in manifest(d)["tensors"]["model.head.weight"]["chunks"]:
        where = tuple(
            slice(o, o + n) for o, n in zip(chunk["offsets"], chunk["sizes"], strict=True)
        )
        assert torch.equal(state["head.weight"][where], shards[chunk["entry"]])
    assert torch.equal(model.head.weight, state["head.weight"])


def test_every_rank_raises_when_one_rank_reads_a_damaged_chunk(saved, tmp_path):
    """Only rank 1 reads rng.1: both ranks raise, rank 0 naming rank 1's file and entry."""
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    d = step_dir(root, 1)
    b, _ = span(d / R1, "rng.1")
    raw = bytearray((d / R1).read_bytes())
    raw[b] ^= 1
    (d / R1).write_bytes(bytes(raw))
    _load_one_device(root)  # one device reads rng.0 only: loads
    prog = autoparallelize(build("gpt", GPT, seed=3), Mesh(tp=2), tokens(GPT), loss_fn=lm_loss)
    notes = _pool().run(_load_rank, prog.mesh.axes, [(prog.module(r), root) for r in range(2)])
    assert notes[0].startswith("rank 1 of the checkpoint group could not load")
    for note in notes:
        assert R1 in note and "rng.1" in note and "sha256" in note, note
