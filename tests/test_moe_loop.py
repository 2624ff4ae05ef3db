"""Per-expert nn.ModuleList MoE loops (autopar/frontend/moe_loop.py): stacked at trace into grouped
matmuls over the user's per-expert parameters, then placed across ep ranks like stacked experts.

Every equivalence test compares the loss and every parameter gradient (by the user's
per-expert names) with one device at relative 1e-5 (fp32, dropless).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar import Mesh, autoparallelize
from autopar.errors import ShardingRuleError, TraceError
from autopar.frontend.trace import trace
from autopar.tools.testing import MoEModel, RMSNorm, build_moe, lm_loss
from autopar.verify import verify

pytest.importorskip("transformers")


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    layers: int = 2
    hidden: int = 16
    ffn: int = 8
    experts: int = 4
    top_k: int = 2
    vocab: int = 64
    seq: int = 8
    batch: int = 4
    dense: bool = False  # every expert on every token, weighted by its (masked) routing weight
    compare: bool = False  # torch.where(chosen == e) instead of a permuted one-hot mask
    put: bool = False  # out[token] += rows (DeepSeek's reference loop), rows by index_select
    stacked: bool = False  # the loop reads rows w[e] of [E, ...] parameters, no ModuleList
    bias: bool = False  # the experts' linears have biases


class Expert(nn.Module):
    def __init__(self, c: LoopConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.hidden, c.ffn, bias=c.bias)
        self.w3 = nn.Linear(c.hidden, c.ffn, bias=c.bias)
        self.w2 = nn.Linear(c.ffn, c.hidden, bias=c.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LoopMoE(nn.Module):
    """Softmax top-k routing, then Mixtral's original per-expert loop (or a dense one)."""

    def __init__(self, c: LoopConfig) -> None:
        super().__init__()
        self.c = c
        self.norm = RMSNorm(c.hidden)
        self.gate = nn.Linear(c.hidden, c.experts, bias=False)
        if c.stacked:
            self.w1 = nn.Parameter(torch.randn(c.experts, c.ffn, c.hidden) / c.hidden**0.5)
            self.w3 = nn.Parameter(torch.randn(c.experts, c.ffn, c.hidden) / c.hidden**0.5)
            self.w2 = nn.Parameter(torch.randn(c.experts, c.hidden, c.ffn) / c.ffn**0.5)
        else:
            self.experts = nn.ModuleList(Expert(c) for _ in range(c.experts))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if not self.c.stacked:
            return self.experts[e](x)
        return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        flat = self.norm(x).reshape(-1, c.hidden)
        weights, chosen = torch.topk(F.softmax(self.gate(flat), dim=-1), c.top_k, dim=-1)
        if c.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        if c.dense:
            for e in range(c.experts):
                share = (weights * (chosen == e)).sum(-1, keepdim=True)
                out = out + self.expert(e, flat) * share
            return x + out.reshape(x.shape)
        if c.compare:
            for e in range(c.experts):
                token, slot = torch.where(chosen == e)
                picked = flat.index_select(0, token) if c.put else flat[token]
                rows = self.expert(e, picked) * weights[token, slot, None]
                if c.put:
                    out[token] += rows
                else:
                    out.index_add_(0, token, rows)
            return x + out.reshape(x.shape)
        mask = F.one_hot(chosen, num_classes=c.experts).permute(2, 1, 0)
        for e in range(c.experts):
            slot, token = torch.where(mask[e])
            rows = self.expert(e, flat[None, token].reshape(-1, c.hidden))
            out.index_add_(0, token, rows * weights[token, slot, None])
        return x + out.reshape(x.shape)


def _model(c: LoopConfig, seed: int = 0) -> MoEModel:
    return build_moe(c, seed, block=LoopMoE)


def _inputs(c: LoopConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids, targets = torch.randint(0, c.vocab, (2, c.batch, c.seq), generator=g)
    return ids, targets


# ---------------------------------------------------------------- 1. the trace-time rewrite


def test_loop_traces_to_grouped_matmuls_over_stacked_parameters():
    c = LoopConfig()
    model = _model(c)
    ids, targets = _inputs(c)
    traced = trace(model, (ids, targets), loss_fn=lm_loss)
    ops = [str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert sum("grouped_mm" in o for o in ops) == 3 * c.layers
    assert sum(o == "aten.stack.default" for o in ops) == 3 * c.layers
    assert not any("where" in o or "nonzero" in o or "index_add_" in o for o in ops)
    stacks = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.stack.default]
    names = [[traced.params[p.name] for p in s.args[0]] for s in stacks]
    assert names[0] == [f"blocks.0.experts.{e}.w1.weight" for e in range(c.experts)]
    values = {ph: traced.tensors[fqn] for ph, fqn in {**traced.params, **traced.buffers}.items()}
    inputs = iter((ids, targets))
    args = [values[n.name] if n.name in values else next(inputs)
            for n in traced.gm.graph.nodes if n.op == "placeholder"]  # fmt: skip
    assert torch.allclose(traced.gm(*args)[0], lm_loss(model(ids), targets), rtol=1e-6)


@pytest.mark.parametrize("put", [False, True])
def test_a_compare_mask_loop_is_stacked_too(put):
    """torch.where(ids == e), combined by index_add_ or by out[token] += rows."""
    c = LoopConfig(compare=True, put=put, layers=1)
    model = _model(c)
    ids, targets = _inputs(c)
    traced = trace(model, (ids, targets), loss_fn=lm_loss)
    ops = [str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert sum("grouped_mm" in o for o in ops) == 3 and "aten.where.default" not in ops
    assert "aten.index_put_.default" not in ops
    values = {ph: traced.tensors[fqn] for ph, fqn in {**traced.params, **traced.buffers}.items()}
    inputs = iter((ids, targets))
    args = [values[n.name] if n.name in values else next(inputs)
            for n in traced.gm.graph.nodes if n.op == "placeholder"]  # fmt: skip
    assert torch.allclose(traced.gm(*args)[0], lm_loss(model(ids), targets), rtol=1e-6)


def test_a_put_that_may_repeat_rows_is_not_an_index_add():
    """out[i] += v with i not provably unique (a where over a mask that is not a top-k's)
    stays an index_put: the loop is not stacked and the trace refuses it."""
    c = LoopConfig(layers=1)
    model = _model(c)

    def forward(x: torch.Tensor, block=model.blocks[0]) -> torch.Tensor:
        flat = x.reshape(-1, c.hidden)
        out = torch.zeros_like(flat)
        for e in range(c.experts):
            token, _ = torch.where(block.gate(flat) > 0.1 * e)
            out[token] += block.experts[e](flat[token])
        return x + out.reshape(x.shape)

    model.blocks[0].forward = forward
    with pytest.raises(TraceError, match="data-dependent shape"):
        trace(model, _inputs(c), loss_fn=lm_loss)


def test_a_loop_body_that_is_not_row_wise_is_refused_with_the_reason():
    """An expert that normalises over its rows (dim 0) cannot be stacked; the trace refuses
    the data-dependent shape and says why the loop was not stacked."""

    class Batchy(Expert):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = super().forward(x)
            return h - h.mean(0, keepdim=True)

    c = LoopConfig(layers=1)
    model = _model(c)
    for block in model.blocks:
        block.experts = nn.ModuleList(Batchy(c) for _ in range(c.experts))
    ids, targets = _inputs(c)
    with pytest.raises(TraceError, match=r"per-expert loop autopar could not stack.*mean"):
        trace(model, (ids, targets), loss_fn=lm_loss)


# ---------------------------------------------------------------- 2. expert parallelism


@settings(max_examples=5, deadline=None)
@given(experts=st.sampled_from([4, 8]), top_k=st.integers(1, 2), ep=st.sampled_from([2, 4]),
       hidden=st.sampled_from([16, 24]), mask=st.sampled_from(["one_hot", "eq", "eq+put"]),
       seed=st.integers(0, 3))  # fmt: skip
def test_loop_moe_matches_single_device(experts, top_k, ep, hidden, mask, seed):
    c = LoopConfig(experts=experts, top_k=top_k, hidden=hidden, compare=mask != "one_hot",
                   put=mask == "eq+put")  # fmt: skip
    model = _model(c, seed)
    report = verify(model, Mesh(ep=ep), _inputs(c, seed + 1), lm_loss, rtol=1e-5)
    assert report.ok, report
    names = {r.name for r in report.rows}
    assert {f"blocks.1.experts.{e}.w2.weight" for e in range(experts)} <= names
    prog = autoparallelize(model, Mesh(ep=ep), _inputs(c, seed + 1), lm_loss)
    assert len(prog.layers) == c.layers  # recognised, not replicated
    _each_rank_holds_its_experts(prog, model, c, ep)


def _each_rank_holds_its_experts(prog, model: MoEModel, c: LoopConfig, ep: int) -> None:
    """Measured on each rank's module: the user's per-expert parameters of experts
    [r E/ep, (r+1) E/ep) and nothing of the others; expert bytes exactly 1/ep."""
    n = c.experts // ep
    full = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    for rank in range(ep):
        params = dict(prog.module(rank).named_parameters())
        held = {int(m.group(1)) for name in params
                if (m := re.search(r"\.experts\.(\d+)\.", name))}  # fmt: skip
        assert held == set(range(rank * n, (rank + 1) * n)), (rank, held)
        mine = sum(p.numel() for name, p in params.items() if ".experts." in name)
        assert mine * ep == full
        for name, p in params.items():
            assert torch.equal(p.detach(), model.get_parameter(name).detach())


def test_collectives_per_layer_as_the_stacked_form():
    c = LoopConfig()
    prog = autoparallelize(_model(c), Mesh(ep=2), _inputs(c), lm_loss)
    for layer in prog.layers:
        mine = [x for x in prog.plan.collectives if x.where == layer.where]
        fwd = [x for x in mine if x.direction == "fwd"]
        bwd = [x for x in mine if x.direction == "bwd"]
        assert [x.kind for x in fwd] == ["all_to_all"] * 3  # counts, dispatch, combine
        assert fwd[0].dtype == "int64" and fwd[0].shape == (c.experts,)
        assert [x.kind for x in bwd] == ["all_to_all"] * 2
    assert not [x for x in prog.plan.collectives if x.kind == "all_gather"]
    code = prog.code(1)
    assert code.count("expert_dispatch(") == c.layers
    assert code.count("expert_combine(") == c.layers
    reads = {n.target for n in prog.module(1).graph.nodes if n.op == "get_attr"}
    assert "blocks.0.experts.3.w1.weight" in reads and "blocks.0.experts.0.w1.weight" not in reads
    assert "stack(blocks.0.experts.0.w1.weight .. blocks.0.experts.3.w1.weight)" in str(prog.plan)


def test_loop_moe_at_ep2_tp2():
    c = LoopConfig(hidden=32, ffn=16)
    model = _model(c)
    report = verify(model, Mesh(ep=2, tp=2), _inputs(c), lm_loss, rtol=1e-5)
    assert report.ok, report
    prog = autoparallelize(model, Mesh(ep=2, tp=2), _inputs(c), lm_loss)
    assert len(prog.layers) == c.layers


# ---------------------------------------------------------------- 3. a loop not recognised


def test_a_dense_loop_warns_and_keeps_experts_replicated():
    c = LoopConfig(dense=True)
    model = _model(c)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        prog = autoparallelize(model, Mesh(ep=2), _inputs(c), lm_loss)
    text = " ".join(str(w.message) for w in seen if "does not recognise" in str(w.message))
    assert "blocks.0.experts.*" in text and "test_moe_loop.py" in text, text
    assert "self.w2(F.silu(self.w1(x)) * self.w3(x))" in text
    assert not prog.layers
    params = dict(prog.module(1).named_parameters())
    assert all(f"blocks.0.experts.{e}.w1.weight" in params for e in range(c.experts))
    report = verify(model, Mesh(ep=2), _inputs(c), lm_loss, rtol=1e-5)
    assert report.ok, report


def test_a_dense_loop_is_an_error_under_strict():
    c = LoopConfig(dense=True, layers=1)
    with pytest.raises(ShardingRuleError, match=r"blocks\.0\.experts\.\*"):
        autoparallelize(_model(c), Mesh(ep=2), _inputs(c), lm_loss, strict=True)


def test_stacked_decoder_layers_are_not_an_expert_loop():
    """A ModuleList of identical layers run one after another is not a per-expert loop."""
    from autopar.frontend.moe_loop import find_expert_loops

    c = LoopConfig(layers=3)
    prog = autoparallelize(_model(c), Mesh(ep=2), _inputs(c), lm_loss)
    found = find_expert_loops(prog.stages[0].module(0))
    assert not [x for x in found if x.prefix == "blocks"]


def test_a_loop_over_rows_of_stacked_parameters_at_ep2():
    """for e: F.linear(x, w[e]): the rows of one [E, ...] parameter are the members; the
    grouped matmul reads the parameter whole, each ep rank keeps its E/ep rows."""
    c = LoopConfig(stacked=True, compare=True)
    model = _model(c)
    traced = trace(model, _inputs(c), loss_fn=lm_loss)
    ops = [str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert sum("grouped_mm" in o for o in ops) == 3 * c.layers
    assert "aten.stack.default" not in ops and "aten.select.int" not in ops
    report = verify(model, Mesh(ep=2), _inputs(c), lm_loss, rtol=1e-5)
    assert report.ok, report
    prog = autoparallelize(model, Mesh(ep=2), _inputs(c), lm_loss)
    assert len(prog.layers) == c.layers
    assert prog.module(1).get_parameter("blocks.0.w1").shape == (c.experts // 2, c.ffn, c.hidden)


@pytest.mark.parametrize("mesh", [Mesh(ep=2), Mesh(ep=4), Mesh(ep=2, tp=2)], ids=str)
def test_experts_with_biases(mesh):
    """nn.Linear experts with biases: a bias inside the experts' region is gathered by each
    row's local expert id on its ep rank (its rows stay there); the last linear's bias, added
    after the region, stays whole on every rank."""
    c = LoopConfig(bias=True, hidden=32, ffn=16)
    model = _model(c)
    report = verify(model, mesh, _inputs(c), lm_loss, rtol=1e-5)
    assert report.ok, report
    prog = autoparallelize(model, mesh, _inputs(c), lm_loss)
    assert len(prog.layers) == c.layers
    ep = mesh.size("ep")
    last = next(r for r in range(mesh.world_size) if mesh.coordinates(r)["ep"] == ep - 1)
    params = dict(prog.module(last).named_parameters())
    held = {n for n in params if n.startswith("blocks.0.experts.") and n.endswith("w1.bias")}
    assert held == {f"blocks.0.experts.{e}.w1.bias" for e in range(c.experts - c.experts // ep,
                                                                   c.experts)}  # fmt: skip
    assert all(f"blocks.0.experts.{e}.w2.bias" in params for e in range(c.experts))


@pytest.mark.parametrize("mesh", [Mesh(dp=2, ep=2), Mesh(pp=2, ep=2)], ids=str)
def test_loop_moe_composes_with_dp_and_pp(mesh):
    """A pipeline cut inside an MoE layer leaves that stage's part of the layer replicated
    (warned); the other parts stay expert-parallel; loss and gradients match one device."""
    c = LoopConfig()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(_model(c), mesh, _inputs(c), lm_loss, rtol=1e-5)
    assert report.ok, report


def test_loop_moe_under_tp_only():
    """Without ep the stacked experts split like any grouped matmul (the rewrite is at trace)."""
    c = LoopConfig(hidden=32, ffn=16, compare=True, put=True)
    report = verify(_model(c), Mesh(tp=2), _inputs(c), lm_loss, rtol=1e-5)
    assert report.ok, report


def test_hf_eager_experts_loop_is_refused_with_its_source_line():
    """HF transformers 5's eager experts loop iterates over a data-dependent list of experts
    (``for expert_idx in expert_hit``): torch.export cannot unroll it; the error says where."""
    from autopar.tools import zoo

    model, args, kwargs, _ = zoo.build(zoo.family("mixtral"))
    for module in model.modules():
        if hasattr(module, "config"):
            module.config._experts_implementation = "eager"
    with pytest.raises(TraceError, match=r"(?s)data-dependent.*expert_hit"):
        trace(model, args, kwargs)
