"""recompute pass: the printed graph of a two-layer llama on tp=2 under recompute="full" (each
block one checkpoint call), its place in the history (the last pass), each rank's blocks
holding their shards, and numerics against one device."""

from __future__ import annotations

from golden import assert_golden

from autopar import Mesh, autoparallelize, verify
from autopar.axes.recompute import block_targets, blocks_outlined
from autopar.tools.testing import Config, build, lm_loss, tokens

SMALL = Config(layers=2, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=32, seq=8, batch=2)


def test_printed_graph():
    prog = autoparallelize(build("llama", SMALL), Mesh(tp=2), tokens(SMALL), lm_loss,
                           recompute="full")  # fmt: skip
    names = [r.name for r in prog.history]
    assert names[-3:] == ["cleanup", "fuse_norms", "recompute"]
    rec = prog.history[-1]
    assert rec.graph.count("= checkpoint(") == 2 and rec.nodes_after < rec.nodes_before
    assert_golden("llama_tp2_recompute", rec.graph)


def test_each_rank_block_holds_its_shards():
    prog = autoparallelize(build("llama", SMALL), Mesh(tp=2), tokens(SMALL), lm_loss,
                           recompute="full")  # fmt: skip
    whole = prog.final().module
    for rank in range(2):
        module = prog.module(rank)
        assert blocks_outlined(module) and block_targets(module) == ["layers.0", "layers.1"]
        block, full = module.get_submodule("layers.0"), whole.get_submodule("layers.0")
        local = dict(block.named_parameters())
        assert local.keys() == dict(full.named_parameters()).keys()
        assert sum(p.numel() for p in local.values()) < sum(p.numel() for p in full.parameters())
        assert module.meta["shards"].keys() == {n for n, _ in module.named_parameters()}


def test_matches_one_device():
    report = verify(build("llama", SMALL), Mesh(tp=2), tokens(SMALL), lm_loss, recompute="full",
                    rtol=1e-5)  # fmt: skip
    assert report.ok, report
