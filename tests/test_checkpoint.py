"""Checkpoints: sharded, asynchronous, atomically committed, resharded on load.

Each resume test trains, saves at step 5 under one plan, loads under another (fresh weights
from a different seed, so a load that silently did nothing fails) and trains 5 more steps: the
losses must equal an uninterrupted single-device run (fp32, rtol 1e-5).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from autopar import Mesh, autoparallelize
from autopar.codegen import shard_tensor
from autopar.ir.layout import Layout
from autopar.runtime.checkpoint_format import SafetensorsWriter
from autopar.runtime.checkpoints import (
    Checkpointer,
    ShardSpec,
    committed_steps,
    export_state_dict,
    global_pieces,
    read_manifest,
    step_dir,
)
from autopar.runtime.pool import get_pool
from autopar.tools.testing import Config, build, lm_loss, run_rank_scripts, tokens, train_loop

GPT = Config(layers=1, vocab=90, fused_qkv=True, batch=4)  # 90 rows: padded to 92 at tp=4
LLAMA = Config(layers=2, hidden=32, heads=4, ffn=64, vocab=48, seq=8, batch=4, bias=False)
LR, WD = 1e-2, 0.01
_GROUPS: dict[int, object] = {}  # n -> Gloo group of ranks 0..n-1 (on a pool worker)


def _reference(kind: str, c: Config, steps: int = 10) -> list[float]:
    model = build(kind, c)
    x, y = tokens(c)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return train_loop(lambda: lm_loss(model(x), y), opt, steps)


def _make_groups(rank, groups):
    """On every pool worker (all take part in new_group): Gloo groups of ranks 0..n-1 for the
    checkpoint's own collectives, so a background save never interleaves with training's."""
    import torch.distributed as dist

    for n in (2, 4):
        if n not in _GROUPS:  # a worker keeps its groups across jobs
            _GROUPS[n] = dist.new_group(list(range(n)), backend="gloo")


def _ckpt_group(n: int):
    return _GROUPS[n]


def _pool():
    pool = get_pool(4)
    pool.run(_make_groups, (), [()] * pool.world)
    return pool


def _run(model, opt, ck: Checkpointer, step_fn, first: int, last: int, save_at=()) -> list:
    """Steps ``first..last`` (1-based) of ``step_fn`` (forward and backward, returns the loss),
    saving (asynchronously) after each step in save_at."""
    losses = []
    for step in range(first, last + 1):
        loss = step_fn()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step in save_at:
            ck.save(step, {"data_position": step})
    ck.wait()
    return losses


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss


def _tp_rank(rank, groups, module, root, n, resume):
    from autopar.ops import collectives

    collectives.bind(groups)
    x, y = tokens(GPT)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD)
    ck = Checkpointer(root, module, opt, group=_ckpt_group(n))
    step = lambda: _backward(module(x, y))  # noqa: E731
    if resume:
        state = ck.load()
        assert state.step == 5 and state.extra == {"data_position": 5}
        return _run(module, opt, ck, step, 6, 10), ck.staged_bytes
    return _run(module, opt, ck, step, 1, 5, save_at=(3, 5)), ck.staged_bytes


def _single_resume(root) -> list[float]:
    model = build("gpt", GPT, seed=7)
    x, y = tokens(GPT)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ck = Checkpointer(root, model, opt)
    assert ck.load().step == 5
    return _run(model, opt, ck, lambda: _backward(lm_loss(model(x), y)), 6, 10)


def test_saved_under_tp2_resumes_under_tp4_and_one_device(tmp_path):
    ref = _reference("gpt", GPT)
    x, y = tokens(GPT)
    two = autoparallelize(build("gpt", GPT), Mesh(tp=2), (x, y), loss_fn=lm_loss)
    four = autoparallelize(build("gpt", GPT, seed=3), Mesh(tp=4), (x, y), loss_fn=lm_loss)
    assert four.module(0).get_parameter("head.weight").shape[0] == 23  # padded 92 / 4
    first = _pool().run(_tp_rank, two.mesh.axes, [(two.module(r), tmp_path, 2, False)
                                                      for r in range(2)])  # fmt: skip
    assert first[0][0] == pytest.approx(ref[:5], rel=1e-5)
    assert committed_steps(tmp_path) == [3, 5]
    sizes = {k: v.shape for k, v in read_manifest(tmp_path / "step_00000005").tensors.items()
             if k.startswith("model.")}  # fmt: skip
    assert sizes["model.head.weight"] == (90, 64)  # global, unpadded
    again = _pool().run(_tp_rank, four.mesh.axes, [(four.module(r), tmp_path, 4, True)
                                                       for r in range(4)])  # fmt: skip
    for losses, _ in again:
        assert losses == pytest.approx(ref[5:], rel=1e-5)
    assert _single_resume(tmp_path) == pytest.approx(ref[5:], rel=1e-5)
    staged = sum(s for _, s in first)  # the staging copy holds each rank's own shards only
    whole = sum(p.numel() * 4 * 3 for p in build("gpt", GPT).parameters())  # params + 2 moments
    assert staged < 1.3 * whole


def _dp_rank(rank, groups, module, root, zero):
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.ops import collectives
    from autopar.runtime import DataParallelModule

    collectives.bind({a: g for a, g in groups.items() if a != "dp"})
    dp_mesh = DeviceMesh.from_group(groups["dp"], "cpu", mesh_dim_names=("dp",))
    wrapped = DataParallelModule(module, group=groups["dp"], dp_mesh=dp_mesh, zero=zero,
                                 reduction="mean")  # fmt: skip
    x, y = (t.chunk(2)[dp_mesh.get_local_rank()] for t in tokens(LLAMA))
    opt = wrapped.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
    ck = Checkpointer(root, wrapped, opt, group=_ckpt_group(4))
    return _run(wrapped, opt, ck, lambda: _backward(wrapped(x, y)), 1, 5, save_at=(5,))


def _pp_rank(rank, groups, share, root):
    from autopar.ops import collectives
    from autopar.runtime import PipelineRunner

    collectives.bind(groups)
    runner = PipelineRunner(share, groups["pp"])
    opt = runner.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
    ck = Checkpointer(root, runner, opt, group=_ckpt_group(4))
    assert ck.load().step == 5
    x, y = tokens(LLAMA)
    return _run(runner, opt, ck, lambda: runner.step(x, y), 6, 10)


@pytest.mark.parametrize("zero", [1, 3])  # ZeroRedundancyOptimizer's / FSDP2's shards
def test_saved_under_dp_tp_zero_resumes_under_pp_tp(tmp_path, zero):
    ref = _reference("llama", LLAMA)
    x, y = tokens(LLAMA)
    dp = autoparallelize(build("llama", LLAMA), Mesh(dp=2, tp=2), (x, y), loss_fn=lm_loss,
                         zero=zero)  # fmt: skip
    jobs = [(dp.module(r), tmp_path, zero) for r in range(4)]
    first = _pool().run(_dp_rank, dp.mesh.axes, jobs)
    assert first[0] == pytest.approx(ref[:5], rel=1e-5)
    pp = autoparallelize(build("llama", LLAMA, seed=3), Mesh(pp=2, tp=2), (x, y),
                         loss_fn=lm_loss)  # fmt: skip
    again = _pool().run(_pp_rank, pp.mesh.axes, [(pp.share(r), tmp_path) for r in range(4)])
    for losses in again:
        assert losses == pytest.approx(ref[5:], rel=1e-5)
    model = build("llama", LLAMA, seed=9)
    model.load_state_dict(export_state_dict(tmp_path / "step_00000005"))  # strict: every name


@pytest.mark.parametrize(("shape", "layout", "sizes", "true"), [
    ((12, 4), Layout(dims=(("tp",), ()), blocks=(3, 1)), {"tp": 2}, (11, 4)),
    ((8, 6), Layout(dims=((), ("tp",)), blocks=(1, 1)), {"tp": 2}, (7, 6)),
    ((24,), Layout(dims=(("tp",),), blocks=(3,)), {"tp": 4}, (24,)),
])  # fmt: skip
def test_pieces_of_every_rank_tile_the_global_tensor_once(shape, layout, sizes, true):
    """Blocked splits and vocab padding, each rank's shard cut in two row ranges (FSDP2)."""
    full, mesh = torch.randn(shape), Mesh(**sizes)
    out, cover = torch.zeros(true), torch.zeros(true)
    for r in range(mesh.world_size):
        coords = mesh.coordinates(r)
        local = shard_tensor(full, layout, mesh, coords)
        half = local.shape[0] // 2
        spec = ShardSpec(shape=true, padded=shape, layout=layout, sizes=sizes, coords=coords)
        for row0, part in ((0, local[:half]), (half, local[half:])):
            for offsets, view in global_pieces(part, spec, row0):
                where = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape, strict=True))
                out[where] = view
                cover[where] += 1
    assert torch.equal(out, full[tuple(slice(0, n) for n in true)])
    assert bool((cover == 1).all())


def test_export_gives_every_alias_of_a_tied_weight():
    import tempfile

    c = Config(layers=1, vocab=32, tied=True)
    model = build("gpt", c)
    with tempfile.TemporaryDirectory() as root:
        Checkpointer(root, model).save(1, blocking=True)
        state = export_state_dict(step_dir(root, 1), model)
    other = build("gpt", c, seed=5)
    other.load_state_dict(state)  # strict: head.weight (tied to wte.weight) is there too
    assert torch.equal(other.head.weight, model.wte.weight)


# ---------------------------------------------------------------- a save killed part-way

ROOT = Path(__file__).resolve().parents[1]


class _DyingWriter(SafetensorsWriter):
    """Rank 1 writes its files of step 5's checkpoint, then its process is killed."""

    def write_data(self, plan, planner):
        import torch.distributed as dist

        result = super().write_data(plan, planner)
        if dist.get_rank() == 1 and "step_00000005" in str(self.path):
            result.wait()
            os._exit(9)
        return result


def _killed_save_main(rank: int, port: int, root: str) -> None:
    """A real 2-rank tp job (not the pool): saves at steps 3 and 5; rank 1 dies in save 5."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))  # fmt: skip
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    x, y = tokens(GPT)
    module = autoparallelize(build("gpt", GPT), mesh, (x, y), loss_fn=lm_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD)
    ck = Checkpointer(root, module, opt, writer=_DyingWriter)
    _run(module, opt, ck, lambda: _backward(module(x, y)), 1, 5, save_at=(3, 5))


def _resume_rank(rank, groups, module, root):
    from autopar.ops import collectives

    collectives.bind(groups)
    x, y = tokens(GPT)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WD)
    ck = Checkpointer(root, module, opt, group=_ckpt_group(2))
    assert ck.load().step == 3
    return _run(module, opt, ck, lambda: _backward(module(x, y)), 4, 10)


def test_a_save_killed_part_way_leaves_the_previous_checkpoint_loadable(tmp_path):
    codes, errs = run_rank_scripts(__file__, 2, str(tmp_path), timeout=120, root=str(ROOT))
    assert codes[1] == 9, errs[1][-2000:]
    assert codes[0] != 0 and "checkpoint save failed" in errs[0], errs[0][-2000:]
    assert committed_steps(tmp_path) == [3]  # step 5 never became visible
    assert any((tmp_path / "step_00000005.tmp").iterdir())  # though rank 1 wrote its files
    ref = _reference("gpt", GPT)
    two = autoparallelize(build("gpt", GPT, seed=4), Mesh(tp=2), tokens(GPT), loss_fn=lm_loss)
    resumed = _pool().run(
        _resume_rank, two.mesh.axes, [(two.module(r), tmp_path) for r in range(2)]
    )
    assert resumed[0] == pytest.approx(ref[3:], rel=1e-5)


if __name__ == "__main__":
    _killed_save_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


class _Gained(torch.nn.Module):
    """A persistent buffer split with the activation it scales (``gain``) and a
    non-persistent one (``scratch``, not in the state dict, so never checkpointed)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        self.register_buffer("gain", torch.ones(64))
        self.register_buffer("scratch", torch.ones(64), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)) * self.gain * self.scratch).sum()


def _save_rank(rank, groups, module, root):
    from autopar.ops import collectives

    collectives.bind(groups)
    Checkpointer(root, module, group=_ckpt_group(2)).save(1, blocking=True)
    return module.get_buffer("gain").clone()


def _load_rank(rank, groups, module, root):
    from autopar.ops import collectives

    collectives.bind(groups)
    Checkpointer(root, module, group=_ckpt_group(2)).load()
    return module.get_buffer("gain").clone()


def test_persistent_buffers_are_saved_and_resharded(tmp_path):
    x = torch.randn(4, 16)
    saved_model = _Gained()
    saved_model.gain.copy_(torch.randn(64))
    prog = autoparallelize(saved_model, Mesh(tp=2), (x,))
    shards = _pool().run(_save_rank, prog.mesh.axes, [(prog.module(r), tmp_path)
                                                       for r in range(2)])  # fmt: skip
    assert shards[0].shape == (32,)  # split like the activation it scales
    names = set(read_manifest(tmp_path / "step_00000001").tensors)
    assert "model.gain" in names and "model.scratch" not in names
    fresh = autoparallelize(_Gained(), Mesh(tp=2), (x,))
    loaded = _pool().run(_load_rank, fresh.mesh.axes, [(fresh.module(r), tmp_path)
                                                        for r in range(2)])  # fmt: skip
    assert torch.equal(torch.cat(loaded), saved_model.gain)
    single = _Gained()
    Checkpointer(tmp_path, single).load()
    assert torch.equal(single.gain, saved_model.gain)
    assert torch.equal(export_state_dict(tmp_path / "step_00000001")["gain"], saved_model.gain)


def _dp_pp_rank(rank, groups, share, root, zero, reduction):
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.ops import collectives
    from autopar.runtime import DataAxis, PipelineRunner

    collectives.bind({a: g for a, g in groups.items() if a != "dp"})
    dp_mesh = DeviceMesh.from_group(groups["dp"], "cpu", mesh_dim_names=("dp",))
    data = DataAxis(group=groups["dp"], mesh=dp_mesh, zero=zero, reduction=reduction)
    runner = PipelineRunner(share, groups["pp"], data=data)
    x, y = (t.chunk(2)[dp_mesh.get_local_rank()] for t in tokens(LLAMA))
    opt = runner.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
    ck = Checkpointer(root, runner, opt, group=_ckpt_group(4))
    return _run(runner, opt, ck, lambda: runner.step(x, y), 1, 5, save_at=(5,))


def test_saved_under_dp_pp_resumes_on_one_device(tmp_path):
    ref = _reference("llama", LLAMA)
    x, y = tokens(LLAMA)
    prog = autoparallelize(build("llama", LLAMA), Mesh(dp=2, pp=2), (x, y), loss_fn=lm_loss,
                           n_microbatches=2)  # fmt: skip
    jobs = [(prog.share(r), tmp_path, prog.plan.dp.zero, prog.plan.dp.reduction)
            for r in range(4)]  # fmt: skip
    first = _pool().run(_dp_pp_rank, prog.mesh.axes, jobs)
    for losses in first:
        assert losses == pytest.approx(ref[:5], rel=1e-5)
    model = build("llama", LLAMA, seed=9)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    ck = Checkpointer(tmp_path, model, opt)
    assert ck.load().step == 5
    rest = _run(model, opt, ck, lambda: _backward(lm_loss(model(x), y)), 6, 10)
    assert rest == pytest.approx(ref[5:], rel=1e-5)


def test_a_rank_the_saved_world_lacked_gets_a_reproducible_rng(tmp_path):
    """A rank with no saved RNG state (the world grew) is seeded from the checkpoint and its
    rank: the same draws on every resume, other draws than rank 0's and another new rank's."""
    model = torch.nn.Linear(4, 4)
    torch.manual_seed(7)
    Checkpointer(tmp_path, model).save(1, blocking=True)
    draws = {}
    for rank, again in ((0, 0), (3, 0), (3, 1), (5, 0)):
        torch.manual_seed(100 + again)  # whatever the process drew before must not matter
        ck = Checkpointer(tmp_path, model)
        ck.rank = rank  # as a rank of a larger world, in one process
        ck.load()
        draws[rank, again] = torch.rand(4)
    assert torch.equal(draws[3, 0], draws[3, 1])
    assert not torch.equal(draws[3, 0], draws[0, 0]) and not torch.equal(draws[3, 0], draws[5, 0])
    torch.manual_seed(7)
    assert torch.equal(draws[0, 0], torch.rand(4))  # rank 0 resumes its own state
