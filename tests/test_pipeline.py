"""Pipeline parallelism: exact stage balance, per-stage programs, schedules, equivalence."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar import InputError, Mesh, PlanError, autoparallelize, verify
from autopar.axes.pipeline import balanced_cuts, sent_placements, unit_costs
from autopar.frontend.trace import trace
from autopar.ir import meta
from autopar.tools.testing import Config, build, lm_loss, tokens
from passes.pipeline_split import cuttable_units


def brute_force(costs, boundary, stages, pinned=()):
    n, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        if not set(pinned) <= set(cuts):
            continue
        bounds = [0, *cuts, n]
        worst = max(sum(costs[a:b]) + (boundary[b] if b < n else 0.0)
                    for a, b in itertools.pairwise(bounds))  # fmt: skip
        best = min(best, worst)
    return best


@settings(max_examples=60)
@given(
    st.lists(st.floats(0.0, 10.0), min_size=2, max_size=8),
    st.data(),
)
def test_balanced_cuts_equal_brute_force(costs, data):
    n = len(costs)
    boundary = data.draw(st.lists(st.floats(0.0, 3.0), min_size=n + 1, max_size=n + 1))
    stages = data.draw(st.integers(1, n))
    pinned = (
        data.draw(st.lists(st.integers(1, n - 1), max_size=stages - 1, unique=True))
        if n > 1
        else []
    )
    cuts, value = balanced_cuts(costs, boundary, stages, pinned)
    assert len(cuts) == stages - 1 and set(pinned) <= set(cuts)
    assert value == pytest.approx(brute_force(costs, boundary, stages, pinned))


@settings(max_examples=150)
@given(st.integers(1, 24), st.data())
def test_the_searchs_banded_cut_is_the_exact_cut(n, data):
    """`cost.stages._fast_cuts` (the search's one-boundary cut, each DP row on the band of
    ends a partition can reach) returns `balanced_cuts`'s cuts, ties included: blocks of one
    cost between two end units, or any costs."""
    from cost.stages import _fast_cuts

    if data.draw(st.booleans()):
        layer = data.draw(st.sampled_from([1.0, 0.5, 2.5]))
        ends = data.draw(st.lists(st.sampled_from([0.0, 0.1, layer, 3.0]), min_size=2,
                                  max_size=2))  # fmt: skip
        costs = [ends[0], *([layer] * n), ends[1]]
    else:
        costs = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.5]) | st.floats(0, 4),
                                   min_size=n, max_size=n))  # fmt: skip
    boundary = data.draw(st.sampled_from([0.0, 0.1]) | st.floats(0.0, 2.0))
    stages = data.draw(st.integers(1, len(costs)))
    cuts, _ = balanced_cuts(costs, [boundary] * (len(costs) + 1), stages)
    assert _fast_cuts(costs, boundary, stages) == cuts


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_unequal_blocks_cut_at_the_brute_force_optimum(pp):
    # a 16k-row vocabulary makes the embedding and LM-head units far heavier than a block
    c = Config(layers=4, hidden=256, heads=4, kv_heads=4, ffn=512, vocab=16384, seq=128, batch=4)
    with torch.device("meta"):
        model = build("gpt", c)
    mesh = Mesh(pp=pp, tp=1)
    prog = autoparallelize(model, mesh, tokens(c), loss_fn=lm_loss, n_microbatches=4)
    traced = trace(model, tuple(t[:1] for t in tokens(c)), loss_fn=lm_loss)
    units = cuttable_units(traced)
    costs, boundary, _ = unit_costs(traced, units, mesh)
    assert prog.pipeline.cut.slowest_s == pytest.approx(brute_force(costs, boundary, pp))
    names = [u.name for u in units]
    assert names[0] == "prologue" and names[-1] == "epilogue" and "blocks.2" in names


def test_cuts_fall_between_blocks_and_pinned_cuts_are_kept():
    c = Config(layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=64, seq=16, batch=8)
    prog = autoparallelize(build("llama", c), Mesh(pp=2, tp=1), tokens(c), loss_fn=lm_loss,
                           n_microbatches=4, split_points=["layers.1"])  # fmt: skip
    assert [prog.pipeline.cut.units[i] for i in prog.pipeline.cut.cuts] == ["layers.1"]
    assert all(
        name in ("prologue", "epilogue") or name.startswith("layers.") for name in prog.pipeline.cut.units
    )


def test_virtual_mesh_prints_the_schedule_timeline():
    c = Config(layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=64, seq=16, batch=8)
    prog = autoparallelize(build("llama", c), Mesh(pp=4, tp=1), tokens(c), loss_fn=lm_loss,
                           n_microbatches=8, schedule="gpipe")  # fmt: skip
    text = str(prog.train_step(lambda params: torch.optim.SGD(params, lr=0.1)))
    rows = [line for line in text.splitlines() if line.startswith("rank ")]
    assert len(rows) == 4 and set("".join(r[8:] for r in rows)) == {"F", "B", "."}
    assert "bubble: 27.3%" in text  # (p-1)/(m+p-1) = 3/11
    with pytest.raises(RuntimeError, match="virtual Mesh has no processes"):
        prog.train_step(lambda params: None)(torch.zeros(1))


@st.composite
def pipeline_cases(draw):
    pp = draw(st.sampled_from([2, 4]))
    tp = draw(st.sampled_from([1, 2]))
    schedules = ["gpipe", "1f1b", "interleaved"] + (["zero_bubble"] if tp == 1 else [])
    schedule = draw(st.sampled_from(schedules))
    v = 2 if schedule in ("interleaved", "zero_bubble") else 1
    layers = draw(st.integers(max(1, pp * v - 2), pp * v))
    m = pp * draw(st.sampled_from([1, 2])) if schedule != "gpipe" else draw(st.sampled_from([2, 4]))
    kind = draw(st.sampled_from(["gpt", "llama"]))
    heads = 2 * tp
    c = Config(layers=layers, hidden=heads * 8, heads=heads, kv_heads=heads if kind == "gpt" else tp,
               ffn=heads * 16, vocab=draw(st.sampled_from([32, 48])), seq=8, batch=m * draw(st.integers(1, 2)),
               bias=draw(st.booleans()), tied=draw(st.booleans()))  # fmt: skip
    return kind, c, pp, tp, schedule, m


@settings(max_examples=10)
@given(pipeline_cases())
def test_pipelined_programs_match_single_device(case):
    kind, c, pp, tp, schedule, m = case
    report = verify(build(kind, c), Mesh(pp=pp, tp=tp), tokens(c), loss_fn=lm_loss,
                    n_microbatches=m, schedule=schedule)  # fmt: skip
    assert report.ok, f"{case}\n{report}"


def test_hf_llama_pp2_tp2_matches_single_device():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    ids, labels = (torch.randint(0, 128, (8, 16), generator=g) for _ in range(2))
    report = verify(
        model, Mesh(pp=2, tp=2), (ids,), example_kwargs={"labels": labels}, n_microbatches=4
    )
    assert report.ok, str(report)


def _llama(layers: int = 2):
    c = Config(layers=layers, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=64, seq=16, batch=8)
    return build("llama", c), tokens(c)


def test_more_stages_than_cuttable_blocks_is_an_error():
    model, batch = _llama(layers=2)
    with pytest.raises(PlanError, match=r"8 pipeline stages but Llama has only 4 cuttable units"):
        autoparallelize(model, Mesh(pp=8, tp=1), batch, loss_fn=lm_loss, n_microbatches=8)


def test_pinned_cut_at_unknown_module_is_an_error():
    model, batch = _llama()
    with pytest.raises(
        PlanError, match=r"split point 'layers.9' is not a cuttable module.*layers.1"
    ):
        autoparallelize(model, Mesh(pp=2, tp=1), batch, loss_fn=lm_loss, n_microbatches=4,
                        split_points=["layers.9"])  # fmt: skip


def test_microbatch_count_must_divide_the_batch():
    model, batch = _llama()
    with pytest.raises(InputError, match=r"n_microbatches=3 does not divide the batch.*8"):
        autoparallelize(model, Mesh(pp=2, tp=1), batch, loss_fn=lm_loss, n_microbatches=3)


def test_one_f_one_b_needs_as_many_microbatches_as_ranks():
    model, batch = _llama(layers=4)
    with pytest.raises(InputError, match=r"1f1b schedule needs at least as many micro-batches"):
        autoparallelize(model, Mesh(pp=4, tp=1), batch, loss_fn=lm_loss, n_microbatches=2)


def test_zero_bubble_with_tensor_parallelism_is_refused_not_hung():
    model, batch = _llama(layers=4)
    with pytest.raises(InputError, match=r"zero_bubble schedule .* use schedule='interleaved'"):
        autoparallelize(model, Mesh(pp=2, tp=2), batch, loss_fn=lm_loss, n_microbatches=4,
                        schedule="zero_bubble")  # fmt: skip


def test_model_without_scalar_loss_is_an_error():
    model, batch = _llama()
    with pytest.raises(InputError, match="needs Llama .* to return one scalar loss"):
        autoparallelize(model, Mesh(pp=2, tp=1), batch[:1], n_microbatches=4)


def test_stage_prices_follow_the_autocast_dtype():
    """Under param_dtype=bf16 a unit's price is that of its nodes in the dtype they run in
    (matrix products at the bf16 peak), so the cut and its printed ms/micro-batch describe the
    bf16 run, not the fp32 trace: the slowest stage is several times cheaper than in fp32."""
    from autopar.frontend.precision import annotate_autocast

    c = Config(layers=4, hidden=1024, heads=8, kv_heads=8, ffn=4096, vocab=8192, seq=512, batch=4)
    with torch.device("meta"):
        model = build("gpt", c)
    mesh = Mesh(pp=2, tp=1)
    kw = {"loss_fn": lm_loss, "n_microbatches": 2}
    fp32 = autoparallelize(model, mesh, tokens(c), **kw)
    bf16 = autoparallelize(model, mesh, tokens(c), **kw, param_dtype=torch.bfloat16,
                           mixed_precision="autocast")
    assert bf16.pipeline.cut.slowest_s < fp32.pipeline.cut.slowest_s / 4
    traced = trace(model, tuple(t[:2] for t in tokens(c)), loss_fn=lm_loss)
    annotate_autocast(traced.gm, torch.bfloat16)
    units = cuttable_units(traced)
    costs, boundary, _ = unit_costs(traced, units, mesh, torch.bfloat16)
    assert bf16.pipeline.cut.slowest_s == pytest.approx(brute_force(costs, boundary, 2))


def test_memory_limit_reaches_the_stage_cuts():
    """``memory_limit`` bounds each pipeline stage (parameters with Adam state + in-flight
    activations), not only the GPU's memory: a limit no 2-stage cut fits is a PlanError that
    says what a stage must hold and what to change; one every cut fits keeps the default cut."""
    c = Config(layers=4, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=96, seq=16, batch=4)
    kw = {"loss_fn": lm_loss, "n_microbatches": 2}
    free = autoparallelize(build("llama", c), Mesh(pp=2), tokens(c), **kw)
    roomy = autoparallelize(build("llama", c), Mesh(pp=2), tokens(c), **kw, memory_limit=1e9)
    assert roomy.pipeline.cut.cuts == free.pipeline.cut.cuts
    with pytest.raises(PlanError, match=r"no split of \d+ units into 2 stages fits.*"
                                        r"within 0\.00 GiB per GPU \(memory_limit\)"):  # fmt: skip
        autoparallelize(build("llama", c), Mesh(pp=2), tokens(c), **kw, memory_limit=1e5)


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_sequence_parallel_stages_send_their_shard_and_match_single_device(kind):
    """Megatron-SP inside the stages (steered by the memory price): each boundary value
    leaves a stage in the layout its plan produced it in, so a sequence-split residual stream
    is sent as each rank's [b, s/t, h] shard, arrives in that layout, and the loss and every
    gradient still match one device."""
    c = Config(layers=4, hidden=64, heads=4, kv_heads=2 if kind == "llama" else 4, ffn=128,
               vocab=64, seq=16, batch=8)  # fmt: skip
    model, inputs = build(kind, c), tokens(c)
    prog = autoparallelize(model, Mesh(pp=2, tp=2), inputs, lm_loss, n_microbatches=4,
                           memory_weight=1e-3)  # fmt: skip
    first, second = prog.stages[0].graph_module, prog.stages[1].graph_module
    sent = sent_placements(first, prog.pipeline.graphs[0])
    split = {n: p for n, p in sent.items() if p.startswith("S(")}
    assert split, sent  # the SP residual stream crosses split
    arrived = {n.name: str(meta.layout(n).placement("tp")) for n in second.graph.nodes
               if n.op == "placeholder" and n.name in split}  # fmt: skip
    assert arrived == split
    whole = sum(first_out.meta["val"].numel() for first_out in _sent_values(prog, 0))
    assert prog.pipeline.cut.boundary_bytes[0] < 4 * whole  # fp32 bytes of the local shards, not whole
    report = verify(model, Mesh(pp=2, tp=2), inputs, lm_loss, n_microbatches=4,
                    memory_weight=1e-3)  # fmt: skip
    assert report.ok, str(report)


def _sent_values(prog, stage: int) -> list:
    """The global values stage ``stage`` sends (the traced stage graph's outputs)."""
    out = next(n for n in prog.pipeline.graphs[stage].traced.gm.graph.nodes if n.op == "output")
    return [a for a in torch.utils._pytree.tree_leaves(out.args[0])]
