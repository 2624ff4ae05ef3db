"""Per-op FLOPs and bytes on a real torch.export graph; roofline time and matmul efficiency."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost.compute import (
    KERNEL_LAUNCH_S,
    MATMUL_K_HALF,
    MATMUL_PEAK_FRACTION,
    MEMORY_BW_FRACTION,
    matmul_efficiency,
    node_flops_bytes,
    node_time,
    op_time,
)
from cost.errors import CostInputError
from cost.hardware import GPU

F32 = 4


class AllOps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.lin = nn.Linear(16, 32)
        self.m = nn.Parameter(torch.randn(16, 8))
        self.p = nn.Parameter(torch.randn(16, 4))
        self.bias = nn.Parameter(torch.randn(8))
        self.ln = nn.LayerNorm(16)
        self.rms = nn.RMSNorm(16)

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)  # [2, 8, 16]
        a = self.lin(x)  # [2, 8, 32]
        x2 = x.reshape(16, 16)
        mm = torch.mm(x2, self.m)
        am = torch.addmm(self.bias, x2, self.m)
        bm = torch.bmm(x, x.transpose(1, 2))  # [2, 8, 8]
        mt = x @ self.p  # matmul 3-D @ 2-D
        q = a[..., :16].reshape(2, 8, 2, 8).transpose(1, 2)  # [2, 2, 8, 8]
        causal = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        full = F.scaled_dot_product_attention(q, q, q)
        norms = self.ln(x) + self.rms(x)
        probs = torch.softmax(bm, -1) + torch.log_softmax(bm, -1)
        loss = F.cross_entropy(a.reshape(16, 32), y)
        return (loss + mm.sum() + am.sum() + mt.sum() + causal.sum() + full.sum() + norms.sum()
                + probs.sum() + x.to(torch.float16).sum())  # fmt: skip


@pytest.fixture(scope="module")
def nodes() -> dict[str, torch.fx.Node]:
    ids = torch.randint(0, 10, (2, 8))
    y = torch.randint(0, 32, (16,))
    ep = torch.export.export(AllOps(), (ids, y), strict=False)
    return {n.name: n for n in ep.graph_module.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize(
    ("name", "flops", "nbytes"),
    [
        ("embedding", 0, 2 * 256 * F32 + 16 * 8),
        ("linear", 2 * 16 * 16 * 32 + 16 * 32, (256 + 512 + 32 + 512) * F32),
        ("mm", 2 * 16 * 16 * 8, (256 + 128 + 128) * F32),
        ("addmm", 2 * 16 * 16 * 8 + 16 * 8, (8 + 256 + 128 + 128) * F32),
        ("bmm", 2 * 2 * 8 * 16 * 8, (256 + 256 + 128) * F32),
        ("matmul", 2 * 16 * 16 * 4, (256 + 64 + 64) * F32),
        ("scaled_dot_product_attention", 2 * 4 * 8 * 8 * 16 * 9 / 16, 4 * 256 * F32),
        ("scaled_dot_product_attention_1", 2 * 4 * 8 * 8 * 16, 4 * 256 * F32),
        ("layer_norm", 8 * 256, (256 + 16 + 16 + 256) * F32),
        ("rms_norm", 4 * 256, (256 + 16 + 256) * F32),
        ("softmax", 5 * 128, 2 * 128 * F32),
        ("log_softmax", 5 * 128, 2 * 128 * F32),
        ("cross_entropy_loss", 6 * 512, (512 + 1) * F32 + 16 * 8),
        ("add", 256, 3 * 256 * F32),
        ("sum_1", 128, (128 + 1) * F32),
        ("to", 0, 256 * F32 + 256 * 2),
        ("_assert_tensor_metadata_default", 0, 0),
        ("reshape", 0, 0),
        ("slice_1", 0, 0),
        ("transpose", 0, 0),
    ],
)
def test_node_flops_bytes_hand_values(nodes, name, flops, nbytes):
    assert node_flops_bytes(nodes[name]) == (pytest.approx(flops), pytest.approx(nbytes))


def test_conv_flops_are_a_gemm_per_output_position():
    x, w, b = torch.randn(2, 3, 8, 8), torch.randn(6, 3, 4, 4), torch.randn(6)
    conv = next(n for n in torch.export.export(_Conv(), (x, w, b), strict=False)
                .graph_module.graph.nodes if n.op == "call_function")  # fmt: skip
    out = 2 * 6 * 2 * 2  # [2, 6, 2, 2]
    assert node_flops_bytes(conv) == (pytest.approx(2 * out * 3 * 4 * 4),
                                      pytest.approx((x.numel() + w.numel() + 6 + out) * F32))


class _Conv(nn.Module):
    def forward(self, x, w, b):
        return F.conv2d(x, w, b, stride=4)


def test_node_time_is_zero_for_views_and_positive_for_kernels(nodes):
    gpu = GPU.preset("h100-sxm")
    assert node_time(nodes["reshape"], gpu) == 0.0
    assert node_time(nodes["linear"], gpu) == KERNEL_LAUNCH_S  # tiny: launch bound


def test_op_time_roofline_hand_values():
    """Compute at the GPU's sustained peak: the data sheet's times its achievable matmul
    fraction over the A100's (H100 SXM 80.3 / 86.9: `cost.hardware.MAMF_SOURCE`)."""
    gpu = GPU.preset("h100-sxm")
    sustained = 0.803 / 0.869
    assert op_time(1e12, 0.0, gpu) == pytest.approx(
        1e12 / (989e12 * sustained * MATMUL_PEAK_FRACTION))
    assert op_time(0.0, 1e9, gpu) == pytest.approx(1e9 / (3.35e12 * MEMORY_BW_FRACTION))
    assert op_time(1.0, 1.0, gpu) == KERNEL_LAUNCH_S
    assert op_time(1e12, 0.0, gpu, 1) == pytest.approx(
        1e12 / (1979e12 * sustained * MATMUL_PEAK_FRACTION))
    assert op_time(1e12, 0.0, gpu, 4) == pytest.approx(1e12 / (67e12 * MATMUL_PEAK_FRACTION))
    assert op_time(1e12, 0.0, gpu, compute_efficiency=0.5) == pytest.approx(
        1e12 / (989e12 * sustained / 2))
    a100 = GPU.preset("a100-80gb")
    assert op_time(1e12, 0.0, a100) == pytest.approx(1e12 / (312e12 * MATMUL_PEAK_FRACTION))
    with pytest.raises(CostInputError, match="3-byte"):
        op_time(1.0, 1.0, gpu, 3)


def test_matmul_efficiency_hand_values():
    k = 4096
    assert matmul_efficiency(4096, 4096, k) == pytest.approx(
        MATMUL_PEAK_FRACTION * k / (k + MATMUL_K_HALF)
    )
    tiles = 100 * 128 / (128 * 128)  # one 128×128 tile, 100×128 of it useful
    assert matmul_efficiency(100, 128, 64) == pytest.approx(
        MATMUL_PEAK_FRACTION * tiles * 64 / (64 + MATMUL_K_HALF)
    )
    assert matmul_efficiency(128, 128, 1 << 20) < MATMUL_PEAK_FRACTION


def test_skinny_gemm_uses_a_narrow_tile_and_is_memory_bound():
    """A [T, h] x [h, 8] router GEMM fills half of a 16-wide tile (not 1/16 of a 128-wide
    one), and its time is the memory roofline's: reading x, not 1/16-efficient tensor cores."""
    k = 2048
    kloop = k / (k + MATMUL_K_HALF)
    assert matmul_efficiency(4096, 8, k) == pytest.approx(MATMUL_PEAK_FRACTION * 0.5 * kloop)
    assert matmul_efficiency(4096, 1, k) == pytest.approx(MATMUL_PEAK_FRACTION / 16 * kloop)
    assert matmul_efficiency(4096, 48, k) == pytest.approx(MATMUL_PEAK_FRACTION * 0.75 * kloop)
    assert matmul_efficiency(4096, 200, k) == pytest.approx(
        MATMUL_PEAK_FRACTION * 200 / 256 * kloop
    )
    gpu = GPU.preset("h100-sxm")
    for dtype_bytes in (2, 4):
        m, n = 4096, 8
        flops, nbytes = 2.0 * m * n * k, dtype_bytes * (m * k + k * n + m * n)
        t = op_time(flops, nbytes, gpu, dtype_bytes, compute_efficiency=matmul_efficiency(m, n, k))
        assert t == pytest.approx(nbytes / (gpu.hbm_bw * MEMORY_BW_FRACTION))
