"""Failures end cleanly and named; stragglers are named; the numerics guard and loss scaling.

The failure tests start real processes (4 Gloo ranks running an autopar tp=4 program; not the
shared pool, which must survive): this file is also their entry point.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autopar.runtime.pool import get_pool
from autopar.runtime.resilience import (
    EXIT_CODE,
    Heartbeat,
    LossScaler,
    SpikeGuard,
    StragglerMonitor,
    diagnose,
    find_stragglers,
    where,
)
from autopar.tools.testing import run_rank_scripts

ROOT = Path(__file__).resolve().parents[1]
WORLD, TIMEOUT = 4, 4.0


def _rank_main(rank: int, port: int, mode: str, victim: int) -> None:
    """One rank: train an autopar dp=2 x tp=2 MLP; the victim dies (or hangs) after step 3's
    forward.  Its tp peer then waits on it in a tp collective, the other dp replica's ranks
    wait in dp gradient reductions (one of them on the victim's tp peer, not the victim)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar import autoparallelize
    from autopar.runtime.resilience import Watchdog, enable_flight_recorder
    from autopar.tools.testing import MLP

    enable_flight_recorder()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=120))  # fmt: skip
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    module = autoparallelize(MLP(), mesh, (x,))
    x = x.chunk(2)[mesh.get_local_rank("dp")]  # each dp rank passes its slice of the batch
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    dist.barrier()  # the watchdog guards the steps: compiling may take ranks unequal times
    watchdog = Watchdog(timeout=TIMEOUT)
    with watchdog.guard():
        for step in range(1, 1000):
            watchdog.step(step)
            out = module(x)
            if rank == victim and step == 3:
                if mode == "kill":
                    os._exit(17)
                time.sleep(3600)
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    print("finished", flush=True)


def _watchdog_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("[autopar watchdog]")]


@pytest.mark.parametrize(("mode", "victim"), [("kill", 1), ("hang", 1), ("kill", 0)])
def test_every_rank_blames_the_rank_that_died_or_hung(mode, victim):
    """Every rank that is left (the hung one included) names the victim -- the root cause,
    not the peer it waited on -- and the collective it never joined.  Rank 0 hosts the job's
    store: killed, the others lose the store with no verdict posted and name it."""
    codes, errs = run_rank_scripts(__file__, WORLD, mode, str(victim), timeout=90,
                                   root=str(ROOT))  # fmt: skip
    for r, (code, err) in enumerate(zip(codes, errs, strict=True)):
        if r == victim and mode == "kill":
            assert code == 17
            continue
        # ended by the watchdog, or by guard() raising RankFailure once a peer's exit broke
        # the collective (both name the rank)
        assert code in (1, EXIT_CODE), (r, code, err[-2000:])
        lines = _watchdog_lines(err)
        assert len(lines) == 1, (r, err[-2000:])
        want = (
            f"rank {victim} is dead" if mode == "kill" else f"rank {victim} hung: it did not join"
        )
        assert lines[0].startswith(f"[autopar watchdog] rank {r}: {want}"), (r, lines[0])
        if victim == 0:  # its store is gone: no collective to name, the store says why
            assert "(the job's store it hosts closed" in lines[0], (r, lines[0])
        else:  # where the victim stopped: step 3, after its forward's collectives
            assert "gloo:" in lines[0] and "store" not in lines[0], (r, lines[0])
            stopped = "last seen at step 3" if mode == "kill" else "at step 3, not inside"
            assert stopped in lines[0], (r, lines[0])
        if r == victim:
            assert lines[0].endswith("; this rank; ending this rank"), lines[0]


def _hb(rank, step, seqs, inflight=(), beat=1):
    groups = {"0": [0, 1, 2, 3], "tp0": [0, 1], "tp1": [2, 3], "dp0": [0, 2], "dp1": [1, 3]}
    mine = {pg: ranks for pg, ranks in groups.items() if rank in ranks}
    return Heartbeat(rank=rank, time=0.0, seqs=seqs, step=step, inflight=inflight, groups=mine,
                     beat=beat)  # fmt: skip


def _issue_layout():
    """dp=2 x tp=2 with rank 1 sleeping after a tp all_reduce: rank 0 waits on it in tp; rank 2
    waits on rank 0 in dp; rank 3 waits on rank 1 in dp."""
    ar = "gloo:all_reduce"
    return [_hb(0, 3, {"tp0": (11, ar), "dp0": (4, ar)}, inflight=("tp0",)),
            _hb(1, 3, {"tp0": (10, ar), "dp1": (4, ar)}),
            _hb(2, 3, {"tp1": (11, ar), "dp0": (5, ar)}, inflight=("dp0",)),
            _hb(3, 3, {"tp1": (11, ar), "dp1": (5, ar)}, inflight=("dp1",))]  # fmt: skip


def test_diagnose_follows_the_waits_to_the_rank_that_stopped_first():
    peers = _issue_layout()
    alive = [0.1] * WORLD
    assert diagnose(peers, alive, [3.0] * WORLD, timeout=5) is None  # not stuck for long yet
    # rank 3 has waited only 1 s: its wait on rank 1 still counts; rank 2's chain 2 -> 0 -> 1
    # ends at rank 1, not at rank 0 (the peer rank 2 waits on)
    verdict = diagnose(peers, alive, [6.0, 7.0, 6.0, 1.0], timeout=5)
    assert (verdict.rank, verdict.kind) == (1, "hung")
    assert verdict.why.startswith("rank 1 hung: it did not join gloo:all_reduce #5 on process "
                                  "group dp1 (ranks [1, 3]) (it is at #4 there), nor "
                                  "gloo:all_reduce #11 on process group tp0 (ranks [0, 1]) (it "
                                  "is at #10 there)")  # fmt: skip
    assert verdict.why.endswith("ranks [0, 3] wait on it")
    dead = diagnose(peers, [0.1, 6.0, 0.1, 0.1], [6.0] * WORLD, timeout=5)
    assert (dead.rank, dead.kind) == (1, "dead") and dead.why.startswith("rank 1 is dead")
    assert (
        "last seen at step 3; its peers went on to gloo:all_reduce #5 on process group dp1 "
        "(ranks [1, 3]), gloo:all_reduce #11 on process group tp0 (ranks [0, 1])" in dead.why
    )
    first = diagnose(peers, [0.1, 6.0, 8.0, 0.1], [9.0] * WORLD, timeout=5)
    assert first.rank == 2  # of two silent ranks, the one silent longest


def test_where_names_the_collective_this_rank_waits_in():
    peers = _issue_layout()
    groups = {"dp0": [0, 2]}
    assert where(peers[2], groups) == ("rank 2 was waiting in gloo:all_reduce #5 on process group "
                                       "dp0 (ranks [0, 2]) at step 3")  # fmt: skip
    assert where(peers[1], groups) == "rank 1 was at step 3"


# ---------------------------------------------------------------- stragglers

_GROUP: dict[int, object] = {}


def _monitor_group(rank, groups):
    import torch.distributed as dist

    if "all" not in _GROUP:
        _GROUP["all"] = dist.new_group(list(range(WORLD)), backend="gloo")


def _straggler_rank(rank, groups, steps, slow_rank, delay):
    import torch.distributed as dist

    monitor = StragglerMonitor(every=5, margin=0.5, min_s=0.02, group=_GROUP["all"])
    x = torch.randn(64, 64)
    for _ in range(steps):
        with monitor.step():
            y = x @ x  # compute
            if rank == slow_rank:
                time.sleep(delay)
            dist.all_reduce(y, group=groups["tp"])
    first = next((rep.step for rep in monitor.reports if rep.slow), None)
    return monitor.slow_ranks(), first, str(monitor.reports[-1])


def test_a_slowed_rank_is_named_within_20_steps_and_nobody_over_50_normal_steps():
    pool = get_pool(WORLD)
    pool.run(_monitor_group, (), [()] * pool.world)
    axes = (("tp", WORLD),)
    slow = pool.run(_straggler_rank, axes, [(20, 1, 0.08)] * WORLD)
    for named, first, report in slow:
        assert named == {1} and first <= 20, report
    assert "rank 1" in slow[0][2] and "slow in compute" in slow[0][2]
    normal = pool.run(_straggler_rank, axes, [(50, None, 0.0)] * WORLD)
    for named, _, report in normal:
        assert named == set(), report


def _expert_rank(rank, groups):
    from autopar.ops import collectives

    collectives._LOAD.append(([999, 999], 0))  # a dispatch before the monitor: not counted
    monitor = StragglerMonitor(every=4, group=_GROUP["all"], expert_load=True)
    for _ in range(4):
        with monitor.step():  # what expert_dispatch records: rows per local expert, dropped
            collectives._LOAD.append(([10 * (rank + 1), 5], 0))
            collectives._LOAD.append(([1, 1], 0))  # a second MoE layer
    return monitor.reports[-1]


def test_expert_load_feeds_the_straggler_report():
    """Each rank's expert rows over the window (every MoE layer, every step) are gathered with
    the timings; a rank whose experts ran hot shows it."""
    pool = get_pool(WORLD)
    pool.run(_monitor_group, (), [()] * pool.world)
    reports = pool.run(_expert_rank, (("tp", WORLD),), [()] * WORLD)
    want = tuple(4.0 * (10 * (r + 1) + 5 + 2) for r in range(WORLD))
    for rep in reports:
        assert rep.expert_rows == want
    assert reports[0].expert_imbalance == pytest.approx(max(want) / (sum(want) / WORLD))
    assert f"expert rows {want[-1]:9.0f}" in str(reports[0])


def test_find_stragglers_tells_compute_from_waiting():
    assert find_stragglers([0.1, 0.1, 0.1, 0.1], [0.08, 0.08, 0.0, 0.08], 0.5, 0.01) == (
        (2, "compute"),
    )
    assert find_stragglers([0.1, 0.1, 0.1, 0.1], [0.01, 0.01, 0.01, 0.06], 0.5, 0.01) == (
        (3, "waiting"),
    )
    assert find_stragglers([0.1, 0.101, 0.099, 0.1], [0.01] * 4, 0.5, 0.01) == ()


# ---------------------------------------------------------------- numerics


def test_spike_guard_skips_spikes_and_non_finite_values():
    guard = SpikeGuard(factor=3.0, warmup=3, action="skip")
    assert [guard.check(i, v) for i, v in enumerate([2.0, 1.9, 1.8, 1.7])] == ["ok"] * 4
    assert guard.check(4, 9.0) == "skip"  # 9 > 3 x 1.85
    assert guard.check(5, float("nan")) == "skip"
    assert guard.check(6, 1.6, grad_norm=float("inf")) == "skip"
    assert guard.check(7, 1.6) == "ok"
    assert [s for s, _ in guard.spikes] == [4, 5, 6]


def test_rollback_to_the_checkpoint_and_skipping_the_batch_equals_never_seeing_it(tmp_path):
    """A poisoned batch at step 6 spikes the loss; the guard rolls back to step 5's checkpoint
    and skips the batch: the run equals one that never had the batch."""
    from autopar.runtime.checkpoints import Checkpointer
    from autopar.tools.testing import Config, build, lm_loss, tokens

    c = Config(layers=1, vocab=32, batch=2)
    good = [tokens(c, seed=1)] * 10  # memorised quickly: the loss falls steadily
    poisoned = (good[0][0], tokens(c, seed=2)[1])  # the same ids with other labels

    def run(batches, guard=None):
        model = build("gpt", c)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ck = Checkpointer(tmp_path / str(guard is not None), model, opt)
        losses, queue = [], list(batches)
        while queue:
            x, y = queue.pop(0)
            loss = lm_loss(model(x), y)
            loss.backward()
            if guard is not None and guard.check(len(losses), loss.item()) == "rollback":
                opt.zero_grad()
                ck.load()
                continue
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            ck.save(len(losses), blocking=True)
        return losses, model

    guard = SpikeGuard(factor=1.5, warmup=3, action="rollback")
    spiky = [*good[:5], poisoned, *good[5:]]
    ref, ref_model = run(good)
    got, model = run(spiky, guard)
    assert len(guard.spikes) == 1 and guard.spikes[0][0] == 5
    assert got == ref
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                ref_model.state_dict().values(), strict=True))  # fmt: skip


def test_loss_scaler_backs_off_on_overflow_and_grows_after_clean_steps():
    p = torch.nn.Parameter(torch.ones(3))
    scaler = LossScaler(scale=8.0, growth_interval=2)
    scaler.scaled(p.sum()).backward()
    assert scaler.unscale_and_check([p]) and torch.equal(p.grad, torch.ones(3))
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert not scaler.unscale_and_check([p]) and scaler.scale == 4.0
    for _ in range(2):
        p.grad = torch.ones(3)
        assert scaler.unscale_and_check([p])
    assert scaler.scale == 8.0


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    sys.exit(0)


def _fail_or_wait(rank: int, groups: dict) -> None:
    if rank == 0:
        raise ValueError("rank 0's own mistake")
    dist.barrier()  # rank 1 waits on rank 0, which never comes


def test_a_failed_rank_is_reported_while_the_others_wait_on_it():
    """A rank that raises while the others wait on it (a pipeline receive, a collective) is
    reported with its traceback once the grace period ends, naming the ranks left waiting,
    not as the pool's timeout with the cause lost."""
    from autopar.runtime.pool import WorkerError

    with pytest.raises(WorkerError) as err:
        get_pool(2).run(_fail_or_wait, (("tp", 2),), [(), ()])
    assert "rank 0 failed" in str(err.value) and "rank 0's own mistake" in str(err.value)
    assert "ranks [1] never finished (waiting on it)" in str(err.value)
