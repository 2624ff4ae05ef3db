"""The printed estimate: a deterministic plain-text table.

Algorithm (`render`):
1. Header: model, cluster (nodes × GPUs, GPU name), the resolved parallel configuration.
2. Memory per rank, one row per component, with the HBM capacity and FITS / DOES NOT FIT.
3. Step time: compute, exposed communication per mesh axis, pipeline bubble, optimizer, total.
4. Throughput: tokens/s, TFLOP/s per GPU and MFU under both FLOP conventions, naming them.

Algorithm (`explain`): pick the closed forms (`cost.symbolic`) that match the plan — tp traffic,
pipeline boundary and bubble of its schedule, model state of its ZeRO stage, activations of its
recompute / sequence-parallel mode, FLOP counts — and print each with the plan's values.
"""

from __future__ import annotations

GIB = 2**30
# printed under an MoE model's step time: what benchmarks/fidelity.py measured of its pricing
MOE_CAVEAT = [
    "  MoE: optimistic. Priced from the experts' GEMM FLOPs and all-to-all bytes only (router,",
    "  token permutation, per-expert casts and host launches are not); Megatron-Bridge's",
    "  Qwen3-30B-A3B measured 2.5x this model's step on 16 H100 and 3.4x on 8 B200",
    "  (benchmarks/fidelity.py)",
]


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
    for name, value in mem.rows():
        lines.append(f"  {name:<28} {value / GIB:8.2f}")
        if name == "activations" and mem.buffers > 0:  # shown apart, as the plan's table does
            lines.append(f"    {'incl. pipeline buffers':<26} {mem.buffers / GIB:8.2f}")
    spare = (mem.capacity - mem.total) / GIB
    lines.append(f"  fits, {spare:.2f} GiB spare" if mem.fits else
                 f"  DOES NOT FIT: {-spare:.2f} GiB over; add GPUs, raise tp/pp/zero, recompute, or "
                 "shrink the micro-batch")  # fmt: skip
    lines += ["", "step time (s)"]
    rows = [("compute", step.compute)]
    rows += [(f"exposed comm {axis}", t) for axis, t in step.comm.items() if t > 0]
    rows += [("pipeline bubble", step.bubble), ("optimizer", step.optimizer)]
    rows.append(("total", step.total))
    lines += [f"  {name:<28} {value:8.4f}" for name, value in rows]
    if step.comm.get("ep") and est.shape is not None:  # the all-to-alls of one MoE layer
        layers = max(share.blocks for share in _shares(est))
        per_layer = step.comm["ep"] / (est.micro_batches * layers)
        lines.append(f"  {'ep all-to-all per layer':<28} {per_layer * 1e3:8.4f} ms per "
                     "micro-batch (dispatch + combine, forward and backward)")  # fmt: skip
    if est.work.layer_expert_params > 0:
        lines += MOE_CAVEAT
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


def _activation_formula(cfg) -> str:
    if cfg.recompute == "full":
        return (
            "activations_per_layer_full_sp"
            if cfg.sequence_parallel
            else "activations_per_layer_full"
        )
    if cfg.recompute == "selective" and cfg.sequence_parallel:
        return "activations_per_layer_selective"
    if cfg.tp == 1:
        return "activations_per_layer"
    return "activations_per_layer_tp_sp" if cfg.sequence_parallel else "activations_per_layer_tp"


def _explained(est) -> list[tuple[str, float]]:
    """(formula name, this plan's model value) for the formulas that apply to the plan."""
    cfg, work, step = est.config, est.work, est.step
    rows = []
    if cfg.tp > 1:
        rows.append(
            (
                "tp_traffic_per_layer",
                2 * work.tp_calls * 2 * (cfg.tp - 1) / cfg.tp * work.tp_bytes / 2,
            )
        )
    if cfg.pp > 1:
        ideal = step.compute + sum(x for k, x in step.comm.items() if k != "dp")
        bubble = {"gpipe": "bubble_gpipe", "1f1b": "bubble_1f1b"}.get(
            cfg.schedule, "bubble_interleaved"
        )
        share = (
            step.bubble / (ideal + step.bubble) if cfg.schedule == "gpipe" else step.bubble / ideal
        )
        rows += [("pp_boundary_bytes", work.boundary_bytes), (bubble, share)]
    state = ("model_state_ddp", "model_state_zero1", "model_state_zero2", "model_state_zero3")
    mem = est.memory
    rows += [
        (state[cfg.zero], mem.weights + mem.grads + mem.optimizer),
        (_activation_formula(cfg), work.act_bytes[cfg.recompute]),
        ("megatron_flops", est.flops_per_token[1] * est.tokens_per_step),
        ("palm_flops_per_token", est.flops_per_token[0]),
    ]  # fmt: skip
    return rows


def _shares(est) -> tuple:
    """The pipeline ranks' shares the estimate was priced on (`cost.step.pipeline_shares`)."""
    from cost.step import pipeline_shares

    c = est.config
    return pipeline_shares(est.work, c, est.cluster, schedule=c.schedule,
                           virtual=c.virtual_stages, micro_batches=est.micro_batches)  # fmt: skip


def _memory_share(est):
    """The pipeline rank whose memory the estimate reports: the fullest (`rank_memory` keeps
    the first of equals), its state what the model-state formula prices."""
    from cost.memory import rank_memory

    c, w = est.config, est.work
    shares = _shares(est)
    totals = [rank_memory(w, pp=c.pp, zero=c.zero, dp_dense=c.data_parallel,
                          dp_expert=c.data_parallel // c.ep, schedule=c.schedule,
                          micro_batches=est.micro_batches, virtual=c.virtual_stages,
                          recompute=c.recompute, capacity=est.cluster.gpu.hbm_bytes,
                          grad_bytes=c.grad_bytes, weight_bytes=c.weight_bytes,
                          ranks=(share,), pp_buffers=c.pp_buffers).total
              for share in shares]  # fmt: skip
    return shares[totals.index(max(totals))]


def explain(est) -> str:
    """Each applicable formula with its value at this plan, next to the model's own number
    (they differ where the closed form is GPT-specific: GQA, gated MLPs, flash attention)."""
    shape, cfg, work = est.shape, est.config, est.work
    if shape is None:
        return "explain: formulas need a ModelShape; this estimate priced a traced graph"
    v = cfg.virtual_stages if cfg.schedule == "interleaved" else 1
    rank = _memory_share(est)  # N_r, N_k: the parameters of the rank whose memory is shown
    per_rank = (rank.blocks * (work.layer_dense_params + work.layer_expert_params)
                + rank.edges * work.edge_params)  # fmt: skip
    kept = rank.edges * work.edge_params + min(rank.chunks, rank.blocks) * work.layer_dense_params
    values = dict(b=cfg.micro_batch, s=shape.seq // cfg.cp, h=shape.hidden, a=shape.heads,
                  t=cfg.tp, p=cfg.pp, d=cfg.data_parallel, m=est.micro_batches, v=v,
                  L=shape.layers, V=shape.vocab, B_g=cfg.global_batch, N_r=per_rank,
                  N_k=kept,
                  N=shape.active_params)  # fmt: skip
    from cost.symbolic import formulas  # sympy: only when --explain asks for the closed forms

    table = formulas()
    lines = [f"why: {est.model} (N = {shape.active_params:.4g} parameters per token; "
             f"N_r = {per_rank:.4g} on the most loaded rank)"]  # fmt: skip
    for name, model_value in _explained(est):
        f = table[name]
        closed = f.evaluate(**{x.name: values[x.name] for x in f.symbols})
        lines += [str(f), f"    = {closed:.4g}   (model: {model_value:.4g})"]
    return "\n".join(lines)
