"""A saved plan is honoured on every mesh, or refused naming what differs (autopar.plan).

Each round trip compiles under options that change the solution, saves the program, reloads
plan.json and compiles again without those options: the reloaded program's collectives,
parameter layouts and every axis's decisions must be the saved ones (and differ from what
the same mesh solves by default, so the reload cannot pass by re-solving).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import pytest

from autopar import Mesh, autoparallelize
from autopar.errors import InputError, MeshError, PlanError
from autopar.plan import Plan
from autopar.tools.testing import Config, MoEConfig, build, build_moe, lm_loss, tokens

pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

LLAMA = Config(batch=4)
PIPE = Config(batch=4, layers=4)
MOE = MoEConfig()

# mesh, model, its config, options that change the solution, the section they change
CASES: dict[str, tuple[Mesh, Callable[[], Any], Any, dict[str, Any], str]] = {
    "dp": (Mesh(dp=2, tp=2), lambda: build("llama", LLAMA), LLAMA,
           {"memory_limit": 9.5e5}, "dp"),
    "pp": (Mesh(pp=2, tp=2), lambda: build("llama", PIPE), PIPE,
           {"split_points": ["layers.1"], "n_microbatches": 2, "schedule": "gpipe"}, "pp"),
    "ep": (Mesh(ep=2, tp=2), lambda: build_moe(MOE), MOE,
           {"capacity_factor": 1.5, "memory_limit": 2.4e5}, "ep"),
    "cp": (Mesh(cp=2, tp=2), lambda: build("llama", LLAMA), LLAMA,
           {"cp_attention": "all_to_all", "recompute": "full"}, "cp"),
}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoundTrip:
    default: Plan  # the mesh's plan without options
    made: Plan  # under the options
    saved: Plan  # plan.json, loaded
    reloaded: Plan  # compiled from ``saved`` without the options


_TRIPS: dict[str, RoundTrip] = {}


def round_trip(kind: str, tmp_path_factory: pytest.TempPathFactory) -> RoundTrip:
    """Compile by default and under the options, save, reload without them (once per kind)."""
    if kind not in _TRIPS:
        mesh, model, config, options, _ = CASES[kind]
        default = autoparallelize(model(), mesh, tokens(config), lm_loss)
        prog = autoparallelize(model(), mesh, tokens(config), lm_loss, **options)
        directory = tmp_path_factory.mktemp(kind)
        prog.save(directory)
        saved = Plan.load(directory / "plan.json")
        again = autoparallelize(model(), mesh, tokens(config), lm_loss, plan=saved)
        _TRIPS[kind] = RoundTrip(default=default.plan, made=prog.plan,
                                 saved=saved, reloaded=again.plan)  # fmt: skip
    return _TRIPS[kind]


@pytest.mark.parametrize("kind", list(CASES))
def test_reloaded_program_is_the_saved_plan(kind, tmp_path_factory):
    trip = round_trip(kind, tmp_path_factory)
    section = CASES[kind][4]
    assert trip.saved == trip.made  # plan.json holds every axis's decisions
    assert isinstance(trip.made, Plan) and str(trip.saved) == str(trip.made)  # one Plan, any mesh
    assert trip.saved.mesh == CASES[kind][0].axes and getattr(trip.saved, section) is not None
    assert trip.default.differences(trip.saved)  # the options changed the solution
    assert trip.reloaded.collectives == trip.saved.collectives
    assert trip.reloaded.params == trip.saved.params
    assert trip.reloaded.differences(trip.saved) == []


def test_each_mesh_changes_what_its_options_decide(tmp_path_factory):
    """What each round trip carries back: the ZeRO stage the limit forced, the pinned cut and
    schedule, the capacity factor with sequence parallelism, the attention and recompute."""
    dp, pp, ep, cp = (round_trip(k, tmp_path_factory) for k in ("dp", "pp", "ep", "cp"))
    assert dp.saved.dp.zero > dp.default.dp.zero
    assert len(dp.saved.collectives) != len(dp.default.collectives)
    assert pp.saved.pp.stage_starts == ("layers.1",) != pp.default.pp.stage_starts
    assert (pp.saved.pp.schedule, pp.saved.pp.n_microbatches) == ("gpipe", 2)
    assert [s.choice for s in pp.saved.stages] == [s.choice for s in pp.reloaded.stages]
    assert ep.saved.ep.capacity_factor == 1.5 and ep.default.ep.capacity_factor is None
    assert ep.saved.params != ep.default.params  # the tp layouts the limit chose
    assert {c for _, c in cp.saved.cp.attention} == {"all_to_all"} != {
        c for _, c in cp.default.cp.attention}  # fmt: skip
    assert cp.saved.recompute == "full" and cp.saved.choice == cp.default.choice != ()


def test_an_option_contradicting_the_plan_names_both(tmp_path_factory):
    dp = round_trip("dp", tmp_path_factory)
    mesh, model, config, _, _ = CASES["dp"]
    other = (dp.saved.dp.zero + 1) % 4
    with pytest.raises(PlanError, match=rf"zero={other} contradicts the plan, which has "
                                        rf"zero={dp.saved.dp.zero}"):  # fmt: skip
        autoparallelize(model(), mesh, tokens(config), lm_loss, plan=dp.saved, zero=other)
    cp = round_trip("cp", tmp_path_factory)
    mesh, model, config, _, _ = CASES["cp"]
    with pytest.raises(PlanError, match=r"cp_attention='ring' contradicts the plan, which has "
                                        r"scaled_dot_product_attention=all_to_all"):  # fmt: skip
        autoparallelize(model(), mesh, tokens(config), lm_loss, plan=cp.saved,
                        cp_attention="ring")  # fmt: skip


def test_a_plan_for_another_mesh_or_without_its_section_is_refused(tmp_path_factory):
    dp = round_trip("dp", tmp_path_factory)
    _, model, config, _, _ = CASES["dp"]
    with pytest.raises(MeshError, match=r"made for Mesh\{'dp': 2, 'tp': 2\} but the mesh is "
                                        r"Mesh\(dp=4\)"):  # fmt: skip
        autoparallelize(model(), Mesh(dp=4), tokens(config), lm_loss, plan=dp.saved)
    with pytest.raises(PlanError, match="has no dp section"):
        autoparallelize(model(), Mesh(dp=2, tp=2), tokens(config), lm_loss,
                        plan=dataclasses.replace(dp.saved, dp=None))  # fmt: skip


def test_a_plan_for_another_model_names_the_nodes(tmp_path_factory):
    cp = round_trip("cp", tmp_path_factory)
    gpt = Config(batch=4)
    with pytest.raises(PlanError, match=r"the plan does not fit GPT: it decides nodes the "
                                        r"model does not have \('"):  # fmt: skip
        autoparallelize(build("gpt", gpt), Mesh(cp=2, tp=2), tokens(gpt), lm_loss,
                        plan=cp.saved)  # fmt: skip


def test_a_pipeline_plan_whose_cut_the_model_lacks_is_refused(tmp_path_factory):
    pp = round_trip("pp", tmp_path_factory)
    mesh, model, config, _, _ = CASES["pp"]
    edited = dataclasses.replace(pp.saved, pp=dataclasses.replace(pp.saved.pp,
                                                                  stage_starts=("layers.9",)))  # fmt: skip
    with pytest.raises(PlanError, match=r"starts stages at layers\.9, which Llama has no "
                                        r"cuttable unit"):  # fmt: skip
        autoparallelize(model(), mesh, tokens(config), lm_loss, plan=edited)


def test_expert_layers_that_differ_from_the_plan_are_named(tmp_path_factory):
    ep = round_trip("ep", tmp_path_factory)
    mesh, model, config, _, _ = CASES["ep"]
    layers = tuple((where, experts * 2) for where, experts in ep.saved.ep.layers)
    edited = dataclasses.replace(ep.saved, ep=dataclasses.replace(ep.saved.ep, layers=layers))
    with pytest.raises(PlanError, match=r"\(saved vs compiled\): ep: EpSection\("):
        autoparallelize(model(), mesh, tokens(config), lm_loss, plan=edited)


def test_a_wrapper_programs_plan_is_reused_directly(tmp_path_factory):
    """``plan=prog.plan`` of a dp program is reused as it is; anything but a Plan is refused."""
    mesh, model, config, options, _ = CASES["dp"]
    prog = autoparallelize(model(), mesh, tokens(config), lm_loss, zero=2)
    again = autoparallelize(model(), mesh, tokens(config), lm_loss, plan=prog.plan)
    assert again.plan.dp.zero == 2 and again.plan == prog.plan
    with pytest.raises(InputError, match="plan= takes an autopar Plan"):
        autoparallelize(model(), mesh, tokens(config), lm_loss, plan=prog.plan.to_json())
