"""Elastic training: a training loop that survives torchrun's elastic restarts with a new world.

    run = Elastic(root, model=make_model, batch=batch_of_step, loss_fn=loss_fn, steps=1000,
                  save_every=100, mesh="tp=2, dp=*")   # or mesh=None: Mesh.auto chooses
    run.train()                                          # under torchrun --nnodes MIN:MAX

Algorithm (:meth:`Elastic.train`, on every (re)start of the workers):
1. The job's Gloo group, its keys prefixed by a generation the round's workers agree on
   (torchrun's agents keep one store across restarts: :func:`init_attempt_group`); the
   attempt is the number of starts ``root/elastic/replans.jsonl`` records (torchrun's restart
   count differs between agents); the cluster from the environment
   (``LOCAL_WORLD_SIZE`` GPUs per node, ``WORLD_SIZE / LOCAL_WORLD_SIZE`` nodes).
2. Plan for that world: the user's rule (``"tp=2, dp=*"``: tp 2, dp the rest; a callable
   world -> Mesh) or ``Mesh.auto`` (the whole-cluster search, global batch fixed; its
   world-independent prices kept in ``root/elastic/plan_cache`` for the next start:
   autopar.planner.cache), compile and
   bind to a DeviceMesh in the chosen axis order.  The re-plan time (trace + search + compile)
   is measured.
3. Load the newest committed checkpoint resharded to the new plan (model, optimizer incl. ZeRO
   shards, RNG, step = data position: :class:`autopar.runtime.checkpoints.Checkpointer`);
   a ``.tmp`` left by a rank lost mid-save is ignored, so the previous commit is resumed.
4. Train: the global batch of step ``i`` is ``batch(i)``, the same whatever the world; each
   rank feeds its dp (then ep) slice of it, in ``accumulate`` chunks when fewer ranks must
   hold more rows (``micro_rows``), so the loss curve is an uninterrupted run's.
5. A rank lost: the watchdog ends every survivor with ``EXIT_CODE`` (non-zero: torchrun
   restarts the workers with the new world) after recording why in ``root/elastic/`` (unless
   torchrun's own SIGTERM ends it within ``STOP_GRACE_S``: the agent stopping the workers for
   a node that joins is no failure).  A start with no failure recorded and a larger world
   than the checkpoint's reads "the world is now N ranks".
6. A straggler slow in compute for ``evict_after`` consecutive reports is evicted: its node's
   agent is sent SIGTERM (torchrun then leaves the rendezvous open for the others) and the
   survivors exit with ``EXIT_CODE`` after ``EVICT_GRACE_S`` (the evicted agent is gone by
   then, so it cannot join the survivors' next rendezvous round and leave them waiting for
   its role), the reason recorded; they re-plan and resume as after a failure.
7. Each start prints and appends to ``root/elastic/replans.jsonl`` one :class:`Replan`: old mesh
   -> new mesh, the reason, the re-plan and resume times.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import InputError, MeshError
from autopar.mesh import KNOWN_AXES, Mesh
from cost.hardware import Cluster

REASON = "reason.txt"
STOP_GRACE_S = 2.0  # a watchdog verdict waits this long for torchrun's own SIGTERM (step 5)
EVICT_GRACE_S = 5.0  # survivors of an eviction exit this long after its SIGTERM (step 6)


def init_attempt_group(timeout_s: float = 120.0) -> int:
    """Step 1: the job's Gloo group, its rendezvous keys prefixed by this round's generation;
    returns the generation (0 on a fresh store, then one more per round that shares it).

    torchrun's agents keep one worker store across restarts, so a restarted worker reading the
    previous round's addresses would dial dead processes.  ``TORCHELASTIC_RESTART_COUNT`` cannot
    name the round: a membership change (a node joining) restarts the workers without counting,
    and a node that joins late starts its count at 0.  The generation is agreed on instead
    (:func:`agree_generation`).  Under ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (needed for a
    node to join a running job with torch 2.13: a late agent waits for a store address the
    first agent published only in round 0) rank 0 hosts a fresh store each round."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=world, is_master=rank == 0 and not agent_store,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)  # fmt: skip
    generation = agree_generation(store, rank, world, timeout_s)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"autopar/round_{generation}", store),
                            rank=rank, world_size=world)  # fmt: skip
    return generation


def agree_generation(store: Any, rank: int, world: int, timeout_s: float = 120.0) -> int:
    """A number every worker of this rendezvous round agrees on and no earlier round on the same
    store used (the store keeps the keys of dead rounds, so nothing already in it is trusted).

    Algorithm:
    1. Rank 0 takes the next value of the counter ``autopar/generation`` (only rank 0 of each
       round adds to it).
    2. Every other rank posts a fresh random nonce under ``autopar/ask/<rank>`` and waits for
       ``autopar/answer/<nonce>``; rank 0 answers every nonce it reads there (a stale one from
       a dead round is answered too, harmlessly) until each rank has acknowledged this
       generation under ``autopar/ack/<generation>/<rank>``, keys no earlier round wrote."""
    import uuid

    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"autopar/ask/{rank}", nonce)
        generation = int(store.get(f"autopar/answer/{nonce}"))
        store.set(f"autopar/ack/{generation}/{rank}", "1")
        return generation - 1
    generation = store.add("autopar/generation", 1)
    waiting, answered = set(range(1, world)), set()
    deadline = time.monotonic() + timeout_s
    while waiting:
        for r in sorted(waiting):
            if store.check([f"autopar/ack/{generation}/{r}"]):
                waiting.discard(r)
            elif store.check([f"autopar/ask/{r}"]):
                nonce = store.get(f"autopar/ask/{r}").decode()
                if nonce not in answered:
                    store.set(f"autopar/answer/{nonce}", str(generation))
                    answered.add(nonce)
        if waiting and time.monotonic() > deadline:
            raise MeshError(f"ranks {sorted(waiting)} of a world of {world} did not join the "
                            f"elastic group within {timeout_s:.0f} s (rank 0's generation "
                            f"{generation}); check that every agent runs the same job")  # fmt: skip
        time.sleep(0.01)
    return generation - 1


def cluster_from_env(preset: str = "dgx-h100") -> Cluster:
    """Step 1: ``preset``'s node with ``LOCAL_WORLD_SIZE`` GPUs, ``WORLD_SIZE`` of them in all."""
    import dataclasses

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if local < 1 or world % local:
        raise MeshError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local}: "
                        "elastic plans need the same number of workers on every node")  # fmt: skip
    return dataclasses.replace(Cluster.preset(preset, nodes=world // local), gpus_per_node=local)


def mesh_rule(rule: str) -> Callable[[int], Mesh]:
    """``"tp=2, dp=*"`` -> world -> Mesh: fixed degrees, one axis (``*``) the rest of the world."""
    fixed, rest = {}, None
    for part in filter(None, (p.strip() for p in rule.split(","))):
        name, _, value = (x.strip() for x in part.partition("="))
        if name not in KNOWN_AXES or not (value == "*" or value.isdigit()) or name in fixed:
            raise InputError(f"cannot read {part!r} in the mesh rule {rule!r}: write degrees "
                             "as 'tp=2, dp=*' (axes dp, pp, cp, ep, tp; '*' the rest, once)")  # fmt: skip
        if value == "*":
            if rest is not None:
                raise InputError(f"mesh rule {rule!r}: only one axis can be '*'")
            rest = name
        else:
            fixed[name] = int(value)

    def mesh(world: int) -> Mesh:
        used = 1
        for n in fixed.values():
            used *= n
        if world % used or (rest is None and world != used):
            raise MeshError(f"mesh rule {rule!r} does not fit a world of {world} ranks "
                            f"(the fixed degrees need a multiple of {used})")  # fmt: skip
        sizes = {**fixed, **({rest: world // used} if rest else {})}
        return Mesh(**{a: n for a, n in sizes.items() if n > 1} or {"tp": 1})

    return mesh


@dataclass(frozen=True, kw_only=True)
class Replan:
    """One (re)start: the mesh before and after, why, and what it cost."""

    attempt: int
    world: int
    old_mesh: str
    new_mesh: str
    reason: str
    replan_s: float  # trace + search + compile + bind
    resume_s: float  # loading the checkpoint resharded
    resumed_step: int
    chunks: int = 1  # gradient accumulation: each step's global batch in this many forwards

    def __str__(self) -> str:
        return (f"[autopar elastic] attempt {self.attempt}: {self.old_mesh} -> {self.new_mesh} "
                f"(world {self.world}); reason: {self.reason}; re-plan {self.replan_s:.2f} s, "
                f"resume {self.resume_s:.2f} s from step {self.resumed_step}"
                + (f"; {self.chunks} accumulated chunks per step" if self.chunks > 1 else ""))  # fmt: skip


class Elastic:
    """A training run that continues across restarts with another world size (steps 1-7).

    ``model()``: the unmodified single-device model (the same initial weights on every
    process); ``batch(step)``: the global batch of ``step`` (1-based), a tuple of tensors whose
    last is the target; ``loss_fn(out, target)``; ``optimizer(params)``: a torch optimizer
    (ZeRO-sharded for the plan: the optimizer's class and keyword arguments are read from it);
    ``mesh``: a rule (``"tp=2, dp=*"``), a callable world -> Mesh, or None for ``Mesh.auto``;
    ``micro_rows``: at most this many rows per rank per forward (gradient accumulation makes
    up the global batch); ``on_step(step, run)``: called before each step (tests inject faults).
    """

    def __init__(self, root: str | Path, *, model: Callable[[], torch.nn.Module],
                 batch: Callable[[int], tuple], loss_fn: Callable[..., torch.Tensor] | None,
                 steps: int, save_every: int,
                 optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 mesh: str | Callable[[int], Mesh] | None = None, micro_rows: int | None = None,
                 watchdog_timeout: float = 20.0, straggler_every: int = 3,
                 evict_after: int | None = None, gpu: str = "dgx-h100",
                 on_step: Callable[[int, Elastic], None] | None = None,
                 **options: Any) -> None:  # fmt: skip
        if steps < 1 or save_every < 1:
            raise InputError(f"steps ({steps}) and save_every ({save_every}) must be positive")
        self.root, self.model_fn, self.batch, self.loss_fn = Path(root), model, batch, loss_fn
        self.steps, self.save_every, self.micro_rows = steps, save_every, micro_rows
        self.optimizer_fn = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3))
        self.rule = mesh_rule(mesh) if isinstance(mesh, str) else mesh
        self.watchdog_timeout, self.gpu, self.on_step = watchdog_timeout, gpu, on_step
        self.straggler_every, self.evict_after, self.options = straggler_every, evict_after, options
        self.attempt = 0  # starts recorded before this one (read in train)
        self.losses: dict[int, float] = {}
        self.checkpointer: Any = None

    # ------------------------------------------------------------ step 2: plan for this world

    def plan(self) -> tuple[Any, Mesh, float]:
        """(this rank's module, its mesh, seconds) for the world that is there."""
        from torch.distributed.device_mesh import init_device_mesh

        from autopar import autoparallelize
        from autopar.runtime import bind

        start, world = time.perf_counter(), dist.get_world_size()
        cluster = cluster_from_env(self.gpu)
        wanted = None if self.rule is None else Mesh.ordered(self.rule(world).axes, cluster)
        self.chunks = self.accumulate(world, wanted)
        model, example = self.model_fn(), self.example()
        if wanted is None:
            options = {"plan_cache": self.root / "elastic" / "plan_cache", **self.options}
            prog = autoparallelize(model, Mesh.auto(cluster, global_batch=self.global_rows),
                                   example, loss_fn=self.loss_fn, **options)  # fmt: skip
            mesh = prog.search.mesh
            if "pp" in mesh.sizes and self.chunks > 1:
                raise InputError(f"Mesh.auto chose {mesh} for a world of {world}: a pipeline "
                                 "runs its own micro-batches, so micro_rows cannot accumulate "
                                 "chunks as well; give micro_rows=None or a mesh rule "
                                 "without pp")  # fmt: skip
        else:
            mesh = wanted
            prog = autoparallelize(model, mesh, example, loss_fn=self.loss_fn, **self.options)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        dm = init_device_mesh(device, tuple(n for _, n in mesh.axes),
                              mesh_dim_names=tuple(a for a, _ in mesh.axes))  # fmt: skip
        module = bind(prog, dm, mesh, self.options.get("param_dtype", torch.float32),
                      self.options.get("mixed_precision", "cast"))  # fmt: skip
        self.coords = {a: dm.get_local_rank(a) for a, _ in mesh.axes}
        return module, mesh, time.perf_counter() - start

    @property
    def global_rows(self) -> int:
        return int(self.batch(1)[0].shape[0])

    def accumulate(self, world: int, mesh: Mesh | None) -> int:
        """Chunks each step's global batch runs in, so no rank feeds more than ``micro_rows``
        rows at once (1 with a pipeline: its micro-batches do that).  Under ``Mesh.auto``
        (``mesh`` None, not chosen yet) every rank is assumed to split the batch."""
        if self.micro_rows is None or (mesh is not None and "pp" in mesh.sizes):
            return 1
        splitting = world if mesh is None else mesh.size("dp") * mesh.size("ep")
        rows = self.global_rows
        for k in range(1, rows // splitting + 1):  # the fewest equal chunks that are small enough
            if rows % (k * splitting) == 0 and rows // (k * splitting) <= self.micro_rows:
                return k
        raise InputError(f"the global batch of {rows} rows does not split into equal chunks of "
                         f"at most micro_rows={self.micro_rows} rows on each of {splitting} "
                         "batch-splitting ranks; pick a global batch with more divisors")  # fmt: skip

    def example(self) -> tuple:
        """The first chunk of step 1's global batch: what the program is compiled for."""
        return tuple(t.chunk(self.chunks)[0] if _batched(t) else t for t in self.batch(1))

    # ------------------------------------------------------------ step 4: the local batch

    def local(self, step: int, mesh: Mesh) -> list[tuple]:
        """This rank's inputs of ``step``: per chunk, its dp slice then its ep slice."""
        from autopar.axes.data_parallel import batch_slices

        out = []
        for i in range(self.chunks):
            chunk = []
            for t in self.batch(step):
                t = t.chunk(self.chunks)[i] if _batched(t) else t
                for axis in ("dp", "ep"):
                    if axis in mesh.sizes and _batched(t):
                        t = batch_slices(t, mesh.size(axis))[self.coords[axis]]
                chunk.append(t)
            out.append(tuple(chunk))
        return out

    # ------------------------------------------------------------ the loop

    def train(self) -> dict[int, float]:
        """Steps 1-7; returns {step: loss} of the steps this attempt ran."""
        from autopar.runtime.resilience import (
            EXIT_CODE,
            RankFailure,
            StragglerMonitor,
            Watchdog,
            enable_flight_recorder,
        )

        enable_flight_recorder()
        if not dist.is_initialized():
            init_attempt_group()
        self.attempt = len(replans(self.root))  # rank 0 appends this start's after a barrier
        module, mesh, replan_s = self.plan()
        opt = self._optimizer(module)
        resumed, resume_s = self._resume(module, opt)
        self._record(mesh, replan_s, resume_s, resumed)
        dist.barrier()
        watchdog = Watchdog(timeout=self.watchdog_timeout, on_failure=self._peer_lost)
        monitor = StragglerMonitor(every=self.straggler_every, evict_after=self.evict_after)
        step_fn = self._step_fn(module, opt, mesh)
        try:
            with watchdog.guard():
                for step in range(resumed + 1, self.steps + 1):
                    watchdog.step(step)
                    with monitor.step():
                        if self.on_step is not None:
                            self.on_step(step, self)
                        self.losses[step] = step_fn(step)
                    if step % self.save_every == 0:
                        self.checkpointer.save(step, {"data_position": step, "mesh": str(mesh),
                                                      "world": dist.get_world_size()})  # fmt: skip
                    self._maybe_evict(monitor, watchdog)
                self.checkpointer.wait()
        except RankFailure as e:  # a peer died or hung: the exit torchrun restarts on
            self._failed(str(e))
            print(f"[autopar elastic] rank {dist.get_rank()}: {e}", file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)
        except Exception as e:
            self._failed(f"{type(e).__name__}: {e}")
            raise
        watchdog.stop()
        dist.destroy_process_group()
        return self.losses

    def _optimizer(self, module: Any) -> Any:
        """The user's optimizer, rebuilt for the plan (ZeRO-1 shards its state over dp)."""
        probe = self.optimizer_fn([torch.nn.Parameter(torch.zeros(1))])
        kwargs = {k: v for k, v in probe.defaults.items() if k in _OPT_KEYS}
        if hasattr(module, "optimizer"):
            return module.optimizer(type(probe), **kwargs)
        return type(probe)(module.parameters(), **kwargs)

    def _resume(self, module: Any, opt: Any) -> tuple[int, float]:
        from autopar.runtime.checkpoints import Checkpointer

        start = time.perf_counter()
        self.checkpointer = Checkpointer(self.root / "ckpt", module, opt)
        resumed = self.checkpointer.load()
        self.previous_mesh = resumed.extra.get("mesh", "?") if resumed else "none"
        self.previous_world = resumed.extra.get("world") if resumed else None
        return (resumed.extra["data_position"] if resumed else 0), time.perf_counter() - start

    def _step_fn(self, module: Any, opt: Any, mesh: Mesh) -> Callable[[int], float]:
        """One optimizer step over the global batch of ``step``; the global loss."""
        from autopar.runtime import PipelineRunner

        def step(n: int) -> float:
            chunks = self.local(n, mesh)
            if isinstance(module, PipelineRunner):
                loss = module.step(*chunks[0][:-1], target=chunks[0][-1])
                total = float(loss.detach())
            else:
                total = 0.0
                for chunk in chunks:
                    loss = module(*chunk)
                    (loss / len(chunks)).backward()
                    total += float(loss.detach()) / len(chunks)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return total

        return step

    # ------------------------------------------------------------ steps 5-7: reasons, reports

    def _reason_file(self) -> Path:
        return self.root / "elastic" / REASON

    def _peer_lost(self, message: str) -> None:
        """Step 5 for the watchdog's verdict, after STOP_GRACE_S: when torchrun stops the
        workers itself (a node joined), it signals them one by one, and a rank that sees a
        stopped peer first must not record that as a failure; its own SIGTERM ends it first."""
        time.sleep(STOP_GRACE_S)
        self._failed(message)

    def _failed(self, message: str) -> None:
        """Step 5: why this attempt ends (the first rank to write it wins)."""
        path = self._reason_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            path.write_text(f"attempt {self.attempt} ended: {message}")

    def _maybe_evict(self, monitor: Any, watchdog: Any) -> None:
        """Step 6: a straggler's node leaves; the others exit to re-plan."""
        from autopar.runtime.resilience import EXIT_CODE

        found = monitor.to_evict()
        if found is None:
            return
        rank, why = found
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        node = rank // local
        me = dist.get_rank()
        self.checkpointer.wait()
        self._failed(f"evicted node {node} (ranks {node * local}..{node * local + local - 1}): "
                     f"{why}")  # fmt: skip
        print(f"[autopar elastic] rank {me}: evicting node {node}: {why}", file=sys.stderr,
              flush=True)  # fmt: skip
        watchdog.stop()
        if me // local == node:
            if me % local == 0:
                os.kill(os.getppid(), signal.SIGTERM)  # the agent stops its workers, leaves
            time.sleep(3600)
        # an evicted agent still in its monitor loop when the survivors' agents open the next
        # round would join it and never post its role (the others then time out after 60 s;
        # seen once under load in the full suite): exit once it is gone
        time.sleep(EVICT_GRACE_S)
        os._exit(EXIT_CODE)

    def _record(self, mesh: Mesh, replan_s: float, resume_s: float, resumed: int) -> None:
        """Step 7: one Replan, printed by rank 0 and appended to replans.jsonl."""
        path = self._reason_file()
        world = dist.get_world_size()
        if path.exists():
            reason = path.read_text()
        elif self.previous_mesh == "none":
            reason = "first start"
        elif self.previous_world not in (None, world):  # restarted by torchrun: a node joined
            reason = f"the world is now {world} ranks (was {self.previous_world})"
        else:
            reason = "restarted with no failure recorded"
        report = Replan(attempt=self.attempt, world=world, old_mesh=self.previous_mesh,
                        new_mesh=str(mesh), reason=reason, replan_s=replan_s,
                        resume_s=resume_s, resumed_step=resumed, chunks=self.chunks)  # fmt: skip
        self.replan = report
        dist.barrier()
        if dist.get_rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            print(report, flush=True)
            with open(self.root / "elastic" / "replans.jsonl", "a") as f:
                f.write(json.dumps(asdict(report)) + "\n")
            path.unlink(missing_ok=True)


def replans(root: str | Path) -> list[dict[str, Any]]:
    """The :class:`Replan` records of every start of the run in ``root``, oldest first."""
    path = Path(root) / "elastic" / "replans.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


_OPT_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "alpha", "amsgrad", "foreach")


def _batched(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0
