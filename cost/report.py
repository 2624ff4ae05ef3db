"""The printed estimate: a deterministic plain-text table.

Algorithm (`render`):
1. Header: model, cluster (nodes × GPUs, GPU name), the resolved parallel configuration.
2. Memory per rank, one row per component, with the HBM capacity and FITS / DOES NOT FIT.
3. Step time: compute, exposed communication per mesh axis, pipeline bubble, optimizer, total.
4. Throughput: tokens/s, TFLOP/s per GPU and MFU under both FLOP conventions, naming them.
"""

from __future__ import annotations

GIB = 2**30


def _config_line(cfg) -> str:
    return (
        f"tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} cp={cfg.cp} ep={cfg.ep} zero={cfg.zero} "
        f"global_batch={cfg.global_batch} micro_batch={cfg.micro_batch} "
        f"schedule={cfg.schedule} v={cfg.virtual_stages} recompute={cfg.recompute} "
        f"attention={cfg.attention}"
    )


def render(est) -> str:
    """The table printed for an `Estimate`."""
    c = est.cluster
    mem, step = est.memory, est.step
    lines = [
        f"estimate: {est.model} on {c.nodes} × {c.gpus_per_node} {c.gpu.name} "
        f"({c.world_size} GPUs)",
        f"config:   {_config_line(est.config)}",
        "",
        f"memory per rank (GiB)          capacity {mem.capacity / GIB:8.2f}",
    ]
    lines += [f"  {name:<28} {value / GIB:8.2f}" for name, value in mem.rows()]
    lines.append(f"  {'fits' if mem.fits else 'DOES NOT FIT':<28}")
    lines += ["", "step time (s)"]
    rows = [("compute", step.compute)]
    rows += [(f"exposed comm {axis}", t) for axis, t in step.comm.items() if t > 0]
    rows += [("pipeline bubble", step.bubble), ("optimizer", step.optimizer)]
    rows.append(("total", step.total))
    lines += [f"  {name:<28} {value:8.4f}" for name, value in rows]
    lines += [
        "",
        "throughput",
        f"  {'tokens/s':<28} {est.tokens_per_s:12.0f}",
        f"  {'TFLOP/s per GPU (PaLM)':<28} {est.tflops_per_gpu:8.1f}   MFU {est.mfu:6.1%}",
        f"  {'TFLOP/s per GPU (Megatron)':<28} {est.tflops_per_gpu_megatron:8.1f}   "
        f"MFU {est.mfu_megatron:6.1%}",
        "  MFU = PaLM model FLOPs (6N + 12·L·a·d·s per token, no recompute); Megatron-2021",
        "  counts the recompute forward (closer to hardware FLOPs utilisation).",
    ]
    return "\n".join(lines)
