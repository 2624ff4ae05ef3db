"""Expert parallelism (autopar/axes/expert_parallel.py): MoE layers recognised in the ATen graph,
experts placed across ep ranks, tokens dispatched and combined with all-to-alls.

Every equivalence test compares the loss and every parameter gradient with one device at
relative 1e-5 (fp32, dropless); the reference MoE block (autopar.tools.testing.MoEModel) is drawn by
hypothesis over experts, top-k, hidden sizes, routing and shared experts.
"""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar import Mesh, Program, autoparallelize
from autopar.axes.expert_parallel import expert_load
from autopar.codegen import _param_block
from autopar.errors import InputError, ShardingRuleError
from autopar.ops import collectives as C
from autopar.ops.compiled import compile_stats
from autopar.runtime.pool import get_pool
from autopar.tools import zoo
from autopar.tools.testing import MoEConfig, build_moe, lm_loss, tokens
from autopar.verify import _rank_step, _reference, program_view, rank_jobs, replica, verify

pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)


def _ids(c: MoEConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return tokens(c, seed)  # (batch, seq) ids and targets


# ---------------------------------------------------------------- 1. the reference block


@settings(max_examples=6, deadline=None)
@given(experts=st.sampled_from([4, 8]), top_k=st.integers(1, 3),
       hidden=st.sampled_from([16, 32]), ffn=st.sampled_from([8, 24]),
       ep=st.sampled_from([2, 4]), sigmoid=st.booleans(), shared=st.booleans(),
       seed=st.integers(0, 3))  # fmt: skip
def test_reference_moe_matches_single_device(experts, top_k, hidden, ffn, ep, sigmoid, shared,
                                             seed):  # fmt: skip
    c = MoEConfig(experts=experts, top_k=top_k, hidden=hidden, expert_ffn=ffn, sigmoid=sigmoid,
                  shared=shared)  # fmt: skip
    model = build_moe(c, seed)
    report = verify(model, Mesh(ep=ep), _ids(c, seed + 1), lm_loss, rtol=1e-5)
    assert report.ok, report
    prog = autoparallelize(model, Mesh(ep=ep), _ids(c, seed + 1), lm_loss)
    assert len(prog.layers) == c.layers  # recognised, not replicated


def test_a_rank_whose_experts_get_no_tokens():
    """Sigmoid routing whose bias always picks experts 0 and 1: ep rank 1 receives no rows."""
    c = MoEConfig(sigmoid=True)
    model = build_moe(c)
    with torch.no_grad():
        for block in model.blocks:
            block.score_bias.copy_(torch.tensor([10.0, 10.0, -10.0, -10.0]))
    report = verify(model, Mesh(ep=2), _ids(c), lm_loss, rtol=1e-5)
    assert report.ok, report


def test_recognised_layer_and_printed_program():
    c = MoEConfig()
    prog = autoparallelize(build_moe(c), Mesh(ep=2), _ids(c), lm_loss)
    assert isinstance(prog, Program) and prog.plan.ep is not None
    layer = prog.layers[0]
    assert layer.experts == 4 and layer.weights == ("blocks.0.gate_up", "blocks.0.down")
    assert [n.split("_fallback")[0] for n in layer.matmuls] == ["grouped_mm", "grouped_mm"]
    code = prog.code(1)
    assert code.count("expert_dispatch(") == 2 and code.count("expert_combine(") == 2
    assert "batch_loss(" in code and "ep=1" in code
    text = str(prog.plan)
    assert "2 MoE layers, each rank holds 1/2 of their experts" in text and "dropless" in text


def test_save_writes_the_distinct_programs_and_the_plan(tmp_path):
    c = MoEConfig()
    prog = autoparallelize(build_moe(c), Mesh(ep=2), _ids(c), lm_loss)
    written = {p.name for p in prog.save(tmp_path)}
    assert written == {"plan.txt", "plan.json", "program_0.py"}  # both ep ranks run one program
    source = (tmp_path / "program_0.py").read_text()
    assert "# runs on ranks [0, 1]" in source and "expert_dispatch(" in source
    assert (tmp_path / "plan.txt").read_text() == str(prog.plan) + "\n"


# ---------------------------------------------------------------- 2. HF MoE families


def _deepseek_v3():
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=64, use_cache=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms and the routing bias: not ones and zeros
                p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 128, (2, 2, 16), generator=g)
    return model, (ids,), {"labels": labels}


def _gpt_oss():
    """Per-expert biases: the gate/up bias is gathered by expert id inside the experts."""
    import transformers

    cfg = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        layer_types=["full_attention"] * 2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))  # the expert biases start at zero
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 128, (2, 2, 16), generator=g)
    return model, (ids,), {"labels": labels}


def _family(name: str):
    if name in ("deepseek_v3", "gpt_oss"):
        return {"deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss}[name]()
    model, args, kwargs, _ = zoo.build(zoo.family(name))
    return model, args, kwargs


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "deepseek_v3",
                                  "gpt_oss"])
def test_hf_moe_family_at_ep2(name):
    model, args, kwargs = _family(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = autoparallelize(model, Mesh(ep=2), args, example_kwargs=kwargs)
        report = verify(model, Mesh(ep=2), args, example_kwargs=kwargs, rtol=1e-5)
    assert len(prog.layers) == 2, prog.plan.notes
    assert report.ok, report
    if name == "gpt_oss":
        assert prog.layers[0].weights[-1].endswith("gate_up_proj_bias")


# ---------------------------------------------------------------- 3. collectives and memory


def test_collectives_per_moe_layer():
    c = MoEConfig(experts=8)
    prog = autoparallelize(build_moe(c), Mesh(ep=4), _ids(c), lm_loss)
    moe = [x for x in prog.collectives() if x.kind == "all_to_all"]
    rows = c.batch // 4 * c.seq * c.top_k
    for i in range(c.layers):
        mine = [x for x in moe if x.where == f"blocks.{i}"]
        fwd = sorted(x.shape for x in mine if x.direction == "fwd")
        bwd = [x.shape for x in mine if x.direction == "bwd"]
        assert fwd == [(c.experts,), (rows, c.hidden), (rows, c.hidden)], fwd  # count exchange
        assert bwd == [(rows, c.hidden), (rows, c.hidden)]
    assert not [x for x in prog.collectives() if x.kind == "all_gather"]
    graph = prog.module(0).graph
    ops = [n.target.__name__ for n in graph.nodes if n.op == "call_function"
           and n.target.__module__ == "autopar.ops.collectives"]  # fmt: skip
    assert ops.count("expert_dispatch") == ops.count("expert_combine") == c.layers
    assert "all_gather" not in ops


def test_each_rank_holds_its_share_of_the_experts():
    c = MoEConfig(experts=8)
    model = build_moe(c)
    prog = autoparallelize(model, Mesh(ep=4), _ids(c), lm_loss)
    expert_bytes = sum(p.numel() * 4 for n, p in model.named_parameters()
                       if n.endswith(("gate_up", "down")))  # fmt: skip
    dense_bytes = sum(p.numel() * 4 for p in model.parameters()) - expert_bytes
    for rank in range(4):
        local = dict(prog.module(rank).named_parameters())
        held = sum(p.numel() * 4 for p in local.values())
        assert held == dense_bytes + expert_bytes // 4
        whole = model.blocks[0].gate_up.detach()
        torch.testing.assert_close(local["blocks.0.gate_up"], whole[2 * rank:2 * rank + 2])
    assert prog.plan.ep.param_bytes == (dense_bytes, expert_bytes // 4)


# ---------------------------------------------------------------- capacity


@pytest.mark.parametrize("compile", [False, "aot_eager"])
def test_capacity_drops_like_the_one_device_rule(compile):
    """Also under torch.compile (the expert all-to-alls as custom ops): the same drops, loads
    and gradients, and no graph break."""
    c = MoEConfig(experts=4, top_k=2, batch=4, seq=8, layers=1)
    factor = 0.5
    capacity = math.ceil(factor * c.batch * c.seq * c.top_k / c.experts)  # 16 of 64 rows
    model = build_moe(c)
    reference = build_moe(MoEConfig(**{**c.__dict__, "capacity": capacity}))
    prog = autoparallelize(model, Mesh(ep=2), _ids(c), lm_loss, capacity_factor=factor,
                           compile=compile)  # fmt: skip
    assert "capacity factor 0.5" in str(prog.plan)
    fwd = [x.kind for x in prog.collectives() if x.where == "blocks.0" and x.direction == "fwd"]
    assert sorted(fwd) == ["all_gather", "all_to_all", "all_to_all", "all_to_all"]  # + counts
    args = _ids(c)
    ref_out, ref_grads, cots = _reference(reference, args, None, lm_loss, 0)
    view = program_view(prog)
    before = _dynamo_counts(prog)
    results = get_pool(2).run(_with_load, prog.mesh.axes, rank_jobs(view, args, None, cots))
    after = _dynamo_counts(prog)
    assert after[0] == before[0] and (after[1] > before[1]) == bool(compile), (before, after)
    assert len(results[0][2]) == c.layers  # one load record per MoE layer and forward
    dropped = sum(load.dropped for r in results for load in r[2])
    assert dropped == _one_device_dropped(reference, args[0], capacity) > 0
    took = [n for r in results for load in r[2] for n in load.tokens]  # every expert, once
    assert len(took) == c.experts and max(took) <= capacity
    assert sum(took) + dropped == c.batch * c.seq * c.top_k
    assert all(load.imbalance >= 1.0 for r in results for load in r[2])
    outs, grads = replica(view, [r[:2] for r in results], None, prog.stages[0], (0,))[0]
    torch.testing.assert_close(outs[0], ref_out[0], rtol=1e-5, atol=1e-7)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def _dynamo_counts(prog: Program) -> tuple[int, int]:
    """Dynamo's graph breaks and graphs compiled so far, summed over the pool's workers."""
    world = prog.mesh.world_size
    stats = get_pool(world).run(compile_stats, prog.mesh.axes, [()] * world)
    return sum(s["graph_breaks"] for s in stats), sum(s["unique_graphs"] for s in stats)


def _with_load(rank, groups, *job):
    expert_load()
    outs, grads = _rank_step(rank, groups, *job)
    return outs, grads, expert_load()


def _one_device_dropped(model, ids, capacity: int) -> int:
    block, c = model.blocks[0], model.blocks[0].c
    with torch.no_grad():
        flat = block.norm(model.embed(ids)).reshape(-1, c.hidden)
        experts = torch.topk(torch.softmax(block.router(flat), -1), c.top_k).indices
        counts = torch.bincount(experts.reshape(-1), minlength=c.experts)
    return int((counts - capacity).clamp(min=0).sum())


# ---------------------------------------------------------------- bad input


def test_experts_not_divisible_by_ep():
    c = MoEConfig(experts=6, batch=4)
    with pytest.raises(InputError, match=r"6 experts, which ep=4 does not divide"):
        autoparallelize(build_moe(c), Mesh(ep=4), _ids(c), lm_loss)


@pytest.mark.parametrize("factor", [0, -1.0])
def test_capacity_factor_must_be_positive(factor):
    c = MoEConfig()
    with pytest.raises(InputError, match="capacity factor must be > 0"):
        autoparallelize(build_moe(c), Mesh(ep=2), _ids(c), lm_loss, capacity_factor=factor)


class _LeakyBlock(torch.nn.Module):
    """A layout the recogniser refuses: the routing weights enter between the two grouped
    matmuls (the experts' region reads a tensor it was not dispatched)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = build_moe(MoEConfig(layers=1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from autopar.tools.testing import grouped_mm

        m = self.inner
        block = m.blocks[0]
        x = m.embed(ids).reshape(-1, block.c.hidden)
        weights, experts = torch.topk(torch.softmax(block.router(x), -1), 1)
        ids_, perm = torch.sort(experts.reshape(-1), stable=True)
        offs = torch.cumsum(torch.histc(ids_.float(), bins=4, min=0, max=3), 0, dtype=torch.int32)
        h = grouped_mm(x[perm], block.gate_up.transpose(-2, -1), offs)
        h = h * weights.reshape(-1)[perm].unsqueeze(-1)  # weighs inside the experts
        out = grouped_mm(h[:, : block.c.expert_ffn], block.down.transpose(-2, -1), offs)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        return m.head(out[inv]).view(*ids.shape, -1)


def test_unrecognised_layout_warns_and_replicates_or_errors_under_strict():
    c = MoEConfig(layers=1)
    model, args = _LeakyBlock(), _ids(c)
    with pytest.warns(UserWarning, match=r"does not recognise.*node 'mul.*comes from outside"):
        prog = autoparallelize(model, Mesh(ep=2), args, lm_loss)
    assert not prog.layers
    assert "experts replicated" in str(prog.plan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert verify(model, Mesh(ep=2), args, lm_loss, rtol=1e-5).ok
    with pytest.raises(ShardingRuleError, match=r"node 'mul.*line"):
        autoparallelize(model, Mesh(ep=2), args, lm_loss, strict=True)


# ---------------------------------------------------------------- compositions


@pytest.mark.parametrize("mesh", [Mesh(ep=2, tp=2), Mesh(dp=2, ep=2), Mesh(pp=2, ep=2)], ids=str)
def test_composes_with_tp_and_dp(mesh):
    c = MoEConfig(batch=4, shared=True)
    model = build_moe(c)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, mesh, _ids(c), lm_loss, rtol=1e-5)
        prog = autoparallelize(model, mesh, _ids(c), lm_loss)
    assert report.ok, report
    assert len(prog.layers) == c.layers
    held = dict(prog.module(0).named_parameters())["blocks.0.gate_up"]
    tp = mesh.size("tp")
    assert held.shape == (c.experts // 2, 2 * c.expert_ffn // tp, c.hidden)
    if "pp" in mesh.sizes:  # each stage recognised its own layers
        assert [len(ls) for ls in prog.stage_layers] == [1, 1]


_WITH_EP = [Mesh(**{a: 2 for a in axes}) for axes in
            (("ep",), ("dp", "ep"), ("pp", "ep"), ("ep", "tp"), ("dp", "pp", "ep"),
             ("dp", "ep", "tp"), ("pp", "ep", "tp"), ("dp", "pp", "ep", "tp"))]  # fmt: skip


@pytest.mark.parametrize("mesh", _WITH_EP, ids=str)
def test_every_mesh_with_ep_compiles(mesh):
    """Every combination of dp, pp and tp around ep: each rank holds E/ep experts (tp-split)
    on every stage, and each stage recognised its own MoE layer."""
    c = MoEConfig(batch=8, shared=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = autoparallelize(build_moe(c), mesh, _ids(c), lm_loss)
    assert prog.plan.ep is not None and prog.phases[0].name == "expert_parallel"
    tp, pp = mesh.size("tp"), mesh.size("pp")
    for rank in range(mesh.world_size):
        stage = mesh.coordinates(rank)["pp"] if pp > 1 else 0
        held = dict(prog.module(rank, stage).named_parameters())
        assert held[f"blocks.{stage}.gate_up"].shape == (c.experts // 2,
                                                         2 * c.expert_ffn // tp, c.hidden)
    assert [len(ls) for ls in prog.stage_layers] == ([1, 1] if pp > 1 else [2])


def test_dp_pp_ep_on_eight_ranks():
    """Mesh(dp=2, pp=2, ep=2): each dp replica runs the pp x ep program on its batch slice,
    its stages under DDP over dp; expert gradients are reduced over dp only (each (pp, ep)
    rank holds its own experts), dense ones over ep in the program and then over dp."""
    c = MoEConfig(batch=8, shared=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(build_moe(c), Mesh(dp=2, pp=2, ep=2), _ids(c), lm_loss, rtol=1e-5)
    assert report.ok, report
    assert any("gate_up (stage 1)" in r.name for r in report.rows)  # experts compared


def test_pipeline_reduces_dense_gradients_once_per_step():
    """Under pp the ep buckets add the micro-batches' dense gradients up locally and
    all-reduce once, after the last micro-batch's backward (as DDP's no_sync does)."""
    c = MoEConfig(batch=8, shared=True)
    mesh = Mesh(pp=2, ep=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = autoparallelize(build_moe(c), mesh, _ids(c), lm_loss, n_microbatches=2)
        report = verify(build_moe(c), mesh, _ids(c), lm_loss, rtol=1e-5, n_microbatches=2)
    assert report.ok, report
    for stage in (0, 1):
        graph = prog.module(0 if stage == 0 else 2, stage).graph
        buckets = [n for n in graph.nodes if n.target is C.grad_bucket_all_reduce]
        assert buckets and all(b.args[2] == 2 for b in buckets)
        assert not [n for n in graph.nodes if n.target is C.grad_all_reduce]


@pytest.mark.parametrize("cap", [0, 3000, None], ids=["per-parameter", "small-buckets", "default"])
def test_dense_gradients_are_bucketed(cap, monkeypatch):
    """Dense gradients are all-reduced over ep in buckets of at most BUCKET_BYTES (one dtype,
    in reverse order of first use); the plan lists exactly the program's buckets, and the
    loss and every gradient still match one device."""
    from autopar.axes import expert_parallel as ep_module

    if cap is not None:
        monkeypatch.setattr(ep_module, "BUCKET_BYTES", cap)
    c = MoEConfig(shared=True)
    model = build_moe(c)
    prog = autoparallelize(model, Mesh(ep=2), _ids(c), lm_loss)
    graph = prog.module(0).graph
    buckets = [n for n in graph.nodes if n.target is C.grad_bucket_all_reduce]
    single = [n for n in graph.nodes if n.target is C.grad_all_reduce]
    listed = [x for x in prog.collectives() if x.axis == "ep" and x.kind == "all_reduce"
              and x.direction == "bwd"]  # fmt: skip
    assert len(listed) == len(buckets) + len(single)
    dense = [n for n, _ in model.named_parameters() if not n.endswith(("gate_up", "down"))]
    held = [a.target for b in buckets for a in b.args[3:]] + [n.args[0].target for n in single]
    assert sorted(held) == sorted(dense)  # every dense parameter reduced once
    assert sum(x.bytes for x in listed) == 4 * sum(
        p.numel() for n, p in model.named_parameters() if n in dense)  # fmt: skip
    if cap == 0:
        assert not buckets and len(single) == len(dense)
    elif cap is None:  # all fits one cap: one bucket per block, and the parameters outside
        keys = [_param_block((n.args[3] if n in buckets else n.args[0]).target)
                for n in buckets + single]  # fmt: skip
        blocks = {_param_block(n) for n in dense} - {None}
        assert blocks and all(keys.count(k) == 1 for k in blocks), keys
    else:
        assert len(buckets) > 1 and all(x.bytes <= cap for x in listed if "parameters" in x.where)
    for b in buckets:  # never across blocks (per-block recompute and ZeRO outline them)
        assert len({_param_block(a.target) for a in b.args[3:]}) == 1
    report = verify(model, Mesh(ep=2), _ids(c), lm_loss, rtol=1e-5)
    assert report.ok, report


# ---------------------------------------------------------------- cost


def test_all_to_all_priced_on_the_link_ep_rides():
    from cost.comm import collective_time
    from cost.hardware import Cluster

    c = MoEConfig(experts=16, batch=16)
    two_nodes = Cluster.preset("dgx-h100", nodes=2)
    inside = autoparallelize(build_moe(c), Mesh(two_nodes, ep=8), _ids(c), lm_loss).plan
    across = autoparallelize(build_moe(c), Mesh(two_nodes, ep=16), _ids(c), lm_loss).plan
    assert inside.ep.link == two_nodes.intra.name and across.ep.link == two_nodes.inter.name
    for plan, link in ((inside, two_nodes.intra), (across, two_nodes.inter)):
        mine = [x for x in plan.collectives if x.kind == "all_to_all" and x.where == "blocks.0"]
        assert len(mine) == 5  # count exchange, dispatch, combine, and their backward pair
        ep = dict(plan.mesh)["ep"]
        want = sum(collective_time("all_to_all", x.bytes, ep, link) for x in mine)
        assert plan.ep.layer_s == pytest.approx(want)
    assert "all-to-alls" in str(across) and two_nodes.inter.name in str(across)


def test_estimate_prices_a_deepseek_v3_like_shape(capsys):
    """DeepSeek-V3-like: 61 layers, hidden 7168, 256 experts of FFN 2048, top-8 (no MLA,
    no shared expert) on 32 DGX H100 nodes, ep=32 across 4 nodes."""
    from autopar.tools.cli import main

    argv = ["estimate", "--model", "llama", "--layers", "61", "--hidden", "7168", "--heads",
            "128", "--kv-heads", "128", "--ffn", "2048", "--experts", "256", "--top-k", "8",
            "--seq", "4096", "--vocab", "129280", "--nodes", "32", "--pp", "8", "--zero", "3", "--ep", "32",
            "--global-batch", "1024"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if "ep all-to-all per layer" in s)
    assert float(line.split()[4]) > 0 and "MFU" in out
    narrow = main([*argv[:-4], "--ep", "8", "--global-batch", "1024"])  # ep inside a node
    assert narrow == 0
    inside = next(s for s in capsys.readouterr().out.splitlines() if "per layer" in s)
    assert float(inside.split()[4]) < float(line.split()[4])


def test_hf_mixtral_at_ep2_tp2():
    model, args, kwargs = _family("mixtral")
    mesh = Mesh(ep=2, tp=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = autoparallelize(model, mesh, args, example_kwargs=kwargs)
        report = verify(model, mesh, args, example_kwargs=kwargs, rtol=1e-5)
    assert len(prog.layers) == 2 and report.ok, report
