"""Step-time cost of checkpointing every step, asynchronous vs synchronous, as a ratio.

Run from the repository root:  python benchmarks/bench_checkpoint.py [--hidden 256] [--batch 4]

Algorithm:
1. Spawn 2 Gloo ranks; each compiles a Llama-style model for Mesh(tp=2) and trains with AdamW.
2. Three runs of STEPS steps each (after one warm-up step): no checkpoint; a blocking save
   every step; an asynchronous save every step (staged copy, written by a background thread over
   the checkpoint's own Gloo group while the next step computes).
3. Print the median step time of each, the checkpoint's cost per step (minus the run without),
   the async/sync cost ratio, and the staging copy's bytes on rank 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

from autopar import autoparallelize
from autopar.runtime.checkpoints import Checkpointer
from autopar.runtime.pool import free_port, gloo_rank
from autopar.tools.testing import Config, build, lm_loss, tokens

WORLD = 2


def timed_steps(module, opt, ck: Checkpointer | None, steps: int, blocking: bool,
                batch: tuple) -> list[float]:  # fmt: skip
    """Step 2: per-step wall time, a save after every step when ``ck`` is given."""
    times = []
    for step in range(steps):
        start = time.perf_counter()
        loss = module(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if ck is not None:
            ck.save(step, blocking=blocking)
        times.append(time.perf_counter() - start)
    if ck is not None:
        ck.wait()
    return times


def rank_main(rank: int, port: int, c: Config, steps: int, root: str, out: mp.SimpleQueue) -> None:
    with gloo_rank(rank, WORLD, port, (WORLD,), ("tp",)) as mesh:
        batch = tokens(c)
        module = autoparallelize(build("llama", c), mesh, batch, loss_fn=lm_loss)
        opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        ck = Checkpointer(root, module, opt, keep=1)
        timed_steps(module, opt, None, 1, True, batch)
        result = {
            "none": timed_steps(module, opt, None, steps, True, batch),
            "sync": timed_steps(module, opt, ck, steps, True, batch),
            "async": timed_steps(module, opt, ck, steps, False, batch),
        }
        if rank == 0:
            out.put((result, ck.staged_bytes))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="more compute per step, same checkpoint")
    args = ap.parse_args()
    c = Config(layers=args.layers, hidden=args.hidden, heads=8, kv_heads=4, ffn=4 * args.hidden,
               vocab=1024, seq=64, batch=args.batch)  # fmt: skip
    out = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as root:
        mp.spawn(rank_main, args=(free_port(), c, args.steps, root, out), nprocs=WORLD)
    result, staged = out.get()
    med = {k: statistics.median(v) for k, v in result.items()}
    sync_cost, async_cost = med["sync"] - med["none"], med["async"] - med["none"]
    print(f"Llama h={c.hidden} layers={c.layers} V={c.vocab} batch {c.batch}x{c.seq}, "
          f"Mesh(tp={WORLD}), a save every "
          f"step; staging copy on rank 0: {staged / 2**20:.1f} MiB")  # fmt: skip
    for k in ("none", "sync", "async"):
        print(f"  {k:<6} median step {med[k] * 1e3:8.1f} ms")
    print(f"checkpoint cost per step: sync {sync_cost * 1e3:.1f} ms, async {async_cost * 1e3:.1f} "
          f"ms; async/sync cost ratio {async_cost / sync_cost:.2f}; async/sync step-time ratio "
          f"{med['async'] / med['sync']:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
