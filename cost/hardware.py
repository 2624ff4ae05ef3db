"""Hardware and topology: GPUs, links and clusters, and which link a mesh axis rides.

Algorithm (pricing a mesh axis, `Cluster.axis_link`):
1. Lay the mesh out in row-major order over the global ranks: the last axis is innermost, so
   its ranks are contiguous; an axis's stride is the product of the sizes of the axes after it.
2. The group of ranks along an axis spans `stride * size` consecutive ranks, starting at a
   multiple of that span.
3. If every such span fits inside one node (the span divides the node size), the axis rides the
   intra-node link (NVLink/NVSwitch); otherwise it crosses nodes and rides the fabric.

Presets hold data-sheet numbers: dense (not sparse) tensor-core peaks, HBM capacity in bytes
and bandwidth in bytes/s, link bandwidth per GPU per direction in bytes/s and latency in s;
and, where a measurement is published, the GPU's achievable matmul fraction of its peak
(`GPU.mamf`): compute is priced at the data sheet times that fraction over the A100's
(`GPU.sustained_flops`), the A100 being what the cost model's efficiencies were fitted on.
User-defined hardware is built with the same dataclasses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cost.errors import CostInputError

GiB = 2**30
TB = 1e12
GB = 1e9


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One accelerator: dense peak FLOP/s per dtype, HBM capacity (bytes) and bandwidth (B/s)."""

    name: str
    bf16_flops: float
    fp8_flops: float
    fp32_flops: float
    hbm_bytes: float
    hbm_bw: float
    # the fraction of the bf16 peak FlashAttention-2 reaches at best, where it is below what
    # the kernel's score GEMM would (a kernel written for another architecture); None: no cap
    fa2_fraction: float | None = None
    # measured Maximum Achievable Matmul FLOPS over the data-sheet peak, (bf16, fp8), where a
    # source publishes it (`MAMF_SOURCE`); None: as the A100 the cost model was fitted on
    mamf: tuple[float, float | None] | None = None
    # FlashAttention v1 (`attention="flash1"`): its measured causal forward + backward TFLOP/s
    # at `ATTENTION_SEQS`, per head dim, where a benchmark on this GPU is published
    # (`FLASH1_SOURCE`); None: not priced on this GPU
    flash1: tuple[tuple[int, tuple[float, ...]], ...] | None = None

    def flash1_flops(self, head_dim: int, seq: float) -> float:
        """FLOP/s of FlashAttention v1's causal forward + backward at one head dim and key
        length, read from `flash1`:
        1. At each tabled head dim, interpolate linearly in log2(seq) between the tabled
           sequences; outside them hold the end value (the curves flatten by 16K).
        2. Between the tabled head dims interpolate linearly; outside them raise."""
        if self.flash1 is None:
            raise CostInputError(
                f"attention='flash1': no published measurement of FlashAttention v1 on "
                f"{self.name} (measured for the presets "
                f"{', '.join(n for n, g in GPU_PRESETS.items() if g.flash1)}); price another kernel "
                f"(attention='flash2' or 'flash') or give this GPU a `flash1` table")
        table = dict(self.flash1)
        dims = sorted(table)
        if not dims[0] <= head_dim <= dims[-1]:
            raise CostInputError(
                f"attention='flash1' on {self.name}: head dim {head_dim} is outside the "
                f"measured {dims[0]}..{dims[-1]}; price another kernel")
        x = np.log2(np.clip(seq, ATTENTION_SEQS[0], ATTENTION_SEQS[-1]))
        at = {d: float(np.interp(x, np.log2(ATTENTION_SEQS), table[d])) for d in dims}
        return 1e12 * float(np.interp(head_dim, dims, [at[d] for d in dims]))

    def fa2_efficiency(self, efficiency: Any, dtype_bytes: Any = 2) -> Any:
        """A FlashAttention-2 kernel's fraction of the sustained peak (`sustained_flops`) at
        its element size, given what its score GEMM alone would reach (floats or arrays): at
        most `fa2_fraction` of the data-sheet peak where that is set.  The one place the cap
        is applied (the formula path's kernels, the graph path's SDPA nodes,
        `cost.compute.sdpa_efficiency`)."""
        if self.fa2_fraction is None:
            return efficiency
        scale = np.vectorize(self.matmul_scale, otypes=[float])(dtype_bytes)
        return np.minimum(efficiency, self.fa2_fraction / scale)

    def matmul_scale(self, dtype_bytes: int = 2) -> float:
        """This GPU's achievable matmul fraction of its peak over the A100's, at an element
        size (`mamf`; 1.0 where none is published, and for fp32).  The cost model's GEMM
        efficiencies (`cost.compute.MATMUL_PEAK_FRACTION`, ...) were fitted on A100 runs,
        so they hold the A100's fraction: another GPU's compute runs at its own."""
        if self.mamf is None or dtype_bytes == 4:
            return 1.0
        bf16, fp8 = self.mamf
        return (fp8 if dtype_bytes == 1 and fp8 is not None else bf16) / REFERENCE_MAMF

    def sustained_flops(self, dtype_bytes: int = 2) -> float:
        """`peak_flops` times `matmul_scale`: the peak the cost model's efficiencies apply to."""
        return self.peak_flops(dtype_bytes) * self.matmul_scale(dtype_bytes)

    def peak_flops(self, dtype_bytes: int = 2) -> float:
        """Dense tensor-core peak for an element size: 1 → fp8, 2 → bf16/fp16, 4 → fp32."""
        peaks = {1: self.fp8_flops, 2: self.bf16_flops, 4: self.fp32_flops}
        if dtype_bytes not in peaks:
            raise CostInputError(f"no peak for {dtype_bytes}-byte elements; use 1, 2 or 4")
        return peaks[dtype_bytes]

    @staticmethod
    def preset(name: str) -> GPU:
        """A GPU from the data-sheet table `GPU_PRESETS` (case-insensitive)."""
        return _lookup(GPU_PRESETS, name, "GPU")


@dataclass(frozen=True, kw_only=True)
class Link:
    """A link class: bandwidth per GPU per direction (B/s), per-hop latency (s), and the
    fraction of the bandwidth that collectives achieve on it (NCCL bus bandwidth / wire speed)."""

    name: str
    bandwidth: float
    latency: float
    efficiency: float = 1.0

    @property
    def achieved_bandwidth(self) -> float:
        """Bytes/s a collective actually moves per GPU per direction."""
        return self.bandwidth * self.efficiency


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """`nodes` identical nodes of `gpus_per_node` GPUs; `intra` inside a node, `inter` across."""

    gpu: GPU
    gpus_per_node: int
    nodes: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise CostInputError(
                f"a cluster needs >= 1 GPU per node and >= 1 node, got "
                f"gpus_per_node={self.gpus_per_node}, nodes={self.nodes}"
            )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @staticmethod
    def preset(name: str, nodes: int = 1) -> Cluster:
        """A cluster of `nodes` copies of the node preset `name` (see `CLUSTER_PRESETS`)."""
        node = _lookup(CLUSTER_PRESETS, name, "cluster")
        return Cluster(
            gpu=node.gpu,
            gpus_per_node=node.gpus_per_node,
            nodes=nodes,
            intra=node.intra,
            inter=node.inter,
        )

    @staticmethod
    def default() -> Cluster:
        """One DGX H100 node: the hardware assumed when the user names none."""
        return Cluster.preset("dgx-h100", nodes=1)

    def axis_span(self, axes: Sequence[tuple[str, int]], axis: str) -> tuple[int, int]:
        """(stride, size) of `axis` in the row-major mesh `axes` (outermost first)."""
        names = [a for a, _ in axes]
        if axis not in names:
            raise CostInputError(f"mesh axis {axis!r} not in mesh axes {names}")
        index = names.index(axis)
        stride = 1
        for _, size in axes[index + 1 :]:
            stride *= size
        return stride, axes[index][1]

    def axis_in_node(self, axes: Sequence[tuple[str, int]], axis: str) -> bool:
        """True when every group of ranks along `axis` lies within one node."""
        stride, size = self.axis_span(axes, axis)
        return size == 1 or self.gpus_per_node % (stride * size) == 0

    def axis_link(self, axes: Sequence[tuple[str, int]], axis: str) -> Link:
        """The slowest link a group along `axis` spans: `intra` inside a node, else `inter`."""
        return self.intra if self.axis_in_node(axes, axis) else self.inter


def _lookup(table: dict, name: str, kind: str):
    key = ALIASES.get(name.lower(), name.lower())
    if key not in table:
        raise CostInputError(
            f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}. "
            f"Build a {kind} yourself with the dataclass for other hardware."
        )
    return table[key]


# Other spellings users type for the same presets.
ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "h100-sxm5": "h100-sxm",
           "hgx-h100": "dgx-h100", "hgx-h200": "dgx-h200", "hgx-h800": "dgx-h800",
           "hgx-b200": "dgx-b200", "hgx-a100": "dgx-a100"}  # fmt: skip

# FlashAttention-2 on Hopper: "FlashAttention-2 achieving only 35% utilization on the H100
# GPU" (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, abstract); FA2 was written for
# Ampere, where it reaches 50-73% of the peak (Dao 2023, arXiv 2307.08691): no cap there
FA2_ON_HOPPER = 0.35

# Maximum Achievable Matmul FLOPS: the best mean TFLOP/s of a brute-force search over matmul
# shapes, over the data-sheet peak (stas00/ml-engineering compute/accelerator/README.md
# @744d01e, "Maximum Achievable Matmul FLOPS comparison table"): BF16 A100 SXM 271.2 of 312
# (86.9%, torch 2.6.0+cu126), H100 SXM 794.5 of 989 (80.3%, 2.7.0+cu126; "H200 is the
# same"), B200 SXM 1745.0 of 2250 (77.6%, 2.7.1+cu128).  The A100's is the reference the cost
# model's fitted efficiencies hold (its fit rows ran on A100s).  The FP8 figures (H100 SXM
# 70.9%, B200 76.3%) are not used: FP8 GEMMs are priced at the bf16 fraction of the FP8 peak,
# as before (tried: H100's prices Megatron-Bridge's three H100 FP8 rows 10-11% slow; NOTES.md,
# Fidelity, session 35).
MAMF_SOURCE = "stas00/ml-engineering compute/accelerator/README.md @744d01e (MAMF tables)"
REFERENCE_MAMF = 0.869
MAMF_A100 = (0.869, None)
MAMF_H100_SXM = (0.803, None)
MAMF_B200 = (0.776, None)

# FlashAttention (v1, CUDA: flash-attn 1.0.x), causal forward + backward TFLOP/s at head dims
# 64 and 128 and `ATTENTION_SEQS` (FLOPs: 3.5 x the forward's 4·b·h·s²·d / 2), read off the
# bar labels of the FlashAttention-2 paper's benchmark figures (Dao 2023, arXiv 2307.08691,
# Fig. 4 and 7, panels (c) and (d); Dao-AILab/flash-attention
# assets/flash2_{a100,h100}_fwd_bwd_benchmark.png @4f285b35, "FlashAttention" bars).  Measured
# on the A100 80 GB SXM4 and H100 80 GB SXM5; the A100 40 GB has the 80 GB's SMs and clocks,
# the H200 and H800 the H100's die.
ATTENTION_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
FLASH1_SOURCE = ("FlashAttention-2 paper Fig. 4/7 (c)(d), 'FlashAttention' bars: "
                 "Dao-AILab/flash-attention assets/flash2_{a100,h100}_fwd_bwd_benchmark.png "
                 "@4f285b35")  # fmt: skip
FLASH1_A100 = ((64, (58.0, 70.0, 77.0, 87.0, 92.0, 97.0)),
               (128, (55.0, 62.0, 69.0, 76.0, 80.0, 83.0)))  # fmt: skip
FLASH1_H100 = ((64, (104.0, 123.0, 136.0, 138.0, 149.0, 156.0)),
               (128, (98.0, 109.0, 108.0, 126.0, 135.0, 137.0)))  # fmt: skip

GPU_PRESETS: dict[str, GPU] = {
    g.name: g
    for g in (
        # A100 has no fp8 tensor cores: fp8 runs at the bf16 rate.
        GPU(name="a100-40gb", bf16_flops=312e12, fp8_flops=312e12, fp32_flops=19.5e12,
            hbm_bytes=40 * GiB, hbm_bw=1.555 * TB, mamf=MAMF_A100,
            flash1=FLASH1_A100),
        GPU(name="a100-80gb", bf16_flops=312e12, fp8_flops=312e12, fp32_flops=19.5e12,
            hbm_bytes=80 * GiB, hbm_bw=2.039 * TB, mamf=MAMF_A100,
            flash1=FLASH1_A100),
        GPU(name="h100-sxm", bf16_flops=989e12, fp8_flops=1979e12, fp32_flops=67e12,
            fa2_fraction=FA2_ON_HOPPER, hbm_bytes=80 * GiB, hbm_bw=3.35 * TB,
            mamf=MAMF_H100_SXM, flash1=FLASH1_H100),
        # H200 ("the same" in the source) and H800 (the H100 SXM's GH100 die at its 700 W):
        # the H100's measured fraction
        GPU(name="h200", bf16_flops=989e12, fp8_flops=1979e12, fp32_flops=67e12,
            fa2_fraction=FA2_ON_HOPPER, hbm_bytes=141 * GB, hbm_bw=4.8 * TB,
            mamf=MAMF_H100_SXM, flash1=FLASH1_H100),
        GPU(name="h800", bf16_flops=989e12, fp8_flops=1979e12, fp32_flops=67e12,
            fa2_fraction=FA2_ON_HOPPER, hbm_bytes=80 * GiB, hbm_bw=3.35 * TB,
            mamf=MAMF_H100_SXM, flash1=FLASH1_H100),
        GPU(name="b200", bf16_flops=2.25e15, fp8_flops=4.5e15, fp32_flops=80e12,
            hbm_bytes=192 * GB, hbm_bw=8.0 * TB, mamf=MAMF_B200),
    )
}  # fmt: skip

# Collective efficiency: NCCL reaches ~80% of NVLink/NVSwitch wire speed as bus bandwidth and
# ~90% of InfiniBand line rate (protocol headers, chunk pipelining).
NVLINK3 = Link(name="nvlink3", bandwidth=300 * GB, latency=5e-6, efficiency=0.8)
NVLINK3_H800 = Link(name="nvlink-h800", bandwidth=200 * GB, latency=5e-6, efficiency=0.8)
NVLINK4 = Link(name="nvlink4", bandwidth=450 * GB, latency=5e-6, efficiency=0.8)
NVLINK5 = Link(name="nvlink5", bandwidth=900 * GB, latency=5e-6, efficiency=0.8)
HDR_IB = Link(name="ib-hdr-200g", bandwidth=25 * GB, latency=10e-6, efficiency=0.9)
NDR_IB = Link(name="ib-ndr-400g", bandwidth=50 * GB, latency=10e-6, efficiency=0.9)


def _node(gpu: str, intra: Link, inter: Link) -> Cluster:
    return Cluster(gpu=GPU.preset(gpu), gpus_per_node=8, nodes=1, intra=intra, inter=inter)


CLUSTER_PRESETS: dict[str, Cluster] = {
    "dgx-a100": _node("a100-80gb", NVLINK3, HDR_IB),
    "dgx-a100-40gb": _node("a100-40gb", NVLINK3, HDR_IB),
    "dgx-h100": _node("h100-sxm", NVLINK4, NDR_IB),
    "dgx-h200": _node("h200", NVLINK4, NDR_IB),
    "dgx-h800": _node("h800", NVLINK3_H800, NDR_IB),
    "dgx-b200": _node("b200", NVLINK5, NDR_IB),
}
