"""A rank crashes mid-run; torchrun's elastic restart resumes from the last checkpoint and the loss
curve continues exactly where an uninterrupted single-device run goes.

Run from the repository root (it re-launches itself under torchrun when started plainly):

    python examples/resume.py
    # or: AUTOPAR_RESUME_DIR=/tmp/run torchrun --nproc-per-node=2 --max-restarts=1 \\
    #       examples/resume.py

Algorithm:
1. Every rank compiles a Llama-style model for Mesh(tp=2) and builds AdamW; a Checkpointer
   loads the newest committed checkpoint if there is one (the model, the optimizer, RNG and the
   data position: batch ``i`` is ``tokens(seed=i)``).
2. Train to step STEPS, saving asynchronously every SAVE_EVERY steps; the watchdog names a dead
   rank.  On the first attempt rank 1 dies at step CRASH_AT: torchrun restarts every worker,
   which resume at step 1.
3. Rank 0 appends each step's loss to losses.jsonl; at the end it trains the unmodified model
   on one device over the same batches and compares the curve (the last value logged for each
   step: the steps redone after the restart must also equal their first run) with TOLERANCE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
WORLD, STEPS, SAVE_EVERY, CRASH_AT, LR, TOLERANCE = 2, 12, 4, 10, 3e-3, 1e-5


def config():
    from autopar.tools.testing import Config

    return Config(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=96, seq=16, batch=4)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    from autopar.tools.testing import tokens

    return tokens(config(), seed=step)


def train_rank(root: Path) -> None:
    """Steps 1-3 on one torchrun worker."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar import autoparallelize
    from autopar.elastic import init_attempt_group
    from autopar.runtime.checkpoints import Checkpointer
    from autopar.runtime.resilience import Watchdog, enable_flight_recorder
    from autopar.tools.testing import build, lm_loss

    enable_flight_recorder()
    torch.set_num_threads(1)
    init_attempt_group()
    rank = dist.get_rank()
    watchdog = Watchdog(timeout=20)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    module = autoparallelize(build("llama", config()), mesh, batch(1), loss_fn=lm_loss)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.01)
    ckpt = Checkpointer(root / "ckpt", module, opt)
    resumed = ckpt.load()
    start = resumed.extra["data_position"] + 1 if resumed else 1
    if rank == 0:
        print(f"[attempt {RESTART}] starting at step {start}", flush=True)
    with watchdog.guard():
        for step in range(start, STEPS + 1):
            watchdog.step(step)
            if RESTART == 0 and rank == 1 and step == CRASH_AT:
                print(f"[attempt {RESTART}] rank 1 crashes at step {step}", flush=True)
                os._exit(1)
            loss = module(*batch(step))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if rank == 0:
                with open(root / "losses.jsonl", "a") as f:
                    f.write(
                        json.dumps({"attempt": RESTART, "step": step, "loss": loss.item()}) + "\n"
                    )
                print(f"[attempt {RESTART}] step {step:2d} loss {loss.item():.6f}", flush=True)
            if step % SAVE_EVERY == 0:
                ckpt.save(step, {"data_position": step})  # background write
        ckpt.wait()
    watchdog.stop()
    dist.destroy_process_group()


def single_device() -> list[float]:
    from autopar.tools.testing import build, lm_loss

    model = build("llama", config())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for step in range(1, STEPS + 1):
        x, y = batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def report(root: Path) -> int:
    """Step 3: the resumed curve against one device, and the redone steps against their first
    run."""
    from autopar.tools.testing import compare_losses

    rows = [json.loads(line) for line in (root / "losses.jsonl").read_text().splitlines()]
    last = {r["step"]: r["loss"] for r in rows}
    redone = [(r["step"], r["loss"]) for r in rows if r["attempt"] == 0
              and any(q["attempt"] > 0 and q["step"] == r["step"] for q in rows)]  # fmt: skip
    same = all(last[s] == v for s, v in redone)
    print(f"steps redone after the restart: {[s for s, _ in redone]}; "
          f"bitwise equal to their first run: {same}")  # fmt: skip
    ok = compare_losses(single_device(), [last[s] for s in range(1, STEPS + 1)],
                        "tp=2, crash + resume", TOLERANCE)  # fmt: skip
    return 0 if ok and same and any(r["attempt"] > 0 for r in rows) else 1


def main() -> int:
    if "LOCAL_RANK" in os.environ:  # a torchrun worker
        train_rank(Path(os.environ["AUTOPAR_RESUME_DIR"]))
        return 0
    from autopar.runtime.pool import free_port

    root = Path(tempfile.mkdtemp(prefix="autopar-resume-"))
    env = {**os.environ, "AUTOPAR_RESUME_DIR": str(root), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD),
           "--max-restarts", "1", "--monitor-interval", "0.5", "--master-port",
           str(free_port()), __file__]  # fmt: skip
    print("launching:", " ".join(cmd), flush=True)
    code = subprocess.call(cmd, env=env)
    print(f"torchrun exited with {code}", flush=True)
    return code or report(root)


if __name__ == "__main__":
    sys.exit(main())
