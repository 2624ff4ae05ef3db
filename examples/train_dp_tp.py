"""Train HF Llama with data x tensor parallelism and ZeRO-3 on 4 CPU ranks; compare with one
device.

Run from the repository root (after `pip install -e .`, or with `PYTHONPATH=.`):

    python examples/train_dp_tp.py

Algorithm:
1. Compile a tiny random-weight LlamaForCausalLM (loss from ``labels``) for a virtual
   Mesh(dp=2, tp=2) with zero=3 and print the plan: each axis and its link, the ZeRO memory
   table, the dp traffic of one step and the tensor-parallel program every dp rank runs.
2. Spawn 4 ranks over Gloo; each compiles the same model for the real (dp, tp) device mesh
   (its module comes back wrapped in FSDP2 over its dp group), builds AdamW through
   ``module.optimizer`` and trains STEPS steps on its half of one fixed batch; every rank
   reports the loss it returned (the global-batch loss), which must all agree.
3. Train the unmodified model on one device on the whole batch with the same optimizer.
4. Print both loss curves with the relative difference per step; exit 1 if any step differs
   by more than TOLERANCE or the ranks disagree.
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

DP, TP, ZERO, BATCH, SEQ, VOCAB = 2, 2, 3, 4, 16, 128
WORLD, STEPS, LR, WEIGHT_DECAY, TOLERANCE = DP * TP, 20, 3e-3, 0.01, 1e-4


def tiny_llama() -> torch.nn.Module:
    return hf_tiny_llama(layers=2, vocab=VOCAB)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(BATCH, SEQ, VOCAB)


def rank_main(rank: int, port: int, results: mp.SimpleQueue) -> None:
    """Step 2 on one rank: compile for the device mesh, train on this rank's batch slice."""
    with gloo_rank(rank, WORLD, port, (DP, TP), ("dp", "tp")) as mesh:
        ids, labels = batch()
        module = autoparallelize(tiny_llama(), mesh, (ids,), example_kwargs={"labels": labels},
                                 zero=ZERO)  # fmt: skip
        d = mesh.get_local_rank("dp")
        ids, labels = ids.chunk(DP)[d], labels.chunk(DP)[d]
        opt = module.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WEIGHT_DECAY)
        losses = []
        for i in range(STEPS):
            loss = module(ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if rank == 0:
                print(f"[rank 0] step {i + 1:2d}/{STEPS}  loss {losses[-1]:.6f}", flush=True)
        results.put((rank, losses))


def train_single(log: Callable[[str], None]) -> list[float]:
    """Step 3: STEPS steps of AdamW on the unmodified model and the whole batch."""
    return train_hf_single(tiny_llama(), *batch(), STEPS, LR, WEIGHT_DECAY, log)


def main() -> int:
    start = time.perf_counter()
    print(f"1. compiling HF LlamaForCausalLM for Mesh(dp={DP}, tp={TP}), zero={ZERO}, global "
          f"batch {BATCH} x {SEQ}", flush=True)  # fmt: skip
    ids, labels = batch()
    prog = autoparallelize(tiny_llama(), Mesh(dp=DP, tp=TP), (ids,),
                           example_kwargs={"labels": labels}, zero=ZERO)  # fmt: skip
    print(prog.plan, flush=True)

    print(f"2. spawning {WORLD} Gloo ranks", flush=True)
    parallel, agree = spawn_ranks(rank_main, WORLD)

    print("3. training the unmodified model on one device", flush=True)
    single = train_single(lambda s: print(f"[single] {s}", flush=True))

    ok = compare_losses(single, parallel, f"autopar dp={DP} tp={TP} zero={ZERO}", TOLERANCE)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0 if ok and agree else 1


if __name__ == "__main__":
    sys.exit(main())
