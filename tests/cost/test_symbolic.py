"""Symbolic formulas: readable, fast to evaluate, and equal to the numeric model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost.comm import collective_time
from cost.config import ParallelConfig
from cost.estimate import ShapeModel
from cost.hardware import GPU, Link
from cost.model import ModelShape
from cost.symbolic import _compiled, formulas
from cost.workload import shape_workload

PROPERTY = settings(max_examples=60, deadline=None)


def test_formulas_print_why():
    f = formulas()
    assert str(f["tp_traffic_per_layer"]).startswith("tp_traffic_per_layer = 8*b*h*s*(t - 1)/t")
    assert "(p - 1)/(m*v)" in str(f["bubble_interleaved"])


def test_evaluate_is_cached_and_checks_symbols():
    f = formulas()["bubble_1f1b"]
    assert f.evaluate(p=8, m=32) == pytest.approx(7 / 32)
    assert _compiled(f) is _compiled(f)
    with pytest.raises(ValueError, match="needs values for m"):
        f.evaluate(p=8)


@PROPERTY
@given(kind=st.sampled_from(["all_reduce", "all_gather"]), n=st.integers(1, 512),
       nbytes=st.floats(1.0, 1e11), bw=st.floats(1e8, 1e13), lat=st.floats(0, 1e-4))  # fmt: skip
def test_collective_formulas_equal_the_numeric_model(kind, n, nbytes, bw, lat):
    name = "ring_all_reduce_time" if kind == "all_reduce" else "all_gather_time"
    link = Link(name="l", bandwidth=bw, latency=lat)
    symbolic = formulas()[name].evaluate(n=n, M=nbytes, B=bw, alpha=lat)
    assert collective_time(kind, nbytes, n, link) == pytest.approx(symbolic if n > 1 else 0.0)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_tp_traffic_formula_equals_the_workload(t):
    shape = ModelShape.gpt(layers=2, hidden=2048, heads=16, seq=1024, vocab=1000)
    work = shape_workload(shape, ParallelConfig(tp=t, global_batch=8), 2, GPU.preset("h100-sxm"))
    elements = work.tp_bytes / 2
    per_gpu = 2 * work.tp_calls * 2 * (t - 1) / t * elements  # 2 passes, ring all-reduce
    assert per_gpu == formulas()["tp_traffic_per_layer"].evaluate(b=2, s=1024, h=2048, t=t)


def test_megatron_flops_formula_equals_the_model_count():
    shape = ModelShape.gpt(layers=80, hidden=12288, heads=96, seq=2048, vocab=51200)
    per_iteration = ShapeModel(shape=shape).flops_per_token()[1] * 2304 * 2048
    exact = formulas()["megatron_flops"].evaluate(B_g=2304, s=2048, L=80, h=12288, V=51200)
    assert per_iteration == pytest.approx(exact, rel=2e-4)  # biases and norms: 13h vs 12h²


def test_gpt_parameter_formula_equals_the_shape():
    shape = ModelShape.gpt(layers=96, hidden=12288, heads=96, seq=2048, vocab=50257)
    count = formulas()["gpt_params"].evaluate(L=96, h=12288, V=50257, s=2048)
    learned_positions, final_norm = 2048 * 12288, 2 * 12288
    assert shape.params == pytest.approx(count - learned_positions + final_norm)
