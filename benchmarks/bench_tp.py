"""Step time of autopar's per-rank programs next to hand-written DTensor tensor parallelism.

Run from the repository root (after `pip install -e .`, or with `PYTHONPATH=.`):

    python benchmarks/bench_tp.py                      # plans priced for a DGX H100 node
    python benchmarks/bench_tp.py --cluster dgx-a100   # or any other cluster preset

Algorithm:
1. Spawn WORLD Gloo ranks forming one tensor-parallel mesh, one compute thread each.
2. For each size, every rank builds the same autopar.tools.testing Llama (fp32, seed 0) and from it
   a. autopar: ``autoparallelize(model, device_mesh, (x, y), loss_fn=lm_loss)``;
   b. DTensor: the same weights in blocks that view heads as -1 (a rank's local heads),
      parallelised by hand with torch.distributed.tensor.parallel: ColwiseParallel on
      wq/wk/wv/w1/w3 and RowwiseParallel on wo/w2 of every block (local outputs, so attention
      runs on plain tensors); embedding, norms and lm_head stay replicated;
   c. single device: the unmodified model on rank 0 with WORLD threads (the whole machine)
      while the other ranks wait.
3. Warm up WARMUP rounds, then time ITERS rounds of one forward+backward step of each variant,
   interleaved; a distributed step costs its slowest rank's time.
4. Rank 0 prints the median ms per step, autopar/DTensor (goal <= 0.8), each variant's speedup
   over single device, and the last loss of each variant (they agree up to rounding).

On a 2-core CPU the single-device step already uses both cores, so TP=2 over Gloo is not
expected to beat it there; the ratio this benchmark tracks is autopar/DTensor. Other load on the
machine inflates all columns (interleaving keeps the ratios comparable). A benchmark, not a test:
nothing asserts on time.
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from autopar import Cluster, autoparallelize
from autopar.runtime.pool import free_port, gloo_rank
from autopar.tools.testing import Config, LlamaBlock, build, lm_loss, rope, tokens

WORLD, WARMUP, ITERS = 2, 3, 10
SIZES = ((256, 128), (512, 128), (1024, 128))  # (hidden, seq)
VARIANTS = ("single", "autopar", "dtensor")


def config(hidden: int, seq: int) -> Config:
    return Config(layers=4, hidden=hidden, heads=8, kv_heads=4, ffn=3 * hidden, vocab=4096,
                  seq=seq, batch=4, bias=False)  # fmt: skip


class LocalHeadsBlock(LlamaBlock):
    """autopar.tools.testing's LlamaBlock with ``view(b, s, -1, d)``: runs on a rank's local heads."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c, d = self.c, self.c.hidden // self.c.heads
        y = self.attn_norm(x)
        q, k, v = (w(y).view(b, s, -1, d).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=c.kv_heads != c.heads
        )
        x = x + self.wo(y.transpose(1, 2).reshape(b, s, -1))
        y = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


def dtensor_model(model: nn.Module, c: Config, mesh: DeviceMesh) -> nn.Module:
    """Step 2b: a copy of ``model`` whose blocks are split by the hand-written Megatron plan."""
    baseline = copy.deepcopy(model)
    for i, layer in enumerate(model.layers):
        block = LocalHeadsBlock(c)
        block.load_state_dict(layer.state_dict())
        plan = {name: ColwiseParallel() for name in ("wq", "wk", "wv", "w1", "w3")}
        plan |= {name: RowwiseParallel() for name in ("wo", "w2")}
        baseline.layers[i] = parallelize_module(block, mesh, plan)
    return baseline


def timed_step(loss_fn: Callable[[], torch.Tensor], module: nn.Module) -> tuple[float, float]:
    """One forward+backward step; returns (ms, loss)."""
    module.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = loss_fn()
    loss.backward()
    return (time.perf_counter() - start) * 1e3, loss.item()


def measure(rank: int, mesh: DeviceMesh, c: Config, cluster: str) -> tuple[dict, dict, int]:
    """Steps 2-3 for one size: median ms per step and last loss of each variant, parameters."""
    x, y = tokens(c)
    model = build("llama", c)
    local = autoparallelize(model, mesh, (x, y), loss_fn=lm_loss, cluster=Cluster.preset(cluster))
    baseline = dtensor_model(model, c, mesh)
    steps = {
        "single": (lambda: lm_loss(model(x), y), model),
        "autopar": (lambda: local(x, y), local),
        "dtensor": (lambda: lm_loss(baseline(x), y), baseline),
    }
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    losses: dict[str, float] = {}
    for round_ in range(WARMUP + ITERS):
        for name in VARIANTS:
            dist.barrier()
            if name == "single" and rank != 0:
                continue
            torch.set_num_threads(WORLD if name == "single" else 1)
            ms, losses[name] = timed_step(*steps[name])
            if round_ >= WARMUP:
                times[name].append(ms)
    torch.set_num_threads(1)
    medians = {"single": statistics.median(times["single"]) if rank == 0 else 0.0}
    for name in ("autopar", "dtensor"):
        t = torch.tensor(times[name], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
        medians[name] = statistics.median(t.tolist())
    return medians, losses, sum(p.numel() for p in model.parameters())


def report_header() -> None:
    print(f"\nforward+backward step, median of {ITERS} (after {WARMUP} warm-up rounds); "
          f"tp={WORLD} over Gloo, 1 thread per rank; single device: {WORLD} threads")  # fmt: skip
    print(f"{'hidden':>6} {'seq':>4} {'params':>7} | {'single ms':>9} {'autopar ms':>10} "
          f"{'DTensor ms':>10} | {'autopar/DTensor':>15} {'autopar x':>9} {'DTensor x':>9} | "
          f"{'loss rel. diff (autopar, DTensor)':>34}")  # fmt: skip


def report_row(c: Config, params: int, ms: dict[str, float], loss: dict[str, float]) -> None:
    rel = [abs(loss[n] - loss["single"]) / abs(loss["single"]) for n in ("autopar", "dtensor")]
    print(f"{c.hidden:>6} {c.seq:>4} {params / 1e6:>6.1f}M | {ms['single']:>9.2f} "
          f"{ms['autopar']:>10.2f} {ms['dtensor']:>10.2f} | "
          f"{ms['autopar'] / ms['dtensor']:>15.2f} {ms['single'] / ms['autopar']:>9.2f} "
          f"{ms['single'] / ms['dtensor']:>9.2f} | {rel[0]:>16.1e}, {rel[1]:>16.1e}",
          flush=True)  # fmt: skip


def rank_main(rank: int, port: int, cluster: str) -> None:
    """Steps 1-4 on one rank."""
    with gloo_rank(rank, WORLD, port, (WORLD,), ("tp",)) as mesh:
        if rank == 0:
            report_header()
        for hidden, seq in SIZES:
            c = config(hidden, seq)
            ms, losses, params = measure(rank, mesh, c, cluster)
            if rank == 0:
                report_row(c, params, ms, losses)


if __name__ == "__main__":
    name = sys.argv[sys.argv.index("--cluster") + 1] if "--cluster" in sys.argv else "dgx-h100"
    print(f"plans priced for cluster preset {name!r}")
    mp.spawn(rank_main, args=(free_port(), name), nprocs=WORLD)
