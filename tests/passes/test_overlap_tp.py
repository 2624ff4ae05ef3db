from __future__ import annotations

import torch
from golden import assert_golden, masked

from autopar import Mesh, autoparallelize
from autopar.tools.testing import Config, build, lm_loss, tokens
from passes.overlap_tp import candidates


def _sp_program(mode: str):
    c = Config(layers=1, bias=False)
    torch.manual_seed(0)
    return autoparallelize(build("llama", c), Mesh(tp=2), tokens(c), loss_fn=lm_loss,
                           memory_weight=1e-6, tp_overlap=mode)  # fmt: skip


def test_printed_graph():
    """One sequence-parallel Llama layer with every candidate decomposed: each gather before
    the q/k/v and gate/up projections is one ``gather_linear`` feeding ``getitem``s, each
    reduce-scatter after the out / down projection one ``linear_scatter``."""
    prog = _sp_program("all")
    graphs = {rec.name: rec.graph for rec in prog.history}
    assert_golden("llama_tp2_overlap_tp", masked(graphs["overlap_tp"]))


def test_candidates_are_the_sequence_parallel_pairs():
    prog = _sp_program("none")
    found = candidates(prog.graph_module)
    kinds = [c.kind for c in found]
    # q/k/v, gate/up and the head read gathers; the out and down projections' sums scatter
    assert kinds.count("all_gather") == 3 and kinds.count("reduce_scatter") == 2
    assert [len(c.linears) for c in found] == [3, 1, 2, 1, 1]  # q/k/v, wo, gate/up, down, head
    assert "overlap_tp" not in [rec.name for rec in prog.history]  # nothing chosen: no pass
