"""Step time and parameter memory of autopar's expert axis next to replicated experts.

Run from the repository root (after `pip install -e .`, or with `PYTHONPATH=.`):

    python benchmarks/bench_ep.py

Algorithm:
1. For WORLD in (2, 4) spawn WORLD Gloo ranks, one compute thread each; every rank builds the
   same autopar.tools.testing MoE language model (fp32, seed 0) and from it
   a. autopar ep: ``autoparallelize(model, mesh_ep, (x, y), lm_loss)`` (each rank E/WORLD
      experts; tokens dispatched and combined with all-to-alls, dense gradients all-reduced);
   b. the same with the dense gradients all-reduced one parameter at a time (``BUCKET_BYTES
      = 0``; the default cuts them into buckets of up to 25 MiB, one all-reduce each);
   c. replicated experts: ``autoparallelize(model, mesh_dp, (x, y), lm_loss, zero=0)`` (torch
      DDP over the same ranks, every rank every expert).
   Both take AdamW steps on the rank's slice of one fixed global batch.
2. Warm up WARMUP rounds, then time ITERS interleaved rounds of one training step (forward,
   backward, optimizer); a distributed step costs its slowest rank's time.
3. Rank 0 prints the median ms per step, the ratios ep / replicated and bucketed / per
   parameter, the parameter bytes per rank of each, and the last global losses (they agree:
   dropless ep is exact).
4. One process: the local experts' compute, one grouped matmul pair over the rows grouped by
   expert (``transformers::grouped_mm_fallback``, what the traced model runs) against an eager
   per-expert loop of two matmuls (the loop HF's eager experts run), as a ratio.

A benchmark, not a test: nothing asserts on time.  Other load on the machine inflates every
column; interleaving keeps the ratios comparable.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from autopar import autoparallelize
from autopar.axes import expert_parallel as ep_module
from autopar.ops import collectives
from autopar.runtime.pool import free_port, gloo_rank
from autopar.tools.testing import (
    MoEConfig,
    build_moe,
    grouped_mm,
    lm_loss,
    optimizer_step,
    slowest_rank_time,
    tokens,
)

WARMUP, ITERS = 2, 8
CONFIG = MoEConfig(layers=4, hidden=256, expert_ffn=512, experts=8, top_k=2, vocab=1024, seq=64,
                   batch=8)  # fmt: skip
VARIANTS = ("ep", "ep_per_param", "replicated")


def variants(world: int, mesh_ep: object, mesh_dp: object) -> dict[str, tuple[Callable, int]]:
    """Step 1: one training-step closure per variant and its parameter bytes on this rank."""
    x, y = tokens(CONFIG)
    r = dist.get_rank()
    xs, ys = x.chunk(world)[r], y.chunk(world)[r]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = autoparallelize(build_moe(CONFIG), mesh_ep, (x, y), lm_loss)
        cap, ep_module.BUCKET_BYTES = ep_module.BUCKET_BYTES, 0
        per_param = autoparallelize(build_moe(CONFIG), mesh_ep, (x, y), lm_loss)
        ep_module.BUCKET_BYTES = cap
        dp = autoparallelize(build_moe(CONFIG), mesh_dp, (x, y), lm_loss, zero=0)
    groups = {"ep": mesh_ep.get_group("ep")}  # the dp compile rebinds the collectives' axes

    def ep_loss(module: torch.nn.Module) -> Callable[[], torch.Tensor]:
        def loss() -> torch.Tensor:
            collectives.bind(groups)
            return module(xs, ys)

        return loss

    return {"ep": (optimizer_step(ep_loss(ep), torch.optim.AdamW(ep.parameters(), 1e-3)),
                   _bytes(ep)),
            "ep_per_param": (optimizer_step(ep_loss(per_param),
                                            torch.optim.AdamW(per_param.parameters(), 1e-3)),
                             _bytes(per_param)),
            "replicated": (optimizer_step(lambda: dp(xs, ys), dp.optimizer(torch.optim.AdamW, lr=1e-3)),
                           _bytes(dp))}  # fmt: skip


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def rank_main(rank: int, world: int, port: int) -> None:
    """Steps 1-3 on one rank."""
    with gloo_rank(rank, world, port, (world,), ("ep",)) as mesh_ep:
        mesh_dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        steps = variants(world, mesh_ep, mesh_dp)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        losses: dict[str, float] = {}
        for i in range(WARMUP + ITERS):
            for v in VARIANTS:
                t, losses[v] = slowest_rank_time(steps[v][0])
                if i >= WARMUP:
                    times[v].append(t)
        if rank == 0:
            ms = {v: statistics.median(ts) * 1e3 for v, ts in times.items()}
            print(f"ep={world}: ep {ms['ep']:8.2f} ms  replicated {ms['replicated']:8.2f} ms  "
                  f"ratio ep/replicated {ms['ep'] / ms['replicated']:.3f}  parameter bytes per "
                  f"rank {steps['ep'][1] / 2**20:.2f} MiB vs {steps['replicated'][1] / 2**20:.2f} "
                  f"MiB ({steps['ep'][1] / steps['replicated'][1]:.3f})  last losses "
                  f"{losses['ep']:.5f} {losses['replicated']:.5f}", flush=True)  # fmt: skip
            print(f"ep={world}: dense gradients bucketed {ms['ep']:8.2f} ms  per parameter "
                  f"{ms['ep_per_param']:8.2f} ms  ratio bucketed/per-parameter "
                  f"{ms['ep'] / ms['ep_per_param']:.3f}  last losses {losses['ep']:.5f} "
                  f"{losses['ep_per_param']:.5f}", flush=True)  # fmt: skip


def local_experts() -> None:
    """Step 4: grouped matmuls vs an eager per-expert loop, forward and backward."""
    import transformers.integrations.moe  # noqa: F401 - registers grouped_mm_fallback

    torch.manual_seed(0)
    c, rows = CONFIG, CONFIG.batch * CONFIG.seq * CONFIG.top_k
    x = torch.randn(rows, c.hidden, requires_grad=True)
    w1 = torch.randn(c.experts, 2 * c.expert_ffn, c.hidden, requires_grad=True)
    w2 = torch.randn(c.experts, c.hidden, c.expert_ffn, requires_grad=True)
    counts = torch.bincount(torch.randint(0, c.experts, (rows,)), minlength=c.experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)

    def grouped() -> torch.Tensor:
        gate, up = grouped_mm(x, w1.transpose(-2, -1), offs).chunk(2, -1)
        return grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs)

    def loop() -> torch.Tensor:
        outs = []
        for e, part in enumerate(x.split(counts.tolist())):
            gate, up = F.linear(part, w1[e]).chunk(2, -1)
            outs.append(F.linear(F.silu(gate) * up, w2[e]))
        return torch.cat(outs)

    torch.testing.assert_close(grouped(), loop())
    ms = {}
    for name, fn in (("grouped", grouped), ("loop", loop)):
        ts = []
        for i in range(WARMUP + ITERS):
            start = time.perf_counter()
            fn().sum().backward()
            if i >= WARMUP:
                ts.append(time.perf_counter() - start)
        ms[name] = statistics.median(ts) * 1e3
    print(f"local experts ({c.experts} experts, {rows} rows, fwd+bwd): grouped matmul "
          f"{ms['grouped']:.2f} ms  eager loop {ms['loop']:.2f} ms  ratio "
          f"{ms['grouped'] / ms['loop']:.3f}", flush=True)  # fmt: skip


def main() -> int:
    print(f"{CONFIG}\nGloo, fp32, AdamW; median of {ITERS} interleaved steps", flush=True)
    torch.set_num_threads(1)
    local_experts()
    for world in (2, 4):
        mp.spawn(rank_main, args=(world, free_port()), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
