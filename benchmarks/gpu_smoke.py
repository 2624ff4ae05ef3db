"""GPU smoke check: autopar's per-rank program on one CUDA device in bf16 vs the eager model.

One GPU means NCCL with world size 1, so the mesh is Mesh(tp=1): the check is that the
compiled program runs on CUDA in bf16, computes what the eager model computes, runs as fast,
and that the cost model's predicted MFU is near the measured one.  Without CUDA it says so and
exits 0 (``--device cpu`` runs the same steps on CPU over Gloo, to check the script itself).

Algorithm:
1. Build a Llama-style model (autopar.tools.testing) in bf16 on the device; one NCCL (Gloo on CPU)
   rank with a DeviceMesh named ``tp`` of size 1.
2. Compile it with ``autoparallelize(model, device_mesh, ...)``; move the rank's module to the
   device.  Plan it on the meta device in bf16 for the predicted step time.
3. Forward + backward of the eager model and of the program on the same batch: max relative
   error of the loss and of every parameter gradient (bf16: ~1e-2 is rounding).
4. Time STEPS forward + backward passes, then STEPS steps with AdamW, of each after WARMUP;
   print the times, their ratios, tokens/s, and forward + backward against the cost model's
   prediction (which prices forward + backward): measured and predicted MFU (PaLM
   convention: 6·N·tokens + attention, N without the embedding).

5. ``--compile``: also the rank program with ``compile=True`` and the eager model with
   torch.compile applied by hand per block, side by side (ms, tokens/s, MFU, the prediction).
6. ``--fp8 tensorwise|rowwise``: also the rank program with ``fp8=`` (eager) and the eager
   model converted by hand with torchao's ``convert_to_float8_training`` (same recipe, the
   LM head kept), fwd+bwd side by side with the bf16 ones and the cost model's FP8
   prediction; the loss of both FP8 runs against the bf16 eager one.

Run: python benchmarks/gpu_smoke.py [--compile] [--fp8 tensorwise] [--shapes 8x2048x2048x4,4x4096x2048x4]
(each shape is layers x hidden x seq x batch). Prints a few lines per shape; takes well under
five minutes on an H100/H200.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from autopar import Mesh, autoparallelize
from autopar.runtime.pool import free_port
from autopar.tools.testing import Config, build, lm_loss, tokens
from cost.hardware import Cluster

WARMUP, STEPS = 3, 10
PEAK_BF16 = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "b200": 2.25e15}


def main() -> int:
    args = _args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_smoke: no CUDA device here; nothing to measure (run it on a GPU machine)")
        return 0
    device = torch.device(args.device)
    print(f"torch {torch.__version__}; {'nccl' if device.type == 'cuda' else 'gloo'}, world size 1",
          flush=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      WORLD_SIZE="1")  # fmt: skip
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        for shape in args.shapes.split(","):
            _run(_config(shape), device, torch.bfloat16, args)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return 0
    finally:
        dist.destroy_process_group()


def _config(shape: str) -> Config:
    """A Llama-style config from 'layers x hidden x seq x batch' (head dim 128, GQA 4:1)."""
    layers, hidden, seq, batch = (int(v) for v in shape.lower().split("x"))
    return Config(layers=layers, hidden=hidden, heads=max(1, hidden // 128),
                  kv_heads=max(1, hidden // 512), ffn=int(hidden * 2.6875) // 64 * 64,
                  vocab=32000, seq=seq, batch=batch, bias=False)  # fmt: skip


def _run(c: Config, device: torch.device, dtype: torch.dtype, args: argparse.Namespace) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\ngpu_smoke on {name}: {args.model} {c.layers} layers, hidden {c.hidden}, "
          f"seq {c.seq}, batch {c.batch}, bf16", flush=True)  # fmt: skip
    x, y = (t.to(device) for t in tokens(c))
    eager, loss_fn = _model(args.model, c)
    eager = eager.to(dtype)
    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("tp",))
    local = autoparallelize(eager, mesh, tokens(c), loss_fn=loss_fn).to(device)
    eager = eager.to(device)
    errors = _compare(eager, local, loss_fn, x, y)
    print(f"max relative error vs eager (bf16): loss {errors[0]:.2e}, gradients {errors[1]:.2e}")
    e_fb, e_step = _time(lambda: loss_fn(eager(x), y), eager.parameters(), device)
    p_fb, p_step = _time(lambda: local(x, y), local.parameters(), device)
    if device.type == "cuda":
        print(f"peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB")
    n = sum(p.numel() for n_, p in eager.named_parameters() if "embed" not in n_)
    flops = 6 * n * c.batch * c.seq + 12 * c.layers * c.hidden * c.seq * c.batch * c.seq
    peak = next((v for k, v in PEAK_BF16.items() if k in name.lower()), None)
    predicted = _predicted_step(args.model, c, args.cluster)
    print(f"fwd+bwd: eager {e_fb * 1e3:.1f} ms, autopar {p_fb * 1e3:.1f} ms, ratio "
          f"{p_fb / e_fb:.3f}; cost model {predicted * 1e3:.1f} ms (measured / predicted "
          f"{p_fb / predicted:.2f})")  # fmt: skip
    print(f"step (fwd+bwd+AdamW): eager {e_step * 1e3:.1f} ms, autopar {p_step * 1e3:.1f} ms, "
          f"ratio {p_step / e_step:.3f}; {c.batch * c.seq / p_step:,.0f} tokens/s")  # fmt: skip
    if peak:
        print(f"MFU of fwd+bwd (PaLM convention): measured {flops / p_fb / peak:.1%}, cost model "
              f"{flops / predicted / peak:.1%}")  # fmt: skip
    else:
        print(f"no bf16 peak known for {name}: MFU not computed")
    if args.compile:
        _compiled_rows(c, eager, loss_fn, mesh, device, (x, y),
                       {"eager model": e_fb, "autopar eager": p_fb}, flops, peak, predicted)
    if args.fp8:
        _fp8_rows(c, args, eager, loss_fn, mesh, device, (x, y),
                  {"eager model": (e_fb, predicted), "autopar eager": (p_fb, predicted)}, flops,
                  peak)  # fmt: skip
    return 0


def _fp8_rows(c: Config, args: argparse.Namespace, eager: torch.nn.Module, loss_fn: Callable,
              mesh: Any, device: torch.device, batch: tuple,
              measured: dict[str, tuple[float, float]], flops: float,
              peak: float | None) -> None:  # fmt: skip
    """Step 6 (``--fp8``): autopar's ``fp8=`` program and torchao applied by hand to a copy of
    the eager model, fwd+bwd next to the bf16 ones (ms, ratio, tokens/s, MFU against the bf16
    peak, prediction)."""
    import copy

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    x, y = batch
    from autopar.ops.fp8 import fp8_linear

    local = autoparallelize(eager, mesh, tokens(c), loss_fn=loss_fn, fp8=args.fp8).to(device)
    print(f"autopar fp8={args.fp8}: {sum(n.target is fp8_linear for n in local.graph.nodes)} "
          "fp8_linear calls in the rank program")  # fmt: skip
    fp8_pred = _predicted_step(args.model, c, args.cluster, fp8=args.fp8)
    measured[f"autopar fp8={args.fp8}"] = (_time(lambda: local(x, y), local.parameters(),
                                                 device)[0], fp8_pred)  # fmt: skip
    head = "lm_head"
    by_hand = convert_to_float8_training(copy.deepcopy(eager),
                                         config=Float8LinearConfig.from_recipe_name(args.fp8),
                                         module_filter_fn=lambda _m, fqn: head not in fqn)  # fmt: skip
    measured["torchao by hand"] = (_time(lambda: loss_fn(by_hand(x), y), by_hand.parameters(),
                                         device)[0], fp8_pred)  # fmt: skip
    with torch.no_grad():
        ref = loss_fn(eager(x), y).float()
        rel = [(abs(f().float() - ref) / ref).item() for f in (lambda: local(x, y),
                                                               lambda: loss_fn(by_hand(x), y))]
    print(f"loss vs bf16 eager: autopar fp8 {rel[0]:.2e}, torchao by hand {rel[1]:.2e}")
    base = measured["eager model"][0]
    print(f"{'fwd+bwd':<24} {'ms':>8} {'/eager':>7} {'tokens/s':>10} {'MFU':>6} {'predicted ms':>13}")
    for label, (s, pred) in measured.items():
        mfu = f"{flops / s / peak:.1%}" if peak else "-"
        print(f"{label:<24} {s * 1e3:>8.1f} {s / base:>7.3f} {c.batch * c.seq / s:>10,.0f} "
              f"{mfu:>6} {pred * 1e3:>13.1f}")  # fmt: skip


def _compiled_rows(c: Config, eager: torch.nn.Module, loss_fn: Callable, mesh: Any,
                   device: torch.device, batch: tuple, measured: dict[str, float],
                   flops: float, peak: float | None, predicted: float) -> None:  # fmt: skip
    """Step 5 (``--compile``): the eager model with torch.compile applied by hand per block
    (torchtitan's way: each block of the largest ModuleList) and the rank program compiled by
    autopar (``compile=True``), fwd+bwd next to the eager ones: tokens/s, MFU, prediction."""
    x, y = batch
    local = autoparallelize(eager, mesh, tokens(c), loss_fn=loss_fn, compile=True).to(device)
    measured["autopar compile=True"] = _time(lambda: local(x, y), local.parameters(), device)[0]
    blocks = max((m for m in eager.modules() if isinstance(m, torch.nn.ModuleList)), key=len)
    for block in blocks:
        block.compile()
    measured["torch.compile by hand"] = _time(lambda: loss_fn(eager(x), y), eager.parameters(),
                                              device)[0]  # fmt: skip
    print(f"{'fwd+bwd, bf16':<24} {'ms':>8} {'tokens/s':>10} {'MFU':>6} {'predicted ms':>13}")
    for label, s in measured.items():
        mfu = f"{flops / s / peak:.1%}" if peak else "-"
        print(f"{label:<24} {s * 1e3:>8.1f} {c.batch * c.seq / s:>10,.0f} {mfu:>6} "
              f"{predicted * 1e3:>13.1f}")  # fmt: skip


def _model(kind: str, c: Config) -> tuple[torch.nn.Module, Callable]:
    """autopar.tools.testing's Llama, or transformers' LlamaForCausalLM of the same shape."""
    if kind == "llama":
        return build("llama", c), lm_loss
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.ffn,
        num_hidden_layers=c.layers, num_attention_heads=c.heads,
        num_key_value_heads=c.kv_heads, max_position_embeddings=c.seq, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg), hf_loss


def hf_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    return lm_loss(out.logits, targets)


def _compare(eager: torch.nn.Module, local: torch.nn.Module, loss_fn: Callable, x: torch.Tensor,
             y: torch.Tensor) -> tuple[float, float]:  # fmt: skip
    ref = loss_fn(eager(x), y)
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


def _time(step: Callable, params: Any, device: torch.device) -> tuple[float, float]:
    """Seconds per forward + backward, and per step with AdamW (means after WARMUP)."""
    params = list(params)
    opt = torch.optim.AdamW(params, lr=1e-4)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(with_opt: bool) -> float:
        def once() -> None:
            step().backward()
            if with_opt:
                opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(WARMUP):
            once()
        sync()
        start = time.perf_counter()
        for _ in range(STEPS):
            once()
        sync()
        return (time.perf_counter() - start) / STEPS

    return timed(False), timed(True)


def _predicted_step(kind: str, c: Config, cluster: str, fp8: str | None = None) -> float:
    with torch.device("meta"):
        model, loss_fn = _model(kind, c)
        model = model.to(torch.bfloat16)
    prog = autoparallelize(model, Mesh(Cluster.preset(cluster), tp=1), tokens(c), loss_fn=loss_fn,
                           fp8=fp8)  # fmt: skip
    return prog.plan.step_s


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--cluster", default="dgx-h100", help="cost-model preset for the prediction")
    p.add_argument("--model", default="llama", choices=("llama", "hf-llama"),
                   help="autopar.tools.testing's Llama or transformers' LlamaForCausalLM")
    p.add_argument("--compile", action="store_true",
                   help="also time compile=True and torch.compile applied by hand per block")
    p.add_argument("--fp8", choices=("tensorwise", "rowwise"),
                   help="also time fp8= and torchao's convert_to_float8_training by hand")
    p.add_argument("--shapes", default="8x2048x2048x4",
                   help="comma-separated layers x hidden x seq x batch")
    return p.parse_args()


if __name__ == "__main__":
    sys.exit(main())
