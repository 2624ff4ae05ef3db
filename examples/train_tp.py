"""Train a Llama-style model with tensor parallelism on 4 CPU ranks; compare with one device.

Run from the repository root (after `pip install -e .`, or with `PYTHONPATH=.`):

    python examples/train_tp.py

Algorithm:
1. Compile the model for a virtual Mesh(tp=4) and print the plan and rank 1's program.
2. Spawn 4 ranks over Gloo; each compiles the same model for the real device mesh and trains
   its per-rank module for STEPS steps with AdamW on one fixed batch.
3. Train the unmodified model on one device with the same optimizer, hyper-parameters and data.
4. Print both loss curves side by side with the relative difference per step; exit 1 if any
   step differs by more than TOLERANCE.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable

import torch
import torch.multiprocessing as mp

from autopar import Mesh, autoparallelize
from autopar.runtime.pool import free_port, gloo_rank, rank_context, start_ranks
from autopar.tools.testing import Config, build, compare_losses, lm_loss, tokens, train_loop

CONFIG = Config(layers=2, hidden=128, heads=8, kv_heads=4, ffn=256, vocab=256, seq=32, batch=4)
WORLD, STEPS, LR, WEIGHT_DECAY, TOLERANCE = 4, 20, 3e-3, 0.01, 1e-4


def train(model: Callable[..., torch.Tensor], params: Iterable[torch.nn.Parameter],
          log: Callable[[str], None]) -> list[float]:  # fmt: skip
    """STEPS steps of AdamW on one fixed batch (``model(x, y) -> loss``); the loss per step."""
    x, y = tokens(CONFIG)
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    return train_loop(lambda: model(x, y), opt, STEPS, log)


def rank_main(rank: int, port: int, results: mp.SimpleQueue) -> None:
    """Step 2 on one rank: compile for the device mesh, train, and report rank 0's losses."""
    with gloo_rank(rank, WORLD, port, (WORLD,), ("tp",)) as mesh:
        local = autoparallelize(build("llama", CONFIG), mesh, tokens(CONFIG), loss_fn=lm_loss)
        log = (lambda s: print(f"[rank 0] {s}", flush=True)) if rank == 0 else (lambda s: None)
        log(f"compiled; training {STEPS} steps on {WORLD} ranks")
        losses = train(local, local.parameters(), log)
        if rank == 0:
            results.put(losses)


def main() -> int:
    start = time.perf_counter()
    print(f"1. compiling the Llama model for Mesh(tp={WORLD}) ({CONFIG})", flush=True)
    prog = autoparallelize(build("llama", CONFIG), Mesh(tp=WORLD), tokens(CONFIG), loss_fn=lm_loss)
    print(prog.plan)
    print(prog.code(rank=1), flush=True)

    print(f"2. spawning {WORLD} Gloo ranks", flush=True)
    results = rank_context().SimpleQueue()
    start_ranks(rank_main, (free_port(), results), WORLD)
    parallel = results.get()

    print("3. training the unmodified model on one device", flush=True)
    model = build("llama", CONFIG)
    single = train(lambda x, y: lm_loss(model(x), y), model.parameters(),
                   lambda s: print(f"[single] {s}", flush=True))  # fmt: skip

    ok = compare_losses(single, parallel, f"autopar tp={WORLD}", TOLERANCE)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
