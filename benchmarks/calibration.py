"""Calibration: predicted vs reported throughput of published large training runs.

Every row is priced with the one set of efficiency constants in `cost` (no per-run tuning).
The runs share one software stack, described by facts of Megatron-LM in 2021 rather than by
fitted numbers: unfused attention (the s×s scores reach HBM; FlashAttention came in 2022),
no sequence parallelism (2022), data-parallel gradient all-reduce after backward (no overlap,
no distributed optimizer), full activation recomputation. The micro-batch, pipeline schedule and
virtual stages are free choices of the estimator, as they were the authors' tuning choices.

Run: PYTHONPATH=. python benchmarks/calibration.py
"""

from __future__ import annotations

from dataclasses import dataclass

from cost.config import ParallelConfig
from cost.estimate import Estimate, estimate
from cost.hardware import Cluster
from cost.model import ModelShape

TOLERANCE = 0.15


@dataclass(frozen=True, kw_only=True)
class Run:
    name: str
    layers: int
    hidden: int
    heads: int
    gpus: int
    tp: int
    pp: int
    dp: int
    global_batch: int
    reported_tflops: float


RUNS = (
    Run(name="Narayanan 2021, 1.7B", layers=24, hidden=2304, heads=24, gpus=32, tp=1, pp=1,
        dp=32, global_batch=512, reported_tflops=137),
    Run(name="Narayanan 2021, 18.4B", layers=40, hidden=6144, heads=48, gpus=256, tp=8, pp=1,
        dp=32, global_batch=1024, reported_tflops=135),
    Run(name="Narayanan 2021, 145.6B", layers=80, hidden=12288, heads=96, gpus=1536, tp=8,
        pp=8, dp=24, global_batch=2304, reported_tflops=148),
    Run(name="Narayanan 2021, 1008B", layers=128, hidden=25600, heads=160, gpus=3072, tp=8,
        pp=64, dp=6, global_batch=3072, reported_tflops=163),
)  # fmt: skip


def predict(run: Run) -> Estimate:
    """Price one run on DGX A100 nodes with the Megatron-LM 2021 software stack."""
    shape = ModelShape.gpt(name=run.name, layers=run.layers, hidden=run.hidden,
                           heads=run.heads, seq=2048, vocab=51200)  # fmt: skip
    config = ParallelConfig(tp=run.tp, pp=run.pp, dp=run.dp, zero=0,
                            global_batch=run.global_batch, recompute="full",
                            attention="unfused", sequence_parallel=False,
                            overlap_grad_reduce=False)  # fmt: skip
    return estimate(shape, Cluster.preset("dgx-a100", nodes=run.gpus // 8), config)


def main() -> None:
    print("TFLOP/s per GPU, Megatron-2021 FLOP count (includes the recompute forward)")
    header = f"{'run':<24} {'reported':>9} {'predicted':>10} {'error':>7}  {'MFU':>6}  chosen"
    print(header)
    print("-" * len(header))
    worst = 0.0
    for run in RUNS:
        est = predict(run)
        error = est.tflops_per_gpu_megatron / run.reported_tflops - 1
        worst = max(worst, abs(error))
        c = est.config
        print(f"{run.name:<24} {run.reported_tflops:9.1f} {est.tflops_per_gpu_megatron:10.1f} "
              f"{error:+7.1%}  {est.mfu_megatron:6.1%}  b={c.micro_batch} {c.schedule}"
              f"{f' v={c.virtual_stages}' if c.schedule == 'interleaved' else ''}")  # fmt: skip
    verdict = "within" if worst <= TOLERANCE else "OUTSIDE"
    print(f"worst relative error {worst:.1%}: {verdict} ±{TOLERANCE:.0%}")


if __name__ == "__main__":
    main()
