"""Property tests: random GPT / Llama configs x tp in {1, 2, 4}; outputs and every parameter
gradient of the per-rank programs (real Gloo processes, persistent pool) match the
single-device model to 1e-4 relative in fp32."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar import Mesh
from autopar.tools.testing import Config, build, lm_loss, tokens
from autopar.verify import verify


@st.composite
def configs(draw, kind: str):
    tp = draw(st.sampled_from([1, 2, 4]))
    heads = tp * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([8, 16]))
    kv = (
        draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
        if kind == "llama"
        else heads
    )
    c = Config(
        layers=draw(st.integers(1, 2)),
        hidden=heads * head_dim,
        heads=heads,
        kv_heads=kv,
        ffn=heads * head_dim * draw(st.sampled_from([2, 3])),
        vocab=draw(st.sampled_from([48, 64, 96, 100])),
        seq=draw(st.sampled_from([8, 16])),
        batch=draw(st.integers(1, 2)),
        bias=draw(st.booleans()),
        tied=draw(st.booleans()),
        fused_qkv=kind == "gpt" and draw(st.booleans()),
    )
    return c, tp, draw(st.booleans())


def check(kind: str, c: Config, tp: int, with_loss: bool) -> None:
    model = build(kind, c)
    x, y = tokens(c)
    if with_loss:
        report = verify(model, Mesh(tp=tp), (x, y), loss_fn=lm_loss)
    else:
        report = verify(model, Mesh(tp=tp), (x,))
    assert report.ok, f"{c} tp={tp} loss={with_loss}\n{report}"
    n_params = len([p for p in model.parameters()])
    assert len([r for r in report.rows if r.kind == "grad"]) == n_params


@settings(max_examples=12)
@given(configs("gpt"))
def test_gpt_matches_single_device(case):
    check("gpt", *case)


@settings(max_examples=12)
@given(configs("llama"))
def test_llama_matches_single_device(case):
    check("llama", *case)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_plan_matches_single_device(tp):
    c = Config(layers=2, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=64, seq=16, batch=2)
    model = build("llama", c)
    report = verify(model, Mesh(tp=tp), tokens(c), loss_fn=lm_loss, memory_weight=1e-3)
    assert report.ok, str(report)
