"""Fused projections of unequal blocks are cut per block (autopar/frontend/fused.py).

A fused [q | k | v] weight whose blocks differ in width (multi-query: one KV head; GQA: g < a
KV heads) gets one projection per block on a piece of the weight, so the q rows split by
heads while a single KV head stays whole (REFERENCE.md).  Read three ways: ``split``,
``slice`` and a list index (``x[..., [-2], :]``, traced as a slice).  Equal blocks keep their
blocked split.  Gradients and parameter names map back to the user's fused weight.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import Mesh, autoparallelize, verify
from autopar.frontend.fused import split_fused_projections
from autopar.frontend.trace import _run_as_slice, trace


class FusedAttention(nn.Module):
    """One pre-norm attention block + MLP with a fused QKV of ``kv`` KV heads, read by ``how``."""

    def __init__(self, hidden: int, heads: int, kv: int, how: str, bias: bool = True) -> None:
        super().__init__()
        self.heads, self.kv, self.d, self.how = heads, kv, hidden // heads, how
        self.norm = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, (heads + 2 * kv) * self.d, bias=bias)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.head = nn.Linear(hidden, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self._split(self.qkv(self.norm(x)))
        q = q.reshape(b, s, self.heads, self.d).transpose(1, 2)
        k, v = (t.reshape(b, s, self.kv, self.d).transpose(1, 2) for t in (k, v))
        rep = self.heads // self.kv  # HF's repeat_kv
        k, v = (t[:, :, None].expand(b, self.kv, rep, s, self.d).reshape(b, self.heads, s, self.d)
                for t in (k, v))  # fmt: skip
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, -1))
        x = x + self.down(F.gelu(self.up(x)))
        return self.head(x)

    def _split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        nq, nk = self.heads * self.d, self.kv * self.d
        if self.how == "split":
            return y.split([nq, nk, nk], dim=-1)
        if self.how == "slice":
            return y[..., :nq], y[..., nq : nq + nk], y[..., nq + nk :]
        y = y.view(*y.shape[:-1], self.heads + 2, self.d)  # Falcon: one KV head, list indices
        return y[..., :-2, :], y[..., [-2], :], y[..., [-1], :]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _inputs(hidden: int, seq: int = 8, device: str = "cpu") -> tuple:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, seq, hidden, generator=g).to(device)
    return x, torch.randint(0, 64, (2, seq), generator=g).to(device)


@pytest.mark.parametrize("how,kv", [("split", 1), ("slice", 2), ("index", 1)])
def test_pieces_tile_the_fused_weight(how, kv):
    model = FusedAttention(32, 4, kv, how, bias=how != "index")
    traced = split_fused_projections(trace(model, _inputs(32), loss_fn=_loss))
    rows = [(p.start, p.stop) for n, p in sorted(traced.pieces.items()) if p.fqn.endswith("weight")]
    nq, nk = 32, 8 * kv
    assert rows == [(0, nq), (nq, nq + nk), (nq + nk, nq + 2 * nk)]
    assert "qkv.weight" not in traced.params.values()
    whole = traced.tensors["qkv.weight"]
    for name, p in traced.pieces.items():
        assert torch.equal(traced.tensors[name], traced.tensors[p.fqn][p.start : p.stop])
    assert whole.shape[0] == nq + 2 * nk


@pytest.mark.parametrize("how,kv", [("split", 1), ("slice", 2), ("index", 1)])
def test_tp2_verifies_against_the_fused_model(how, kv):
    model = FusedAttention(32, 4, kv, how, bias=how != "index")
    with torch.no_grad():
        if model.qkv.bias is not None:
            model.qkv.bias.normal_()
    report = verify(model, Mesh(tp=2), _inputs(32), loss_fn=_loss)
    assert report.ok, report
    names = {r.name for r in report.rows}
    assert "qkv.weight" in names and not any(n.startswith("qkv.weight.") for n in names)
    assert ("qkv.bias" in names) == (how != "index")


def test_realistic_mqa_splits_q_heads_and_keeps_the_kv_head_whole():
    """h 1024, 8 heads, one KV head: the q rows split by heads, the KV rows replicated; the
    attention block's forward traffic is the output projection's all-reduce alone."""
    with torch.device("meta"):
        model = FusedAttention(1024, 8, 1, "index", bias=False)
    prog = autoparallelize(model, Mesh(tp=2), _inputs(1024, seq=512, device="meta"), _loss)
    params = dict(prog.plan.params)
    assert params["qkv.weight.0"] == "P('tp', None)"
    assert params["qkv.weight.1"] == params["qkv.weight.2"] == "P(None, None)"
    local = dict(prog.module(0).named_parameters())
    assert local["qkv.weight.0"].shape == (512, 1024) and local["qkv.weight.1"].shape == (128, 1024)
    fwd = [c for c in prog.collectives() if c.direction == "fwd" and c.where.startswith("qkv")]
    assert not fwd and not [c for c in prog.collectives() if c.kind == "all_gather"]


def test_equal_blocks_keep_the_blocked_split():
    model = FusedAttention(32, 4, 4, "split")  # q, k and v of one width
    traced = split_fused_projections(trace(model, _inputs(32), loss_fn=_loss))
    assert not traced.pieces
    prog = autoparallelize(model, Mesh(tp=2), _inputs(32), loss_fn=_loss)
    assert dict(prog.plan.params)["qkv.weight"] == "P('tp:3', None)"


class PartlyRead(nn.Module):
    """Only the first two blocks of the projection are read: no tiling, nothing cut."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 40, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y[..., :16].sum(-1) + y[..., 16:24].sum(-1)


def test_blocks_that_do_not_tile_the_features_are_left_alone():
    traced = split_fused_projections(trace(PartlyRead(), (torch.randn(2, 16),)))
    assert not traced.pieces and "proj.weight" in traced.params.values()


def test_list_index_runs_become_slices():
    x = torch.empty(2, 3, 6, 4)
    assert _run_as_slice(x, (Ellipsis, [-2], slice(None))) == (Ellipsis, slice(4, 5), slice(None))
    assert _run_as_slice(x, (0, [1, 2])) == (0, slice(1, 3))
    assert _run_as_slice(x, [0, 1]) == (slice(0, 2),)
    for index in [(Ellipsis, [0, 2], slice(None)), (Ellipsis, [True, False]), ([0], [1]),
                  (Ellipsis, [9], slice(None)), (None, [0])]:  # fmt: skip
        assert _run_as_slice(x, index) is None, index


# ---------------------------------------------------------------------------------------------
# Checkpoints name the user's fused parameter: the pieces of every rank tile it.

_CKPT_GROUP: dict[int, object] = {}


def _fused_model(seed: int) -> FusedAttention:
    torch.manual_seed(seed)
    return FusedAttention(32, 4, 1, "index", bias=False)


def _train(loss_of, opt, first: int, last: int, ck=None, save_at: int = 0) -> list[float]:
    losses = []
    for step in range(first, last + 1):
        loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if ck is not None and step == save_at:
            ck.save(step)
    if ck is not None:
        ck.wait()
    return losses


def _make_ckpt_group(rank, groups):
    """On every pool worker (new_group is collective over the whole pool): the checkpoint's
    own Gloo group of ranks 0 and 1."""
    import torch.distributed as dist

    if 2 not in _CKPT_GROUP:
        _CKPT_GROUP[2] = dist.new_group([0, 1], backend="gloo")


def _ckpt_rank(rank, groups, module, root, resume):
    from autopar.ops import collectives
    from autopar.runtime.checkpoints import Checkpointer

    collectives.bind(groups)
    x, y = _inputs(32)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01)
    ck = Checkpointer(root, module, opt, group=_CKPT_GROUP[2])
    if resume:
        assert ck.load().step == 3
        return _train(lambda: module(x, y), opt, 4, 6)
    return _train(lambda: module(x, y), opt, 1, 3, ck, save_at=3)


def test_checkpoint_of_pieces_resumes_under_tp2_and_on_one_device(tmp_path):
    from autopar.runtime.checkpoints import Checkpointer, export_state_dict, step_dir
    from autopar.runtime.pool import get_pool

    x, y = _inputs(32)
    ref_model = _fused_model(0)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    ref = _train(lambda: _loss(ref_model(x), y), opt, 1, 6)
    first = autoparallelize(_fused_model(0), Mesh(tp=2), (x, y), loss_fn=_loss)
    again = autoparallelize(_fused_model(5), Mesh(tp=2), (x, y), loss_fn=_loss)
    assert "qkv.weight.1" in dict(first.module(0).named_parameters())
    pool = get_pool(2)
    pool.run(_make_ckpt_group, (), [()] * pool.world)
    saved = pool.run(_ckpt_rank, first.mesh.axes, [(first.module(r), tmp_path, False)
                                                   for r in range(2)])  # fmt: skip
    assert saved[0] == pytest.approx(ref[:3], rel=1e-5)
    state = export_state_dict(step_dir(tmp_path, 3), ref_model)
    assert tuple(state["qkv.weight"].shape) == (48, 32) and "qkv.weight.0" not in state
    resumed = pool.run(_ckpt_rank, again.mesh.axes, [(again.module(r), tmp_path, True)
                                                     for r in range(2)])  # fmt: skip
    for losses in resumed:
        assert losses == pytest.approx(ref[3:], rel=1e-5)
    one = _fused_model(5)
    opt = torch.optim.AdamW(one.parameters(), lr=1e-2, weight_decay=0.01)
    assert Checkpointer(tmp_path, one, opt).load().step == 3
    assert _train(lambda: _loss(one(x), y), opt, 4, 6) == pytest.approx(ref[3:], rel=1e-5)


@pytest.mark.parametrize("mesh", [Mesh(pp=2, tp=2), Mesh(dp=2, tp=2)], ids=str)
def test_pipeline_and_data_parallel_meshes_check_the_fused_gradients(mesh):
    """Each stage (or dp replica) of HF GPT-BigCode holds c_attn as pieces; verify compares
    their reassembled gradients with the fused weight's (none is skipped)."""
    import logging

    from autopar.tools import zoo

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model, args, kwargs, loss_fn = zoo.build(zoo.family("gpt_bigcode"), "tiny")
    report = verify(model, mesh, args, loss_fn, example_kwargs=kwargs)
    assert report.ok, report
    fused = [r.name for r in report.rows if ".c_attn." in r.name]
    assert len(fused) == 4 and not [n for n in fused if ".weight." in n or ".bias." in n], fused


def test_saved_plan_of_pieces_reloads_to_the_same_program(tmp_path):
    from autopar.plan import Plan

    prog = autoparallelize(_fused_model(0), Mesh(tp=2), _inputs(32), loss_fn=_loss)
    prog.save(tmp_path)
    again = autoparallelize(_fused_model(0), Mesh(tp=2), _inputs(32), loss_fn=_loss,
                            plan=Plan.load(tmp_path / "plan.json"))  # fmt: skip
    assert again.plan == prog.plan and again.code(0) == prog.code(0)
    assert "qkv.weight.1" in (tmp_path / "plan.txt").read_text()


def test_context_parallel_with_tp_checks_the_fused_gradients():
    model = _fused_model(0)
    report = verify(model, Mesh(cp=2, tp=2), _inputs(32), _loss, cp_attention="all_to_all")
    assert report.ok, report
    assert "qkv.weight" in {r.name for r in report.rows}
