"""bf16 "cast" vs "autocast" side by side: what the plan moves and saves at the issue's shape.

    python benchmarks/bf16_bytes.py [--batch 4] [--tp 4]

HF Llama (h 2048, s 2048, 16 heads, 4 KV heads, ffn 5632, 2 layers, vocab 32000) on the meta
device, Mesh(tp=t), ``param_dtype=torch.bfloat16`` under each ``mixed_precision``.  Per mode:
the tp messages of one step by dtype (MiB, full tensors), the plan's step total, the saved
activations per layer (the cost model's count, the plan's activation row), the same saved
tensors counted at 2 bytes each (Korthikanti's 16-bit counting), REFERENCE.md's TP+SP formula
with fused attention (34·s·b·h/t) and the Llama-shaped one (see NOTES.md), and cast/autocast.
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from collections import Counter

import torch

from autopar import Mesh, autoparallelize
from autopar.tools import zoo

MIB = 2.0**20


def per_layer_activations(prog, sixteen: bool = False) -> float:
    """Saved bytes per layer on rank 0, each value in its run-time dtype (``sixteen``: every
    floating value at 2 bytes)."""
    from autopar.axes.data_parallel import local_parts
    from cost.config import ParallelConfig
    from cost.graph import GraphModel

    local, _ = local_parts(prog.stages[0])
    if sixteen:
        for n in local.graph.nodes:
            v = n.meta.get("val")
            if n.op == "call_function" and isinstance(v, torch.Tensor) and v.is_floating_point():
                n.meta["run_dtype"] = torch.bfloat16
    model = GraphModel.from_traced(local)
    work = model.workload(ParallelConfig(global_batch=model.batch), model.batch,
                          prog.mesh.cluster.gpu)  # fmt: skip
    return work.act_bytes["none"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tp", type=int, default=4)
    a = parser.parse_args()
    warnings.filterwarnings("ignore")
    entry = zoo.family("llama")
    d = dataclasses.replace(zoo.dims(entry, "realistic"), batch=a.batch)
    zoo.REALISTIC = d  # zoo.dims reads it when called
    model, args, kwargs, loss_fn = zoo.build(entry, "realistic", device="meta")
    s, b, h, t, f, g = d.seq, d.batch, d.hidden, a.tp, d.ffn, d.kv_heads / d.heads
    formula = 34 * s * b * h / t
    llama = s * b * h / t * (2 + 2 + 2 + 4 * g + 2 + 2 + 2 + 8 * f / h)
    rows = {}
    for mode in ("cast", "autocast"):
        prog = autoparallelize(model, Mesh(tp=t), args, loss_fn, example_kwargs=kwargs,
                               param_dtype=torch.bfloat16, mixed_precision=mode)  # fmt: skip
        by = Counter()
        for c in prog.collectives():
            if c.axis == "tp" and len(c.shape) == 3:
                by[c.dtype] += c.bytes
        total = sum(c.bytes for c in prog.collectives())
        rows[mode] = (by, total, per_layer_activations(prog), per_layer_activations(prog, True))
    print(f"HF Llama h {h}, s {s}, b {b}, heads {d.heads}/{d.kv_heads}, ffn {f}, Mesh(tp={t}), "
          "bf16, meta")  # fmt: skip
    for mode, (by, total, act, act16) in rows.items():
        msgs = ", ".join(f"{k} {v / MIB:.0f}" for k, v in sorted(by.items()))
        print(f"{mode:9} [b,s,h] tp messages MiB: {msgs}; step total {total / MIB:.1f} MiB; "
              f"activations/layer {act / MIB:.1f} MiB (16-bit count {act16 / MIB:.1f}, x{act / act16:.3f})")
    c, ac = rows["cast"], rows["autocast"]
    print(f"REFERENCE TP+SP fused attention 34sbh/t {formula / MIB:.1f} MiB; Llama-shaped "
          f"{llama / MIB:.1f} MiB; cast activations / 34sbh/t x{c[2] / formula:.2f}, / Llama-shaped "
          f"x{c[2] / llama:.2f}")  # fmt: skip
    print(f"cast / autocast: step bytes {c[1] / ac[1]:.3f}, activations {c[2] / ac[2]:.3f}")


if __name__ == "__main__":
    main()
