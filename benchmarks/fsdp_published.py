"""The cost model's FSDP (ZeRO-3) throughput against published FSDP runs, error per row.

Sources (the configurations as published; the network is not always stated, so the link
assumed for each is printed with it):
- IBM fms-fsdp README (github.com/foundation-model-stack/fms-fsdp, commit 0d31998): Llama 2
  7B / 13B / 34B / 70B on 128 A100-80GB, 4096 tokens, FSDP or HSDP, tokens/s/GPU.  A later
  revision of that README gives the fabric as 400 Gb/s per node (50 Gb/s per GPU), used here.
- torchtitan docs/performance.md (github.com/pytorch/torchtitan): Llama 3 8B / 70B on 64
  A100-80GB, FSDP2, local batch 1, 8192 tokens, words (tokens)/s per GPU.  Network not stated:
  DGX A100 HDR InfiniBand (200 Gb/s per GPU) assumed.

Algorithm:
1. Build each model shape (Llama 2 / Llama 3 dimensions) and cluster (A100-80GB nodes of 8;
   the row's inter-node link).
2. Price ZeRO-3 over every GPU (tp = pp = 1) at the published local batch and activation
   checkpointing (selective or full; none) with ``cost.estimate``.
3. Print predicted vs published tokens/s/GPU and the relative error.  HSDP rows (ZeRO-3 inside
   a node, replicas across nodes) are priced as FSDP over all GPUs, which the cost model
   does not distinguish: their error includes that difference and is marked.

Run: python benchmarks/fsdp_published.py
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost.config import ParallelConfig
from cost.estimate import estimate
from cost.hardware import Cluster, Link
from cost.model import ModelShape

GB = 1e9
FMS_FABRIC = Link(name="400Gb/s per node", bandwidth=400 / 8 / 8 * GB, latency=10e-6,
                  efficiency=0.9)  # fmt: skip


@dataclass(frozen=True)
class Row:
    source: str
    model: ModelShape
    gpus: int
    batch: int
    recompute: str
    sharding: str
    published: float  # tokens / s / GPU
    fabric: Link | None = None  # None: the DGX A100 preset's HDR InfiniBand


def _llama2(size: str) -> ModelShape:
    dims = {"7b": (32, 4096, 32, 32, 11008), "13b": (40, 5120, 40, 40, 13824),
            "34b": (48, 8192, 64, 8, 22016), "70b": (80, 8192, 64, 8, 28672)}[size]  # fmt: skip
    layers, hidden, heads, kv, ffn = dims
    return ModelShape.llama(name=f"llama2-{size}", layers=layers, hidden=hidden, heads=heads,
                            kv_heads=kv, ffn=ffn, seq=4096, vocab=32000)  # fmt: skip


def _llama3(size: str) -> ModelShape:
    return ModelShape.preset(f"llama3-{size}")


ROWS = (
    Row("fms-fsdp", _llama2("7b"), 128, 2, "none", "HSDP", 3760, FMS_FABRIC),
    Row("fms-fsdp", _llama2("13b"), 128, 1, "none", "HSDP", 1700, FMS_FABRIC),
    Row("fms-fsdp", _llama2("34b"), 128, 8, "full", "FSDP", 772, FMS_FABRIC),
    Row("fms-fsdp", _llama2("70b"), 128, 6, "full", "FSDP", 380, FMS_FABRIC),
    Row("torchtitan", _llama3("8b"), 64, 1, "selective", "FSDP", 2904),
    Row("torchtitan", _llama3("70b"), 64, 1, "full", "FSDP", 331),
)


def predicted(row: Row) -> float:
    """Steps 1-2: tokens/s/GPU the cost model predicts for the row's configuration."""
    cluster = Cluster.preset("dgx-a100", nodes=row.gpus // 8)
    if row.fabric is not None:
        cluster = replace(cluster, inter=row.fabric)
    config = ParallelConfig(tp=1, pp=1, dp=row.gpus, zero=3, micro_batch=row.batch,
                            global_batch=row.gpus * row.batch, recompute=row.recompute)  # fmt: skip
    est = estimate(row.model, cluster, config)
    return est.tokens_per_s / row.gpus


def main() -> None:
    print(f"{'source':<11} {'model':<12} {'GPUs':>4} {'b':>2} {'recompute':<10} {'sharding':<8} "
          f"{'published':>9} {'predicted':>9} {'error':>7}  fabric")  # fmt: skip
    errors = []
    for row in ROWS:
        ours = predicted(row)
        err = ours / row.published - 1
        mark = " (HSDP priced as FSDP)" if row.sharding == "HSDP" else ""
        if not mark:
            errors.append(abs(err))
        fabric = (row.fabric or Cluster.preset("dgx-a100").inter).name
        print(f"{row.source:<11} {row.model.name:<12} {row.gpus:>4} {row.batch:>2} "
              f"{row.recompute:<10} {row.sharding:<8} {row.published:>9.0f} {ours:>9.0f} "
              f"{err:>+7.1%}  {fabric}{mark}")  # fmt: skip
    print(f"FSDP rows: mean |error| {sum(errors) / len(errors):.1%}, worst {max(errors):.1%}")


if __name__ == "__main__":
    main()
