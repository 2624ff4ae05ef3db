"""context_parallel pass: the printed graph of a small llama on cp=2, its numerics against one
device, and its place in the runner's history (after the tp passes)."""

from __future__ import annotations

from golden import assert_golden

from autopar import Mesh, autoparallelize, verify
from autopar.tools.testing import Config, build, lm_loss, tokens

SMALL = Config(layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=32, seq=8, batch=2)


def test_printed_graph():
    prog = autoparallelize(build("llama", SMALL), Mesh(cp=2), tokens(SMALL), lm_loss,
                           cp_attention="ring")  # fmt: skip
    graphs = {rec.name: rec.graph for rec in prog.history}
    assert list(graphs) == ["context_parallel"]
    assert_golden("llama_cp2_context_parallel", graphs["context_parallel"])


def test_runs_after_the_tp_passes_and_matches_one_device():
    c = Config(layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=32, seq=16, batch=2)
    model, inputs = build("llama", c), tokens(c)
    prog = autoparallelize(model, Mesh(cp=2, tp=2), inputs, lm_loss, cp_attention="ring")
    assert [r.name for r in prog.history] == ["propagate_layout", "tensor_parallel",
                                              "lower_collectives", "localize", "cleanup",
                                              "fuse_norms", "context_parallel"]  # fmt: skip
    cp = prog.history[-1]
    assert cp.nodes_after > cp.nodes_before  # localized inputs, ring steps, the global mean
    assert "ring_send" in cp.graph and "cp_global_mean" in cp.graph
    report = verify(model, Mesh(cp=2, tp=2), inputs, lm_loss, cp_attention="ring", rtol=1e-5)
    assert report.ok, report
