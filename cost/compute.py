"""Compute: FLOPs and bytes moved per ATen op, and roofline time on a GPU.

Algorithm (`node_flops_bytes`, one call_function node of a torch.export graph):
1. Read the output and tensor-argument shapes from `meta["val"]` (fake tensors).
2. Dispatch on the op name: matmul family (2·M·K·N, plus M·N for a bias), SDPA (two
   batched matmuls; halved when causal), norms, softmax and cross-entropy (a few FLOPs per
   element), embedding and copies (no FLOPs), elementwise and reductions (one FLOP per element);
   autopar's fused 16-bit RMSNorm as the HF chain of ops it runs.
3. Bytes moved = every tensor argument read once + the output written once (SDPA assumes a
   fused kernel: the s×s scores never reach HBM). Views and unknown ops cost (0, 0).

Algorithm (`op_time`):
1. Compute time = FLOPs / (peak for the dtype × compute efficiency); the efficiency of a matmul
   falls with its size (`matmul_efficiency`): small tiles leave SMs idle and short K loops pay
   their prologue/epilogue.
2. Memory time = bytes / (HBM bandwidth × achieved fraction).
3. Time = max(compute, memory, kernel-launch floor): a kernel overlaps its loads with its math,
   and no kernel is faster than its launch.

Algorithm (`train_factor`, the one rule the search and the compiler price a training step by):
a node on the gradient path (its value depends on a trainable parameter) runs its forward and
a backward of 2× its forward (input and weight gradients), 2.5× for flash attention, which
recomputes its scores; a node off the gradient path (rotary tables, masks) runs forward only.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from cost.hardware import GPU

if TYPE_CHECKING:  # torch is imported where a graph is read, not for model shapes
    import torch
    import torch.fx

MATMUL_PEAK_FRACTION = 0.72  # large GEMMs: ~82% kernel efficiency × ~88% sustained clock
MATMUL_K_HALF = 64  # a K loop of 64 runs at half speed: fixed prologue/epilogue per tile
MATMUL_TILE = 128  # output tile edge of a tensor-core GEMM kernel
MATMUL_MIN_TILE = 16  # narrowest tile edge GEMM libraries pick for a skinny dim (router, gate)
MEMORY_BW_FRACTION = 0.80  # streaming kernels reach ~80% of the HBM data-sheet bandwidth
KERNEL_LAUNCH_S = 4e-6  # eager launch + scheduling floor per kernel
BACKWARD_FACTOR = 2.0  # backward seconds per forward second: input + weight gradients
SDPA_BACKWARD_FACTOR = 2.5  # flash attention's backward recomputes the scores

MATMUL_OPS = {"linear", "addmm", "mm", "bmm", "matmul", "baddbmm",
              "_grouped_mm", "grouped_mm_fallback"}  # fmt: skip
_CANONICAL = {
    "_scaled_dot_product_flash_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_cudnn_attention": "scaled_dot_product_attention",
    "native_layer_norm": "layer_norm", "_fused_rms_norm": "rms_norm",
    "native_group_norm": "group_norm", "_softmax": "softmax", "_log_softmax": "log_softmax",
    "native_dropout": "dropout", "nll_loss_forward": "nll_loss", "_unsafe_view": "view",
}  # fmt: skip
_CONVS = {"conv1d", "conv2d", "conv3d"}
_NORMS = {"layer_norm": 8.0, "rms_norm": 4.0, "group_norm": 8.0}
_SOFTMAX = {"softmax": 5.0, "log_softmax": 5.0}
_LOSSES = {"cross_entropy_loss": 6.0, "nll_loss": 1.0}
_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "norm", "prod",
               "argmax", "argmin", "logsumexp", "var_mean"}  # fmt: skip
_ELEMENTWISE = {"add", "sub", "mul", "div", "neg", "pow", "exp", "log", "sqrt", "rsqrt",
                "tanh", "sigmoid", "relu", "gelu", "silu", "sin", "cos", "where", "clamp",
                "masked_fill", "dropout", "abs", "maximum", "minimum", "erf",
                "reciprocal", "square", "lt", "gt", "le", "ge", "eq", "ne", "logical_not",
                "rsub", "softplus", "hardtanh", "leaky_relu", "elu", "mish", "addcmul",
                "addcdiv", "lerp", "scatter_add"}  # fmt: skip
_ALIASING_CASTS = {"to", "type_as"}  # return their input when the dtype already matches
# memory traffic without arithmetic: copies, layout changes, gathers, fills
_COPIES = {"clone", "_to_copy", "to", "copy", "contiguous", "fill", "cat", "stack", "triu",
           "tril", "index_select", "gather", "scatter", "index", "type_as", "zeros_like",
           "ones_like", "full_like"}  # fmt: skip


def node_flops_bytes(node: torch.fx.Node) -> tuple[float, float]:
    """Global (FLOPs, bytes read + written) of one ATen call_function node; (0, 0) for views,
    non-tensor results and ops outside the table."""
    name = op_name(node)
    out = tensors_of(node.meta.get("val"))
    if name is None or not out:
        return 0.0, 0.0
    ins = tensors_of([_val(a) for a in node.args]) + tensors_of(
        [_val(a) for a in node.kwargs.values()]
    )
    if (
        name in _ALIASING_CASTS
        and ins
        and (ins[0].dtype, ins[0].device) == (out[0].dtype, out[0].device)
    ):
        return 0.0, 0.0  # `x.to(x.dtype)` returns x itself: no kernel
    moved = float(sum(_nbytes(t) for t in ins + out))
    out_elems = float(sum(t.numel() for t in out))
    if name in MATMUL_OPS:
        return _matmul_flops(name, node, out[0]), moved
    if name == "scaled_dot_product_attention":
        return _sdpa_flops(node), moved
    if name in _CONVS and len(ins) >= 2:  # a GEMM per output position: k = c_in/groups * kernel
        weight = ins[1]
        return 2.0 * out_elems * weight.numel() / max(weight.shape[0], 1), moved
    if name == "embedding":
        return 0.0, 2.0 * _nbytes(out[0]) + _nbytes(ins[1])
    if name == "rms_norm_16":
        return _rms_norm_16(ins, out[0], bool(node.kwargs.get("cast_last")))
    for table in (_NORMS, _SOFTMAX, _LOSSES):
        if name in table:
            return table[name] * float(ins[0].numel()), moved
    if name in _REDUCTIONS:
        return float(ins[0].numel()) if ins else 0.0, moved
    if name in _ELEMENTWISE:
        return out_elems, moved
    return (0.0, moved) if name in _COPIES else (0.0, 0.0)


def _rms_norm_16(ins: list[torch.Tensor], out: torch.Tensor,
                 cast_last: bool) -> tuple[float, float]:  # fmt: skip
    """autopar's fused 16-bit RMSNorm (autopar.ops.norms) runs the kernels of the HF chain it
    replaces (up-cast, pow, mean, add, rsqrt, mul, down-cast and the weight multiply: after
    the cast in 16 bits, or before it in fp32, ``cast_last``): their FLOPs and bytes, so
    fusing changes what is saved, not the priced time."""
    x, n = ins[0], float(ins[0].numel())
    rows, narrow = n / max(x.shape[-1], 1), _nbytes(x)
    flops = 3.0 * n + 2.0 * rows  # pow, mean, mul; add and rsqrt per row
    moved = 2.0 * narrow + 28.0 * n + 24.0 * rows  # the casts' 16-bit ends, fp32 in between
    if len(ins) > 1:  # the weight multiply
        flops += n
        moved += _nbytes(ins[1]) + (8.0 * n if cast_last else narrow + _nbytes(out))
    return flops, moved


def reads_whole_inputs(node: torch.fx.Node) -> bool:
    """Whether `node_flops_bytes` counts every input whole (an embedding reads only the rows
    it gathers, so its table's size is no part of its traffic)."""
    return op_name(node) != "embedding"


def matmul_efficiency(m: float, n: float, k: float) -> float:
    """Fraction of the dense peak a GEMM [m,k]×[k,n] reaches: the large-GEMM fraction, times
    the useful share of its output tiles, times k/(k + K_HALF) for the K loop.

    A tile edge is 128, except along a dim shorter than that, where GEMM libraries pick a
    narrower tile (the next power of two, at least 16): a [T, h] × [h, 8] router GEMM fills
    half of a 16-wide tile, not 1/16 of a 128-wide one.  Narrow tiles reuse each loaded
    operand less; that cost is the memory roofline's (`op_time`), which such skinny GEMMs hit.
    """
    useful = _tile_use(m) * _tile_use(n)
    return MATMUL_PEAK_FRACTION * useful * k / (k + MATMUL_K_HALF)


def _tile_use(d: float) -> float:
    """Useful fraction of the tiles covering one output dim of length d."""
    edge = MATMUL_TILE if d >= MATMUL_TILE else max(MATMUL_MIN_TILE, 2 ** math.ceil(math.log2(max(d, 1))))
    return d / (math.ceil(d / edge) * edge)


def op_time(
    flops: float,
    nbytes: float,
    gpu: GPU,
    dtype_bytes: int = 2,
    *,
    compute_efficiency: float = MATMUL_PEAK_FRACTION,
) -> float:
    """Roofline seconds of one kernel: max(compute, memory, launch floor)."""
    compute = flops / (gpu.sustained_flops(dtype_bytes) * compute_efficiency)
    memory = nbytes / (gpu.hbm_bw * MEMORY_BW_FRACTION)
    return max(compute, memory, KERNEL_LAUNCH_S)


def node_time(node: torch.fx.Node, gpu: GPU, itemsize: int | None = None) -> float:
    """Roofline seconds of one graph node, with the matmul size efficiency where it applies;
    views and untabled ops are free (they launch no kernel of their own).  ``itemsize``: the
    element size the node computes in when it differs from its traced one (a matmul under
    bf16 autocast in an fp32-traced graph): peak and bytes moved follow it."""
    flops, moved = node_flops_bytes(node)
    if flops == 0.0 and moved == 0.0:
        return 0.0
    out = tensors_of(node.meta.get("val"))
    traced = out[0].element_size() if out else 2
    if itemsize is not None and out:
        moved *= itemsize / traced
    dtype_bytes = min(max(itemsize or traced, 2), 4)
    return op_time(flops, moved, gpu, dtype_bytes,
                   compute_efficiency=node_efficiency(node, gpu, dtype_bytes))


def attention_time(flops: float, nbytes: float, gpu: GPU, dtype_bytes: int, q_len: int,
                   k_len: int, head_dim: int) -> float:
    """Roofline seconds of a fused attention at the efficiency of its score GEMM
    [q_len, head_dim] x [head_dim, k_len], capped as torch SDPA's kernel runs on `gpu`
    (`sdpa_efficiency`, what `node_efficiency` gives SDPA): a ring attention's FLOPs over
    the whole sequence are priced at the whole sequence's efficiency, as the search prices
    the SDPA it replaces."""
    return op_time(flops, nbytes, gpu, dtype_bytes,
                   compute_efficiency=sdpa_efficiency(q_len, k_len, head_dim, gpu, dtype_bytes))


def sdpa_efficiency(q_len: int, k_len: int, head_dim: int, gpu: GPU | None = None,
                    dtype_bytes: int = 2) -> float:  # fmt: skip
    """Fraction of the sustained peak (`GPU.sustained_flops`) torch's SDPA reaches: its score
    GEMM's `matmul_efficiency`, at most `gpu.fa2_fraction` of the data-sheet peak where that
    is set (torch's default flash backend is FlashAttention-2, FlashAttention-3 being an
    opt-in prototype in torch 2.13; on Hopper FA2 reaches 35% of the peak:
    `cost.hardware.FA2_ON_HOPPER`)."""
    eff = matmul_efficiency(q_len, k_len, head_dim)
    return eff if gpu is None else float(gpu.fa2_efficiency(eff, dtype_bytes))


def node_efficiency(node: torch.fx.Node, gpu: GPU | None = None,
                    dtype_bytes: int | None = None) -> float:  # fmt: skip
    """Compute efficiency of a node's kernel: `matmul_efficiency` of its GEMM shape (for SDPA
    the score GEMM, whose K loop is the head dim, capped on `gpu` by `sdpa_efficiency` at
    the element size it runs in: ``dtype_bytes``, else its query's), else the large-GEMM
    fraction."""
    name, out = op_name(node), tensors_of(node.meta.get("val"))
    if name in MATMUL_OPS and out:
        return matmul_efficiency(*gemm_dims(node, out[0]))
    if name == "scaled_dot_product_attention":
        q, k = (_val(a) for a in node.args[:2])
        size = dtype_bytes or min(max(q.element_size(), 2), 4)
        return sdpa_efficiency(q.shape[-2], k.shape[-2], q.shape[-1], gpu, size)
    return MATMUL_PEAK_FRACTION


def backward_factor(name: str | None, on_grad_path: bool) -> float:
    """Backward seconds per forward second of an op named `name` (module docstring)."""
    if not on_grad_path:
        return 0.0
    return SDPA_BACKWARD_FACTOR if name == "scaled_dot_product_attention" else BACKWARD_FACTOR


def train_factor(node: torch.fx.Node, on_grad_path: bool) -> float:
    """Forward + backward seconds per forward second of one node in a training step."""
    return 1.0 + backward_factor(op_name(node), on_grad_path)


def op_name(node: torch.fx.Node) -> str | None:
    """The ATen op name of a call_function node, with decomposed / backend variants mapped to
    the op they implement (`_scaled_dot_product_flash_attention` → SDPA, ...)."""
    if node.op != "call_function":
        return None
    name = getattr(node.target, "_opname", None) or getattr(node.target, "__name__", None)
    return _CANONICAL.get(name, name)


def _arg(node: torch.fx.Node, name: str, default=None):
    """An argument by schema name, positional or keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema else []
    index = names.index(name) if name in names else len(node.args)
    return node.args[index] if index < len(node.args) else default


def _val(arg):
    if isinstance(arg, (list, tuple)):
        return [_val(a) for a in arg]
    import torch.fx

    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else arg


def tensors_of(val) -> list[torch.Tensor]:
    """The tensors in a (possibly nested) `meta["val"]`, in order."""
    import torch

    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in tensors_of(v)]
    return []


def _nbytes(t: torch.Tensor) -> float:
    return float(t.numel() * t.element_size())


def gemm_dims(node: torch.fx.Node, out: torch.Tensor) -> tuple[float, float, float]:
    """(m, n, k) of the matmul: m = all output rows (batch folded in), n = last output dim."""
    name = op_name(node)
    a = _val(node.args[1] if name in ("addmm", "baddbmm") else node.args[0])
    k = float(a.shape[-1]) if a.dim() > 0 else 1.0
    n = float(out.shape[-1]) if out.dim() > 0 else 1.0
    return out.numel() / n, n, k


def _matmul_flops(name: str, node: torch.fx.Node, out: torch.Tensor) -> float:
    m, n, k = gemm_dims(node, out)
    flops = 2.0 * m * n * k
    has_bias = (name == "linear" and len(node.args) > 2 and node.args[2] is not None) or name in (
        "addmm",
        "baddbmm",
    )
    return flops + (m * n if has_bias else 0.0)


def _sdpa_flops(node: torch.fx.Node) -> float:
    """QKᵀ and PV: 2·B·H·Sq·Sk·(Dqk + Dv); causal keeps (Sk+1)/(2·Sk) of the score matrix."""
    q, k, v = (_val(a) for a in node.args[:3])
    causal = _arg(node, "is_causal", False)
    sq, sk = q.shape[-2], k.shape[-2]
    heads = q.numel() / (sq * q.shape[-1])
    flops = 2.0 * heads * sq * sk * (q.shape[-1] + v.shape[-1])
    return flops * ((sk + 1) / (2 * sk) if causal and sq == sk else 1.0)
