"""Step time of autopar's sequence-parallel rank programs with their tp gathers and
reduce-scatters decomposed into ring steps under the matmuls (``tp_overlap="all"``: collective
matmuls, autopar.ops.overlap) next to the same programs with them whole (``"none"``: Megatron-SP's
blocking pairs), on 2 Gloo ranks (Mesh(tp=2)).

Run from the repository root (after `pip install -e .`, or with `PYTHONPATH=.`):

    python benchmarks/bench_overlap.py [--layers 2] [--iters 10]

Algorithm:
1. Spawn 2 Gloo ranks forming one tensor-parallel mesh, one compute thread each.
2. For each hidden size (256, 512, 1024; seq 128, batch 4, fp32), every rank builds the same
   autopar.tools.testing Llama and from it two sequence-parallel rank modules (a memory weight
   that makes the planner split the residual stream): ``tp_overlap="none"`` and ``"all"``.
3. Warm up, then time ITERS rounds of one forward+backward step of each, interleaved; a step
   costs its slowest rank's time.
4. Rank 0 prints the median ms per step of each and decomposed / whole (below 1: the
   decomposition is faster), the ring steps' count, and both last losses (equal up to rounding).
A benchmark, not a test: nothing asserts on time.  On 2 shared CPU cores the ring's p2p runs
on Gloo's background thread beside the matmuls, which use every core: what it measures is the
mechanism's overhead and whatever overlap the cores allow, not an NVLink GPU's.
"""

from __future__ import annotations

from bench_compile import HIDDEN, WORLD, config, interleaved, launch, step_s  # same models, timer

from autopar import autoparallelize
from autopar.ops.cp_ops import reset_exchanges
from autopar.runtime.pool import gloo_rank
from autopar.tools.testing import build, lm_loss, tokens

SP = 1e-6  # memory weight (s/byte): the planner splits the residual stream (sequence parallel)


def rank_main(rank: int, port: int, layers: int, iters: int) -> None:
    with gloo_rank(rank, WORLD, port, (WORLD,), ("tp",)) as mesh:
        if rank == 0:
            print(f"{'hidden':>6} {'whole ms':>9} {'decomposed ms':>14} {'decomposed/whole':>17} "
                  f"{'ring steps':>11}  losses (whole, decomposed)", flush=True)  # fmt: skip
        for hidden in HIDDEN:
            c = config(hidden, layers)
            x, y = tokens(c)
            model = build("llama", c)
            variants = {mode: autoparallelize(model, mesh, (x, y), loss_fn=lm_loss,
                                              memory_weight=SP, tp_overlap=mode)
                        for mode in ("none", "all")}  # fmt: skip
            reset_exchanges()
            step_s(variants["all"], x, y)
            steps = reset_exchanges().get("tp", 0)
            ms, loss = interleaved(variants, x, y, iters)
            if rank == 0:
                print(f"{hidden:>6} {ms['none']:>9.1f} {ms['all']:>14.1f} "
                      f"{ms['all'] / ms['none']:>17.2f} {steps:>11}  "
                      f"{loss['none']:.5f}, {loss['all']:.5f}", flush=True)  # fmt: skip


def main() -> None:
    launch(rank_main, __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
