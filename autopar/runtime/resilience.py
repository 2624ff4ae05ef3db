"""Surviving a long run: failures that end cleanly, stragglers named, loss spikes handled.

:class:`Watchdog` -- a rank that dies or hangs mid-step ends every rank with an error naming
it (the root cause, not the peer each rank happened to wait on) and the collective.  Algorithm:
1. torch's flight recorder (``TORCH_FR_BUFFER_SIZE``, Gloo included) records every collective
   a rank issues with its per-process-group sequence number, and retires it when it completes.
2. A daemon thread publishes this rank's heartbeat to the job's store every ``interval`` (and
   :meth:`Watchdog.step` at each step): a counter, the step, its process groups' ranks and, per group, the last collective issued
   (sequence number, name, still in flight or not).
3. It reads every rank's heartbeat and notes (on its own clock) when each one last changed and
   when each rank's progress last changed.  A heartbeat unchanged for ``timeout`` is a dead
   rank.  Else a rank inside a collective waits on each member of the group at a lower
   sequence number there; once a rank has been stuck for ``timeout`` the waits are followed
   to the rank that waits on nobody: it stopped first (hung) -- :func:`diagnose`.
4. The verdict is posted to the store (the first one posted wins; every rank reads it before
   diagnosing again), so all ranks name the same root cause.  Each rank prints it with where
   it was itself, acknowledges it and exits non-zero (a rank blocked inside a collective cannot
   raise, so the thread ends the process); the store's host waits for the other live ranks'
   acknowledgements first, so its exit never reads as its death.  A store lost before any
   verdict means its host died.
5. :meth:`Watchdog.guard` turns a collective's own error (Gloo: "connection closed by peer")
   into :class:`RankFailure` carrying the verdict.

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
from collections.abc import Callable, Iterator, Sequence
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


@dataclass(frozen=True, kw_only=True)
class FlightState:
    """What torch's flight recorder says about this rank's collectives."""

    seqs: dict[str, tuple[int, str]]  # process group -> (last sequence number, collective)
    inflight: tuple[str, ...]  # process groups whose last collective has not completed
    latest: str = ""  # the process group of the last collective issued


def flight_state() -> FlightState:
    """Step 1: per process group, the last collective this rank issued and whether it is still
    in flight (the flight recorder retires an entry when its work completes)."""
    from torch._C._distributed_c10d import _dump_fr_trace

    last: dict[str, dict] = {}
    entries = pickle.loads(_dump_fr_trace(includeStackTraces=False)).get("entries", [])
    for e in entries:
        pg, seq = e["process_group"][0], e.get("collective_seq_id") or 0
        if pg not in last or seq >= (last[pg].get("collective_seq_id") or 0):
            last[pg] = e
    seqs = {pg: (e.get("collective_seq_id") or 0, e.get("profiling_name", "?"))
            for pg, e in last.items()}  # fmt: skip
    inflight = tuple(sorted(pg for pg, e in last.items() if not e.get("retired", True)))
    latest = (
        max(entries, key=lambda e: e.get("record_id", 0))["process_group"][0] if entries else ""
    )
    return FlightState(seqs=seqs, inflight=inflight, latest=latest)


def _group_ranks() -> dict[str, list[int]]:
    """Process-group name -> global ranks, for the groups this rank belongs to."""
    from torch.distributed import distributed_c10d as c10d

    out = {}
    for pg, name in list(c10d._world.pg_names.items()):
        with contextlib.suppress(Exception):
            out[name] = dist.get_process_group_ranks(pg)
    return out


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    """Step 2: one rank's published progress."""

    rank: int
    time: float
    seqs: dict[str, tuple[int, str]]  # process group -> (last sequence number, collective)
    step: int
    inflight: tuple[str, ...] = ()  # process groups whose last collective has not completed
    groups: dict[str, list[int]] = field(default_factory=dict)  # its process groups' ranks
    latest: str = ""  # the process group of its last collective
    beat: int = 0  # counts publications: a heartbeat that stops changing is a dead rank

    @property
    def progress(self) -> tuple:
        """Changes whenever the rank issues or completes a collective, or starts a step."""
        return (tuple(sorted(self.seqs.items())), self.inflight, self.step)

    def dumps(self) -> bytes:
        return json.dumps({"rank": self.rank, "time": self.time, "seqs": self.seqs,
                           "step": self.step, "inflight": self.inflight, "groups": self.groups,
                           "latest": self.latest, "beat": self.beat}).encode()  # fmt: skip

    @staticmethod
    def loads(data: bytes) -> Heartbeat:
        d = json.loads(data)
        return Heartbeat(rank=d["rank"], time=d["time"], step=d["step"],
                         seqs={k: (v[0], v[1]) for k, v in d["seqs"].items()},
                         inflight=tuple(d.get("inflight", ())), groups=d.get("groups", {}),
                         latest=d.get("latest", ""), beat=d.get("beat", 0))  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Wait:
    """Rank ``waiter`` is inside collective ``op`` #``seq`` on ``group``, which rank ``on``
    (at #``theirs`` there) has not joined."""

    waiter: int
    on: int
    group: str
    seq: int
    op: str
    theirs: int


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """The root cause every rank reports: the rank that stopped making progress first."""

    rank: int
    kind: str  # "dead" | "hung" | "store"
    why: str  # the root rank, what it was doing, who waits on it

    def dumps(self) -> str:
        return json.dumps({"rank": self.rank, "kind": self.kind, "why": self.why})

    @staticmethod
    def loads(data: bytes | str) -> Verdict:
        return Verdict(**json.loads(data))


def all_groups(peers: Sequence[Heartbeat | None]) -> dict[str, list[int]]:
    """Every process group any rank published (a rank knows only the groups it is in)."""
    out: dict[str, list[int]] = {}
    for hb in peers:
        out.update(hb.groups if hb is not None else {})
    return out


def wait_edges(peers: Sequence[Heartbeat | None], groups: dict[str, list[int]]) -> list[Wait]:
    """The wait-for graph: a rank inside a collective waits on each member of its group that
    is at a lower sequence number there (has not joined it yet)."""
    edges = []
    for hb in peers:
        for pg in hb.inflight if hb is not None else ():
            seq, op = hb.seqs[pg]
            for r in groups.get(pg, []):
                peer = peers[r] if r < len(peers) else None
                theirs = peer.seqs.get(pg, (0, ""))[0] if peer is not None else 0
                if r != hb.rank and theirs < seq:
                    edges.append(Wait(waiter=hb.rank, on=r, group=pg, seq=seq, op=op,
                                      theirs=theirs))  # fmt: skip
    return edges


def diagnose(peers: Sequence[Heartbeat | None], beat_age: Sequence[float],
             stuck: Sequence[float], timeout: float) -> Verdict | None:  # fmt: skip
    """Step 3: the root cause, or None while every rank is alive and keeping up.

    ``beat_age[r]``: seconds since rank r's heartbeat last changed; ``stuck[r]``: seconds
    since its progress last changed (both as this rank observed them: no clock is compared
    across hosts).
    1. A rank whose heartbeat is ``timeout`` old is dead; of several, the one silent longest.
    2. Otherwise, once a rank has been stuck in a collective for ``timeout``, follow the
       wait-for graph from the stuck ranks: the ranks the waits lead to that wait on nobody
       stopped first (the others wait on them, directly or through a chain); of several, the
       one stuck longest is the root.  A cycle (collectives issued in different orders) names
       its rank stuck longest.
    """
    groups = all_groups(peers)
    edges = wait_edges(peers, groups)
    dead = [r for r in range(len(peers)) if beat_age[r] > timeout]
    if dead:
        root = max(dead, key=lambda r: (beat_age[r], -r))
        why = ("its heartbeat never started: process exited?" if peers[root] is None else
               f"its heartbeat stopped {beat_age[root]:.1f} s ago: process exited or froze")  # fmt: skip
        return Verdict(rank=root, kind="dead", why=_dead(root, peers, groups, edges, why))
    stuck_waiters = {w.waiter for w in edges if stuck[w.waiter] > timeout}
    if not stuck_waiters:
        return None
    roots = _ends(stuck_waiters, edges)
    root = max(roots, key=lambda r: (stuck[r], -r))
    return Verdict(rank=root, kind="hung", why=_hung(root, peers, groups, edges, stuck[root]))


def _ends(starts: set[int], edges: Sequence[Wait]) -> set[int]:
    """The ranks the waits from ``starts`` lead to that wait on nobody (all the ranks on the
    way when the waits form a cycle)."""
    out = {w.waiter: {x.on for x in edges if x.waiter == w.waiter} for w in edges}
    seen, todo, ends = set(starts), list(starts), set()
    while todo:
        r = todo.pop()
        if not out.get(r):
            ends.add(r)
        for nxt in out.get(r, ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return ends or seen


def _collective(seq: int, op: str, pg: str, groups: dict[str, list[int]]) -> str:
    return f"{op} #{seq} on process group {pg} (ranks {groups.get(pg, '?')})"


def _waiters(root: int, edges: Sequence[Wait]) -> str:
    ranks = sorted({w.waiter for w in edges if w.on == root})
    return f"; ranks {ranks} wait on it" if ranks else ""


def _hung(root: int, peers: Sequence[Heartbeat | None], groups: dict[str, list[int]],
          edges: Sequence[Wait], stuck_s: float) -> str:  # fmt: skip
    """The hung rank: the collectives it never joined (one per group), or, in a cycle of
    waits, the collective it is stuck in."""
    hb = peers[root]
    missed = {(w.group, w.seq): w for w in edges if w.on == root}
    if missed:
        where = "it did not join " + ", nor ".join(
            f"{_collective(w.seq, w.op, w.group, groups)} (it is at #{w.theirs} there)"
            for _, w in sorted(missed.items())
        )
    else:
        pg = hb.inflight[0]
        where = f"it is stuck in {_collective(*hb.seqs[pg], pg, groups)} (a cycle of waits)"
    inside = "inside " + ", ".join(hb.inflight) if hb.inflight else "not inside a collective"
    return (f"rank {root} hung: {where} and has made no progress for {stuck_s:.1f} s "
            f"(at step {hb.step}, {inside}){_waiters(root, edges)}")  # fmt: skip


def _dead(root: int, peers: Sequence[Heartbeat | None], groups: dict[str, list[int]],
          edges: Sequence[Wait], why: str) -> str:  # fmt: skip
    """The dead rank, where its last heartbeat saw it (published every ``interval``)."""
    hb = peers[root] if root < len(peers) else None
    if hb is None:
        return f"rank {root} is dead ({why})"
    last = ""
    if hb.latest in hb.seqs:
        state = "in" if hb.latest in hb.inflight else "after"
        last = f" {state} {_collective(*hb.seqs[hb.latest], hb.latest, groups)}"
    return (f"rank {root} is dead ({why}); last seen at step {hb.step}{last}"
            f"{_reached(hb, peers, groups)}{_waiters(root, edges)}")  # fmt: skip


def _reached(dead: Heartbeat, peers: Sequence[Heartbeat | None],
             groups: dict[str, list[int]]) -> str:  # fmt: skip
    """The furthest collective the dead rank's peers issued on each group they share with it,
    where that is past what the dead rank was last seen issuing."""
    far: dict[str, tuple[int, str]] = {}
    for hb in peers:
        for pg, (seq, op) in hb.seqs.items() if hb is not None and hb.rank != dead.rank else ():
            if dead.rank in groups.get(pg, ()) and seq > max(dead.seqs.get(pg, (0, ""))[0],
                                                               far.get(pg, (0, ""))[0]):  # fmt: skip
                far[pg] = (seq, op)
    if not far:
        return ""
    return "; its peers went on to " + ", ".join(
        _collective(seq, op, pg, groups) for pg, (seq, op) in sorted(far.items())
    )


def where(me: Heartbeat, groups: dict[str, list[int]]) -> str:
    """What this rank was doing when the verdict came."""
    if not me.inflight:
        return f"rank {me.rank} was at step {me.step}"
    pg = me.inflight[0]
    return (f"rank {me.rank} was waiting in {_collective(*me.seqs[pg], pg, groups)} at step "
            f"{me.step}")  # fmt: skip


class _Observer:
    """When (this rank's monotonic clock) each rank's heartbeat and progress last changed."""

    def __init__(self, world: int, now: float) -> None:
        self.beats: list[tuple[Any, float]] = [(None, now)] * world
        self.progress: list[tuple[Any, float]] = [(None, now)] * world

    def update(self, peers: Sequence[Heartbeat | None],
               now: float) -> tuple[list[float], list[float]]:  # fmt: skip
        """(seconds since each heartbeat changed, seconds since each rank's progress did)."""
        for r, hb in enumerate(peers):
            beat = None if hb is None else hb.beat
            progress = None if hb is None else hb.progress
            if beat != self.beats[r][0]:
                self.beats[r] = (beat, now)
            if progress != self.progress[r][0]:
                self.progress[r] = (progress, now)
        return [now - t for _, t in self.beats], [now - t for _, t in self.progress]


VERDICT_KEY = "autopar/verdict"


def _store_host() -> int | None:
    """The rank hosting the job's store: rank 0 (``env://``, ``tcp://``), or none under
    torchrun, whose agent hosts it."""
    return None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0


class Watchdog:
    """Ends this rank with a named error when another rank dies or hangs (steps 1-5).

    Start it after ``init_process_group`` (with :func:`enable_flight_recorder` called before),
    best once the model is compiled and every rank has reached the training loop (a barrier):
    ranks may take unequal times to compile.  ``timeout`` seconds without a peer's heartbeat, or stuck in a collective, end the process
    with :data:`EXIT_CODE`.  Call :meth:`step` once per training step (names the step in the
    error) and :meth:`stop` at the end.  ``store_host``: the rank whose exit closes the job's
    store (default: :func:`_store_host`).  ``on_failure(message)`` runs on the watchdog thread
    just before the exit (an elastic driver records why the attempt ended: autopar.elastic).
    """

    def __init__(self, timeout: float = 30.0, interval: float = 0.25, store: Any = None,
                 store_host: int | None = None,
                 on_failure: Callable[[str], None] | None = None) -> None:  # fmt: skip
        from torch.distributed import distributed_c10d as c10d

        self.timeout, self.interval = timeout, interval
        self.store_host = _store_host() if store_host is None else store_host
        self.store = store if store is not None else c10d._get_default_store()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.step_no, self._beat = 0, 0
        self._stop, self._ended = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self._observer = _Observer(self.world, time.monotonic())
        self._last: tuple[Heartbeat, list[Heartbeat | None]] | None = None
        self.failure: str | None = None
        self.on_failure = on_failure
        self._publish()
        self._thread = threading.Thread(target=self._loop, name="autopar-watchdog", daemon=True)
        self._thread.start()

    def step(self, n: int | None = None) -> None:
        """A new training step: published at once (about a millisecond), so a rank that dies
        between two heartbeats is still seen at the step it died in."""
        self.step_no = self.step_no + 1 if n is None else n
        with contextlib.suppress(Exception):  # the store's loss is the watchdog thread's to judge
            self._publish()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Step 5: a collective's error becomes a RankFailure naming the root cause."""
        try:
            yield
        except RankFailure:
            raise
        except RuntimeError as e:  # c10d's errors (DistBackendError, Gloo's) are RuntimeErrors
            self._ended.wait(3 * self.timeout + 10 * self.interval)  # a safety limit
            if self.failure is None:
                raise
            raise RankFailure(self.failure) from e

    def _publish(self) -> Heartbeat:
        with self._lock:  # the training thread publishes at each step, the watchdog's always
            self._beat += 1
            hb = self._heartbeat_now()
            self.store.set(f"autopar/heartbeat/{self.rank}", hb.dumps())
        return hb

    def _peers(self) -> list[Heartbeat | None]:
        keys = [f"autopar/heartbeat/{r}" for r in range(self.world)]
        if not self.store.check(keys):
            return [Heartbeat.loads(self.store.get(k)) if self.store.check([k]) else None
                    for k in keys]  # fmt: skip
        return [Heartbeat.loads(v) for v in self.store.multi_get(keys)]

    def _loop(self) -> None:
        """Steps 2-4, every ``interval``: a verdict already in the store is taken first."""
        while not self._stop.wait(self.interval):
            try:
                verdict = self._posted() or self._check()
            except Exception as e:  # noqa: BLE001 - the store's host exited with no verdict
                verdict = self._store_lost(e)
            if verdict is not None:
                self._end(verdict)
                return

    def _posted(self) -> Verdict | None:
        if not self.store.check([VERDICT_KEY]):
            return None
        return Verdict.loads(self.store.get(VERDICT_KEY))

    def _check(self) -> Verdict | None:
        """Steps 2-3; a verdict found is posted (the first one posted wins, step 4)."""
        me, peers = self._publish(), self._peers()
        self._last = (me, peers)
        beat_age, stuck = self._observer.update(peers, time.monotonic())
        verdict = diagnose(peers, beat_age, stuck, self.timeout)
        if verdict is None:
            return None
        return Verdict.loads(self.store.compare_set(VERDICT_KEY, "", verdict.dumps()))

    def _store_lost(self, error: Exception) -> Verdict:
        """The store's host closes it only after every rank read the verdict (step 4), so a
        store lost before any verdict means its host died (described from the last
        heartbeats read)."""
        if self.store_host is None:
            return Verdict(rank=-1, kind="store", why=f"the job's store (torchrun's agent) "
                           f"closed ({error}) and no rank had named a failure")  # fmt: skip
        peers = self._last[1] if self._last is not None else []
        groups = all_groups(peers)
        why = f"the job's store it hosts closed: {error}"
        return Verdict(
            rank=self.store_host,
            kind="store",
            why=_dead(self.store_host, peers, groups, wait_edges(peers, groups), why),
        )

    def _end(self, verdict: Verdict) -> None:
        """Step 4: report, acknowledge the verdict; the store's host waits until every other
        live rank has read it (bounded by ``timeout``) before its exit closes the store."""
        me, peers = self._last if self._last is not None else (self._heartbeat_now(), [])
        mine = "this rank" if verdict.rank == self.rank else where(me, all_groups([me, *peers]))
        self.failure = f"{verdict.why}; {mine}"
        print(f"[autopar watchdog] rank {self.rank}: {self.failure}; ending this rank",
              file=sys.stderr, flush=True)  # fmt: skip
        if verdict.kind != "store":
            self._acknowledge(verdict)
        if self.on_failure is not None:
            with contextlib.suppress(Exception):
                self.on_failure(self.failure)
        self._ended.set()
        time.sleep(2 * self.interval)  # let guard() raise it on the training thread first
        os._exit(EXIT_CODE)

    def _acknowledge(self, verdict: Verdict) -> None:
        with contextlib.suppress(Exception):
            self.store.set(f"{VERDICT_KEY}/read/{self.rank}", b"1")
            if self.rank != self.store_host:
                return
            live = [r for r in range(self.world) if verdict.kind == "hung" or r != verdict.rank]
            others = [f"{VERDICT_KEY}/read/{r}" for r in live]
            deadline = time.monotonic() + self.timeout
            while not self.store.check(others) and time.monotonic() < deadline:
                time.sleep(self.interval / 5)

    def _heartbeat_now(self) -> Heartbeat:
        state = flight_state()
        return Heartbeat(rank=self.rank, time=time.time(), seqs=state.seqs, step=self.step_no,
                         inflight=state.inflight, groups=_group_ranks(), latest=state.latest,
                         beat=self._beat)  # fmt: skip


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
    also takes the rows this rank's experts processed (``autopar.axes.expert_parallel``'s record,
    which it resets), so the report shows which ranks' experts ran hot.  With ``evict_after=n``
    a rank named slow in compute in ``n`` consecutive reports is to be evicted
    (:meth:`to_evict`; :mod:`autopar.elastic` removes its node and re-plans).
    """

    def __init__(self, every: int = 5, margin: float = 0.5, min_s: float = 0.01,
                 group: Any = None, expert_load: bool = False,
                 evict_after: int | None = None) -> None:  # fmt: skip
        if evict_after is not None and evict_after < 1:
            raise ValueError(f"evict_after must be a positive number of reports, got {evict_after}")
        self.every, self.margin, self.min_s, self.group = every, margin, min_s, group
        self.evict_after = evict_after
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
        from autopar.ops import collectives

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

    def to_evict(self) -> tuple[int, str] | None:
        """(rank, why) of a rank slow in compute in the last ``evict_after`` reports (the same
        on every rank: the reports are), or None."""
        n = self.evict_after
        if n is None or len(self.reports) < n:
            return None
        last = self.reports[-n:]
        slow = set.intersection(*({r for r, k in rep.slow if k == "compute"} for rep in last))
        if not slow:
            return None
        rank = min(slow)
        compute = ", ".join(f"{rep.compute_s[rank] * 1e3:.0f} ms" for rep in last)
        return rank, (f"rank {rank} was slow in compute in {n} consecutive straggler reports "
                      f"(steps {', '.join(str(rep.step) for rep in last)}; its median compute "
                      f"{compute} vs the median rank's "
                      f"{statistics.median(last[-1].compute_s) * 1e3:.0f} ms)")  # fmt: skip


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
