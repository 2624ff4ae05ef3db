"""Speed of the whole-cluster search: `autopar plan` on the issue's two targets.

Targets (issue 11): Llama-3-8B on 64 H100 in <= 2 s, a 405B shape on 16,384 H100 in <= 10 s,
on this 2-core machine. Prints the configurations in the space, how many were priced (the rest
pruned by exact bounds), the wall time (topology graph, search and ranking; imports excluded)
and the time per configuration.

Run: PYTHONPATH=. python benchmarks/plan_speed.py
"""

from __future__ import annotations

import time

from autopar.search import plan_shape
from cost.hardware import Cluster

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


if __name__ == "__main__":
    main()
