"""Train HF Llama with pipeline x tensor parallelism on 4 CPU ranks; compare with one device.

Run from the repository root (after `pip install -e .`, or with `PYTHONPATH=.`):

    python examples/train_pp.py

Algorithm:
1. Compile a tiny random-weight LlamaForCausalLM (loss from ``labels``) for a virtual
   Mesh(pp=2, tp=2) and print the plan (stage cuts, predicted bubble, per-stage TP plans) and
   the schedule one training step runs (an ASCII timeline per pipeline rank).
2. Spawn 4 ranks over Gloo; each compiles the same model for the real (pp, tp) device mesh and
   trains its pipeline runner for STEPS steps with AdamW on one fixed batch, split into
   MICROBATCHES micro-batches by the SCHEDULE schedule; every rank reports the losses its
   runner returned (the runner broadcasts the last stage's loss), which must all agree.
3. Train the unmodified model on one device with the same optimizer, hyper-parameters and data
   (the whole batch at once: every micro-batch has the same number of shifted-label positions,
   so the mean of the micro-batch losses is the full-batch loss).
4. Print both loss curves side by side with the relative difference per step; exit 1 if any
   step differs by more than TOLERANCE or the ranks disagree.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

from autopar import Mesh, autoparallelize
from autopar.runtime.pool import gloo_rank
from autopar.tools.testing import (
    compare_losses,
    hf_tiny_llama,
    spawn_ranks,
    token_batch,
    train_hf_single,
)

PP, TP, BATCH, SEQ, VOCAB, MICROBATCHES, SCHEDULE = 2, 2, 8, 16, 128, 4, "1f1b"
WORLD, STEPS, LR, WEIGHT_DECAY, TOLERANCE = PP * TP, 20, 3e-3, 0.01, 1e-4


def tiny_llama() -> torch.nn.Module:
    return hf_tiny_llama(layers=4, vocab=VOCAB)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(BATCH, SEQ, VOCAB)


def optimizer(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def rank_main(rank: int, port: int, results: mp.SimpleQueue) -> None:
    """Step 2 on one rank: compile for the device mesh, train, and report this rank's losses."""
    with gloo_rank(rank, WORLD, port, (PP, TP), ("pp", "tp")) as mesh:
        ids, labels = batch()
        runner = autoparallelize(tiny_llama(), mesh, (ids,), example_kwargs={"labels": labels},
                                 n_microbatches=MICROBATCHES, schedule=SCHEDULE)  # fmt: skip
        step = runner.train_step(optimizer)
        losses = []
        for i in range(STEPS):
            losses.append(step(ids, labels=labels).item())
            if rank == 0:
                print(f"[rank 0] step {i + 1:2d}/{STEPS}  loss {losses[-1]:.6f}", flush=True)
        results.put((rank, losses))


def train_single(log: Callable[[str], None]) -> list[float]:
    """Step 3: STEPS steps of AdamW on the unmodified model and the whole batch."""
    return train_hf_single(tiny_llama(), *batch(), STEPS, LR, WEIGHT_DECAY, log)


def main() -> int:
    start = time.perf_counter()
    print(f"1. compiling HF LlamaForCausalLM for Mesh(pp={PP}, tp={TP}), batch {BATCH} x {SEQ}, "
          f"{MICROBATCHES} micro-batches, schedule {SCHEDULE}", flush=True)  # fmt: skip
    ids, labels = batch()
    prog = autoparallelize(tiny_llama(), Mesh(pp=PP, tp=TP), (ids,),
                           example_kwargs={"labels": labels}, n_microbatches=MICROBATCHES,
                           schedule=SCHEDULE)  # fmt: skip
    print(prog.plan)
    print(prog.train_step(optimizer), flush=True)

    print(f"2. spawning {WORLD} Gloo ranks", flush=True)
    parallel, agree = spawn_ranks(rank_main, WORLD)

    print("3. training the unmodified model on one device", flush=True)
    single = train_single(lambda s: print(f"[single] {s}", flush=True))

    ok = compare_losses(single, parallel, f"autopar pp={PP} tp={TP}", TOLERANCE) and agree
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
