"""GPU smoke check: autopar's per-rank program on one CUDA device in bf16 vs the eager model.

One GPU means NCCL with world size 1, so the mesh is Mesh(tp=1): the check is that the
compiled program runs on CUDA in bf16, computes what the eager model computes, runs as fast,
and that the cost model's predicted MFU is near the measured one.  Without CUDA it says so and
exits 0 (``--device cpu`` runs the same steps on CPU over Gloo, to check the script itself).

Algorithm:
1. Build a Llama-style model (autopar.testing) in bf16 on the device; one NCCL (Gloo on CPU)
   rank with a DeviceMesh named ``tp`` of size 1.
2. Compile it with ``autoparallelize(model, device_mesh, ...)``; move the rank's module to the
   device.  Plan it on the meta device in bf16 for the predicted step time.
3. Forward + backward of the eager model and of the program on the same batch: max relative
   error of the loss and of every parameter gradient (bf16: ~1e-2 is rounding).
4. Time STEPS forward + backward + AdamW steps of each after WARMUP steps; print step times,
   their ratio, tokens/s, the measured MFU (PaLM convention: 6·N·tokens, N without the
   embedding) and the cost model's predicted MFU for that GPU.

Run: python benchmarks/gpu_smoke.py [--layers 8 --hidden 2048 --seq 2048 --batch 4]
Prints a few lines; takes well under five minutes on an H100/H200.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from autopar import Mesh, autoparallelize
from autopar.pool import free_port
from autopar.testing import Config, build, lm_loss, tokens
from cost.hardware import Cluster

WARMUP, STEPS = 3, 10
PEAK_BF16 = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "b200": 2.25e15}


def main() -> int:
    args = _args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device here; nothing to measure (run it on a GPU machine)")
        return 0
    device = torch.device(args.device)
    dtype = torch.bfloat16
    c = Config(layers=args.layers, hidden=args.hidden, heads=args.hidden // 128,
               kv_heads=max(1, args.hidden // 512), ffn=int(args.hidden * 2.6875) // 64 * 64,
               vocab=32000, seq=args.seq, batch=args.batch, bias=False)  # fmt: skip
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1")  # fmt: skip
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        return _run(c, device, dtype, args)
    finally:
        dist.destroy_process_group()


def _run(c: Config, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_smoke on {name}: Llama {c.layers} layers, hidden {c.hidden}, seq {c.seq}, "
          f"batch {c.batch}, bf16", flush=True)  # fmt: skip
    x, y = (t.to(device) for t in tokens(c))
    eager = build("llama", c).to(dtype)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("tp",))
    local = autoparallelize(eager, mesh, tokens(c), loss_fn=lm_loss).to(device)
    eager = eager.to(device)
    errors = _compare(eager, local, x, y)
    print(f"max relative error vs eager (bf16): loss {errors[0]:.2e}, gradients {errors[1]:.2e}")
    t_eager = _time(lambda: lm_loss(eager(x), y), eager.parameters(), device)
    t_prog = _time(lambda: local(x, y), local.parameters(), device)
    n = sum(p.numel() for n_, p in eager.named_parameters() if "embed" not in n_)
    flops = 6 * n * c.batch * c.seq + 12 * c.layers * c.hidden * c.seq * c.batch * c.seq
    peak = next((v for k, v in PEAK_BF16.items() if k in name.lower()), None)
    predicted = _predicted_step(c, args.cluster)
    print(f"step (fwd+bwd+AdamW): eager {t_eager * 1e3:.1f} ms, autopar {t_prog * 1e3:.1f} ms, "
          f"ratio {t_prog / t_eager:.3f}; {c.batch * c.seq / t_prog:,.0f} tokens/s")  # fmt: skip
    if peak:
        print(f"MFU (PaLM convention): measured {flops / t_prog / peak:.1%}, cost model "
              f"{flops / predicted / peak:.1%} (predicted fwd+bwd {predicted * 1e3:.1f} ms)")
    else:
        print(f"no bf16 peak known for {name}: MFU not computed")
    return 0


def _compare(eager: torch.nn.Module, local: torch.nn.Module, x: torch.Tensor,
             y: torch.Tensor) -> tuple[float, float]:  # fmt: skip
    ref = lm_loss(eager(x), y)
    ref.backward()
    ours = local(x, y)
    ours.backward()
    loss_err = ((ours.float() - ref.float()).abs() / ref.float().abs()).item()
    mine = dict(local.named_parameters())
    worst = 0.0
    for n, p in eager.named_parameters():
        g, h = p.grad.float(), mine[n].grad.float()
        worst = max(worst, ((g - h).abs().max() / g.abs().max().clamp(min=1e-12)).item())
    eager.zero_grad(set_to_none=True)
    local.zero_grad(set_to_none=True)
    return loss_err, worst


def _time(step, params, device: torch.device) -> float:
    opt = torch.optim.AdamW(list(params), lr=1e-4)

    def once() -> None:
        step().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(WARMUP):
        once()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(STEPS):
        once()
    sync()
    return (time.perf_counter() - start) / STEPS


def _predicted_step(c: Config, cluster: str) -> float:
    with torch.device("meta"):
        model = build("llama", c).to(torch.bfloat16)
    prog = autoparallelize(model, Mesh(Cluster.preset(cluster), tp=1), tokens(c), loss_fn=lm_loss)
    return prog.plan.step_s


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--cluster", default="dgx-h100", help="cost-model preset for the prediction")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(main())
