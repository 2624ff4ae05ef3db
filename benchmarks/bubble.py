"""Measured pipeline bubble of autopar's runners next to the formula and the simulated timeline.

Run from the repository root (after `pip install -e .`, or with `PYTHONPATH=.`):

    python benchmarks/bubble.py

Algorithm:
1. For each schedule (GPipe, 1F1B) and micro-batch count m, compile the autopar.tools.testing Llama
   (LAYERS equal blocks, loss_fn=lm_loss, a fixed micro-batch of MICRO sequences, so the batch
   is m * MICRO) for a virtual Mesh(pp=WORLD) and keep its stage cuts and simulated bubble
   (``prog.timeline().bubble``); the formula is REFERENCE.md's (p-1)/(m+p-1) of the step.
2. Spawn WORLD Gloo ranks, one compute thread each; every rank compiles the same model for the
   real pp device mesh and records the inputs its stage module receives in one schedule step.
3. Time the schedule: WARMUP steps, then the median over ITERS of ``runner.step(x, y)`` (forward
   and backward of all micro-batches, no optimizer), each started after a barrier; the step
   ends with the loss broadcast, so every rank measures the same step time T.
4. Time one micro-batch forward+backward of the rank's stage module alone, on its recorded
   inputs (median over ITERS after warm-up): t_mb.  Twice: "alone", one rank at a time while
   the others wait at a barrier, and "together", all ranks at once.
5. Measured bubble per rank = 1 - m * t_mb / T; print per-rank values and their mean, next to
   the formula and the simulated prediction.

Caveats: this machine has 2 cores for WORLD=4 ranks, so ranks contend.  In a steady-state
schedule up to all four ranks compute at once, so "alone" t_mb understates the in-schedule
compute time (measured bubble too high) and "together" t_mb overstates it whenever ranks idle
(measured bubble too low); the truth lies between.  The measured bubble also counts what the
formula ignores: send/recv and its synchronisation, the loss broadcast, schedule bookkeeping
and any imbalance between stages (the per-rank t_mb columns show it).  Absolute numbers are
noisy.  A benchmark, not a test: nothing asserts on time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar import Mesh, autoparallelize
from autopar.axes.schedule import formula_bubble
from autopar.runtime.pool import free_port, gloo_rank
from autopar.tools.testing import Config, build, lm_loss, tokens

WORLD, LAYERS, MICRO, WARMUP, ITERS = 4, 8, 2, 2, 7
SCHEDULES, MICROBATCHES = ("gpipe", "1f1b"), (4, 8)
Rows = dict[tuple[str, int], list[dict[str, Any]]]  # (schedule, m) -> per-rank timings


def config(m: int) -> Config:
    return Config(layers=LAYERS, hidden=256, heads=8, kv_heads=4, ffn=768, vocab=1024, seq=64,
                  batch=m * MICRO, bias=False)  # fmt: skip


def median_s(fn: Callable[[], Any]) -> float:
    """Median wall time of ``fn`` over ITERS calls after WARMUP calls."""
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(ITERS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def stage_fwd_bwd(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> Callable[[], None]:
    """One micro-batch forward+backward of a stage, as the schedule runs it (step 4): the last
    stage back-propagates its loss, the others a gradient for every output that has one."""

    def run() -> None:
        args = tuple(a.detach().requires_grad_(a.requires_grad) for a in inputs)
        out = module(*args)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        module.zero_grad(set_to_none=True)

    return run


def record_inputs(module: torch.nn.Module) -> tuple[list[tuple[torch.Tensor, ...]], Any]:
    """Step 2: a hook keeping the (detached) inputs of each forward call of ``module``."""
    seen: list[tuple[torch.Tensor, ...]] = []

    def hook(_: torch.nn.Module, args: tuple) -> None:
        seen.append(tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args))

    return seen, module.register_forward_pre_hook(hook)


def measure(schedule: str, m: int, mesh: Any) -> dict[str, Any]:
    """Steps 2-4 on one rank for one (schedule, m)."""
    x, y = tokens(config(m))
    runner = autoparallelize(build("llama", config(m)), mesh, (x, y), loss_fn=lm_loss,
                             n_microbatches=m, schedule=schedule)  # fmt: skip
    (stage,) = runner.stage_ids
    module = runner.modules[stage]
    seen, handle = record_inputs(module)
    runner.step(x, y)
    handle.remove()
    module.zero_grad(set_to_none=True)

    def step() -> None:
        dist.barrier()
        runner.step(x, y)

    step_s = median_s(step)
    run = stage_fwd_bwd(module, seen[0])
    alone_s = 0.0
    for r in range(WORLD):
        dist.barrier()
        if r == dist.get_rank():
            alone_s = median_s(run)
    dist.barrier()
    together_s = median_s(run)
    return {"stage": stage, "T": step_s, "alone": alone_s, "together": together_s}


def rank_main(rank: int, port: int, results: mp.SimpleQueue) -> None:
    with gloo_rank(rank, WORLD, port, (WORLD,), ("pp",)) as mesh:
        for schedule in SCHEDULES:
            for m in MICROBATCHES:
                results.put((schedule, m, rank, measure(schedule, m, mesh)))


def report(predicted: dict[tuple[str, int], float], rows: Rows) -> None:
    """Step 5: per (schedule, m): formula, simulation, and measured bubble per rank and mean."""
    for kind in ("alone", "together"):
        print(f"\nmeasured bubble = 1 - m * t_mb / T, t_mb timed {kind}")
        head = "  ".join(f"{f'rank {r}':>7}" for r in range(WORLD))
        print(f"{'schedule':<8} {'m':>2} {'formula':>8} {'simulated':>9} {'T ms':>8}  {head}"
              f"  {'mean':>7}")  # fmt: skip
        for (schedule, m), ranks in rows.items():
            bubbles = [1 - m * r[kind] / r["T"] for r in ranks]
            cells = "  ".join(f"{b:>7.1%}" for b in bubbles)
            print(f"{schedule:<8} {m:>2} {formula_bubble(schedule, WORLD, m):>8.1%} "
                  f"{predicted[schedule, m]:>9.1%} {ranks[0]['T'] * 1e3:>8.1f}  {cells}"
                  f"  {statistics.mean(bubbles):>7.1%}")  # fmt: skip
    print("\nt_mb per rank (ms; alone / together)")
    for (schedule, m), ranks in rows.items():
        cells = "  ".join(f"{r['alone'] * 1e3:6.1f} / {r['together'] * 1e3:6.1f}" for r in ranks)
        print(f"{schedule:<8} {m:>2}  {cells}")


def main() -> None:
    start = time.perf_counter()
    print(f"1. compiling the Llama ({LAYERS} blocks) for Mesh(pp={WORLD})", flush=True)
    predicted = {}
    for schedule in SCHEDULES:
        for m in MICROBATCHES:
            c = config(m)
            prog = autoparallelize(build("llama", c), Mesh(pp=WORLD), tokens(c), loss_fn=lm_loss,
                                   n_microbatches=m, schedule=schedule)  # fmt: skip
            predicted[schedule, m] = prog.timeline().bubble
    print("\n".join(prog.pipeline.cut.describe()), flush=True)

    print(f"2. spawning {WORLD} Gloo ranks", flush=True)
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(free_port(), results), nprocs=WORLD)
    rows: Rows = {key: [{} for _ in range(WORLD)] for key in predicted}
    for _ in range(WORLD * len(predicted)):
        schedule, m, rank, row = results.get()
        rows[schedule, m][rank] = row
    report(predicted, rows)
    print(f"\ndone in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
