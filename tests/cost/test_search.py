"""The whole-cluster search: exact against brute force, the practitioners' rules rediscovered,
published configurations ranked, bad input explained."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from autopar import Mesh, autoparallelize, verify
from autopar.planner.auto import parse_degrees, plan_shape
from autopar.tools.cli import main
from autopar.tools.testing import Config, build, lm_loss, tokens
from cost.config import RECOMPUTE, ParallelConfig, validate
from cost.errors import CostInputError
from cost.estimate import as_priced, price
from cost.hardware import Cluster
from cost.memory import RESERVED_BYTES
from cost.model import ModelShape
from cost.search import TIE_REL, SearchSpace, divisors, search, spans

SMALL = ModelShape.llama(name="small", layers=8, hidden=1024, heads=16, kv_heads=4, ffn=4096,
                         seq=2048, vocab=32000)  # fmt: skip
SMALL_MOE = ModelShape.llama(name="small-moe", layers=4, hidden=1024, heads=8, kv_heads=4,
                             ffn=2048, seq=1024, vocab=32000, experts=8, top_k=2)  # fmt: skip


def _times(result) -> list[float]:
    return [c.step_time_s for c in result.ranked]


@pytest.mark.parametrize(
    ("model", "cluster", "batch"),
    [
        (SMALL, Cluster.preset("dgx-h100", nodes=2), 32),
        (SMALL, Cluster.preset("dgx-h100", nodes=8), 64),
        # tight memory: most configurations do not fit, the bounds do the pruning
        (ModelShape.preset("llama3-8b").with_seq(4096), Cluster.preset("dgx-a100-40gb", nodes=1),
         16),
        (SMALL_MOE, Cluster.preset("dgx-h100", nodes=4), 64),
    ],
)  # fmt: skip
def test_pruned_search_is_the_brute_force_optimum(model, cluster, batch):
    pruned = search(model, cluster, batch, top=5)
    brute = search(model, cluster, batch, top=5, prune=False)
    assert brute.priced > 5 * pruned.priced  # the bounds did prune
    assert pruned.space == brute.space
    for a, b in zip(_times(pruned), _times(brute), strict=True):
        assert a == pytest.approx(b, rel=TIE_REL)


def test_search_agrees_with_pricing_every_config_through_estimate():
    """An independent brute force: every completion priced by `cost.estimate.price` (Megatron
    nesting, the two-level link model) — the search's optimum is its minimum."""
    model, cluster, batch = SMALL, Cluster.preset("dgx-h100", nodes=2), 16
    priced = as_priced(model)
    space = SearchSpace(nest=False, zero=(1, 3))
    best = None
    for tp, pp, cp in itertools.product(divisors(16), repeat=3):
        if 16 % (tp * pp * cp):
            continue
        dp = 16 // (tp * pp * cp)
        for sp, zero, r, b in itertools.product((True, False), (1, 3), RECOMPUTE, divisors(16)):
            per_stage = -(-model.layers // pp)
            settings = [("1f1b", 1)] + [("interleaved", v) for v in range(2, per_stage + 1)
                                        if pp > 1 and pp * v <= model.layers]  # fmt: skip
            for schedule, v in settings:
                if schedule == "interleaved" and (batch // (dp * b)) % pp:
                    continue  # micro-batches in groups of pp
                cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, zero=zero, global_batch=batch,
                                     micro_batch=b, schedule=schedule, virtual_stages=v,
                                     recompute=r, sequence_parallel=sp,
                                     tp_across_nodes=True)  # fmt: skip
                try:
                    validate(cfg, cluster, model.layers, model.heads, model.g, model.seq, 1)
                except CostInputError:
                    continue
                est = price(priced, cluster, cfg)
                if est.fits and (best is None or est.step_time_s < best.step_time_s):
                    best = est
    found = search(model, cluster, batch, space=space, top=1)
    assert found.best.step_time_s == pytest.approx(best.step_time_s, rel=TIE_REL)


@pytest.mark.parametrize("nest", [False, True])
def test_reprice_on_the_searched_model_is_the_search_itself(nest):
    """`reprice` (Mesh.auto prices its candidates again with the compiler's count) given the
    model the search priced gives every ranked choice back: the same step and memory, so a
    difference under `SolvedModel` is the compiler's count alone."""
    from cost.search import reprice
    from cost.topology import Topology

    cluster = Cluster.preset("dgx-h100", nodes=2)
    topology = Topology(cluster=cluster)
    found = search(SMALL_MOE, cluster, 64, space=SearchSpace(nest=nest), top=6,
                   collective=topology.collective)  # fmt: skip
    assert len(found.ranked) == 6
    for choice in found.ranked:
        again = reprice(choice, found.model, cluster, topology.collective)
        assert again.step == choice.step and again.memory == choice.memory
        assert again.config == choice.config and again.order == choice.order


def test_spans_follow_the_nesting():
    # Megatron order: tp innermost (contiguous), dp·cp next, pp outermost
    s = spans(("pp", "dp", "tp"), tp=8, pp=4, dp=2, cp=2, ep=1)
    assert s["tp"] == (1, 8) and s["cp"] == (8, 2) and s["dp"] == (8, 4) and s["pp"] == (32, 4)
    s = spans(("tp", "dp"), tp=2, pp=1, dp=8, cp=1, ep=4)
    assert s["tp"] == (8, 2) and s["dp"] == (1, 8) and s["ep"] == (1, 4)
    assert s["dp_expert"] == (4, 2)


# --- the practitioners' rules, rediscovered -------------------------------------------------


def _inside_node(cluster: Cluster, span: tuple[int, int]) -> bool:
    stride, size = span
    return size == 1 or cluster.gpus_per_node % (stride * size) == 0


def _best_spans(result):
    c = result.best.config
    return spans(result.best.order, c.tp, c.pp, c.dp, c.cp, c.ep)


def test_a_model_that_fits_one_gpu_gets_pure_data_parallelism():
    # Narayanan 2021's 1.7B GPT: weights, gradients and Adam state (31 GB) fit one A100
    model = ModelShape.gpt(name="gpt-1.7b", layers=24, hidden=2304, heads=24, seq=2048,
                           vocab=51200)  # fmt: skip
    result = search(model, Cluster.preset("dgx-a100", nodes=4), 512)
    c = result.best.config
    assert (c.tp, c.pp, c.cp, c.dp) == (1, 1, 1, 32)


@pytest.mark.parametrize(("model", "nodes", "batch"),
                         [("llama3-70b", 8, 256), ("llama3-405b", 64, 512),
                          ("gpt3-175b", 16, 256)])  # fmt: skip
def test_a_dense_model_that_does_not_fit_keeps_tp_inside_a_node_and_pp_across(model, nodes,
                                                                              batch):  # fmt: skip
    cluster = Cluster.preset("dgx-h100", nodes=nodes)
    result = search(model, cluster, batch, space=SearchSpace(zero=(0, 1)))
    c, s = result.best.config, _best_spans(result)
    assert c.tp * c.pp > 1  # it does not fit one GPU
    assert _inside_node(cluster, s["tp"])
    if c.pp > 1:
        assert s["pp"][0] % cluster.gpus_per_node == 0  # stages on different nodes
    # the runners-up too: a tp group that straddles nodes pays the fabric and never wins
    for choice in result.ranked[:5]:
        assert _inside_node(cluster, spans(choice.order, *choice.key)["tp"])
    # the smallest tp that fits: halving it (dp doubles) does not fit or is slower
    if c.tp > 1:
        half = ParallelConfig(tp=c.tp // 2, pp=c.pp, cp=c.cp, dp=c.dp * 2, global_batch=batch)
        try:
            smaller = plan_shape(model, cluster, batch, compare=half,
                                 space=SearchSpace(zero=(0, 1))).compare_rank()  # fmt: skip
        except CostInputError:
            smaller = None
        assert smaller is None or smaller[1].step_time_s >= result.best.step_time_s
    # the data axes absorb the remaining GPUs (cp joins dp's gradient reduction; at 8K with
    # GQA the cost model hides cp's K/V ring behind attention, so cp can stand in for dp)
    assert c.dp * c.cp == cluster.world_size // (c.tp * c.pp) > 1


def test_a_long_sequence_gets_context_parallelism():
    cluster = Cluster.preset("dgx-h100", nodes=8)
    short = search("llama3-8b", cluster, 64)
    long = search(ModelShape.preset("llama3-8b").with_seq(131072), cluster, 64)
    assert short.best.config.cp == 1
    assert long.best.config.cp > 1
    # without cp the long sequence needs tensor or pipeline splits
    no_cp = search(ModelShape.preset("llama3-8b").with_seq(131072), cluster, 64,
                   space=SearchSpace(cp=(1,)))  # fmt: skip
    assert no_cp.best.step_time_s > long.best.step_time_s


def test_zero3_over_thousands_of_ranks_is_priced_by_its_per_layer_gathers():
    # Llama 3 405B at 8K on 16,384 H100 with tp 8 and ZeRO-3 over the other 2,048 ranks: every
    # layer's gather and reduce-scatter pays the ring's latency over the group and hides only
    # behind that layer's compute, so it cannot be nearly free; the search's best stage is not 3
    cluster = Cluster.preset("dgx-h100", nodes=2048)
    zero3 = search("llama3-405b", cluster, 2048, top=1,
                   space=SearchSpace(tp=(8,), pp=(1,), cp=(1,), zero=(3,)))  # fmt: skip
    step = zero3.best.step
    assert step.comm["dp"] > 0.5 * step.compute
    # against the best at the same tp (pp, cp, ZeRO free): 4 s where the whole space takes 30
    best = search("llama3-405b", cluster, 2048, top=1, space=SearchSpace(tp=(8,))).best
    assert best.config.zero != 3 and best.step_time_s < zero3.best.step_time_s


def test_the_cp_ring_is_never_free_and_grows_with_the_ring():
    cluster = Cluster.preset("dgx-h100", nodes=8)
    shape = ModelShape.preset("llama3-8b").with_seq(32768)
    comm = {}
    for cp in (2, 8):
        result = search(shape, cluster, 64, top=1,
                        space=SearchSpace(tp=(1,), pp=(1,), cp=(cp,), zero=(1,)))  # fmt: skip
        comm[cp] = result.best.step.comm["cp"]
    assert 0 < comm[2] < comm[8]


def test_an_moe_model_that_needs_ep_gets_it_inside_a_node():
    # Mixtral-8x22B's shape (141B parameters, 8 experts, top-2) on 64 H100, Megatron's
    # distributed optimizer (ZeRO-1 at most): the experts do not fit without splitting
    moe = ModelShape.llama(name="mixtral-8x22b", layers=56, hidden=6144, heads=48, kv_heads=8,
                           ffn=16384, seq=4096, vocab=32768, experts=8, top_k=2)  # fmt: skip
    cluster = Cluster.preset("dgx-h100", nodes=8)
    result = search(moe, cluster, 512, space=SearchSpace(zero=(0, 1)))
    assert result.best.config.ep > 1
    for choice in result.ranked[:5]:
        assert _inside_node(cluster, spans(choice.order, *choice.key)["ep"])


def test_an_moe_models_expert_all_to_all_stays_inside_a_node():
    cluster = Cluster.preset("dgx-h100", nodes=4)
    for ep in (2, 4, 8):
        result = search("mixtral-8x7b", cluster, 256, space=SearchSpace(ep=(ep,)))
        assert result.best.config.ep == ep
        assert _inside_node(cluster, _best_spans(result)["ep"])


# --- published configurations ---------------------------------------------------------------


def test_llama3_405b_published_configuration_is_ranked():
    """Llama 3 405B on 16,384 H100: TP 8, CP 1, PP 16, DP 128 at 8K sequence (16M tokens)."""
    cluster = Cluster.preset("dgx-h100", nodes=2048)
    published = ParallelConfig(tp=8, pp=16, dp=128, cp=1, global_batch=2048)
    plan = plan_shape("llama3-405b", cluster, 2048, compare=published)
    rank, choice = plan.compare_rank()
    print(f"Llama 3 405B published TP8 PP16 DP128: rank {rank}")
    assert plan.best.step_time_s <= choice.step_time_s
    assert f"compare tp=8 pp=16 dp=128 cp=1 ep=1: rank {rank}" in str(plan)


MEGATRON_2021 = SearchSpace(attention="unfused", sequence_parallel=(False,), zero=(0,),
                            overlap_grad_reduce=False, cp=(1,), ep=(1,))  # fmt: skip


@pytest.mark.parametrize(("layers", "hidden", "heads", "gpus", "tp", "pp", "dp", "batch"), [
    (24, 2304, 24, 32, 1, 1, 32, 512),
    (40, 6144, 48, 256, 8, 1, 32, 1024),
    (80, 12288, 96, 1536, 8, 8, 24, 2304),
    (128, 25600, 160, 3072, 8, 64, 6, 3072),
])  # fmt: skip
def test_megatron_2021_runs_are_ranked(layers, hidden, heads, gpus, tp, pp, dp, batch):
    shape = ModelShape.gpt(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200)
    cluster = Cluster.preset("dgx-a100", nodes=gpus // 8)
    published = ParallelConfig(tp=tp, pp=pp, dp=dp, global_batch=batch)
    plan = plan_shape(shape, cluster, batch, compare=published, space=MEGATRON_2021)
    rank, choice = plan.compare_rank()
    print(f"Megatron 2021 {gpus} GPUs TP{tp} PP{pp} DP{dp}: rank {rank}")
    best = plan.result.estimate(plan.best)
    assert best.tflops_per_gpu_megatron >= plan.result.estimate(choice).tflops_per_gpu_megatron
    assert rank <= len(plan.result.ranked)


# --- bad input ------------------------------------------------------------------------------


def test_a_model_that_fits_nowhere_says_by_how_much_and_what_it_needs():
    with pytest.raises(CostInputError, match=r"fits nowhere on 8 × h100-sxm .* GiB over\. "
                       r"Model state alone is .* needs at least \d+ GPUs"):  # fmt: skip
        search("llama3-405b", Cluster.preset("dgx-h100", nodes=1), 64)


def test_a_global_batch_no_factorisation_divides():
    tiny = ModelShape.llama(layers=2, hidden=256, heads=4, kv_heads=4, ffn=512, seq=1023,
                            vocab=1000)  # fmt: skip
    with pytest.raises(CostInputError, match=r"global batch 7: no factorisation of 64 GPUs "
                                             r"divides it.*multiple of 8"):  # fmt: skip
        search(tiny, Cluster.preset("dgx-h100", nodes=8), 7)


def test_unknown_cluster_preset(capsys):
    argv = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h1000", "--global-batch", "8"]
    assert main(argv) == 2
    assert "unknown cluster 'dgx-h1000'; known: dgx-a100" in capsys.readouterr().err


def test_compare_degrees_are_parsed_or_explained():
    assert parse_degrees("tp=8,pp=4,dp=16").dp == 16
    with pytest.raises(CostInputError, match="write degrees as tp=8,pp=4,dp=16"):
        parse_degrees("tp=8,xp=2")


def test_plan_cli_prints_ranking_stats_and_comparison(capsys):
    argv = ["plan", "--model", "llama3-8b", "--cluster", "dgx-h100", "--nodes", "8",
            "--global-batch", "512", "--top", "5", "--compare", "tp=8,dp=8"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "configurations (" in out and "µs per configuration" in out
    assert out.count("\n") > 20 and "loses on" in out
    assert "compare tp=8 pp=1 dp=8 cp=1 ep=1: rank" in out
    assert "links: exposed communication per axis" in out


# --- Mesh.auto ------------------------------------------------------------------------------


def _node(gpus: int, hbm: float | None = None) -> Cluster:
    node = dataclasses.replace(Cluster.preset("dgx-h100", nodes=1), gpus_per_node=gpus)
    return node if hbm is None else dataclasses.replace(
        node, gpu=dataclasses.replace(node.gpu, hbm_bytes=hbm))  # fmt: skip


def test_mesh_auto_compiles_the_best_configuration_and_verifies():
    c = Config(batch=8)
    model, (x, y) = build("llama", c), tokens(c)
    report = verify(model, Mesh.auto(_node(4)), (x, y), loss_fn=lm_loss, rtol=1e-4)
    assert report.ok, str(report)
    prog = autoparallelize(model, Mesh.auto(_node(4)), (x, y), loss_fn=lm_loss)
    chosen = prog.search.compiled.config
    assert prog.search.best is prog.search.compiled  # dp, pp, tp: nothing missing
    assert prog.mesh.world_size == 4 and prog.mesh.size("dp") == chosen.dp
    assert "Mesh.auto: best tp=" in str(prog.search) and "compiled on Mesh(" in str(prog.search)


def test_mesh_auto_splits_a_model_that_does_not_fit_one_gpu():
    c = Config(batch=8)
    model, (x, y) = build("llama", c), tokens(c)
    params = sum(p.numel() for p in model.parameters())
    # room for ~60% of the Adam model state (18 B/param) next to the runtime reserve
    tight = _node(4, hbm=RESERVED_BYTES + 0.6 * 18 * params)
    mesh = Mesh.auto(tight, zero=(0,))
    prog = autoparallelize(model, mesh, (x, y), loss_fn=lm_loss)
    chosen = prog.search.compiled.config
    assert chosen.tp * chosen.pp > 1
    report = verify(model, mesh, (x, y), loss_fn=lm_loss, rtol=1e-4)
    assert report.ok, str(report)


def test_a_mesh_with_a_cluster_and_no_degrees_is_auto():
    cluster = Cluster.preset("dgx-h100", nodes=2)
    assert Mesh(cluster) == Mesh.auto(cluster)
    assert Mesh(cluster, tp=2).axes == (("tp", 2),)


def test_plan_cli_traces_a_model_built_on_the_meta_device(tmp_path, capsys):
    source = tmp_path / "model.py"
    source.write_text(
        "import torch\n"
        "from autopar.tools.testing import Config, build, lm_loss, tokens\n\n"
        "def make():\n"
        "    c = Config(layers=4, hidden=256, heads=8, kv_heads=2, ffn=512, vocab=512, seq=128,\n"
        "               batch=4)\n"
        "    with torch.device('meta'):\n"
        "        model = build('llama', c)\n"
        "    return model, tokens(c), lm_loss\n"
    )
    argv = ["plan", "--model", f"{source}:make", "--nodes", "2", "--global-batch", "64",
            "--top", "3"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: Llama on 2 × 8 h100-sxm (16 GPUs")
    assert "global batch 64 × 128 tokens" in out
    assert main(["plan", "--model", f"{source}:nothing", "--global-batch", "8"]) == 2
    assert "defines no function 'nothing'" in capsys.readouterr().err


def test_an_invalid_hand_chosen_configuration_is_explained(capsys):
    argv = ["plan", "--model", "llama3-8b", "--nodes", "8", "--global-batch", "512"]
    assert main([*argv, "--compare", "tp=8,dp=4"]) == 2
    assert "tp·pp·dp·cp = 8·1·4·1 = 32 but the cluster has 64 GPUs" in capsys.readouterr().err
    assert main([*argv, "--compare", "pp=64"]) == 2
    assert "32 layers cannot fill pp·virtual_stages = 64" in capsys.readouterr().err
