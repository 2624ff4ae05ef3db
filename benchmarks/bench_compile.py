"""Step time of autopar's rank programs with ``compile=True`` (each repeated block under
torch.compile, inductor) next to the same programs eager, on 2 Gloo ranks (Mesh(tp=2)).

Run from the repository root (after `pip install -e .`, or with `PYTHONPATH=.`):

    python benchmarks/bench_compile.py [--layers 2] [--iters 10]

Algorithm:
1. Spawn 2 Gloo ranks forming one tensor-parallel mesh, one compute thread each.
2. For each hidden size (256, 512, 1024; seq 128, batch 4, fp32), every rank builds the same
   autopar.tools.testing Llama and from it two rank modules: ``autoparallelize(model,
   device_mesh, (x, y), loss_fn=lm_loss)`` and the same with ``compile=True``.
3. Warm up (the compiled one compiles its block here: the compile time is printed apart),
   then time ITERS rounds of one forward+backward step of each, interleaved; a step costs its
   slowest rank's time.
4. Rank 0 prints the median ms per step of each and compiled / eager (below 1: compiled is
   faster), and both last losses (equal up to rounding).
A benchmark, not a test: nothing asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar import autoparallelize
from autopar.runtime.pool import free_port, gloo_rank
from autopar.tools.testing import Config, build, lm_loss, tokens

WORLD, WARMUP = 2, 3
HIDDEN = (256, 512, 1024)


def config(hidden: int, layers: int) -> Config:
    return Config(layers=layers, hidden=hidden, heads=8, kv_heads=4, ffn=3 * hidden,
                  vocab=4096, seq=128, batch=4, bias=False)  # fmt: skip


def step_s(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """One forward+backward; the slowest rank's seconds and the loss."""
    dist.barrier()
    start = time.perf_counter()
    loss = module(x, y)
    loss.backward()
    took = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took), float(loss.detach())


def rank_main(rank: int, port: int, layers: int, iters: int) -> None:
    with gloo_rank(rank, WORLD, port, (WORLD,), ("tp",)) as mesh:
        if rank == 0:
            print(f"{'hidden':>6} {'eager ms':>9} {'compiled ms':>12} {'compiled/eager':>15} "
                  f"{'compile s':>10}  losses (eager, compiled)", flush=True)  # fmt: skip
        for hidden in HIDDEN:
            c = config(hidden, layers)
            x, y = tokens(c)
            model = build("llama", c)
            variants = {"eager": autoparallelize(model, mesh, (x, y), loss_fn=lm_loss),
                        "compiled": autoparallelize(model, mesh, (x, y), loss_fn=lm_loss,
                                                    compile=True)}  # fmt: skip
            start = time.perf_counter()
            step_s(variants["compiled"], x, y)  # compiles
            compile_s = time.perf_counter() - start
            ms, loss = interleaved(variants, x, y, iters)
            if rank == 0:
                print(f"{hidden:>6} {ms['eager']:>9.1f} {ms['compiled']:>12.1f} "
                      f"{ms['compiled'] / ms['eager']:>15.2f} {compile_s:>10.1f}  "
                      f"{loss['eager']:.5f}, {loss['compiled']:.5f}", flush=True)  # fmt: skip


def interleaved(variants: dict, x: torch.Tensor, y: torch.Tensor,
                iters: int) -> tuple[dict[str, float], dict[str, float]]:  # fmt: skip
    """Warm up, then ``iters`` rounds of one step of each variant in turn: the median ms per
    step of each, and each one's last loss."""
    for _ in range(WARMUP):
        for m in variants.values():
            step_s(m, x, y)
    times: dict[str, list[float]] = {k: [] for k in variants}
    loss = {}
    for _ in range(iters):
        for k, m in variants.items():
            s, loss[k] = step_s(m, x, y)
            times[k].append(s)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}, loss


def launch(rank_main, description: str) -> None:  # noqa: ANN001
    """Parse ``--layers`` / ``--iters`` and run ``rank_main(rank, port, layers, iters)`` on
    WORLD spawned ranks."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    mp.spawn(rank_main, args=(free_port(), args.layers, args.iters), nprocs=WORLD)


def main() -> None:
    launch(rank_main, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
