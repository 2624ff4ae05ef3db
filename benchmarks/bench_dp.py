"""Step time of autopar's data axis next to torch DDP and torch FSDP2 on the same model.

Run from the repository root (after `pip install -e .`, or with `PYTHONPATH=.`):

    python benchmarks/bench_dp.py

Algorithm:
1. Spawn WORLD Gloo ranks forming one data-parallel mesh, one compute thread each.
2. For each size, every rank builds the same autopar.tools.testing Llama (fp32, seed 0) and from it
   a. autopar ZeRO-0: ``autoparallelize(model, device_mesh, (x, y), loss_fn=lm_loss, zero=0)``
      (the traced program under torch DDP, gradients averaged, the loss all-reduced);
   b. torch DDP on the eager model, ``lm_loss`` applied outside;
   c. autopar ZeRO-3: the traced program with its blocks outlined into submodules, FSDP2
      ``fully_shard`` on each block and on the rest, resharded after forward;
   d. torch FSDP2 with ``fully_shard`` on every block and on the root (eager model);
   e. the same FSDP2 step returning the global-batch loss as autopar does (one asynchronous
      scalar all-reduce launched after forward, waited when the loss is read): the same
      semantics, for the second ZeRO-3 ratio.
   Each variant takes AdamW steps on its rank's half of one fixed global batch.
3. Warm up WARMUP rounds, then time ITERS rounds of one training step (forward, backward,
   optimizer, reading the loss) of each variant, interleaved, the order rotated every round
   (so no variant always runs after the same other one); a distributed step costs its
   slowest rank's time.  autopar's step includes the scalar all-reduce that returns the
   global-batch loss (asynchronous: ``loss.item()`` at the end of the step waits for it).
   Each step is timed twice: wall clock, and the process CPU time of every thread (compute,
   Gloo's threads), which other jobs on a shared machine inflate far less.
4. Rank 0 prints the median ms per step and the ratios autopar/DDP (goal <= 1.05) and
   autopar ZeRO-3 / FSDP2 (goal <= 1.0; and against e), wall and CPU, with the last loss of
   each variant (they agree).
5. One more (untimed) step of c and d under a dispatch mode that samples, at every op, the
   bytes of parameters FSDP2 holds gathered (``autopar.runtime.gathered_bytes``): the peak
   per rank, next to the whole model's parameter bytes (what one FSDP2 group would gather).

A benchmark, not a test: nothing asserts on time.  Other load on the machine inflates every
column; interleaving keeps the ratios comparable.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from autopar import autoparallelize
from autopar.runtime.pool import free_port, gloo_rank
from autopar.tools.testing import Config, build, lm_loss, optimizer_step, tokens

WORLD, WARMUP, ITERS = 2, 4, 16
SIZES = ((128, 64), (256, 64), (512, 64))  # (hidden, seq)
VARIANTS = ("autopar-zero0", "ddp", "autopar-zero3", "fsdp2", "fsdp2-global")


def config(hidden: int, seq: int) -> Config:
    return Config(layers=4, hidden=hidden, heads=8, kv_heads=4, ffn=3 * hidden, vocab=2048,
                  seq=seq, batch=8, bias=False)  # fmt: skip


def variants(c: Config, mesh: object) -> dict[str, Callable[[], float]]:
    """Step 2: one training-step closure per variant, each on this rank's batch slice."""
    x, y = tokens(c)
    d = mesh.get_local_rank("dp")
    xs, ys = x.chunk(WORLD)[d], y.chunk(WORLD)[d]
    group = mesh.get_group("dp")
    steps = {}
    for zero in (0, 3):
        ours = autoparallelize(build("llama", c), mesh, (x, y), loss_fn=lm_loss, zero=zero)
        steps[f"autopar-zero{zero}"] = optimizer_step(lambda m=ours: m(xs, ys),
                                             ours.optimizer(torch.optim.AdamW, lr=1e-3))  # fmt: skip
    ddp = DistributedDataParallel(build("llama", c), process_group=group, forward_sync_buffers=False)
    steps["ddp"] = optimizer_step(lambda: lm_loss(ddp(xs), ys), torch.optim.AdamW(ddp.parameters(), 1e-3))
    fsdp = build("llama", c)
    for layer in fsdp.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    steps["fsdp2"] = optimizer_step(lambda: lm_loss(fsdp(xs), ys), torch.optim.AdamW(fsdp.parameters(), 1e-3))
    steps["fsdp2-global"] = _global_loss_step(c, mesh, xs, ys)
    steps["modules"] = {"autopar-zero3": ours, "fsdp2": fsdp}  # ours: the zero=3 one
    return steps


def _global_loss_step(c: Config, mesh: object, xs: torch.Tensor, ys: torch.Tensor,
                      ) -> Callable[[], float]:  # fmt: skip
    """Step 2e: FSDP2 per block, the loss all-reduced over dp asynchronously after forward
    and waited when read (after the optimizer step), as autopar's PendingScalar does."""
    model = build("llama", c)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), 1e-3)

    def step() -> float:
        loss = lm_loss(model(xs), ys)
        total = loss.detach() / WORLD
        work = dist.all_reduce(total, group=mesh.get_group("dp"), async_op=True)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        work.wait()
        return total.item()

    return step


def timed(step: Callable[[], float]) -> tuple[float, float, float]:
    """Step 3: one step's wall and CPU seconds on the slowest rank (after a barrier), and
    its loss."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    loss = step()
    spent = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu])
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    return spent[0].item(), spent[1].item(), loss


def peak_gathered(module: torch.nn.Module, step: Callable[[], float]) -> int:
    """Step 5: the peak bytes of gathered parameters during one training step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.runtime import gathered_bytes

    class Sample(TorchDispatchMode):
        peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            out = func(*args, **(kwargs or {}))
            Sample.peak = max(Sample.peak, gathered_bytes(module)[0])
            return out

    with Sample():
        step()
    return Sample.peak


def rank_main(rank: int, port: int) -> None:
    """Steps 2-4 on one rank."""
    with gloo_rank(rank, WORLD, port, (WORLD,), ("dp",)) as mesh:
        for hidden, seq in SIZES:
            c = config(hidden, seq)
            steps = variants(c, mesh)
            modules = steps.pop("modules")
            times: dict[str, list[float]] = {v: [] for v in VARIANTS}
            cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
            losses: dict[str, float] = {}
            for i in range(WARMUP + ITERS):
                for v in VARIANTS[i % len(VARIANTS):] + VARIANTS[: i % len(VARIANTS)]:
                    t, c_s, losses[v] = timed(steps[v])
                    if i >= WARMUP:
                        times[v].append(t)
                        cpu[v].append(c_s)
            for v in ("ddp", "fsdp2"):  # torch's losses are this rank's; autopar's are global
                total = torch.tensor(losses[v])
                dist.all_reduce(total)
                losses[v] = total.item() / WORLD
            peaks = {v: peak_gathered(m.local if hasattr(m, "local") else m, steps[v])
                     for v, m in modules.items()}  # fmt: skip
            if rank == 0:
                report(hidden, seq, {v: statistics.median(ts) for v, ts in times.items()},
                       {v: statistics.median(ts) for v, ts in cpu.items()}, losses)  # fmt: skip
                whole = sum(p.numel() * 4 for p in build("llama", c).parameters())
                print(f"  peak gathered parameters per rank: autopar ZeRO-3 "
                      f"{peaks['autopar-zero3'] / 2**20:.2f} MiB, FSDP2 per block "
                      f"{peaks['fsdp2'] / 2**20:.2f} MiB, whole model {whole / 2**20:.2f} MiB",
                      flush=True)  # fmt: skip


def report(hidden: int, seq: int, ms: dict[str, float], cpu: dict[str, float],
           losses: dict[str, float]) -> None:  # fmt: skip
    cols = "  ".join(f"{v} {ms[v] * 1e3:7.2f} ms" for v in VARIANTS)
    print(f"hidden {hidden:4d} seq {seq}: {cols}", flush=True)
    for name, t in (("wall", ms), ("cpu ", cpu)):
        print(f"  {name} autopar/DDP {t['autopar-zero0'] / t['ddp']:.3f} (goal <= 1.05)   "
              f"autopar ZeRO-3/FSDP2 {t['autopar-zero3'] / t['fsdp2']:.3f} (goal <= 1.0)   "
              f"/FSDP2 returning the global loss {t['autopar-zero3'] / t['fsdp2-global']:.3f}",
              flush=True)  # fmt: skip
    print("  last losses " + " ".join(f"{losses[v]:.5f}" for v in VARIANTS), flush=True)


def main() -> int:
    print(f"{WORLD} Gloo ranks, data-parallel, fp32, AdamW; median of {ITERS} interleaved steps (order rotated per round)",
          flush=True)  # fmt: skip
    mp.spawn(rank_main, args=(free_port(),), nprocs=WORLD)
    return 0


if __name__ == "__main__":
    sys.exit(main())
