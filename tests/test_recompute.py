"""Activation recomputation (``autoparallelize(..., recompute=...)``): every route's rank
programs run it and still equal the single-device model; it saves measured activation bytes in
the direction the plan predicts; Mesh.auto on a memory-tight cluster compiles the recompute it
chose; bad requests get a clear error."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from autopar import Mesh, autoparallelize
from autopar.axes.recompute import (
    RecomputeError,
    block_targets,
    blocks_outlined,
    core_regions,
    measure_saved,
)
from autopar.codegen import outline_blocks
from autopar.tools.testing import MLP, Config, MoEConfig, build, build_moe, lm_loss, tokens
from autopar.verify import verify
from cost.hardware import Cluster

# seq 24 is neither the hidden size nor a head dim: only the attention scores are [s, s]
ROUTES = [
    ("gpt", {"tp": 2}, {}, "full"),
    ("llama", {"tp": 2}, {}, "selective"),
    ("llama", {"dp": 2}, {"zero": 0}, "full"),
    ("gpt", {"dp": 2}, {"zero": 0}, "selective"),
    ("gpt", {"dp": 2}, {"zero": 3}, "full"),
    ("llama", {"dp": 2}, {"zero": 3}, "selective"),
    ("llama", {"pp": 2}, {"n_microbatches": 2}, "full"),
    ("gpt", {"pp": 2}, {"n_microbatches": 2}, "selective"),
    ("llama", {"cp": 2}, {"cp_attention": "ring"}, "full"),
    ("gpt", {"cp": 2}, {"cp_attention": "all_to_all"}, "selective"),
]


def _config(kind: str, axes: dict, mode: str) -> Config:
    # selective needs an unfused attention core; cp rewrites only SDPA (its selective case
    # checks that a fused attention has nothing to recompute)
    unfused = mode == "selective" and "cp" not in axes
    return Config(layers=2, batch=4, seq=24, kv_heads=2 if kind == "llama" else 4,
                  attention="unfused" if unfused else "sdpa")  # fmt: skip


@pytest.mark.parametrize(("kind", "axes", "options", "mode"), ROUTES)
def test_recomputing_programs_equal_single_device(kind, axes, options, mode):
    c = _config(kind, axes, mode)
    x, y = tokens(c)
    model = build(kind, c)
    # ring attention's kernels round differently: compare with the float64 truth (as
    # tests/test_context_parallel.py does)
    wide = torch.float64 if options.get("cp_attention") == "ring" else None
    report = verify(model, Mesh(**axes), (x, y), lm_loss, rtol=1e-5, recompute=mode,
                    reference_dtype=wide, **options)  # fmt: skip
    assert report.ok, f"{kind} {axes} {mode}\n{report}"
    assert len([r for r in report.rows if r.kind == "grad"]) == len(list(model.parameters()))
    prog = autoparallelize(build(kind, c), Mesh(**axes), (x, y), lm_loss, recompute=mode,
                           **options)  # fmt: skip
    code, plan = prog.code(0), str(prog.plan)
    if c.attention == "sdpa" and mode == "selective":  # nothing recomputed, and it says so
        assert "checkpoint(" not in code and "nothing to recompute" in plan
    else:  # the program runs it, and the plan prices it
        assert "autopar_axes_recompute_checkpoint(" in code
        assert f"recompute {mode}: re-runs" in plan and "ms per step" in plan


def test_expert_parallel_recomputes_after_placing_experts():
    c = MoEConfig()
    report = verify(build_moe(c), Mesh(ep=2), tokens(c), lm_loss, rtol=1e-5, recompute="full")
    assert report.ok, str(report)
    prog = autoparallelize(build_moe(c), Mesh(ep=2), tokens(c), lm_loss, recompute="full")
    assert len(prog.layers) == c.layers  # MoE layers recognised before outlining
    assert "autopar_axes_recompute_checkpoint(blocks_0," in prog.code(0)
    assert "recompute full: re-runs the forward of each of 2 blocks" in str(prog.plan)


def test_full_checkpoints_every_block_and_prints_where():
    c = Config(layers=3, batch=2, seq=24)
    x, y = tokens(c)
    prog = autoparallelize(build("gpt", c), Mesh(tp=2), (x, y), lm_loss, recompute="full")
    code = prog.code(0)
    for i in range(3):
        assert f"autopar_axes_recompute_checkpoint(blocks_{i}," in code
    calls = [n for n in prog.module(0).graph.nodes if n.op == "call_function"
             and n.target.__name__ == "checkpoint"]  # fmt: skip
    assert [n.args[0].target for n in calls] == ["blocks.0", "blocks.1", "blocks.2"]
    # parameters keep the user's names; the pickled copy the worker pool runs computes the same
    module = prog.module(0)
    again = pickle.loads(pickle.dumps(module))
    assert [n for n, _ in again.named_parameters()] == [n for n, _ in module.named_parameters()]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputing_programs_still_shard_per_block(mode):
    """ZeRO-3's per-block FSDP2 groups (runtime.shard_per_block) on the pool's pickled copy:
    "full" programs arrive outlined, "selective" ones outline with the core inside its block."""
    c = Config(layers=2, batch=4, seq=24, attention="unfused")
    x, y = tokens(c)
    prog = autoparallelize(build("gpt", c), Mesh(dp=2), (x, y), lm_loss, recompute=mode)
    module = pickle.loads(pickle.dumps(prog.module(0)))
    if mode == "full":
        assert blocks_outlined(module) and block_targets(module) == ["blocks.0", "blocks.1"]
        return
    outlined = outline_blocks(module)
    assert [n.target for n in outlined.graph.nodes if n.op == "call_module"] == [
        "blocks.0", "blocks.1"]
    assert "attention_core" in dict(outlined.get_submodule("blocks.0").named_children())


def test_selective_regions_are_the_attention_core():
    c = Config(layers=2, batch=2, seq=24, attention="unfused")
    x, y = tokens(c)
    module = autoparallelize(build("gpt", c), Mesh(tp=2), (x, y), lm_loss).module(0)
    regions = core_regions(module)
    assert len(regions) == c.layers
    for region in regions:  # QKᵀ ... softmax ... ·V, no parameter read inside
        names = [n.target.__name__ for n in region if hasattr(n.target, "__name__")]
        assert any("softmax" in t for t in names) and sum("matmul" in t for t in names) == 2
        assert not any(a.op == "get_attr" for n in region for a in n.all_input_nodes)


@pytest.mark.parametrize(("kind", "attention"), [("gpt", "unfused"), ("llama", "sdpa")])
def test_saved_activations_fall_as_predicted(kind, attention):
    """Measured saved-tensor bytes per rank (autograd's pack hook, distinct storages, weights
    excluded): full < selective <= none, selective < none exactly when there is an unfused
    core; the plan's predicted saved bytes move the same way."""
    c = Config(layers=4, batch=4, seq=48, attention=attention,
               kv_heads=2 if kind == "llama" else 4)  # fmt: skip
    x, y = tokens(c)
    measured, predicted = {}, {}
    for mode in ("none", "selective", "full"):
        prog = autoparallelize(build(kind, c), Mesh(tp=2), (x, y), lm_loss, recompute=mode)
        measured[mode] = max(measure_saved(prog, (x, y)))
        effect = prog.stages[0].recompute_effect
        predicted[mode] = effect.saved if effect is not None else None
        if effect is not None:
            predicted["none"] = effect.saved_none
    assert measured["full"] < measured["selective"] <= measured["none"]
    assert predicted["full"] < predicted["none"]
    if attention == "unfused":
        assert measured["selective"] < measured["none"]
        assert predicted["selective"] < predicted["none"]
    else:
        assert measured["selective"] == measured["none"]
        assert predicted["selective"] == predicted["none"]


def test_mesh_auto_on_a_tight_cluster_compiles_recompute():
    c = Config(layers=4, batch=8, seq=64, hidden=64, ffn=256)
    x, y = tokens(c)
    base = Cluster.preset("dgx-h100")  # 3 GiB runtime reserve + 4 MB: only recompute fits
    gpu = dataclasses.replace(base.gpu, hbm_bytes=3 * 2**30 + 4e6)
    cluster = dataclasses.replace(base, gpu=gpu, gpus_per_node=2)
    prog = autoparallelize(build("gpt", c), Mesh.auto(cluster), (x, y), lm_loss)
    chosen = prog.search.compiled.config.recompute
    assert chosen in ("selective", "full") and f"recompute={chosen}" in str(prog.search)
    assert f"recompute {chosen}: re-runs" in str(prog.plan)
    assert "autopar_axes_recompute_checkpoint(" in prog.code(0)
    report = verify(build("gpt", c), Mesh.auto(cluster), (x, y), lm_loss, rtol=1e-5)
    assert report.ok, str(report)
    roomy = dataclasses.replace(base, gpus_per_node=2)  # the search's own choice: no recompute
    assert autoparallelize(build("gpt", c), Mesh.auto(roomy), (x, y),
                           lm_loss).search.compiled.config.recompute == "none"  # fmt: skip
    forced = autoparallelize(build("gpt", c), Mesh.auto(roomy), (x, y), lm_loss,
                             recompute="full")  # fmt: skip
    assert forced.search.compiled.config.recompute == "full"
    assert "recompute full: re-runs" in str(forced.plan)


def test_full_without_repeated_blocks_says_so():
    model = MLP()
    with pytest.raises(RecomputeError, match="no repeated blocks were found in MLP.*'none'"):
        autoparallelize(model, Mesh(tp=2), (torch.randn(4, 16),), recompute="full")


def test_unknown_mode_is_refused():
    c = Config(layers=1)
    with pytest.raises(RecomputeError, match="recompute='some'.*'none', 'selective', 'full'"):
        autoparallelize(build("gpt", c), Mesh(tp=2), tokens(c), lm_loss, recompute="some")
