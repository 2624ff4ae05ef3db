"""Hardware presets, user-defined clusters, and which link a mesh axis rides."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cost.errors import CostInputError
from cost.hardware import CLUSTER_PRESETS, GPU, GPU_PRESETS, Cluster, Link

PROPERTY = settings(max_examples=60, deadline=None)


def test_gpu_presets_hold_data_sheet_numbers():
    assert GPU.preset("a100-80gb").bf16_flops == 312e12
    assert GPU.preset("H100-SXM").bf16_flops == 989e12
    assert GPU.preset("h200").hbm_bytes == 141e9
    assert GPU.preset("b200").bf16_flops == 2.25e15
    assert GPU.preset("h100-sxm").fp8_flops == 1979e12
    assert set(GPU_PRESETS) == {"a100-40gb", "a100-80gb", "h100-sxm", "h200", "h800", "b200"}


def test_unknown_gpu_is_a_value_error_listing_known_names():
    with pytest.raises(ValueError, match="unknown GPU 'v100'.*a100-40gb.*h200"):
        GPU.preset("v100")


def test_unknown_cluster_lists_presets():
    with pytest.raises(CostInputError, match="unknown cluster 'tpu-pod'.*dgx-h100"):
        Cluster.preset("tpu-pod")


def test_cluster_preset_scales_nodes_and_default_is_one_dgx_h100():
    cluster = Cluster.preset("dgx-a100", nodes=192)
    assert cluster.world_size == 1536
    assert cluster.gpu.name == "a100-80gb"
    assert cluster.intra.bandwidth == 300e9 and cluster.inter.bandwidth == 25e9
    default = Cluster.default()
    assert (default.gpu.name, default.nodes, default.gpus_per_node) == ("h100-sxm", 1, 8)
    assert {"dgx-a100", "dgx-h100", "dgx-h200", "dgx-b200"} <= set(CLUSTER_PRESETS)
    assert Cluster.preset("hgx-h800").gpu == GPU.preset("h800")
    assert GPU.preset("H100") == GPU.preset("h100-sxm")


def test_user_defined_cluster():
    gpu = GPU(name="x", bf16_flops=1e15, fp8_flops=2e15, fp32_flops=5e13, hbm_bytes=96e9,
              hbm_bw=4e12)  # fmt: skip
    fast, slow = (Link(name="nv", bandwidth=1e11, latency=1e-6),
                  Link(name="eth", bandwidth=1e10, latency=2e-5))  # fmt: skip
    cluster = Cluster(gpu=gpu, gpus_per_node=4, nodes=3, intra=fast, inter=slow)
    assert cluster.world_size == 12
    assert cluster.axis_link([("dp", 3), ("tp", 4)], "tp") is fast
    assert cluster.axis_link([("dp", 3), ("tp", 4)], "dp") is slow


def test_axis_link_follows_mesh_order_and_node_size():
    cluster = Cluster.preset("dgx-h100", nodes=4)
    inner_tp = [("pp", 2), ("dp", 2), ("tp", 8)]
    assert cluster.axis_link(inner_tp, "tp") is cluster.intra
    assert cluster.axis_link(inner_tp, "dp") is cluster.inter
    outer_tp = [("tp", 8), ("dp", 4)]
    assert cluster.axis_link(outer_tp, "dp") is cluster.intra
    assert cluster.axis_link(outer_tp, "tp") is cluster.inter
    odd = [("dp", 8), ("tp", 3)]  # groups {0,1,2}, {3,4,5}, {6,7,8}: the third crosses
    assert cluster.axis_link(odd, "tp") is cluster.inter
    assert cluster.axis_link([("dp", 32), ("tp", 1)], "tp") is cluster.intra


def test_axis_link_unknown_axis():
    with pytest.raises(CostInputError, match="mesh axis 'cp' not in"):
        Cluster.default().axis_link([("tp", 8)], "cp")


@PROPERTY
@given(sizes=st.lists(st.sampled_from([1, 2, 4, 8, 16]), min_size=1, max_size=4),
       gpn=st.sampled_from([4, 8]), data=st.data())  # fmt: skip
def test_axis_is_intra_exactly_when_its_rank_groups_stay_in_a_node(sizes, gpn, data):
    axes = [(f"a{i}", n) for i, n in enumerate(sizes)]
    name, size = data.draw(st.sampled_from(axes))
    world = 1
    for _, n in axes:
        world *= n
    cluster = Cluster(gpu=GPU.preset("h100-sxm"), gpus_per_node=gpn, nodes=max(1, world // gpn),
                      intra=Link(name="i", bandwidth=1e11, latency=1e-6),
                      inter=Link(name="o", bandwidth=1e10, latency=1e-5))  # fmt: skip
    stride, _ = cluster.axis_span(axes, name)
    groups = {}
    for rank in range(world):
        base = rank - (rank // stride) % size * stride
        groups.setdefault(base, set()).add(rank // gpn)
    one_node = all(len(nodes) == 1 for nodes in groups.values())
    assert (cluster.axis_link(axes, name) is cluster.intra) == one_node


def test_compute_runs_at_each_gpus_achievable_matmul_fraction():
    """The cost model's GEMM efficiencies were fitted on A100 runs; an H100 reaches a smaller
    fraction of its data-sheet peak (published MAMF: 80.3% against the A100's 86.9%), so its
    tensor-core compute is scaled by their ratio (B200: 77.6%).  fp32 (no tensor cores) and a
    GPU without a published figure are not scaled; FlashAttention-2's ceiling stays 35% of the
    data sheet."""
    from dataclasses import replace

    from cost.hardware import MAMF_H100_SXM, REFERENCE_MAMF

    a100, h100 = GPU.preset("a100-80gb"), GPU.preset("h100-sxm")
    assert a100.matmul_scale() == 1.0 == a100.matmul_scale(1)
    assert h100.matmul_scale() == pytest.approx(0.803 / 0.869) == MAMF_H100_SXM[0] / REFERENCE_MAMF
    assert h100.sustained_flops() == pytest.approx(989e12 * 0.803 / 0.869)
    assert h100.sustained_flops(1) == pytest.approx(1979e12 * 0.803 / 0.869)  # fp8: bf16's
    assert h100.sustained_flops(4) == 67e12
    assert GPU.preset("b200").matmul_scale() == pytest.approx(0.776 / 0.869)
    assert GPU.preset("h200").matmul_scale() == h100.matmul_scale()  # "H200 is the same"
    assert replace(h100, mamf=None).sustained_flops() == 989e12
    for eff in (0.9, 0.5):  # the FA2 cap in absolute terms, at any score-GEMM efficiency
        capped = h100.sustained_flops() * h100.fa2_efficiency(eff)
        assert capped == pytest.approx(989e12 * min(eff * 0.803 / 0.869, 0.35))
