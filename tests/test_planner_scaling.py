"""Planning stays linear in depth (issue 19): deterministic counts, no clocks.

A solve computes each node's tensor arguments once (``trace.tensor_args`` calls from the
planner <= graph nodes), and the walks that pricing asks for per edge (the replicated region
above a value, a deferred reduction, a gather chain) grow by the same amount per added
identical layer.  Before the walks were memoised, an 8B-shaped HF Llama made 2.1 million
``tensor_args`` calls for 2,244 nodes.
"""

from __future__ import annotations

import pytest
import torch

from autopar import Mesh
from autopar.frontend.trace import Traced, trace
from autopar.planner import tp as planner
from autopar.planner.tp import PlanOptions, solve_axis
from autopar.tools.testing import Config, build, hf_tiny_llama, lm_loss, token_batch, tokens

DEPTHS = (2, 3, 4)


def traced_model(kind: str, layers: int) -> Traced:
    if kind == "hf_llama":
        pytest.importorskip("transformers")
        ids, labels = token_batch(1, 16, 128)
        return trace(hf_tiny_llama(layers), (ids,), {"labels": labels})
    c = Config(layers=layers, bias=False)
    return trace(build(kind, c), tokens(c), loss_fn=lm_loss)


def counted_solve(monkeypatch: pytest.MonkeyPatch, traced: Traced, tp: int) -> dict[str, int]:
    """Solve ``traced`` on tp ranks, counting the planner's tensor_args calls and walk steps."""
    counts = {"tensor_args": 0, "walk_steps": 0}
    tensor_args, walk_args = planner.tensor_args, planner._Walks.args

    def counted_tensor_args(n):
        counts["tensor_args"] += 1
        return tensor_args(n)

    def counted_walk_args(self, n):
        counts["walk_steps"] += 1
        return walk_args(self, n)

    monkeypatch.setattr(planner, "tensor_args", counted_tensor_args)
    monkeypatch.setattr(planner._Walks, "args", counted_walk_args)
    mesh = Mesh(tp=2)
    solve_axis(traced, "tp", tp, mesh.cluster.axis_link(mesh.axes, "tp"), mesh.cluster.gpu,
               PlanOptions())  # fmt: skip
    monkeypatch.undo()
    return counts


@pytest.mark.parametrize(("kind", "tp"), [("llama", 2), ("llama", 1), ("gpt", 2), ("hf_llama", 2)])
def test_planner_walks_are_linear_in_depth(monkeypatch, kind, tp):
    rows = []
    for layers in DEPTHS:
        traced = traced_model(kind, layers)
        rows.append((len(traced.gm.graph.nodes), counted_solve(monkeypatch, traced, tp)))
    for nodes, counts in rows:
        assert counts["tensor_args"] <= nodes  # each node's arguments are found once
    steps = [counts["walk_steps"] for _, counts in rows]
    assert steps[2] - steps[1] == steps[1] - steps[0] > 0  # one more layer, the same walks


def test_pricing_a_sub_mesh_generates_no_python_code(monkeypatch):
    """The search prices a tp / cp degree by compiling that sub-mesh's rank 0 program
    (`planner.solved`) and never runs it, so no graph's Python code is generated on the way
    (rank programs are lazy graph modules: code on first call); the rank program a user asks
    for (`prog.module(rank)`) has its code, and runs."""
    import torch.fx as fx

    from autopar.planner.solved import SolvedModel

    c = Config(layers=2, bias=False)
    model, inputs = build("llama", c), tokens(c)
    traced = trace(model, inputs, loss_fn=lm_loss)
    made = []
    python_code = fx.Graph.python_code
    monkeypatch.setattr(fx.Graph, "python_code",
                        lambda self, *a, **k: made.append(self) or python_code(self, *a, **k))  # fmt: skip
    priced = SolvedModel(traced, Mesh(tp=2).cluster, torch.float32)
    assert priced.solved(2) is not None and priced.solved(2, 2) is not None  # tp, and cp x tp
    assert made == []
    from autopar import autoparallelize

    prog = autoparallelize(model, Mesh(tp=2), inputs, loss_fn=lm_loss)
    module = prog.module(0)
    assert made and "def forward" in module.code
