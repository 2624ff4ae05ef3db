"""Mesh.auto's plan cache (autopar.planner.cache): a second search of the same model, shapes and
cluster shape reads its candidates' prices back (no sub-mesh compile, no slice trace, no trace
of the whole example, no ILP in the final compile) and chooses the same plan; a namespace
found by the model's key whose traces differ is not used; a changed input shape is another namespace; a damaged entry is
recomputed with a warning; the JSON records carry every field of what they stand for."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from autopar import Mesh, autoparallelize
from autopar.plan import Collective
from autopar.planner import auto, tp
from autopar.planner import cache as plan_cache
from autopar.planner.solved import SolvedModel
from autopar.tools.testing import Config, build, lm_loss, tokens
from cost.graph import GraphModel
from cost.hardware import Cluster

NODE = dataclasses.replace(Cluster.preset("dgx-h100", nodes=1), gpus_per_node=4)


def _auto(c: Config, folder):  # noqa: ANN001, ANN202
    model, inputs = build("llama", c), tokens(c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autoparallelize(model, Mesh.auto(NODE), inputs, lm_loss, plan_cache=folder)


def _fingerprint(prog) -> tuple:  # noqa: ANN001
    return (str(prog.search.mesh), str(prog.plan),
            [(str(a.config), a.step_time_s, b.step_time_s) for a, b in prog.search.candidates])  # fmt: skip


def test_a_second_search_reads_the_prices_back_and_plans_the_same(tmp_path, monkeypatch):
    c = Config(batch=8)
    cold = _auto(c, None)
    filled = _auto(c, tmp_path)
    assert _fingerprint(filled) == _fingerprint(cold)
    (space,) = [p for p in tmp_path.iterdir() if p.name not in ("solve", "models")]
    written = sorted(p.name for p in space.iterdir())
    assert "graph_traced.json" in written and any(n.startswith("solved_tp") for n in written)

    def no_solve(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a cached degree was compiled again")

    def no_retrace(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a cached slice was traced again")

    def no_ilp(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the chosen configuration's tp ILP was solved again")

    monkeypatch.setattr(SolvedModel, "_solve", no_solve)
    monkeypatch.setattr(SolvedModel, "_trace", no_retrace)
    def no_whole(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        return lambda: pytest.fail("the whole example was traced again")

    monkeypatch.setattr(tp, "_solve", no_ilp)
    monkeypatch.setattr(auto, "_first_trace", no_whole)
    warm = _auto(c, tmp_path)
    assert _fingerprint(warm) == _fingerprint(cold)
    assert str(warm.plan) == str(cold.plan)
    monkeypatch.undo()

    # a damaged entry warns, is recomputed and rewritten; the plan is unchanged
    entry = sorted(space.glob("solved_tp*.json"))[0]
    entry.write_text('{"model": {"name": 1}')
    with pytest.warns(UserWarning, match=f"plan cache .*{entry.name}: not JSON"):
        model, inputs = build("llama", c), tokens(c)
        again = autoparallelize(model, Mesh.auto(NODE), inputs, lm_loss, plan_cache=tmp_path)
    assert _fingerprint(again) == _fingerprint(cold)
    json.loads(entry.read_text())  # rewritten whole


def test_the_namespace_follows_the_graph_shapes_dtype_and_cluster_shape(tmp_path) -> None:
    from autopar.frontend.trace import trace

    def space(c: Config, cluster: Cluster = NODE, dtype: torch.dtype = torch.float32) -> str:
        traced = trace(build("llama", c), tokens(c), None, lm_loss)
        return plan_cache.PlanCache(tmp_path, traced, cluster, dtype).folder.name

    base = space(Config(batch=8))
    assert space(Config(batch=8)) == base
    assert space(Config(batch=8), dataclasses.replace(NODE, nodes=3)) == base  # any node count
    assert space(Config(batch=8, seq=32)) != base
    assert space(Config(batch=4)) != base
    assert space(Config(batch=8, ffn=256)) != base
    assert space(Config(batch=8), dtype=torch.bfloat16) != base
    assert space(Config(batch=8), Cluster.preset("dgx-a100", nodes=1)) != base


def test_records_carry_every_field() -> None:
    graph_fields = set(plan_cache._GRAPH_SCALARS) | {"arrays", *plan_cache._GRAPH_DICTS}
    assert graph_fields == {f.name for f in dataclasses.fields(GraphModel)}
    assert set(plan_cache._COLLECTIVE) | {"shape", "regather"} == {
        f.name for f in dataclasses.fields(Collective)}  # the bool is read apart (no bool is an int)
    with pytest.raises(TypeError, match="layers: str"):
        plan_cache._graph_from({"name": "m", "layers": "2", "heads": 1, "kv_heads": 1, "seq": 1,
                                "batch": 1, "experts": 1, "arrays": {}, "params": {},
                                "saved": {}, "comm": {}})  # fmt: skip
    c = Collective(kind="all_reduce", axis="tp", shape=(4, 8), dtype="torch.float32", bytes=128,
                   direction="fwd", where="layers.0.mlp")  # fmt: skip
    g = GraphModel(name="m", layers=2, heads=4, kv_heads=2, seq=16, batch=8,
                   arrays={"flops": torch.arange(3.0).numpy() / 3}, params={"block": 1.5},
                   saved={"inner": 2.0}, comm={"tp_calls": 1 / 3})  # fmt: skip
    back, colls, ring = plan_cache._solved_from(
        json.loads(json.dumps(plan_cache._solved_to(g, (c,), {"fwd": 0.1}))))
    assert colls == (c,) and ring == {"fwd": 0.1}
    assert (back.arrays["flops"] == g.arrays["flops"]).all() and back.comm == g.comm
    assert {f.name: getattr(back, f.name) for f in dataclasses.fields(g) if f.name != "arrays"} \
        == {f.name: getattr(g, f.name) for f in dataclasses.fields(g) if f.name != "arrays"}


def test_a_refusal_is_read_back_for_the_same_mesh_and_options(tmp_path) -> None:
    from types import SimpleNamespace

    from autopar.frontend.trace import trace
    from autopar.options import make_options
    from cost.config import ParallelConfig

    c = Config(batch=8)
    cache = plan_cache.PlanCache(tmp_path, trace(build("llama", c), tokens(c), None, lm_loss),
                                 NODE, torch.float32)  # fmt: skip
    choice = SimpleNamespace(config=ParallelConfig(tp=2, dp=2, global_batch=8),
                             order=("dp", "tp"), micro_batches=1)  # fmt: skip
    options, mesh = make_options(), Mesh.ordered((("dp", 2), ("tp", 2)), NODE)
    assert cache.refusal(mesh, choice, options) is None
    cache.put_refusal(mesh, choice, options, "PlanError: no")
    assert cache.refusal(mesh, choice, options) == "PlanError: no"
    assert cache.refusal(Mesh.ordered((("tp", 2), ("dp", 2)), NODE), choice, options) is None
    assert cache.refusal(mesh, choice, options.replace(zero=3)) is None
    assert cache.refusal(mesh, choice, options.replace(plan_cache=tmp_path)) == "PlanError: no"


def test_a_solve_is_read_back_checked_and_one_that_warned_is_not_kept(tmp_path, monkeypatch):
    from autopar.frontend.trace import trace

    c = Config(batch=8)
    traced = trace(build("llama", c), tokens(c), None, lm_loss)
    link, gpu = NODE.axis_link((("tp", 2),), "tp"), NODE.gpu
    cached = tp.PlanOptions(solve_cache=tmp_path)
    cold = tp.solve_axis(traced, "tp", 2, link, gpu, tp.PlanOptions())
    assert tp.solve_axis(traced, "tp", 2, link, gpu, cached) == cold  # solved and written
    (entry,) = (tmp_path / "solve").iterdir()
    real = tp._solve
    monkeypatch.setattr(tp, "_solve", lambda *a, **k: pytest.fail("solved again"))
    assert tp.solve_axis(traced, "tp", 2, link, gpu, cached) == cold  # every field read back
    assert tp.solve_axis(traced, "tp", 2, link, gpu, cached).choice == cold.choice
    data = json.loads(entry.read_text())
    size = data["nodes"]
    monkeypatch.setattr(tp, "_solve", real)
    for damage, why in ((lambda d: d["choice"].append([size, *d["choice"][0][1:]]), "does not have"),
                        (lambda d: d["choice"].append(d["choice"][0]), "decided twice"),
                        (lambda d: d["choice"][0].__setitem__(1, "call_function:aten.foo"), "in this graph"),
                        (lambda d: d.__setitem__("nodes", size + 1), "this one has")):  # fmt: skip
        damaged = json.loads(json.dumps(data))
        damage(damaged)
        entry.write_text(json.dumps(damaged))
        with pytest.warns(UserWarning, match=f"plan cache .*{why}"):
            assert tp.solve_axis(traced, "tp", 2, link, gpu, cached) == cold  # recomputed
        assert json.loads(entry.read_text()) == data  # and rewritten

    # another question (size, options) is another entry; a solve that warned is not kept
    def warned(*a, **k):  # noqa: ANN002, ANN003, ANN202
        warnings.warn("no sharding rule for aten.foo", UserWarning, stacklevel=1)
        return real(*a, **k)

    monkeypatch.setattr(tp, "_solve", warned)
    for _ in range(2):  # shown each time: never read back silently
        with pytest.warns(UserWarning, match="no sharding rule for aten.foo"):
            tp.solve_axis(traced, "tp", 4, link, gpu, cached)
    assert len(list((tmp_path / "solve").iterdir())) == 1


def test_a_namespace_whose_traces_differ_is_planned_again(tmp_path) -> None:
    """The model key names a namespace (a guess without tracing); when the run's own traces
    hash otherwise than that namespace recorded, the plan is made again from the real trace."""
    c = Config(batch=8)
    cold = _auto(c, tmp_path)
    (key,) = (tmp_path / "models").iterdir()
    space = tmp_path / json.loads(key.read_text())["namespace"]
    other = tmp_path / ("0" * 32)  # as if another model's graph had the same key
    other.mkdir()
    for entry in space.iterdir():
        text = '"a different graph"' if entry.name.startswith("trace_") else entry.read_text()
        (other / entry.name).write_text(text)
    key.write_text(json.dumps({"namespace": other.name}))
    with pytest.warns(UserWarning, match="traces differently .* planning again"):
        model, inputs = build("llama", c), tokens(c)
        again = autoparallelize(model, Mesh.auto(NODE), inputs, lm_loss, plan_cache=tmp_path)
    assert _fingerprint(again) == _fingerprint(cold)
    assert json.loads(key.read_text())["namespace"] == space.name  # the key names the real one


def test_stages_that_differ_only_in_names_and_layers_share_one_answer(tmp_path, monkeypatch):
    """Two pipeline stages of one identical block each (layers 1 and 2: other node names,
    parameter names, layer numbers) ask one question: the second is read back from the first's
    entry (the ILP raises), mapped onto its own names, equal to its own fresh solve."""
    from autopar.axes.pipeline import loss_output
    from autopar.frontend.trace import trace
    from passes.pipeline_split import cuttable_units, split_stages

    c = Config(layers=4, batch=8)
    traced = trace(build("llama", c), tokens(c), None, lm_loss)
    units = cuttable_units(traced)
    assert [u.name for u in units[2:4]] == ["layers.1", "layers.2"]
    graphs = split_stages(traced, units, [2, 3, 4], loss_output(traced))
    one, two = graphs[1].traced, graphs[2].traced
    assert [n.name for n in one.gm.graph.nodes] != [n.name for n in two.gm.graph.nodes]
    assert set(one.params.values()).isdisjoint(two.params.values())  # layers.1.* / layers.2.*
    link, gpu = NODE.axis_link((("tp", 2),), "tp"), NODE.gpu
    fresh = tp.solve_axis(two, "tp", 2, link, gpu, tp.PlanOptions())
    cached = tp.PlanOptions(solve_cache=tmp_path)
    tp.solve_axis(one, "tp", 2, link, gpu, cached)
    assert len(list((tmp_path / "solve").iterdir())) == 1
    monkeypatch.setattr(tp, "_solve", lambda *a, **k: pytest.fail("solved again"))
    shared = tp.solve_axis(two, "tp", 2, link, gpu, cached)
    assert shared == fresh and set(shared.choice) <= {n.name for n in two.gm.graph.nodes}
    assert len(list((tmp_path / "solve").iterdir())) == 1
