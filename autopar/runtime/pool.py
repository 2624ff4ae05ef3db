"""A persistent pool of Gloo worker processes for running per-rank programs on this machine.

Starting a torch process costs seconds, so the pool starts ``world`` workers once and reuses
them for every job (tests and :func:`autopar.verify` share one pool per process).

Algorithm:
1. Start ``world`` processes with the user's ``__main__`` hidden from multiprocessing's
   preparation data, so workers never import (re-run) the calling script or notebook: a script
   without an ``if __name__ == "__main__":`` guard works.  They are forked from a fork server
   that imported torch and autopar once (``rank_context``): a pool started again (another
   world size, a rank lost) costs a fraction of a second, not seconds of imports per rank.
   Each worker joins one Gloo process group (loopback rendezvous on a free port) and waits on
   its own task queue.
2. A job is a picklable function plus per-rank arguments for the first ``n`` ranks, pickled in
   the parent by a pickler that refuses (with the fix in the message) any class or function
   the workers cannot import: one defined in ``__main__`` or in a module without a spec
   (``exec``-ed notebook code).  A namedtuple class from such a module travels as its name and
   fields instead.
3. Before a job runs, every worker creates (collectively, once per mesh) the process groups of
   the job's mesh axes; ranks outside the job skip the function.
4. Results come back per rank; an exception on any rank is re-raised with that rank's
   traceback.  A job that does not finish within ``timeout`` kills the pool (never a hang);
   once a rank has failed, the others get ``FAILED_RANK_GRACE`` seconds more (a rank waiting
   on the failed one, in a collective or a pipeline receive, never finishes), then the pool
   stops and the failed rank's traceback is raised, naming the ranks left waiting.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import importlib.util
import io
import os
import pickle
import queue
import socket
import sys
import time
import traceback
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp

_POOL: WorkerPool | None = None
FAILED_RANK_GRACE = 10.0  # seconds the other ranks get to finish once one has failed


class WorkerError(RuntimeError):
    """A job raised on a worker; the message carries that rank's traceback."""


class WorkerPool:
    """``world`` Gloo ranks kept alive across jobs."""

    def __init__(
        self, world: int, timeout: float = float(os.environ.get("AUTOPAR_POOL_TIMEOUT", 300))
    ) -> None:
        self.world, self.timeout = world, timeout
        ctx = rank_context()
        port = free_port()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=with_environment, daemon=True,
                        args=(r, dict(os.environ), _worker, world, port, self.tasks[r],
                              self.results))  # fmt: skip
            for r in range(world)
        ]
        with _main_hidden():
            for p in self.procs:
                p.start()
        self._collect("ready", world)

    def run(self, fn: Callable[..., Any], mesh_axes: Sequence[tuple[str, int]],
            per_rank_args: Sequence[tuple]) -> list[Any]:  # fmt: skip
        """Run ``fn(rank, *per_rank_args[rank])`` on ranks 0..n-1 with the mesh's groups bound."""
        n = len(per_rank_args)
        if n > self.world:
            raise ValueError(f"job needs {n} ranks but the pool has {self.world}")
        for r in range(self.world):
            args = per_rank_args[r] if r < n else None
            self.tasks[r].put(dumps((fn, tuple(mesh_axes), args)))
        return self._collect("job", self.world)[:n]

    def _collect(self, what: str, count: int) -> list[Any]:
        out: dict[int, Any] = {}
        errors = []
        deadline = time.monotonic() + self.timeout
        while len(out) + len(errors) < count:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if errors and time.monotonic() > deadline:  # step 4: left waiting on it
                    self.close()
                    rank, tb = sorted(errors)[0]
                    waiting = sorted(set(range(count)) - set(out) - {r for r, _ in errors})
                    raise WorkerError(f"rank {rank} failed:\n{tb}\nranks {waiting} never "
                                      "finished (waiting on it); pool stopped") from None
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"ranks {dead} died" if dead else f"no result in {self.timeout:.0f}s"
                    raise WorkerError(f"pool {what} failed: {why}; pool stopped") from None
                continue
            if ok:
                out[rank] = value
            else:
                if not errors:
                    deadline = min(deadline, time.monotonic() + FAILED_RANK_GRACE)
                errors.append((rank, value))
        if errors:
            rank, tb = sorted(errors)[0]
            raise WorkerError(f"rank {rank} failed:\n{tb}")
        return [out[r] for r in range(count)]

    def close(self) -> None:
        for q, p in zip(self.tasks, self.procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def get_pool(world: int, exact: bool = False) -> WorkerPool:
    """The process-wide pool, (re)started when a job needs more ranks than it has (or, with
    ``exact``, other than it has: a job that builds a DeviceMesh over the whole world)."""
    global _POOL
    wrong = _POOL is not None and (_POOL.world < world or (exact and _POOL.world != world))
    if _POOL is None or wrong or not all(p.is_alive() for p in _POOL.procs):
        if _POOL is not None:
            _POOL.close()
        _POOL = WorkerPool(world)
    return _POOL


@atexit.register
def _shutdown() -> None:
    if _POOL is not None:
        _POOL.close()


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """Step 1: multiprocessing (spawn, fork server) re-imports ``__main__`` in every child (by
    its module spec, else its file); a stand-in ``__main__`` without either keeps the children
    from running the user's script while they start."""
    main = sys.modules.get("__main__")
    stand_in = types.ModuleType("__main__")
    stand_in.__spec__ = None
    sys.modules["__main__"] = stand_in
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def dumps(obj: Any) -> bytes:
    """Step 2: pickle a job for the workers, refusing what they cannot import."""
    buf = io.BytesIO()
    _JobPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


class _JobPickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, type | types.FunctionType) or worker_importable(obj.__module__):
            return NotImplemented
        if isinstance(obj, type) and issubclass(obj, tuple) and hasattr(obj, "_fields"):
            return _namedtuple, (obj.__module__, obj.__qualname__, tuple(obj._fields))
        where = ("the script being run (__main__)" if obj.__module__ in _MAIN_NAMES
                 else f"module {obj.__module__!r}, which has no file to import it from")  # fmt: skip
        raise pickle.PicklingError(
            f"{obj.__qualname__} is defined in {where}: autopar's worker processes do not run "
            f"your script or notebook, so they cannot load it. Move {obj.__qualname__} into a "
            "module file next to your script and import it from there."
        )


_MAIN_NAMES = ("__main__", "__mp_main__")


def worker_importable(module: str | None) -> bool:
    """Whether a fresh worker can import ``module`` by name."""
    if module in _MAIN_NAMES:
        return False
    mod = sys.modules.get(module or "builtins")
    if mod is None:
        return _findable(module)
    return getattr(mod, "__spec__", None) is not None or hasattr(mod, "__file__")


@functools.cache
def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _namedtuple(module: str, qualname: str, fields: tuple[str, ...]) -> type:
    cls = collections.namedtuple(qualname.rsplit(".", 1)[-1], fields)  # noqa: PYI024
    cls.__module__ = module
    return cls


# imported by the fork server before it forks a rank, where the parent has imported them
FORKSERVER_PRELOAD = ("torch", "torch.export", "autopar", "transformers", "torchao")


def start_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """Run ``fn(rank, *args)`` on ``nprocs`` fresh processes and wait for them, as
    ``torch.multiprocessing.spawn`` does, but fork each from a server process that imported
    the heavy modules this process has (torch, autopar, transformers: seconds per process)
    once, instead of each rank importing them again. The server never ran a torch op, so the
    forked ranks start with no threads; each takes this process's environment as it is now
    (the server's is as it was when it started). A queue in ``args`` comes from
    ``rank_context()``."""
    method = rank_context().get_start_method()
    mp.start_processes(with_environment, args=(dict(os.environ), fn, *args), nprocs=nprocs,
                       start_method=method)  # fmt: skip


def with_environment(rank: int, env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(rank, *args)`` in the environment ``env`` (a forked rank's start)."""
    os.environ.clear()
    os.environ.update(env)
    return fn(rank, *args)


def rank_context() -> Any:
    """The fork-server context of ``start_ranks``, its preload set on first use (``spawn``
    where the platform has no fork server: Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([m for m in FORKSERVER_PRELOAD if m in sys.modules])
    return ctx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tasks: Any, results: Any) -> None:
    import gc

    gc.freeze()  # the modules the fork server imported: never traversed (or copied) by gc
    import torch
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own deprecations
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))  # fmt: skip
    results.put((rank, True, None))
    groups: dict[tuple, dict] = {}
    while (task := tasks.get()) is not None:
        try:
            fn, axes, args = pickle.loads(task)
            if axes not in groups:
                groups[axes] = _mesh_groups(axes, rank)
            value = fn(rank, groups[axes], *args) if args is not None else None
            results.put((rank, True, value))
        except Exception:  # noqa: BLE001 - sent back to the parent with the traceback
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def _mesh_groups(axes: tuple[tuple[str, int], ...], rank: int) -> dict:
    """Create every axis group of the mesh (all workers take part) and keep this rank's."""
    import itertools

    import torch.distributed as dist

    from autopar.ops import collectives

    sizes = [s for _, s in axes]
    mine = {}
    for i, (name, _) in enumerate(axes):
        others = [range(s) if j != i else [0] for j, s in enumerate(sizes)]
        for fixed in itertools.product(*others):
            ranks = []
            for k in range(sizes[i]):
                coords = list(fixed)
                coords[i] = k
                ranks.append(_flat(coords, sizes))
            group = dist.new_group(ranks, backend="gloo")
            if rank in ranks:
                mine[name] = group
            for key, sub in collectives.shared_groups(name, [ranks]):
                group = dist.new_group(sub, backend="gloo")
                if rank in sub:
                    mine[key] = group
    names = [name for name, _ in axes]
    if "dp" in names and "cp" in names:  # the data axis's ZeRO group under cp (dp x cp)
        mine["dp_cp"] = _flattened_group(sizes, [names.index("dp"), names.index("cp")], rank)
    return mine


def _flattened_group(sizes: list[int], dims: list[int], rank: int) -> Any:
    """This rank's group over mesh ``dims`` together (every worker creates every group)."""
    import itertools

    import torch.distributed as dist

    mine = None
    others = [range(s) if j not in dims else [0] for j, s in enumerate(sizes)]
    for fixed in itertools.product(*others):
        ranks = []
        for inner in itertools.product(*(range(sizes[d]) for d in dims)):
            coords = list(fixed)
            for d, c in zip(dims, inner, strict=True):
                coords[d] = c
            ranks.append(_flat(coords, sizes))
        group = dist.new_group(sorted(ranks), backend="gloo")
        if rank in ranks:
            mine = group
    return mine


def _flat(coords: Sequence[int], sizes: Sequence[int]) -> int:
    r = 0
    for c, s in zip(coords, sizes, strict=True):
        r = r * s + c
    return r


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, port: int, shape: tuple[int, ...],
              names: tuple[str, ...]) -> Iterator[Any]:  # fmt: skip
    """One CPU rank of a local Gloo job (examples, benchmarks): one compute thread, the named
    DeviceMesh; at exit a barrier, so no rank tears gloo down while another still talks to it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world))  # fmt: skip
    dist.init_process_group("gloo")
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.barrier()
        dist.destroy_process_group()
