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


def test_replicated_kv_projection_reduces_only_its_weight_gradients():
    """Multi-query attention with the key/value projections replicated (REFERENCE: g < t) and
    the query heads split: the partial K/V gradients pass through the rotary embedding and the
    projection to the weight (an off-critical-path reduction) and to the projection input
    (merged into Megatron's f); no K/V activation is reduced.  Exact vs one device."""
    import dataclasses

    import torch

    from autopar import Mesh, autoparallelize
    from autopar.testing import Config, build, lm_loss, tokens
    from autopar.verify import verify

    c = Config(kv_heads=1, heads=8, bias=False)
    torch.manual_seed(0)
    model = build("llama", c)
    prog = autoparallelize(model, Mesh(tp=2), tokens(c), loss_fn=lm_loss)
    pins = []
    for n in prog.traced.gm.graph.nodes:
        fqn = prog.traced.params.get(n.name, "")
        if fqn.endswith(("wk.weight", "wv.weight")):
            pins += [(n.name, "()->R")] + [(u.name, "(R,R)->R") for u in n.users]
        if fqn.endswith("wq.weight"):
            pins += [(n.name, "()->S(0)")] + [(u.name, "(R,S(0))->S(2)") for u in n.users]
        if "scaled_dot_product" in str(n.target):
            pins.append((n.name, "(S(1),R,R)->S(1) [replicated_kv_heads]"))
    plan = dataclasses.replace(prog.plan, choice=tuple(pins))
    pinned = autoparallelize(model, Mesh(tp=2), tokens(c), loss_fn=lm_loss, plan=plan)
    d = c.hidden // c.heads
    shapes = [(x.direction, x.kind, x.shape) for x in pinned.collectives()]
    assert shapes.count(("bwd", "all_reduce", (d, c.hidden))) == 2 * c.layers  # wk, wv grads
    assert not [s for s in shapes if d in s[2][-1:] and s[2] != (d, c.hidden)]  # no K/V acts
    report = verify(model, Mesh(tp=2), tokens(c), loss_fn=lm_loss, plan=plan)
    assert report.ok and report.max_rel_error < 1e-5, report
