"""Speed of one estimate: the planner prices thousands of configurations.

Traces a 32-layer GPT (torch.export on the meta device, no weights), then times `estimate` of a
fully specified configuration after the first call (which analyses the graph once), next to a
named shape preset and a configuration with free fields (the estimator searches them).

Run: PYTHONPATH=. python benchmarks/estimate_speed.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from cost.config import ParallelConfig
from cost.estimate import estimate
from cost.hardware import Cluster

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, BATCH = 32, 1024, 16, 2048, 32000, 4
BUDGET_MS = 5.0  # the planner's allowance per configuration


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (z.view(b, s, HEADS, h // HEADS).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(h, -1))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _per_call_ms(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    with torch.device("meta"):
        model = GPT().to(torch.bfloat16)
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    start = time.perf_counter()
    traced = torch.export.export(model, (ids,), strict=False)
    print(f"torch.export of {LAYERS}-layer GPT: {time.perf_counter() - start:.2f} s")
    cluster = Cluster.preset("dgx-h100", nodes=4)
    fixed = ParallelConfig(tp=4, pp=4, dp=2, global_batch=64, micro_batch=2, schedule="1f1b",
                           virtual_stages=1, recompute="selective")  # fmt: skip
    start = time.perf_counter()
    estimate(traced, cluster, fixed)
    print(f"first estimate (analyses the graph): {(time.perf_counter() - start) * 1e3:.1f} ms")
    rows = [
        ("traced 32-layer GPT, fixed config", lambda: estimate(traced, cluster, fixed), 2000),
        ("preset llama3-8b, fixed config", lambda: estimate("llama3-8b", cluster, fixed), 2000),
        ("traced, free micro-batch/schedule/recompute",
         lambda: estimate(traced, cluster, ParallelConfig(tp=4, pp=4, dp=2, global_batch=64)), 50),
    ]  # fmt: skip
    print(f"{'configuration':<48} {'ms/estimate':>11} {'of 5 ms budget':>15}")
    for name, fn, calls in rows:
        ms = _per_call_ms(fn, calls)
        print(f"{name:<48} {ms:11.3f} {ms / BUDGET_MS:14.1%}")


if __name__ == "__main__":
    main()
