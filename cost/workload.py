"""Workload: what one rank computes, saves and sends per micro-batch, for a model shape.

A `Workload` is the interface between models and plans: the step-time and memory models read
only it, and both a `ModelShape` (this module) and a traced graph (`cost.graph`) produce one.

Algorithm (`shape_workload`, micro-batch b on a tp·cp shard):
1. List the kernels of one layer's forward as (flops, bytes, efficiency, backward factor): the
   GEMMs with their sharded [m,k]×[k,n] dims (QKV, output projection, MLP, experts, router),
   the attention core (one fused flash kernel, or the unfused QKᵀ / softmax / dropout / PV chain
   that writes the s×s scores to HBM), and the memory-bound elementwise ops (norms,
   bias-dropout-residual, activation, head split/merge copies).
2. Time each with the roofline `op_time`; backward = factor × forward (2 for GEMMs and
   elementwise, 2.5 for flash attention which recomputes the scores).
3. Communication volumes per layer: tp all-reduce of the [b, s/c, h] activation, cp ring K/V
   blocks, ep all-to-all of the b·s/c·k routed rows; pipeline boundary [b, s/c, h] (÷t with SP).
4. Saved activations per layer (Korthikanti et al. 2022, generalised to GQA, gated MLPs, MoE,
   flash attention and cp), for each recomputation mode.
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
    if cfg.attention == "flash":
        causal = 0.5 * (s + 1) / s
        flops = 4.0 * heads * sq * s * d * causal
        nbytes = BF16 * heads * sq * d * 4
        return [_Kernel(flops, nbytes, matmul_efficiency(sq, s, d), bwd=2.5, attn=True)]
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
    q_out = shape.heads * shape.head_dim // t
    kv_out = 2 * max(shape.g // t, 1) * shape.head_dim
    f_cols = shape.f // t * (2 if shape.gated else 1)
    routed = tokens * shape.top_k
    local_experts = shape.experts // cfg.ep
    rows = routed * cfg.ep / shape.experts if shape.experts > 1 else tokens
    sp = t if cfg.sequence_parallel else 1
    drop = 1 if shape.dropout else 0
    g = cfg.gemm_bytes
    kernels = [
        *_gemm(tokens, q_out + kv_out, h, itemsize=g),
        *_gemm(tokens, h, q_out, itemsize=g),
        *_gemm(rows, f_cols, h, local_experts, itemsize=g),
        *_gemm(rows, h, shape.f // t, local_experts, itemsize=g),
        _stream(tokens * h * (2 * 2 * BF16 + 2 * (3 * BF16 + drop)) / sp),
        _stream(tokens * shape.top_k * (f_cols + shape.f // t) * BF16),
        _stream(tokens * 2 * BF16 * (q_out + kv_out + q_out)),
    ]  # fmt: skip
    if shape.experts > 1:
        kernels.extend(_gemm(tokens, shape.experts, h))
    return kernels + _attention(shape, cfg, b)


def _time(kernels: list[_Kernel], gpu: GPU, factor: bool = False) -> float:
    return sum(
        ((k.bwd if factor else 1.0) * op_time(k.flops, k.nbytes, gpu, k.dtype, compute_efficiency=k.eff)
         for k in kernels),
        0.0,
    )  # fmt: skip


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
    input 2h, MLP activation input and output 2·2f (gated: gate, up, product 3·2f), times top-k
    (inside: ÷t). Attention core, dropped by selective recompute: unfused scores 5·a·s
    (softmax output 2, dropout mask 1, dropout output 2); flash keeps only a 4-byte
    log-sum-exp per head. Full recompute keeps the layer input 2h.
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
    inner = (qkv + BF16 * h + f_act + lse) / t
    core = (2 * BF16 + drop) * shape.heads * s / t if unfused else 0.0
    layer_in = BF16 * h / sp
    return {
        "none": tokens * (outer + inner + core),
        "selective": tokens * (outer + inner),
        "full": tokens * layer_in,
    }


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
        recompute_s={"none": 0.0, "selective": _time(core, gpu), "full": fwd},
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
        post_act_bytes=tokens * shape.vocab / t * (BF16 + 4),
        layer_dense_params=dense / t,
        layer_expert_params=experts / t,
        edge_params=tables * shape.embedding_params / t,
        attn_out_bytes=BF16 * tokens * shape.heads // t * shape.head_dim,
    )
