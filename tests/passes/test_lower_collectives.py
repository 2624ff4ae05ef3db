from __future__ import annotations

from golden import assert_golden

from autopar import collectives as C


def test_printed_graph(mlp_prog):
    _, graphs = mlp_prog
    assert_golden("mlp_tp2_lower_collectives", graphs["lower_collectives"])


def test_no_abstract_redistribute_survives(mlp_prog):
    prog, graphs = mlp_prog
    assert "redistribute(" not in graphs["lower_collectives"]
    targets = {n.target for n in prog.graph_module.graph.nodes}
    assert C.redistribute not in targets
    # Megatron's pair on one MLP: f before the column split, all-reduce after the row split
    assert C.grad_all_reduce in targets or C.all_reduce in targets
