from __future__ import annotations

import copy

import torch
from golden import assert_golden

from autopar.ir import meta
from autopar.ir.analysis import needs_grad
from autopar.ops.collectives import redistribute
from passes import PassContext, TpDecisions
from passes.propagate_layout import propagate_layout


def test_printed_graph(mlp_prog):
    _, graphs = mlp_prog
    assert_golden("mlp_tp2_propagate_layout", graphs["propagate_layout"])


def test_every_tensor_node_has_a_layout(mlp_prog):
    prog, _ = mlp_prog
    for node in prog.graph_module.graph.nodes:
        if node.op in ("placeholder", "call_function"):
            assert meta.layout(node) is not None, node.name


def test_idempotent_and_lint_clean(mlp_prog):
    prog, _ = mlp_prog
    traced = prog.traced
    gm = torch.fx.GraphModule(traced.gm, copy.deepcopy(traced.gm.graph))
    ctx = PassContext(mesh=prog.mesh, traced=traced,
                      grad=frozenset(n.name for n in needs_grad(traced)),
                      sections={"tp": TpDecisions(axis="tp", choice=_choice(prog))})  # fmt: skip
    once = propagate_layout(gm, ctx)
    count = sum(1 for n in once.graph.nodes if n.target is redistribute)
    twice = propagate_layout(once, ctx)
    twice.graph.lint()
    assert sum(1 for n in twice.graph.nodes if n.target is redistribute) == count > 0


def _choice(prog):
    from autopar.planner.tp import PlanOptions, solve_axis

    mesh = prog.mesh
    sol = solve_axis(prog.traced, "tp", 2, mesh.cluster.axis_link(mesh.axes, "tp"),
                     mesh.cluster.gpu, PlanOptions())  # fmt: skip
    return sol.choice
