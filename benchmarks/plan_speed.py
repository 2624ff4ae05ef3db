"""Speed of the whole-cluster search: `autopar plan` on the issue's two targets.

Targets (issue 11): Llama-3-8B on 64 H100 in <= 2 s, a 405B shape on 16,384 H100 in <= 10 s,
on this 2-core machine. Prints the configurations in the space, how many were priced (the rest
pruned by exact bounds), the wall time (topology graph, search and ranking; imports excluded)
and the time per configuration.

Then ranks the published configurations (Llama 3 405B at 8K and its 128K long-context stage,
TP8 CP16 PP16 DP8; the Megatron-LM 2021 runs of REFERENCE.md on the Megatron-2021 software
stack) among the planner's.

Run: PYTHONPATH=. python benchmarks/plan_speed.py
"""

from __future__ import annotations

import time

from autopar.planner.auto import plan_shape
from cost.config import ParallelConfig
from cost.hardware import Cluster
from cost.model import ModelShape
from cost.search import SearchSpace

TARGETS = (
    ("llama3-8b", 8, 512, 2.0),
    ("llama3-405b", 2048, 2048, 10.0),
)


def main() -> None:
    print(f"{'model':<12} {'GPUs':>6} {'space':>10} {'priced':>8} {'seconds':>8} "
          f"{'µs/config':>9} {'target':>7}  best")  # fmt: skip
    for model, nodes, batch, target in TARGETS:
        start = time.perf_counter()
        plan = plan_shape(model, Cluster.preset("dgx-h100", nodes=nodes), batch)
        str(plan)
        seconds = time.perf_counter() - start
        r = plan.result
        verdict = "ok" if seconds <= target else "SLOW"
        print(f"{model:<12} {nodes * 8:>6} {r.space:>10,} {r.priced:>8,} {seconds:>8.2f} "
              f"{seconds / r.space * 1e6:>9.2f} {target:>6.0f}s {verdict}  "
              f"{plan.best.describe()}")  # fmt: skip

    print()
    published()


MEGATRON_2021 = SearchSpace(attention="unfused", sequence_parallel=(False,), zero=(0,),
                            overlap_grad_reduce=False, cp=(1,), ep=(1,))  # fmt: skip
PUBLISHED = (
    ("Llama 3 405B", ModelShape.preset("llama3-405b"), "dgx-h100", 16384, 2048, (8, 16, 128),
     None),
    ("Llama 3 405B 128K", ModelShape.preset("llama3-405b").with_seq(131072), "dgx-h100", 16384,
     128, (8, 16, 8, 16), None),
    ("Megatron 1.7B", ModelShape.gpt(layers=24, hidden=2304, heads=24, seq=2048, vocab=51200),
     "dgx-a100", 32, 512, (1, 1, 32), MEGATRON_2021),
    ("Megatron 18.4B", ModelShape.gpt(layers=40, hidden=6144, heads=48, seq=2048, vocab=51200),
     "dgx-a100", 256, 1024, (8, 1, 32), MEGATRON_2021),
    ("Megatron 145.6B", ModelShape.gpt(layers=80, hidden=12288, heads=96, seq=2048,
                                       vocab=51200), "dgx-a100", 1536, 2304, (8, 8, 24),
     MEGATRON_2021),
    ("Megatron 1008B", ModelShape.gpt(layers=128, hidden=25600, heads=160, seq=2048,
                                      vocab=51200), "dgx-a100", 3072, 3072, (8, 64, 6),
     MEGATRON_2021),
)  # fmt: skip


def published() -> None:
    """Where each published configuration ranks, and the planner's choice next to it."""
    print(f"{'run':<18} {'published':<20} {'rank':>5} {'TFLOP/s':>8} {'planner TFLOP/s':>16}  "
          "planner's choice")  # fmt: skip
    for name, shape, preset, gpus, batch, degrees, space in PUBLISHED:
        tp, pp, dp, cp = (*degrees, 1)[:4]
        cluster = Cluster.preset(preset, nodes=gpus // 8)
        cfg = ParallelConfig(tp=tp, pp=pp, dp=dp, cp=cp, global_batch=batch)
        plan = plan_shape(shape, cluster, batch, compare=cfg, space=space)
        rank, choice = plan.compare_rank()
        theirs = plan.result.estimate(choice).tflops_per_gpu_megatron
        ours = plan.result.estimate(plan.best).tflops_per_gpu_megatron
        label = f"TP{tp} CP{cp} PP{pp} DP{dp}" if cp > 1 else f"TP{tp} PP{pp} DP{dp}"
        print(f"{name:<18} {label:<20} {rank:>5} {theirs:>8.1f} "
              f"{ours:>16.1f}  {plan.best.describe()}")  # fmt: skip


if __name__ == "__main__":
    main()
