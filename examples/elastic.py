"""Elastic training: two torchrun agents of 2 workers share a c10d rendezvous (--nnodes 1:2);
agent "b" loses its node at step KILL_AT; agent "a"'s workers restart with world size 2,
re-plan, resume from the last checkpoint and finish with the loss curve of one device.

    python examples/elastic.py            # launch, kill a node, watch it resume
    python examples/elastic.py --evict    # rank 3 sleeps in its steps: evicted, not killed
    python examples/elastic.py --grow     # start on one node, a second joins, then is lost

Algorithm:
1. The launcher starts two agents (own process groups), each running this file's workers:
   ``autopar.elastic.Elastic`` with a small HF Llama, a checkpoint every SAVE_EVERY steps.
2. Fault: at step KILL_AT on attempt 0, agent b's workers wait for the checkpoint in flight,
   kill their agent (SIGKILL) and exit: a lost node.  ``--evict``: rank 3 sleeps SLOW_S in
   every step; the straggler report names it for EVICT_AFTER windows and its node leaves.
   ``--grow``: agent a starts alone (world 2, MICRO_ROWS rows per forward: gradient
   accumulation); at step GROW_AT its workers wait with the checkpoint committed and the
   launcher starts agent b: torchrun restarts a's workers for the larger world (4), they
   re-plan and resume, and node b is lost at step KILL_AT as above (world 2 again).
3. Rank 0 appends each step's loss to losses.jsonl; the launcher compares the last value of
   every step with one device and prints each re-plan (old mesh -> new mesh, reason, times).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

STEPS, SAVE_EVERY, KILL_AT, LR, TOLERANCE = 12, 3, 7, 3e-3, 1e-5
BATCH, SEQ, VOCAB, SLOW_S, EVICT_AFTER = 4, 16, 128, 0.4, 2
GROW_AT, MICRO_ROWS, JOIN = 4, 1, "join.ready"


def loss_fn(out, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))


def model() -> torch.nn.Module:
    from autopar.tools.testing import hf_tiny_llama

    return hf_tiny_llama(layers=2, vocab=VOCAB)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))  # fmt: skip


def optimizer(params) -> torch.optim.Optimizer:  # noqa: ANN001
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def fault(step: int, run) -> None:  # noqa: ANN001
    """Step 2, on every worker before each step."""
    import torch.distributed as dist

    mode, node = os.environ.get("AUTOPAR_FAULT", ""), os.environ.get("AUTOPAR_NODE", "")
    if mode == "grow" and run.attempt == 0 and step == GROW_AT:
        run.checkpointer.wait()
        if dist.get_rank() == 0:
            (run.root / JOIN).touch()  # the launcher starts agent b
        time.sleep(120)  # until agent a stops this worker for the larger world
    lost = {"kill": 0, "grow": 1}.get(mode)  # the attempt node b is lost in
    if node == "b" and run.attempt == lost and step == KILL_AT:
        run.checkpointer.wait()
        print(f"[node b] rank {dist.get_rank()}: losing the node at step {step}", flush=True)
        if int(os.environ["LOCAL_RANK"]) == 0:
            os.kill(os.getppid(), signal.SIGKILL)
        else:
            time.sleep(0.5)
        os._exit(1)
    if mode == "evict" and dist.get_world_size() == 4 and dist.get_rank() == 3:
        time.sleep(SLOW_S)


def worker(root: Path) -> None:
    """Step 1 on one torchrun worker."""
    import torch.distributed as dist

    from autopar.elastic import Elastic

    torch.set_num_threads(1)
    evict, grow = (os.environ.get("AUTOPAR_FAULT") == m for m in ("evict", "grow"))
    run = Elastic(root, model=model, batch=batch, loss_fn=loss_fn, optimizer=optimizer,
                  steps=STEPS, save_every=SAVE_EVERY, mesh="tp=*" if evict else None,
                  micro_rows=MICRO_ROWS if grow else None,
                  evict_after=EVICT_AFTER if evict else None, straggler_every=2,
                  on_step=fault, watchdog_timeout=10)  # fmt: skip
    original = run._step_fn

    def logged(module, opt, mesh):  # noqa: ANN001, ANN202
        step = original(module, opt, mesh)

        def run_step(n: int) -> float:
            loss = step(n)
            if dist.get_rank() == 0:
                with open(root / "losses.jsonl", "a") as f:
                    f.write(json.dumps({"attempt": run.attempt, "step": n, "loss": loss,
                                        "mesh": str(mesh)}) + "\n")  # fmt: skip
            return loss

        return run_step

    run._step_fn = logged
    run.train()


def single_device() -> list[float]:
    m, losses = model(), []
    opt = optimizer(m.parameters())
    for step in range(1, STEPS + 1):
        x, y = batch(step)
        loss = loss_fn(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def agent(root: Path, node: str, port: int, fault_mode: str) -> subprocess.Popen:
    """One torchrun agent in a process group of its own (killed whole at the end)."""
    env = {**os.environ, "AUTOPAR_ELASTIC_DIR": str(root), "AUTOPAR_NODE": node,
           "AUTOPAR_FAULT": fault_mode, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # fmt: skip
    if fault_mode == "grow":  # a node joining needs a fresh store each round (autopar.elastic)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
           "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "autopar-elastic", "--max-restarts", "3",
           "--monitor-interval", "0.5", "--rdzv-conf",
           "join_timeout=120,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=10",
           __file__]  # fmt: skip
    log = open(root / f"agent_{node}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def launch(root: Path, fault_mode: str, timeout: float = 300) -> int:
    """Steps 1-2: both agents (b once a's workers ask for it under ``grow``) until agent a
    ends; every process group killed after."""
    from autopar.runtime.pool import free_port

    port, deadline = free_port(), time.monotonic() + timeout
    agents = [agent(root, "a", port, fault_mode)]
    try:
        _wait_listening(port, agents[0], deadline)  # a hosts the rendezvous store, never b
        while fault_mode == "grow" and not (root / JOIN).exists() and agents[0].poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent a's workers never reached step {GROW_AT} ({root})")
            time.sleep(0.2)
        agents.append(agent(root, "b", port, fault_mode))
        return agents[0].wait(timeout=max(deadline - time.monotonic(), 1.0))
    finally:
        for p in agents:
            with_group_killed(p)


def _wait_listening(port: int, proc: subprocess.Popen, deadline: float) -> None:
    """Until agent a's rendezvous store accepts connections on ``port``: b must not start
    first and host the store itself (an evicted or killed b would take the store with it)."""
    import socket

    while proc.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"agent a's rendezvous store never listened on port {port}")
        time.sleep(0.2)


def with_group_killed(p: subprocess.Popen) -> None:
    import contextlib

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=10)


def curve(root: Path) -> list[float]:
    """The last loss logged for each step (redone steps after a restart replace the first)."""
    rows = [json.loads(line) for line in (root / "losses.jsonl").read_text().splitlines()]
    last = {r["step"]: r["loss"] for r in rows}
    missing = [s for s in range(1, STEPS + 1) if s not in last]
    if missing:
        raise RuntimeError(f"steps {missing} never ran (see the agents' logs in {root})")
    return [last[s] for s in range(1, STEPS + 1)]


def replans(root: Path) -> list[dict]:
    from autopar.elastic import replans as recorded

    return recorded(root)


def main() -> int:
    if "LOCAL_RANK" in os.environ:
        worker(Path(os.environ["AUTOPAR_ELASTIC_DIR"]))
        return 0
    from autopar.tools.testing import compare_losses

    root = Path(tempfile.mkdtemp(prefix="autopar-elastic-"))
    mode = next((m for m in ("evict", "grow") if f"--{m}" in sys.argv), "kill")
    code = launch(root, mode)
    print(f"agent a exited with {code}; logs in {root}")
    for r in replans(root):
        print(
            f"re-plan {r['old_mesh']} -> {r['new_mesh']}: {r['reason']} (re-plan "
            f"{r['replan_s']:.2f} s, resume {r['resume_s']:.2f} s, from step {r['resumed_step']})"
        )
    ok = compare_losses(single_device(), curve(root), "elastic", TOLERANCE)
    return 0 if code == 0 and ok else 1


if __name__ == "__main__":
    sys.exit(main())
