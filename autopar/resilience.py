"""Surviving a long run: failures that end cleanly, stragglers named, loss spikes handled.

:class:`Watchdog` -- a rank that dies or hangs mid-step ends every other rank with an error
naming it and the collective.  Algorithm:
1. torch's flight recorder (``TORCH_FR_BUFFER_SIZE``, Gloo included) records every collective
   a rank issues with its per-process-group sequence number.
2. A daemon thread publishes this rank's heartbeat to the job's store every ``interval``: the
   time and, per process group, the last collective issued (sequence number and name).
3. It reads every rank's heartbeat.  A rank whose heartbeat is older than ``timeout`` died;
   a rank that is ``timeout`` behind this rank on a process group they share never joined this
   rank's collective (hung).  Either way this rank prints the named error and exits non-zero
   (a rank blocked inside a collective cannot raise, so the thread ends the process).
4. :meth:`Watchdog.guard` turns a collective's own error (Gloo: "connection closed by peer")
   into :class:`RankFailure` naming the dead rank, once its heartbeat goes stale.

:class:`StragglerMonitor` -- per-rank step time and time blocked in collectives (the blocking
``torch.distributed`` calls are timed while a step runs); every ``every`` steps the per-rank
medians are all-gathered and ranks whose compute (step minus waiting) exceeds the median by
``margin`` (and ``min_s``) are named, slow in compute; a rank whose waiting alone exceeds the
median is named as waiting on others.

:class:`SpikeGuard` -- a loss or gradient norm that is non-finite or ``factor`` times the
median of the last ``window`` accepted values is a spike: skip the step, or roll back to the
last checkpoint and skip the batch.  :class:`LossScaler` -- fp16 dynamic loss scaling.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

EXIT_CODE = 75  # what a rank ended by the watchdog exits with


class RankFailure(RuntimeError):
    """Another rank died or hung; the message names it and the collective."""


# ---------------------------------------------------------------- the watchdog


def enable_flight_recorder(entries: int = 64) -> None:
    """Step 1: record collectives (must run before the process group is created)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(entries))


def last_collectives() -> dict[str, tuple[int, str]]:
    """Per process-group name: (sequence number, name) of the last collective this rank issued,
    from torch's flight recorder."""
    from torch._C._distributed_c10d import _dump_fr_trace

    out: dict[str, tuple[int, str]] = {}
    for e in pickle.loads(_dump_fr_trace()).get("entries", []):
        pg = e["process_group"][0]
        seq = e.get("collective_seq_id") or 0
        if seq >= out.get(pg, (-1, ""))[0]:
            out[pg] = (seq, e.get("profiling_name", "?"))
    return out


def _group_ranks() -> dict[str, list[int]]:
    """Process-group name -> global ranks."""
    from torch.distributed import distributed_c10d as c10d

    out = {}
    for pg, name in c10d._world.pg_names.items():
        with contextlib.suppress(Exception):
            out[name] = dist.get_process_group_ranks(pg)
    return out


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    rank: int
    time: float
    seqs: dict[str, tuple[int, str]]  # process group -> (last sequence number, collective)
    step: int

    def dumps(self) -> bytes:
        return json.dumps({"rank": self.rank, "time": self.time, "seqs": self.seqs,
                           "step": self.step}).encode()  # fmt: skip

    @staticmethod
    def loads(data: bytes) -> Heartbeat:
        d = json.loads(data)
        return Heartbeat(rank=d["rank"], time=d["time"], step=d["step"],
                         seqs={k: (v[0], v[1]) for k, v in d["seqs"].items()})  # fmt: skip


def diagnose(me: Heartbeat, peers: Sequence[Heartbeat | None], groups: dict[str, list[int]],
             now: float, timeout: float, stuck_s: float, since: float = 0.0) -> str | None:  # fmt: skip
    """Step 3: the named failure (a dead rank, or one that never joined this rank's
    collective), or None when every rank is alive and keeping up.  ``since``: when this
    watchdog started (a peer's first heartbeat may come up to ``timeout`` later)."""
    for r, hb in enumerate(peers):
        if r == me.rank or (hb is None and now - since <= timeout):
            continue
        if hb is None or now - hb.time > timeout:
            age = "never started" if hb is None else f"stopped {now - hb.time:.1f} s ago"
            return (f"rank {r} is dead (its heartbeat {age}, process exited?) while rank "
                    f"{me.rank} {_where(me, groups, r)}")  # fmt: skip
    if stuck_s <= timeout:
        return None
    for pg, (seq, op) in sorted(me.seqs.items(), key=lambda kv: -kv[1][0]):
        for r in groups.get(pg, []):
            hb = peers[r] if r < len(peers) else None
            theirs = hb.seqs.get(pg, (0, ""))[0] if hb else 0
            if r != me.rank and theirs < seq:
                return (f"rank {r} did not join {op} #{seq} on process group {pg} (ranks "
                        f"{groups[pg]}) within {timeout:.0f} s: it is at #{theirs} (hung); "
                        f"rank {me.rank} has waited {stuck_s:.1f} s")  # fmt: skip
    return None


def _where(me: Heartbeat, groups: dict[str, list[int]], dead: int) -> str:
    shared = [(seq, op, pg) for pg, (seq, op) in me.seqs.items() if dead in groups.get(pg, [])]
    if not shared:
        return f"was at step {me.step}"
    seq, op, pg = max(shared)
    return f"was in {op} #{seq} on process group {pg} (ranks {groups[pg]}) at step {me.step}"


class Watchdog:
    """Ends this rank with a named error when another rank dies or hangs (steps 1-4).

    Start it after ``init_process_group`` (with :func:`enable_flight_recorder` called before);
    ``timeout`` seconds without a peer's heartbeat, or stuck behind it in a collective, end the
    process with :data:`EXIT_CODE`.  Call :meth:`step` once per training step (names the step in
    the error) and :meth:`stop` at the end.
    """

    def __init__(self, timeout: float = 30.0, interval: float = 0.25, store: Any = None) -> None:
        from torch.distributed import distributed_c10d as c10d

        self.timeout, self.interval = timeout, interval
        self.store = store if store is not None else c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.step_no = 0
        self._stop = threading.Event()
        self._progress = (None, time.monotonic())  # (last collectives, since when unchanged)
        self.failure: str | None = None
        self.started = time.time()
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="autopar-watchdog", daemon=True)
        self._thread.start()

    def step(self, n: int | None = None) -> None:
        self.step_no = self.step_no + 1 if n is None else n

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Step 4: a collective's error becomes a RankFailure naming the rank behind it."""
        try:
            yield
        except RankFailure:
            raise
        except RuntimeError as e:  # c10d's errors (DistBackendError, Gloo's) are RuntimeErrors
            why = self._wait_for_diagnosis()
            if why is None:
                raise
            raise RankFailure(why) from e

    def _wait_for_diagnosis(self) -> str | None:
        deadline = time.monotonic() + self.timeout + 2 * self.interval
        while time.monotonic() < deadline:
            if self.failure is not None:
                return self.failure
            time.sleep(self.interval)
        return self.failure

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(rank=self.rank, time=time.time(), seqs=last_collectives(),
                         step=self.step_no)  # fmt: skip

    def _publish(self) -> Heartbeat:
        hb = self._heartbeat()
        self.store.set(f"autopar/heartbeat/{self.rank}", hb.dumps())
        return hb

    def _peers(self) -> list[Heartbeat | None]:
        keys = [f"autopar/heartbeat/{r}" for r in range(self.world)]
        if not self.store.check(keys):
            return [Heartbeat.loads(self.store.get(k)) if self.store.check([k]) else None
                    for k in keys]  # fmt: skip
        return [Heartbeat.loads(v) for v in self.store.multi_get(keys)]

    def _loop(self) -> None:
        groups = _group_ranks()
        while not self._stop.wait(self.interval):
            try:
                me = self._publish()
                peers = self._peers()
            except Exception as e:  # noqa: BLE001 - the store's host (rank 0) is gone
                self._end(f"rank {self.rank} lost the job's store ({e}); rank 0 is dead")
                return
            if me.seqs != self._progress[0]:
                self._progress = (me.seqs, time.monotonic())
            stuck = time.monotonic() - self._progress[1]
            why = diagnose(me, peers, groups, time.time(), self.timeout, stuck, self.started)
            if why is not None:
                self._end(why)
                return

    def _end(self, why: str) -> None:
        self.failure = why
        print(f"[autopar watchdog] rank {self.rank}: {why}; ending this rank", file=sys.stderr,
              flush=True)  # fmt: skip
        time.sleep(2 * self.interval)  # let guard() raise it on the training thread first
        os._exit(EXIT_CODE)


# ---------------------------------------------------------------- stragglers


_BLOCKING = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor",
             "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
             "barrier", "all_gather_object")  # fmt: skip


class _CollectiveClock:
    """Times the blocking ``torch.distributed`` calls made while it is installed."""

    def __init__(self) -> None:
        self.waiting = 0.0
        self._saved: dict[str, Any] = {}

    def install(self) -> None:
        for name in _BLOCKING:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._saved:
                self._saved[name] = fn
                setattr(dist, name, self._timed(fn))

    def uninstall(self) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("async_op"):
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.waiting += time.perf_counter() - start

        return timed


@dataclass(frozen=True, kw_only=True)
class StragglerReport:
    """One window's per-rank medians and the ranks named slow."""

    step: int
    step_s: tuple[float, ...]
    waiting_s: tuple[float, ...]
    slow: tuple[tuple[int, str], ...]  # (rank, 'compute' | 'waiting')
    expert_rows: tuple[float, ...] = ()  # rows each rank's experts took in the window (MoE)

    @property
    def compute_s(self) -> tuple[float, ...]:
        return tuple(s - w for s, w in zip(self.step_s, self.waiting_s, strict=True))

    @property
    def expert_imbalance(self) -> float:
        """Max / mean expert rows over ranks (1.0 even; a rank with hot experts computes
        longer and every collective waits for it)."""
        mean = sum(self.expert_rows) / max(len(self.expert_rows), 1)
        return max(self.expert_rows) / mean if mean else 1.0

    def __str__(self) -> str:
        lines = [f"straggler report at step {self.step} (per-rank medians):"]
        mean = sum(self.expert_rows) / max(len(self.expert_rows), 1)
        for r, (s, w) in enumerate(zip(self.step_s, self.waiting_s, strict=True)):
            flag = next((f"  <- slow in {k}" for q, k in self.slow if q == r), "")
            experts = (f"  expert rows {self.expert_rows[r]:9.0f} ({self.expert_rows[r] / mean:.2f}"
                       f" x mean)" if self.expert_rows and mean else "")  # fmt: skip
            lines.append(f"  rank {r}: step {s * 1e3:7.1f} ms  compute {(s - w) * 1e3:7.1f} ms  "
                         f"waiting {w * 1e3:7.1f} ms{experts}{flag}")  # fmt: skip
        return "\n".join(lines)


def find_stragglers(step_s: Sequence[float], waiting_s: Sequence[float], margin: float,
                    min_s: float) -> tuple[tuple[int, str], ...]:  # fmt: skip
    """Ranks whose compute exceeds the median compute by ``margin`` (relative) and ``min_s``;
    else whose waiting does (slow links, or waiting on a rank outside this group)."""
    compute = [s - w for s, w in zip(step_s, waiting_s, strict=True)]
    mc, mw = statistics.median(compute), statistics.median(waiting_s)
    slow = [(r, "compute") for r, c in enumerate(compute)
            if c > mc * (1 + margin) and c - mc > min_s]  # fmt: skip
    if not slow:
        slow = [(r, "waiting") for r, w in enumerate(waiting_s)
                if w > mw * (1 + margin) and w - mw > min_s and compute[r] <= mc + min_s]  # fmt: skip
    return tuple(slow)


class StragglerMonitor:
    """Per-rank step and collective-waiting times; a report every ``every`` steps.

    ``with monitor.step(): ...`` around each training step.  Every ``every`` steps the ranks
    all-gather their medians over ``group`` (one tiny collective) and :attr:`reports` gains a
    :class:`StragglerReport` (the same on every rank).  With ``expert_load=True`` each step
    also takes the rows this rank's experts processed (``autopar.expert_parallel``'s record,
    which it resets), so the report shows which ranks' experts ran hot.
    """

    def __init__(self, every: int = 5, margin: float = 0.5, min_s: float = 0.01,
                 group: Any = None, expert_load: bool = False) -> None:  # fmt: skip
        self.every, self.margin, self.min_s, self.group = every, margin, min_s, group
        self.expert_load = expert_load
        self._expert_rows()  # the first window starts now: drop dispatches recorded before
        self.clock = _CollectiveClock()
        self.steps: list[tuple[float, float, float]] = []
        self.reports: list[StragglerReport] = []
        self.count = 0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self.clock.waiting = 0.0
        self.clock.install()
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            self.clock.uninstall()
            self.steps.append((elapsed, self.clock.waiting, self._expert_rows()))
            self.count += 1
        if self.count % self.every == 0:
            self.reports.append(self._report())

    def _expert_rows(self) -> float:
        if not self.expert_load:
            return 0.0
        from autopar import collectives

        return float(sum(sum(rows) for rows, _ in collectives.expert_load(reset=True)))

    def _report(self) -> StragglerReport:
        mine = torch.tensor([statistics.median(s for s, _, _ in self.steps),
                             statistics.median(w for _, w, _ in self.steps),
                             sum(e for _, _, e in self.steps)], dtype=torch.float64)  # fmt: skip
        world = dist.get_world_size(self.group)
        out = torch.zeros(world * 3, dtype=torch.float64)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        step_s, waiting_s, rows = out.view(world, 3).unbind(1)
        self.steps.clear()
        return StragglerReport(step=self.count, step_s=tuple(step_s.tolist()),
                               waiting_s=tuple(waiting_s.tolist()),
                               slow=find_stragglers(step_s.tolist(), waiting_s.tolist(),
                                                    self.margin, self.min_s),
                               expert_rows=tuple(rows.tolist()) if self.expert_load else ())  # fmt: skip

    def slow_ranks(self) -> set[int]:
        return {r for rep in self.reports for r, _ in rep.slow}


# ---------------------------------------------------------------- numerics


@dataclass(kw_only=True)
class SpikeGuard:
    """The spike rule: non-finite, or above ``factor`` x the median of the last ``window``
    accepted values (after ``warmup`` of them), for the loss and the gradient norm.

    :meth:`check` returns ``'ok'``, or the configured ``action`` (``'skip'``: do not step, drop
    the gradients; ``'rollback'``: reload the last checkpoint and skip the batch)."""

    factor: float = 3.0
    window: int = 20
    warmup: int = 5
    action: str = "skip"
    losses: deque = field(default_factory=deque)
    norms: deque = field(default_factory=deque)
    spikes: list[tuple[int, str]] = field(default_factory=list)

    def check(self, step: int, loss: float, grad_norm: float | None = None) -> str:
        why = self._spike("loss", loss, self.losses) or (
            self._spike("gradient norm", grad_norm, self.norms) if grad_norm is not None else None
        )
        if why is not None:
            self.spikes.append((step, why))
            return self.action
        self._accept(self.losses, loss)
        if grad_norm is not None:
            self._accept(self.norms, grad_norm)
        return "ok"

    def _spike(self, what: str, value: float, history: deque) -> str | None:
        if not math.isfinite(value):
            return f"{what} is {value}"
        if len(history) >= self.warmup:
            median = statistics.median(history)
            if value > self.factor * median:
                return f"{what} {value:.4g} > {self.factor:g} x median {median:.4g}"
        return None

    def _accept(self, history: deque, value: float) -> None:
        history.append(value)
        while len(history) > self.window:
            history.popleft()


def grad_norm(params: Sequence[torch.nn.Parameter], group: Any = None) -> float:
    """The global L2 norm of the gradients: local sums of squares all-reduced over ``group``
    (tp shards hold disjoint pieces; pass the group whose ranks hold distinct shards)."""
    local = sum((p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None),
                torch.zeros((), dtype=torch.float32))  # fmt: skip
    if group is not None:
        dist.all_reduce(local, group=group)
    return float(local.sqrt())


@dataclass(kw_only=True)
class LossScaler:
    """fp16 dynamic loss scaling: scale the loss, unscale the gradients; on an overflow skip
    the step and halve the scale, after ``growth_interval`` clean steps double it."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    backoff: float = 0.5
    growth: float = 2.0
    clean: int = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_and_check(self, params: Sequence[torch.nn.Parameter], group: Any = None) -> bool:
        """Unscale the gradients; True when they are finite on every rank (then step)."""
        found = torch.zeros(())
        for p in params:
            if p.grad is not None:
                p.grad.div_(self.scale)
                found += (~torch.isfinite(p.grad)).any().float()
        if group is not None:
            dist.all_reduce(found, group=group)
        ok = bool(found == 0)
        if ok:
            self.clean += 1
            if self.clean % self.growth_interval == 0:
                self.scale *= self.growth
        else:
            self.scale *= self.backoff
            self.clean = 0
        return ok
