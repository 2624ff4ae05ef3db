"""The one driver (autopar.driver): one trace per ``autoparallelize`` call on every mesh, and no
module below the front door calling the front door."""

from __future__ import annotations

import ast
import dataclasses
import warnings
from pathlib import Path

import pytest
import torch

import autopar
from autopar import Mesh, autoparallelize
from autopar.errors import PlanError
from autopar.tools.testing import Config, MoEConfig, build, build_moe, lm_loss, tokens
from cost.hardware import Cluster

LLAMA = Config(batch=8)
LONG = Config(batch=8, seq=32)  # cp chunks the sequence in 2 x cp
MOE = MoEConfig(batch=8)

# mesh, model kind, options: every axis alone and in the compositions the driver nests
MESHES = [
    (Mesh(tp=2), "llama", {}),
    (Mesh(dp=2), "llama", {}),
    (Mesh(dp=2, tp=2), "llama", {}),
    (Mesh(dp=2, tp=2), "llama", {"memory_limit": 3e6}),  # re-solved under the limit
    (Mesh(dp=4), "llama", {"memory_limit": 1.2e6}),
    (Mesh(pp=2, tp=2), "llama", {"n_microbatches": 4}),
    (Mesh(dp=2, pp=2), "llama", {"n_microbatches": 2, "memory_limit": 1.5e6}),
    (Mesh(cp=2, tp=2), "llama", {}),
    (Mesh(dp=2, cp=2), "llama", {}),
    (Mesh(pp=2, cp=2), "long", {"n_microbatches": 2}),
    (Mesh(tp=2), "llama", {"recompute": "full"}),
    (Mesh(ep=2), "moe", {}),
    (Mesh(ep=2, tp=2), "moe", {"recompute": "full"}),
    (Mesh(dp=2, ep=2), "moe", {}),
    (Mesh(ep=2, pp=2), "moe", {"n_microbatches": 2}),
]


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Every torch.export.export call made, with the batch of its first input."""
    calls: list[tuple] = []
    real = torch.export.export

    def counting(root, args, *rest, **kwargs):  # noqa: ANN001, ANN202 - torch's signature
        calls.append(tuple(a.shape for a in args if isinstance(a, torch.Tensor)))
        return real(root, args, *rest, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting)
    return calls


def _model(kind: str) -> tuple:
    if kind == "moe":
        return build_moe(MOE), tokens(MOE)
    if kind == "long":
        return build("llama", LONG), tokens(LONG)
    return build("llama", LLAMA), tokens(LLAMA)


@pytest.mark.parametrize(("mesh", "kind", "options"), MESHES, ids=lambda v: str(v))
def test_every_mesh_traces_the_model_once(mesh, kind, options, exports):
    model, inputs = _model(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        autoparallelize(model, mesh, inputs, lm_loss, **options)
    rows = inputs[0].shape[0] // mesh.size("dp") // mesh.size("ep")
    if "pp" in mesh.sizes:
        rows //= options["n_microbatches"]
    assert [shapes[0][0] for shapes in exports] == [rows]  # once, at the per-rank slice


def test_mesh_auto_traces_the_example_batch_and_each_slice_once(exports):
    """The search traces the example batch; repricing the candidates (the compiler's count)
    traces each candidate's per-rank slice once, and the compiled configuration reuses the
    trace of its slice: every slice is traced once."""
    model, inputs = build("llama", LLAMA), tokens(LLAMA)
    node = dataclasses.replace(Cluster.preset("dgx-h100", nodes=1), gpus_per_node=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = autoparallelize(model, Mesh.auto(node), inputs, lm_loss)
    mesh, batch = prog.search.mesh, inputs[0].shape[0]
    rows = batch // mesh.size("dp") // mesh.size("ep")
    if "pp" in mesh.sizes:
        rows //= prog.pipeline.config.n_microbatches
    traced = [shapes[0][0] for shapes in exports]
    slices = {c.config.micro_batch for _, c in prog.search.candidates}
    assert traced[0] == batch and len(traced) == len(set(traced))  # each slice once
    assert rows in traced and set(traced) <= {batch} | slices


def test_zero_without_a_data_axis_is_refused_on_every_mesh():
    """``zero=`` was silently dropped on a mesh with ep but no dp."""
    model, inputs = build_moe(MOE), tokens(MOE)
    with pytest.raises(PlanError, match=r"zero=1 shards over the data axis.*no dp axis"):
        autoparallelize(model, Mesh(ep=2), inputs, lm_loss, zero=1)


def _calls_front_door(path: Path) -> list[str]:
    """Lines of ``path`` that import or call ``autoparallelize``."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "autoparallelize" for a in node.names):
            found.append(f"{path.name}:{node.lineno} imports it")
        elif isinstance(node, ast.Call):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", None)
            if name == "autoparallelize":
                found.append(f"{path.name}:{node.lineno} calls it")
    return found


# the front door itself, and the tools above it (they drive whole compiles as a user does)
# callers of the front door as a user is: the api, verify, the CLI and tools, and elastic's
# training-loop driver (it compiles the user's model on every restart)
ABOVE = {"__init__.py", "api.py", "verify.py", "zoo.py", "zoo_models.py", "cli.py", "testing.py",
         "elastic.py"}  # fmt: skip


def test_nothing_below_the_front_door_calls_it():
    root = Path(autopar.__file__).parent
    repo = root.parent
    below = [p for p in root.rglob("*.py") if p.name not in ABOVE]
    below += [*(repo / "passes").rglob("*.py"), *(repo / "cost").rglob("*.py")]
    assert len(below) > 40
    offenders = [line for p in below for line in _calls_front_door(p)]
    assert offenders == []


def test_a_4d_compile_records_every_graph_pass_it_ran():
    """Mesh(dp=2, pp=2, cp=2, tp=2) on 16 virtual ranks: the stage split, then per stage the tp
    passes and the context_parallel pass, then dp's global_batch per stage, in order, in one
    history."""
    model, inputs = build("llama", LONG), tokens(LONG)
    prog = autoparallelize(model, Mesh(dp=2, pp=2, cp=2, tp=2), inputs, lm_loss,
                           n_microbatches=2)  # fmt: skip
    per_stage = ["propagate_layout", "tensor_parallel", "lower_collectives", "localize",
                 "cleanup", "fuse_norms", "context_parallel"]  # fmt: skip
    assert [r.name for r in prog.history] == ["pipeline_split"] + [
        f"{name} [stage {s}]" for s in range(2) for name in per_stage] + [
        f"global_batch [stage {s}]" for s in range(2)]
    assert all(r.graph for r in prog.history)


@pytest.mark.parametrize(("option", "message"), [
    ({"n_microbatches": 0}, r"n_microbatches=0: give a positive integer"),
    ({"virtual_stages": 1.5}, r"virtual_stages=1.5: give a positive integer"),
    ({"split_points": "layers.1"}, r"split_points='layers.1': give a list of module paths"),
    ({"capacity_factor": 0}, r"capacity_factor=0: the capacity factor must be > 0"),
    ({"cp_attention": "flash"}, r"cp_attention='flash': use 'ring', 'all_to_all' or None"),
    ({"recompute": "some"}, r"recompute"),
])  # fmt: skip
def test_options_are_checked_once_before_anything_is_traced(option, message, exports):
    from autopar.errors import AutoparError

    model, inputs = build("llama", LLAMA), tokens(LLAMA)
    with pytest.raises(AutoparError, match=message):
        autoparallelize(model, Mesh(pp=2, tp=2), inputs, lm_loss, **option)
    assert exports == []
