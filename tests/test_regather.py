"""Megatron-SP's memory (issue 21.2): a sequence-parallel gather's linears keep its shard and
re-gather it in backward (autopar.planner.overlap step 4, autopar.ops.overlap.gather_linear),
and the cost model counts what autograd keeps."""

from __future__ import annotations

import pytest
import torch

from autopar import Mesh, autoparallelize
from autopar.axes.data_parallel import saved_activations
from autopar.axes.recompute import measure_saved
from autopar.ops import collectives as C
from autopar.ops.overlap import gather_linear
from autopar.tools import zoo
from autopar.verify import verify

SP = 1e-6  # memory weight (s/byte) that makes the small models sequence-parallel
DIMS = zoo.Dims(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, vocab=128, seq=64, batch=2,
                experts=4, top_k=2, expert_ffn=32)  # fmt: skip


def _llama(dtype: torch.dtype = torch.float32):
    with zoo.tiny_as(DIMS):
        model, args, kwargs, _ = zoo.build(zoo.family("llama"), "tiny")
    return model.to(dtype), args, kwargs


def _compile(t: int, dtype: torch.dtype, **options):
    model, args, kwargs = _llama(dtype)
    prog = autoparallelize(model, Mesh(tp=t), args, None, example_kwargs=kwargs,
                           param_dtype=dtype, memory_weight=SP, **options)  # fmt: skip
    return prog, args, kwargs


def _fused(prog) -> list:
    return [n for n in prog.graph_module.graph.nodes if n.target is gather_linear]


@pytest.mark.parametrize(("t", "overlap"), [(2, "auto"), (4, "auto"), (2, "all")])
def test_regathered_program_verifies(t, overlap):
    """Every sequence-parallel gather that feeds only linears runs as one gather_linear (whole
    under "auto" at this size, ring steps under "all"), none stays a plain gather, the plan
    lists one backward re-gather per gather, and the program equals one device (fp32: the
    loss and every gradient)."""
    prog, args, kwargs = _compile(t, torch.float32, tp_overlap=overlap)
    fused = _fused(prog)
    assert len(fused) >= 2 * DIMS.layers
    assert all(n.args[5] is (overlap == "all") for n in fused)
    plain = [n for n in prog.graph_module.graph.nodes
             if n.target is C.all_gather and all(u.target is torch.ops.aten.linear.default
                                                 for u in n.users)]  # fmt: skip
    assert not plain
    again = [c for c in prog.plan.collectives if c.regather]
    assert len(again) == len(fused) and all(c.kind == "all_gather" and c.direction == "bwd"
                                            for c in again)  # fmt: skip
    assert "re-gather" in str(prog.plan) and "re-gathered in backward" in str(prog.plan)
    model, _, _ = _llama()
    report = verify(model, Mesh(tp=t), args, None, example_kwargs=kwargs, memory_weight=SP,
                    tp_overlap=overlap, rtol=1e-5)  # fmt: skip
    assert report.ok, str(report)


def test_kept_bytes_are_what_the_cost_model_counts():
    """bf16 HF Llama at Mesh(tp=2): the bytes autograd keeps (pack hooks on the ranks, distinct
    storages, weights excluded) equal the cost model's count (the plan's activation row) with
    and without the re-gather, and the re-gather frees half of each gathered input (t = 2)."""
    kept, counted, gathered = {}, {}, {}
    for mode in ("auto", "none"):
        prog, args, kwargs = _compile(2, torch.bfloat16, tp_overlap=mode)
        kept[mode] = max(measure_saved(prog, args, kwargs))
        counted[mode] = saved_activations(prog.stages[0])
        gathered[mode] = sum(n.meta["val"].numel() * 2 for n in prog.priced_graph.graph.nodes
                             if n.meta.get("regather"))  # fmt: skip
    for mode in kept:
        assert abs(counted[mode] - kept[mode]) <= 0.01 * kept[mode], (mode, counted, kept)
    assert gathered["none"] == 0 and gathered["auto"] > 0
    assert kept["none"] - kept["auto"] == pytest.approx(gathered["auto"] / 2, rel=0.02)


@pytest.mark.parametrize("overlap", ["auto", "all"])
def test_regather_inside_recomputed_blocks_verifies(overlap):
    """recompute="full": the checkpointed blocks' gather_linears re-run in backward, keep their
    shards then and re-gather them; loss and every gradient equal one device's (fp32)."""
    model, args, kwargs = _llama()
    report = verify(model, Mesh(tp=2), args, None, example_kwargs=kwargs, memory_weight=SP,
                    tp_overlap=overlap, recompute="full", rtol=1e-5)  # fmt: skip
    assert report.ok, str(report)
