from __future__ import annotations

from golden import assert_golden


def test_printed_graph(mlp_prog):
    _, graphs = mlp_prog
    assert_golden("mlp_tp2_cleanup", graphs["cleanup"])


def test_no_dead_nodes(mlp_prog):
    prog, _ = mlp_prog
    for node in prog.graph_module.graph.nodes:
        if node.op == "call_function":
            assert node.users, f"{node.name} is dead"
