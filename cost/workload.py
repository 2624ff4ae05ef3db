"""Workload: what one rank computes, saves and sends per micro-batch, for a model shape.

A `Workload` is the interface between models and plans: the step-time and memory models read
only it, and both a `ModelShape` (this module) and a traced graph (`cost.graph`) produce one.

Algorithm (`shape_workload`, micro-batch b on a tp·cp shard):
1. List the kernels of one layer's forward as (flops, bytes, efficiency, backward factor): the
   GEMMs with their sharded [m,k]×[k,n] dims (QKV, output projection, MLP, experts, router),
   the attention core (one fused flash kernel, or the unfused QKᵀ / softmax / dropout / PV chain
   that writes the s×s scores to HBM), and the memory-bound elementwise ops (norms,
   bias-dropout-residual, activation, head split/merge copies; under ``kernels="eager"``
   also the separate ops of eager PyTorch, `eager_bytes`).
2. Time each with the roofline `op_time`; backward = factor × forward (2 for GEMMs and
   elementwise, 2.5 for flash attention which recomputes the scores).
3. Communication volumes per layer: tp all-reduce of the [b, s/c, h] activation, cp ring K/V
   blocks, ep all-to-all of the b·s/c·k routed rows; pipeline boundary [b, s/c, h] (÷t with SP).
4. Saved activations per layer (Korthikanti et al. 2022, generalised to GQA, gated MLPs, MoE,
   flash attention and cp), for each recomputation mode: selective replays Megatron's
   attention core, or under ``selective="matmuls"`` torchtitan's op-level policy
   (`saved_matmuls`); full recompute on one layer in ``checkpoint_every`` (`_every`); and the
   loss's bytes per logit (`loss_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost.compute import MATMUL_PEAK_FRACTION, matmul_efficiency, op_time
from cost.config import ParallelConfig
from cost.hardware import GPU
from cost.model import ModelShape

BF16 = 2


@dataclass(frozen=True, kw_only=True)
class Workload:
    """Per-rank, per-micro-batch costs of one plan's model on one GPU (seconds and bytes).

    `recompute_s` and `act_bytes` map each recompute mode to the extra forward seconds and the
    saved activation bytes of one layer; `tp_bytes`, `cp_bytes`, `ep_bytes` are the message of
    one forward collective, `tp_calls`/`cp_calls`/`ep_calls` how many a layer's forward issues.
    """

    layers: int
    layer_fwd_s: float
    attn_fwd_s: float
    layer_bwd_s: float
    recompute_s: dict[str, float]
    pre_s: float
    post_s: float
    tp_bytes: float
    tp_calls: int
    cp_bytes: float
    cp_calls: int
    ep_bytes: float
    ep_calls: int
    boundary_bytes: float
    act_bytes: dict[str, float]
    post_act_bytes: float
    layer_dense_params: float
    layer_expert_params: float
    edge_params: float
    attn_out_bytes: float = 0.0  # bf16 attention output of one layer (the cp ring's merge)
    # the model's output of one micro-batch as the last stage returns it (16-bit logits, the
    # vocabulary split over tp); held per micro-batch under `pp_buffers="torch_2024"`
    output_bytes: float = 0.0
    # the tensor-parallel collectives of one micro-batch as a solved tp plan lists them
    # (`TpCollective`); None: Megatron's two all-reduces per layer per pass (tp_bytes, tp_calls)
    tp_collectives: tuple[TpCollective, ...] | None = None
    # what the compiled pipeline's cut prices its units by, when not this work's own:
    # (prologue, one block, epilogue) forward+backward seconds and a boundary's bytes
    # (`autopar.axes.pipeline.unit_costs`: the whole traced graph divided by tp)
    cut_s: tuple[float, float, float] | None = None
    cut_bytes: float | None = None


@dataclass(frozen=True, kw_only=True)
class TpCollective:
    """One tensor-parallel collective of a micro-batch: its kind, message bytes (the whole
    tensor), whether forward issues it, whether it lies in a repeated block (so a stage
    holds it per layer, and full recompute issues it again in backward), and, outside the
    blocks, whether it comes after them (the head's and the loss's, on the last pipeline
    stage; else the embedding's, on the first), and the seconds a decomposition under its
    matmuls saves at the compiled shapes (autopar.planner.overlap; scaled with the message)."""

    kind: str
    nbytes: float
    forward: bool
    in_block: bool
    after: bool = False
    hidden_s: float = 0.0  # seconds its decomposition under its matmuls saves (planner.overlap)


@dataclass(frozen=True)
class _Kernel:
    flops: float
    nbytes: float
    eff: float
    bwd: float = 2.0
    core: bool = False
    attn: bool = False
    dtype: int = BF16
    fa2: bool = False  # FlashAttention-2: at most the GPU's `fa2_fraction` of its peak
    # (head dim, key length) of a FlashAttention v1 kernel, priced at its measured throughput
    # on the GPU (`GPU.flash1_flops`) instead of `eff`
    measured: tuple[int, float] | None = None


FP8_CAST_BYTES = 5  # per cast element, current scaling: read bf16 for amax, read it again, write fp8


def _gemm(m: float, n: float, k: float, count: float = 1.0, itemsize: int = BF16) -> list[_Kernel]:
    """A GEMM [m,k]x[k,n] (`count` of them); at FP8 (`itemsize` 1) it runs at the FP8 peak on
    1-byte operands and writes bf16, after casting its two inputs (amax + scale + cast,
    `FP8_CAST_BYTES` per element; backward casts the output gradient likewise, so the
    casts take the GEMM's backward factor)."""
    if itemsize == BF16:
        nbytes = BF16 * count * (m * k + k * n + m * n)
        return [_Kernel(2.0 * m * n * k * count, nbytes, matmul_efficiency(m, n, k))]
    nbytes = count * (m * k + k * n + BF16 * m * n)
    gemm = _Kernel(2.0 * m * n * k * count, nbytes, matmul_efficiency(m, n, k), dtype=itemsize)
    return [gemm, _stream(FP8_CAST_BYTES * count * (m * k + k * n))]


def fp8_gemm_seconds(m: float, n: float, k: float, gpu: GPU) -> float:
    """Forward + backward seconds of one linear [m,k]x[k,n] whose three GEMMs run in FP8 (at
    the FP8 peak, with the casts of `_gemm`): what an ``fp8=`` program's linears cost."""
    kernels = _gemm(m, n, k, itemsize=1)
    return _time(kernels, gpu) + _time(kernels, gpu, factor=True)


def _stream(nbytes: float) -> _Kernel:
    return _Kernel(0.0, nbytes, MATMUL_PEAK_FRACTION)


def _attention(shape: ModelShape, cfg: ParallelConfig, b: int) -> list[_Kernel]:
    """Attention core on the local heads and the local query chunk (keys: whole sequence)."""
    t, s, d = cfg.tp, shape.seq, shape.head_dim
    sq, heads = s // cfg.cp, b * shape.heads // t
    if cfg.attention != "unfused":
        causal = 0.5 * (s + 1) / s
        flops = 4.0 * heads * sq * s * d * causal
        nbytes = BF16 * heads * sq * d * 4
        return [_Kernel(flops, nbytes, matmul_efficiency(sq, s, d), bwd=2.5, attn=True,
                        fa2=cfg.attention == "flash2",
                        measured=(d, s) if cfg.attention == "flash1" else None)]  # fmt: skip
    scores = heads * sq * s
    chain = [
        _Kernel(2.0 * scores * d, BF16 * scores, matmul_efficiency(sq, s, d), core=True, attn=True),
        _Kernel(0.0, 2 * BF16 * scores, MATMUL_PEAK_FRACTION, core=True, attn=True),
        _Kernel(2.0 * scores * d, BF16 * scores, matmul_efficiency(sq, d, s), core=True, attn=True),
    ]
    if shape.dropout:
        chain.append(
            _Kernel(0.0, (2 * BF16 + 1) * scores, MATMUL_PEAK_FRACTION, core=True, attn=True)
        )
    return chain


def layer_kernels(shape: ModelShape, cfg: ParallelConfig, b: int) -> list[_Kernel]:
    """Forward kernels of one layer on one rank (see the module docstring, step 1)."""
    t, h = cfg.tp, shape.hidden
    tokens = b * shape.seq // cfg.cp
    q_out, kv_out, f_cols = _widths(shape, cfg)
    routed = tokens * shape.top_k
    local_experts = shape.experts // cfg.ep
    rows = routed * cfg.ep / shape.experts if shape.experts > 1 else tokens
    g = cfg.gemm_bytes
    kernels = [
        *_gemm(tokens, q_out + kv_out, h, itemsize=g),
        *_gemm(tokens, h, q_out, itemsize=g),
        *_gemm(rows, f_cols, h, local_experts, itemsize=g),
        *_gemm(rows, h, shape.f // t, local_experts, itemsize=g),
        *_streams(shape, cfg, tokens),
    ]  # fmt: skip
    if shape.experts > 1:
        kernels.extend(_gemm(tokens, shape.experts, h))
    return kernels + _attention(shape, cfg, b)


def _widths(shape: ModelShape, cfg: ParallelConfig) -> tuple[int, int, int]:
    """(query, key + value, MLP input) output columns of one rank's projections."""
    t = cfg.tp
    kv_out = 2 * max(shape.g // t, 1) * shape.head_dim
    return shape.heads * shape.head_dim // t, kv_out, shape.f // t * (2 if shape.gated else 1)


def _streams(shape: ModelShape, cfg: ParallelConfig, tokens: float) -> list[_Kernel]:
    """The memory-bound kernels of one layer's forward: norms and bias-dropout-residual,
    the MLP activation, head split/merge copies (each one kernel), plus the separate ops of
    eager PyTorch (`eager_bytes`) under ``kernels="eager"``."""
    h, t = shape.hidden, cfg.tp
    q_out, kv_out, f_cols = _widths(shape, cfg)
    sp = t if cfg.sequence_parallel else 1
    drop = 1 if shape.dropout else 0
    kernels = [
        _stream(tokens * h * (2 * 2 * BF16 + 2 * (3 * BF16 + drop)) / sp),
        _stream(tokens * shape.top_k * (f_cols + shape.f // t) * BF16),
        _stream(tokens * 2 * BF16 * (q_out + kv_out + q_out)),
    ]  # fmt: skip
    if cfg.kernels == "eager":
        kernels.append(_stream(tokens * eager_bytes(shape, cfg)))
    return kernels


RMSNORM_EAGER_BYTES = 36  # x.float() r2 w4, pow r4 w4, mean r4, mul r4 w4, type_as r4 w2, *w r2 w2
ROPE_EAGER_BYTES = 20  # .float() r2 w4, complex multiply r4 w4, type_as r4 w2
SWIGLU_EAGER_BYTES = 10  # silu r2 w2, product r4 w2


def eager_bytes(shape: ModelShape, cfg: ParallelConfig) -> float:
    """HBM bytes per token of one layer's forward that eager PyTorch adds to the one-kernel
    count of `_streams`, for the Llama reference code (RMSNorm shapes; their attention is
    rotary, their MLP SwiGLU when gated):
    1. Two RMSNorms of h/sp elements at `RMSNORM_EAGER_BYTES` each, against 4 fused.
    2. Rotary embedding of q and k through complex numbers, `ROPE_EAGER_BYTES` per element
       (fused into the attention input's copy otherwise).
    3. SwiGLU as silu then product, `SWIGLU_EAGER_BYTES` per element of f/t, against 6 fused.
    4. GQA's repeat_kv copies K and V to every query head (read the kv heads, write the
       query heads' width) before the attention kernel.
    Layer-norm shapes (GPT): `native_layer_norm` is one kernel in eager too; nothing is added.
    """
    if shape.norm != "rmsnorm":
        return 0.0
    h, t = shape.hidden, cfg.tp
    q_out, kv_out, _ = _widths(shape, cfg)
    sp = t if cfg.sequence_parallel else 1
    norms = 2 * (RMSNORM_EAGER_BYTES - 2 * BF16) * h / sp
    rope = ROPE_EAGER_BYTES * (q_out + kv_out / 2)
    swiglu = (SWIGLU_EAGER_BYTES - 3 * BF16) * shape.f // t * shape.top_k if shape.gated else 0
    repeat = 2 * BF16 * (kv_out / 2 + q_out) if shape.g < shape.heads else 0.0
    return norms + rope + swiglu + repeat


EAGER_LOSS_BYTES = 3 * 4  # log-softmax output (saved), nll's gradient, log-softmax's gradient
# torch's DTensor loss_parallel backward (`_nll_loss_and_log_softmax_backward`):
# `grad_input = torch.zeros_like(x)` ... `(grad_input + torch.exp(x)) * grad_output`, x the
# saved fp32 log-softmax output: x, the zeros, exp(x) and their sum at once
LOSS_PARALLEL_BYTES = 4 * 4


def loss_bytes(cfg: ParallelConfig) -> int:
    """Bytes per logit the loss holds at its peak: the bf16 logits and their fp32 copy
    (fused); eager `cross_entropy(logits.float(), ...)` with the logits freed before
    backward (torchtitan's `del pred`) peaks in the loss's backward at
    `EAGER_LOSS_BYTES`: the saved fp32 log-softmax output, nll's dense fp32 gradient and
    the log-softmax gradient it produces; under torch's `loss_parallel` (``loss_parallel``
    with tp > 1, vocab-split logits) at `LOSS_PARALLEL_BYTES`, four fp32 tensors of its
    decomposed backward (its forward peaks lower: the bf16 logits, the fp32 copy, the
    shifted logits and their exp, 14 bytes)."""
    if (cfg.loss_kernels or cfg.kernels) != "eager":
        return BF16 + 4
    return LOSS_PARALLEL_BYTES if cfg.loss_parallel and cfg.tp > 1 else EAGER_LOSS_BYTES


def _matmuls(shape: ModelShape, cfg: ParallelConfig, b: int) -> list[tuple[float, float, float, float]]:
    """(m, n, k, count) of one layer's matmuls in the order the Llama / GPT code issues them:
    q, k, v, output projection, MLP up, gate (when gated), down."""
    t, h = cfg.tp, shape.hidden
    tokens = b * shape.seq // cfg.cp
    q_out, kv_out, _ = _widths(shape, cfg)
    experts = shape.experts // cfg.ep
    rows = tokens * shape.top_k * cfg.ep / shape.experts if shape.experts > 1 else tokens
    ff = shape.f // t
    mlp = [(rows, ff, h, experts)] * (2 if shape.gated else 1) + [(rows, h, ff, experts)]
    return [(tokens, q_out, h, 1), (tokens, kv_out / 2, h, 1), (tokens, kv_out / 2, h, 1),
            (tokens, h, q_out, 1), *mlp]  # fmt: skip


def saved_matmuls(shape: ModelShape, cfg: ParallelConfig, b: int) -> tuple[list, list]:
    """torchtitan's op-level selective recompute: (recomputed, saved) matmuls of one layer;
    its policy saves every matmul output except every second one (counted per layer).
    Compiled blocks (``kernels`` other than "eager") keep only what their backward reads:
    the two output projections' results (attention's and the MLP's down projection) feed
    only a residual add, whose backward needs neither, so the partitioner drops them where
    eager's checkpoint caches them (measured: `benchmarks/sac_memory.py`)."""
    mms = _matmuls(shape, cfg, b)
    saved = mms[0::2]
    if cfg.kernels != "eager":
        dead = (3, len(mms) - 1)  # the output projection and the down projection
        saved = [m for i, m in enumerate(mms) if i % 2 == 0 and i not in dead]
    return mms[1::2], saved


def _time(kernels: list[_Kernel], gpu: GPU, factor: bool = False) -> float:
    return sum(
        ((k.bwd if factor else 1.0) * op_time(k.flops, k.nbytes, gpu, k.dtype,
                                              compute_efficiency=_efficiency(k, gpu))
         for k in kernels),
        0.0,
    )  # fmt: skip


def _efficiency(kernel: _Kernel, gpu: GPU) -> float:
    """A kernel's fraction of the sustained peak: its own, FlashAttention-2's ceiling on this
    GPU, or a measured kernel's published throughput over that peak."""
    if kernel.measured is not None:
        return gpu.flash1_flops(*kernel.measured) / gpu.sustained_flops(kernel.dtype)
    return gpu.fa2_efficiency(kernel.eff, kernel.dtype) if kernel.fa2 else kernel.eff


def _edges(shape: ModelShape, cfg: ParallelConfig, b: int, gpu: GPU) -> tuple[float, float]:
    """(embedding fwd+bwd, final norm + LM head + loss fwd+bwd) seconds on the end stages."""
    tokens, h, v = b * shape.seq // cfg.cp, shape.hidden, shape.vocab // cfg.tp
    embed = [_stream(2 * BF16 * tokens * h)]
    head = [
        *_gemm(tokens, v, h),
        _stream(tokens * v * (BF16 + 3 * 4)),  # loss: read bf16 logits, fp32 softmax round trip
        _stream(4 * BF16 * tokens * h),  # final norm
    ]
    return _time(embed, gpu) * 3, _time(head, gpu) + _time(head, gpu, factor=True)  # fmt: skip


def activation_bytes(shape: ModelShape, cfg: ParallelConfig, b: int) -> dict[str, float]:
    """Saved bytes of one layer per recompute mode (Korthikanti 2022 generalised).

    Bytes per token (16-bit): norm inputs 4h, QKV input 2h, MLP input 2h, dropout masks h each
    (outside the tp region: ÷t only with sequence parallelism); Q,K,V 2(a+2g)d, output-projection
    input 2ad (2h where d = h/a), MLP activation input and output 2·2f (gated: gate, up,
    product 3·2f), times top-k, and for MoE each routed row's copy of its token going into
    its expert (the grouped GEMM's weight gradient reads it) and the expert's output row (the
    routing weight's gradient reads it), 2·2h times top-k (inside: ÷t; the routing indices
    and weights, a few bytes a row, are not counted). Attention core, dropped by selective
    recompute: unfused scores 5·a·s (softmax output 2, dropout mask 1, dropout output 2);
    flash keeps only a 4-byte log-sum-exp per head. Full recompute keeps the layer input 2h.
    """
    t, h, s = cfg.tp, shape.hidden, shape.seq
    tokens = b * s / cfg.cp
    sp = t if cfg.sequence_parallel else 1
    drop = 1 if shape.dropout else 0
    f_act = (3 if shape.gated else 2) * BF16 * shape.f * shape.top_k
    qkv = BF16 * (shape.heads + 2 * shape.g) * shape.head_dim
    outer = (4 * BF16 + 2 * drop) * h / sp
    unfused = cfg.attention == "unfused"
    lse = 0 if unfused else 4 * shape.heads
    routed = 2 * BF16 * h * shape.top_k if shape.experts > 1 else 0
    inner = (qkv + BF16 * shape.heads * shape.head_dim + f_act + routed + lse) / t
    core = (2 * BF16 + drop) * shape.heads * s / t if unfused else 0.0
    layer_in = BF16 * h / sp
    saved = {"none": tokens * (outer + inner + core), "selective": tokens * (outer + inner),
             "full": tokens * layer_in}  # fmt: skip
    if cfg.selective == "matmuls":  # layer input, kept matmul outputs, attention out + lse
        kept = sum(BF16 * m * n * c for m, n, _, c in saved_matmuls(shape, cfg, b)[1])
        attn_out = BF16 * shape.heads * shape.head_dim
        saved["selective"] = tokens * layer_in + kept + tokens * (attn_out + lse) / t
    return _every(saved, cfg.checkpoint_every)


def _every(per_mode: dict[str, float], k: int) -> dict[str, float]:
    """Full recompute on one layer in k (`checkpoint_every`): the mean layer holds (or
    replays) 1/k of a checkpointed layer's and (k−1)/k of an unrecomputed one's."""
    if k == 1:
        return per_mode
    return {**per_mode, "full": (per_mode["full"] + (k - 1) * per_mode["none"]) / k}


def _selective_s(shape: ModelShape, cfg: ParallelConfig, b: int, gpu: GPU,
                 core: list[_Kernel]) -> float:
    """Seconds selective recompute replays per layer: the attention core (Megatron), or
    under the matmul policy the unsaved matmuls and every memory-bound kernel."""
    if cfg.selective == "attention":
        return _time(core, gpu)
    tokens = b * shape.seq // cfg.cp
    again = [k for m, n, kk, c in saved_matmuls(shape, cfg, b)[0]
             for k in _gemm(m, n, kk, c, cfg.gemm_bytes)]  # fmt: skip
    return _time(again + _streams(shape, cfg, tokens), gpu)


def shape_workload(shape: ModelShape, cfg: ParallelConfig, b: int, gpu: GPU) -> Workload:
    """The `Workload` of a model shape under `cfg` with micro-batch `b` on `gpu`."""
    t, h = cfg.tp, shape.hidden
    tokens = b * shape.seq // cfg.cp
    kernels = layer_kernels(shape, cfg, b)
    core = [k for k in kernels if k.core]
    attn = [k for k in kernels if k.core or k.attn]
    pre, post = _edges(shape, cfg, b, gpu)
    fwd = _time(kernels, gpu)
    moe = shape.experts > 1
    dense = shape.layer_params - (shape.experts * shape.expert_params if moe else 0)
    experts = shape.experts // cfg.ep * shape.expert_params if moe else 0
    tables = 1 if cfg.pp > 1 or shape.tied_embeddings else 2  # embedding (+ LM head) on a stage
    return Workload(
        layers=shape.layers,
        layer_fwd_s=fwd,
        attn_fwd_s=_time(attn, gpu),
        layer_bwd_s=_time(kernels, gpu, factor=True),
        recompute_s=_every({"none": 0.0, "selective": _selective_s(shape, cfg, b, gpu, core),
                            "full": fwd}, cfg.checkpoint_every),
        pre_s=pre,
        post_s=post,
        tp_bytes=BF16 * tokens * h,
        tp_calls=2,
        cp_bytes=2 * BF16 * tokens * max(shape.g // t, 1) * shape.head_dim,
        cp_calls=cfg.cp - 1,
        ep_bytes=BF16 * tokens * shape.top_k * h / (t if cfg.sequence_parallel else 1),
        ep_calls=2 if shape.experts > 1 else 0,
        boundary_bytes=BF16 * tokens * h / t,
        act_bytes=activation_bytes(shape, cfg, b),
        post_act_bytes=tokens * shape.vocab / t * loss_bytes(cfg),
        layer_dense_params=dense / t,
        layer_expert_params=experts / t,
        edge_params=tables * shape.embedding_params / t,
        attn_out_bytes=BF16 * tokens * shape.heads // t * shape.head_dim,
        output_bytes=BF16 * tokens * shape.vocab / t,
    )
