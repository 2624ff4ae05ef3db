"""The planner: Megatron's plan emerges from the cost model, collectives match REFERENCE.md."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from autopar import Mesh, MeshError, PlanError, autoparallelize
from autopar.frontend.trace import trace
from autopar.ir.analysis import find_blocks
from autopar.planner.tp import PlanOptions, solve_axis
from autopar.tools.testing import Config, build, lm_loss, tokens

# Large enough that splitting pays on the default cluster (one DGX H100 node).
BIG = dict(layers=2, hidden=1024, heads=16, ffn=4096, vocab=8192, seq=1024, batch=2, bias=False)


def compile_meta(kind: str, tp: int, **overrides):
    c = Config(**{**BIG, "kv_heads": 16, **overrides})
    with torch.device("meta"):
        model = build(kind, c)
    return c, autoparallelize(model, Mesh(tp=tp), tokens(c), loss_fn=lm_loss)


def per_layer(prog, kind: str, layer: int, regather: bool = False) -> Counter:
    """The layer's collectives by (direction, kind, shape): Megatron's set, or (``regather``)
    the backward re-gathers of the shards its gathered inputs keep (planner.overlap step 4)."""
    prefix = f"{'blocks' if kind == 'gpt' else 'layers'}.{layer}"
    return Counter(
        (c.direction, c.kind, c.shape)
        for c in prog.collectives()
        if (c.where == prefix or c.where.startswith(prefix + ".")) and c.regather == regather
    )


def param_layouts(prog) -> dict[str, str]:
    return dict(prog.plan.params)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_plain_tp_has_two_all_reduces_per_layer_each_way(kind, tp):
    c, prog = compile_meta(kind, tp)
    bsh = (c.batch, c.seq, c.hidden)
    for layer in range(c.layers):
        assert per_layer(prog, kind, layer) == Counter(
            {("fwd", "all_reduce", bsh): 2, ("bwd", "all_reduce", bsh): 2}
        )
    layer0 = per_layer(prog, kind, 0)
    assert sum(layer0.values()) == 4  # nothing else crosses the wire inside a layer


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_megatron_column_row_pairs_emerge(kind):
    _, prog = compile_meta(kind, 4)
    lay = param_layouts(prog)
    if kind == "gpt":
        col, row = ["q", "k", "v", "fc"], ["proj", "out"]
        name = "blocks.{}.{}.weight"
    else:
        col, row = ["wq", "wk", "wv", "w1", "w3"], ["wo", "w2"]
        name = "layers.{}.{}.weight"
    for i in range(2):
        assert all(lay[name.format(i, m)] == "P('tp', None)" for m in col)
        assert all(lay[name.format(i, m)] == "P(None, 'tp')" for m in row)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_loss_never_gathers_logits(kind):
    c, prog = compile_meta(kind, 4)
    gathered = [x for x in prog.collectives() if c.vocab in x.shape and x.kind == "all_gather"]
    assert gathered == []
    head = "head.weight" if kind == "gpt" else "lm_head.weight"
    assert param_layouts(prog)[head] == "P('tp', None)"  # vocab-split LM head
    small = [
        x for x in prog.collectives() if x.where in ("", "<top>") or x.shape[0] == c.batch * c.seq
    ]
    assert {x.shape for x in small if x.kind == "all_reduce"} >= {
        (c.batch * c.seq,),
        (c.batch * c.seq, 2),
    }


def test_fused_qkv_keeps_each_ranks_q_k_v_slices():
    _, prog = compile_meta("gpt", 4, fused_qkv=True)
    assert param_layouts(prog)["blocks.0.qkv.weight"] == "P('tp:3', None)"
    assert per_layer(prog, "gpt", 0)[("fwd", "all_reduce", (2, 1024, 1024))] == 2


def test_gqa_splits_kv_heads_when_they_divide():
    _, prog = compile_meta("llama", 4, kv_heads=4)
    assert param_layouts(prog)["layers.0.wk.weight"] == "P('tp', None)"
    assert not [x for x in prog.collectives() if x.kind == "all_gather"]


def test_gqa_shares_kv_heads_when_fewer_than_ranks():
    """2 K/V heads over 4 ranks: each head's projection rows on the 2 ranks whose query heads
    read it (tests/test_kv_heads.py checks the numerics)."""
    _, prog = compile_meta("llama", 4, kv_heads=2)
    sdpa = [n for n in prog.graph_module.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert sdpa and all("S(1)x2" in n.meta["autopar"].strategy for n in sdpa)
    assert param_layouts(prog)["layers.0.wk.weight"] == "P('tp'x2, None)"
    assert not [x for x in prog.collectives() if x.kind == "all_gather" and "wk" in x.where]


def test_tied_embedding_is_one_split_parameter():
    _, prog = compile_meta("gpt", 4, tied=True)
    lay = param_layouts(prog)
    tied = [k for k in lay if k in ("wte.weight", "head.weight")]
    assert len(tied) == 1 and lay[tied[0]] == "P('tp', None)"  # vocab-split, used twice


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_memory_pressure_picks_sequence_parallelism(kind):
    c = Config(**{**BIG, "kv_heads": 16})
    with torch.device("meta"):
        model = build(kind, c)
    plain = autoparallelize(model, Mesh(tp=4), tokens(c), loss_fn=lm_loss)
    sp = autoparallelize(model, Mesh(tp=4), tokens(c), loss_fn=lm_loss, memory_weight=1e-11)
    bsh = (c.batch, c.seq, c.hidden)
    for layer in range(c.layers):
        got = per_layer(sp, kind, layer)
        acts = {k: v for k, v in got.items() if k[2] == bsh}
        assert acts == {("fwd", "all_gather", bsh): 2, ("fwd", "reduce_scatter", bsh): 2,
                        ("bwd", "reduce_scatter", bsh): 2, ("bwd", "all_gather", bsh): 2}  # fmt: skip
        norms = {k: v for k, v in got.items() if k[2] == (c.hidden,)}
        assert norms == {("bwd", "all_reduce", (c.hidden,)): 2}  # norm weights in the SP region
        # Megatron's memory: each of the two gathered inputs is kept as its shard and gathered
        # again in backward for its weights' gradients
        assert per_layer(sp, kind, layer, regather=True) == {("bwd", "all_gather", bsh): 2}
    assert sp.plan.memory_bytes < plain.plan.memory_bytes
    # same bytes on the wire as plain TP (REFERENCE.md): 8·b·s·h·(t-1)/t elements per layer
    for prog in (plain, sp):
        assert wire_elements(prog, kind, 0, bsh, 4) == 8 * c.batch * c.seq * c.hidden * 3 / 4


def wire_elements(prog, kind: str, layer: int, shape: tuple, t: int) -> float:
    """Per-GPU elements sent by ring collectives: all-reduce 2(t-1)/t N, the others (t-1)/t N."""
    n = 1
    for s in shape:
        n *= s
    factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    return sum(k * factor[kind_] * n * (t - 1) / t
               for (_, kind_, shp), k in per_layer(prog, kind, layer).items() if shp == shape)  # fmt: skip


def test_thirty_two_identical_layers_are_solved_once():
    c = Config(layers=32, hidden=512, heads=8, kv_heads=8, ffn=1024, vocab=1024, seq=64, batch=1, bias=False)
    with torch.device("meta"):
        model = build("llama", c)
    traced = trace(model, tokens(c), loss_fn=lm_loss)
    blocks = find_blocks(list(traced.gm.graph.nodes), traced)
    mesh = Mesh(tp=8)
    sol = solve_axis(traced, "tp", 8, mesh.cluster.axis_link(mesh.axes, "tp"), mesh.cluster.gpu,
                     PlanOptions())  # fmt: skip
    assert len(blocks) == 32
    assert sol.tied_nodes == sum(len(b) for b in blocks[1:])  # layers 1..31 reuse layer 0
    lays = {str(sol.choice[n.name].output) for n in traced.gm.graph.nodes
            if n.name in traced.params and traced.params[n.name].endswith("wq.weight")}  # fmt: skip
    assert lays == {"S(0)"}


def test_blocks_are_the_layers_not_a_longer_small_sequential():
    """DiT's timestep MLP is an nn.Sequential of 3 modules beside 2 blocks: the blocks (many
    more nodes) are what repeats and what is tied."""
    from autopar.tools import zoo_models

    net, args, kwargs = zoo_models.build(zoo_models.model("dit"), "tiny")
    traced = trace(net, args, example_kwargs=kwargs)
    blocks = find_blocks(list(traced.gm.graph.nodes), traced)
    assert len(blocks) == 2
    assert all(traced.params.get(n.name, "blocks.").startswith("blocks.")
               for b in blocks for n in b if n.op == "placeholder")  # fmt: skip


def test_mesh_size_that_divides_nothing_has_no_valid_plan():
    c = Config(layers=1, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=100, seq=16)
    model = build("gpt", c)
    with pytest.raises(PlanError, match=r"no valid plan.*3 ranks.*tensor-parallel degree"):
        autoparallelize(model, Mesh(tp=3), tokens(c), loss_fn=lm_loss)


def test_unknown_mesh_axis_is_named():
    with pytest.raises(MeshError, match=r"unknown mesh axis 'tensor'"):
        Mesh(tensor=2)


def test_split_gemm_is_priced_at_its_local_shape():
    """In bf16, a head-dim-wide projection (n = 128) is bound by reading its input, which a
    column split still reads whole on every rank: per rank it runs no faster than whole; a
    wide one (compute-bound) runs twice as fast; a row (K) split of the narrow one halves the
    input read but still writes the whole partial output."""
    from autopar.planner.tp import _local_gemm_time
    from autopar.rules import RuleContext, strategies
    from cost.compute import node_time
    from cost.hardware import GPU

    gpu = Mesh(tp=2).cluster.gpu
    assert isinstance(gpu, GPU)
    for width, speedup in ((128, 1.0), (2048, 2.0)):
        with torch.device("meta"):
            model = torch.nn.Linear(4096, width, bias=False, dtype=torch.bfloat16)
        x = torch.empty(1, 8192, 4096, device="meta", dtype=torch.bfloat16)
        traced = trace(model, (x,), {}, None)
        node = next(n for n in traced.gm.graph.nodes if "linear" in str(n.target))
        found = strategies(node, RuleContext(size=2, blocks=(1,)), False)
        cols = [s for s in found if str(s.output) == "S(2)"]
        rows = [s for s in found if str(s.output).startswith("P")]
        assert cols and rows
        whole = node_time(node, gpu)
        local = _local_gemm_time(node, cols[0], 2, gpu)
        if width == 128:  # bound by reading x whole: 65 of the 66.5 MiB it moved whole
            column = (8192 * 4096 + 4096 * 128 / 2 + 8192 * 128 / 2) * 2
            assert local == pytest.approx(column / (gpu.hbm_bw * 0.8))
            assert whole / local < 1.03  # no faster than whole, to 1.5 MiB of 66.5
            # a row (K) split reads x / 2 + W / 2 and writes out whole: 34.5 MiB
            moved = (8192 * 4096 / 2 + 4096 * 128 / 2 + 8192 * 128) * 2
            assert _local_gemm_time(node, rows[0], 2, gpu) == pytest.approx(
                moved / (gpu.hbm_bw * 0.8))
        else:  # compute-bound: half the FLOPs at the same tile use
            assert local == pytest.approx(whole / speedup)
