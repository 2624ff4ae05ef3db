"""Train HF Llama with context parallelism (the sequence split over 2 CPU ranks, ring
attention); compare with one device.

Run from the repository root (after `pip install -e .`, or with `PYTHONPATH=.`):

    python examples/train_cp.py

Algorithm:
1. Compile a tiny random-weight LlamaForCausalLM for a virtual Mesh(cp=2) and print the plan:
   the sequence chunks each rank holds, the attention strategy with both prices, the ring's
   K/V exchanges and the cp gradient reduction.  The loss is the causal-LM cross-entropy on
   labels shifted outside the model (HF's ``labels=`` shifts inside the model, across the
   chunk boundaries, which cp refuses).
2. Spawn 2 ranks over Gloo; each compiles the model for the real cp device mesh and trains
   STEPS AdamW steps on the same global batch (each rank keeps its own sequence chunks); every
   rank returns the global-sequence loss, which must agree.
3. Train the unmodified model on one device with the same optimizer and loss.
4. Print both loss curves with the relative difference per step; exit 1 if any step differs
   by more than TOLERANCE or the ranks disagree.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from autopar import Mesh, autoparallelize
from autopar.runtime.pool import gloo_rank
from autopar.tools.testing import (
    compare_losses,
    hf_tiny_llama,
    spawn_ranks,
    token_batch,
    train_loop,
)

CP, BATCH, SEQ, VOCAB = 2, 2, 64, 128
STEPS, LR, WEIGHT_DECAY, TOLERANCE = 20, 3e-3, 0.01, 1e-4


def shifted_loss(out, labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM cross-entropy on labels already shifted left (-100: no target)."""
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids, labels = token_batch(BATCH, SEQ, VOCAB)
    return ids, torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def rank_main(rank: int, port: int, results: mp.SimpleQueue) -> None:
    """Step 2 on one rank: compile for the device mesh and train."""
    with gloo_rank(rank, CP, port, (CP,), ("cp",)) as mesh:
        ids, labels = batch()
        module = autoparallelize(hf_tiny_llama(layers=2, vocab=VOCAB), mesh, (ids, labels),
                                 shifted_loss, cp_attention="ring")  # fmt: skip
        opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        log = (lambda s: print(f"[rank 0] {s}", flush=True)) if rank == 0 else (lambda _: None)
        results.put((rank, train_loop(lambda: module(ids, labels), opt, STEPS, log)))


def train_single(log: Callable[[str], None]) -> list[float]:
    """Step 3: the unmodified model, the same loss and optimizer."""
    model = hf_tiny_llama(layers=2, vocab=VOCAB)
    ids, labels = batch()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    return train_loop(lambda: shifted_loss(model(ids), labels), opt, STEPS, log)


def main() -> int:
    start = time.perf_counter()
    print(f"1. compiling HF LlamaForCausalLM for Mesh(cp={CP}), batch {BATCH} x {SEQ}", flush=True)
    prog = autoparallelize(hf_tiny_llama(layers=2, vocab=VOCAB), Mesh(cp=CP), batch(),
                           shifted_loss, cp_attention="ring")  # fmt: skip
    print(prog.plan, flush=True)

    print(f"2. spawning {CP} Gloo ranks", flush=True)
    parallel, agree = spawn_ranks(rank_main, CP)

    print("3. training the unmodified model on one device", flush=True)
    single = train_single(lambda s: print(f"[single] {s}", flush=True))

    ok = compare_losses(single, parallel, f"autopar cp={CP}", TOLERANCE)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0 if ok and agree else 1


if __name__ == "__main__":
    sys.exit(main())
