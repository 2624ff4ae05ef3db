"""One-GPU check of the checkpointer: resume equality on CUDA tensors and the cost of a save
every step, async vs sync (skips without CUDA).

Run from the repository root:  python benchmarks/gpu_checkpoint.py

Algorithm:
1. Train a Llama-style model on the GPU for 6 steps, an async save after step 3; load step 3
   into a model built from another seed and train steps 4-6: the losses must equal an
   uninterrupted run (relative 1e-5; GPU kernels need not be bitwise reproducible).
2. Time STEPS steps of a bigger model with no save, a blocking save every step and an async
   save every step (the staging copy goes to host memory, so the GPU keeps computing).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

from autopar.runtime.checkpoints import Checkpointer
from autopar.tools.testing import Config, build, lm_loss, tokens

STEPS = 6
DEV = os.environ.get("AUTOPAR_DEVICE", "cuda")  # 'cpu' for a dry run of the script


def train(model, opt, batch, steps, ck=None, blocking=True, save_at=()):
    losses, times = [], []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        loss = lm_loss(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # syncs the GPU
        if ck is not None and (not save_at or step in save_at):
            ck.save(step, blocking=blocking)
        times.append(time.perf_counter() - start)
    if ck is not None:
        ck.wait()
    return losses, times


def resume_check(root: str) -> bool:
    c = Config(layers=2, hidden=128, heads=8, kv_heads=4, ffn=256, vocab=256, seq=32, batch=4)
    batch = tuple(t.to(DEV) for t in tokens(c))
    model = build("llama", c).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref, _ = train(model, opt, batch, 6)
    model = build("llama", c).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first, _ = train(model, opt, batch, 3, Checkpointer(root, model, opt), False, (3,))
    model = build("llama", c, seed=5).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    Checkpointer(root, model, opt).load()
    rest, _ = train(model, opt, batch, 3)
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, first + rest, strict=True))
    print(
        f"1. resume on CUDA: uninterrupted {ref}\n   resumed       {first + rest}\n"
        f"   max relative difference {worst:.2e} (bitwise equal: {first + rest == ref})"
    )
    return worst <= 1e-5


def cost() -> None:
    c = Config(layers=4, hidden=1024, heads=16, kv_heads=8, ffn=4096, vocab=8192, seq=512,
               batch=32, bias=False)  # fmt: skip
    batch = tuple(t.to(DEV) for t in tokens(c))
    model = build("llama", c).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train(model, opt, batch, 2)
    med = {}
    with tempfile.TemporaryDirectory() as root:
        ck = Checkpointer(root, model, opt, keep=1)
        for name, kw in (
            ("none", {}),
            ("sync", {"ck": ck}),
            ("async", {"ck": ck, "blocking": False}),
        ):
            med[name] = statistics.median(train(model, opt, batch, STEPS, **kw)[1])
            print(f"   {name:<6} median step {med[name] * 1e3:8.1f} ms", flush=True)
        staged = ck.staged_bytes
    sync, asyn = med["sync"] - med["none"], med["async"] - med["none"]
    print(f"2. save every step, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, "
          f"staging copy {staged / 2**30:.2f} GiB: cost sync {sync * 1e3:.0f} ms, async "
          f"{asyn * 1e3:.0f} ms; async/sync cost ratio {asyn / sync:.2f}")  # fmt: skip


def main() -> int:
    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}", flush=True)
    if DEV == "cuda" and not torch.cuda.is_available():
        print("no CUDA: skipped")
        return 0
    with tempfile.TemporaryDirectory() as root:
        ok = resume_check(root)
    cost()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
