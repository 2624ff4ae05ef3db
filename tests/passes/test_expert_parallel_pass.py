"""expert_parallel pass: the printed graph of a one-layer MoE on ep=2, its place in the
history (after the tp passes), the experts' layouts codegen slices, and numerics against one
device (Mesh(ep=2, tp=2))."""

from __future__ import annotations

from golden import assert_golden, masked

from autopar import Mesh, autoparallelize, verify
from autopar.ops import collectives as C
from autopar.tools.testing import MoEConfig, build_moe, lm_loss, tokens

SMALL = MoEConfig(layers=1, hidden=16, expert_ffn=8, experts=4, vocab=32, seq=4, batch=4)


def test_printed_graph():
    prog = autoparallelize(build_moe(SMALL), Mesh(ep=2), tokens(SMALL), lm_loss)
    graphs = {rec.name: rec.graph for rec in prog.history}
    assert list(graphs)[-2:] == ["expert_parallel", "global_batch"]  # after the tp passes
    assert_golden("moe_ep2_expert_parallel", masked(graphs["expert_parallel"]))


def test_experts_split_on_dim_0_and_sliced_by_codegen():
    prog = autoparallelize(build_moe(SMALL), Mesh(ep=2, tp=2), tokens(SMALL), lm_loss)
    assert [r.name for r in prog.history] == ["propagate_layout", "tensor_parallel",
                                              "lower_collectives", "localize", "cleanup",
                                              "fuse_norms", "expert_parallel", "global_batch"]  # fmt: skip
    ep = prog.history[-2]
    assert ep.nodes_after > ep.nodes_before  # dispatch, combine, gradient buckets, global loss
    assert "expert_dispatch" in ep.graph and "batch_loss" in ep.graph
    whole = prog.final(0, upto=1).module  # after the ep phase (the program's first)
    layouts = {n.target: n.meta["autopar"].layout for n in whole.graph.nodes if n.op == "get_attr"}
    assert layouts["blocks.0.gate_up"].dims[0] == ("ep",)  # S(0) over ep, tp on another dim
    assert tuple(whole.get_parameter("blocks.0.gate_up").shape)[0] == 4  # whole until shard
    for rank in range(4):
        module = prog.module(rank)
        assert module.get_parameter("blocks.0.gate_up").shape[0] == 2  # its 2 of 4 experts
        assert module.meta["shards"]["blocks.0.gate_up"][2].dims[0] == ("ep",)
        assert sum(n.target is C.expert_dispatch for n in module.graph.nodes) == 1
    report = verify(build_moe(SMALL), Mesh(ep=2, tp=2), tokens(SMALL), lm_loss, rtol=1e-5)
    assert report.ok, report


def test_idempotent_per_rank():
    """Each rank's module is built once from the one rewritten program: asking again gives the
    same module, and the rewritten program is left whole."""
    prog = autoparallelize(build_moe(SMALL), Mesh(ep=2), tokens(SMALL), lm_loss)
    before = masked(prog.history[-2].graph)
    assert prog.module(1) is prog.module(1)
    assert prog.final(0, upto=1).module.get_parameter("blocks.0.down").shape[0] == SMALL.experts
    assert masked(prog.history[-2].graph) == before
