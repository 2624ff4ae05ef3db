"""Step time: tp collectives per layer, pipeline bubble per schedule, dp overlap, optimizer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cost.comm import collective_time, span_time
from cost.config import ParallelConfig, stage_layers
from cost.hardware import Cluster
from cost.model import ModelShape
from cost.step import step_time
from cost.workload import shape_workload

SHAPE = ModelShape.gpt(layers=16, hidden=4096, heads=32, seq=2048, vocab=51200)
CLUSTER = Cluster.preset("dgx-h100", nodes=8)


def _step(cfg: ParallelConfig, m: int = 16, **over):
    cfg = replace(cfg, **over)
    work = shape_workload(SHAPE, cfg, cfg.micro_batch, CLUSTER.gpu)
    return work, step_time(work, cfg, CLUSTER, micro_batches=m, schedule=cfg.schedule,
                           virtual=cfg.virtual_stages, recompute=cfg.recompute)  # fmt: skip


BASE = ParallelConfig(tp=8, pp=4, dp=2, global_batch=32, micro_batch=1, schedule="1f1b",
                      virtual_stages=1, recompute="none")  # fmt: skip


def test_tp_exposes_two_all_reduces_per_layer_per_pass():
    work, step = _step(BASE)
    ar = collective_time("all_reduce", 2 * 2048 * 4096, 8, CLUSTER.intra)
    assert work.tp_bytes == 2 * 2048 * 4096
    assert step.comm["tp"] == pytest.approx(16 * (16 / 4) * 2 * 2 * ar)  # m · L/p · passes · 2
    _, full = _step(BASE, recompute="full")
    assert full.comm["tp"] == pytest.approx(1.5 * step.comm["tp"])


@pytest.mark.parametrize(("schedule", "v"), [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                             ("interleaved", 4)])  # fmt: skip
def test_bubble_fraction_per_schedule(schedule, v):
    m, p = 16, 4
    _, step = _step(BASE, m=m, schedule=schedule, virtual_stages=v)
    ideal = step.compute + sum(x for k, x in step.comm.items() if k != "dp")
    assert step.bubble / ideal == pytest.approx((p - 1) / (v * m))


def test_interleaving_sends_v_times_more_point_to_point():
    _, plain = _step(BASE)
    _, inter = _step(BASE, schedule="interleaved", virtual_stages=4)
    assert inter.comm["pp"] == pytest.approx(4 * plain.comm["pp"])
    p2p = span_time("send_recv", 2 * 2048 * 4096 / 8, CLUSTER, 8 * 2, 4)
    assert plain.comm["pp"] == pytest.approx(16 * 2 * p2p)


def test_gradient_reduction_overlap_only_hides_time():
    dp_heavy = replace(BASE, tp=1, pp=1, dp=64)
    _, hidden = _step(dp_heavy, m=1)
    _, exposed = _step(dp_heavy, m=1, overlap_grad_reduce=False)
    assert 0 < hidden.comm["dp"] < exposed.comm["dp"]
    assert hidden.compute == exposed.compute


def test_zero_stages_change_dp_traffic_not_compute():
    _, ddp = _step(BASE, zero=0, overlap_grad_reduce=False)
    _, z1 = _step(BASE, zero=1, overlap_grad_reduce=False)
    work, z3 = _step(BASE, zero=3)
    assert ddp.compute == z1.compute == z3.compute
    params = 4 * work.layer_dense_params + work.edge_params  # 16 layers / 4 stages
    span = (8, 2)  # dp groups: stride tp = 8, two ranks
    assert ddp.comm["dp"] == pytest.approx(span_time("all_reduce", 4 * params, CLUSTER, *span))
    scatter = span_time("reduce_scatter", 4 * params, CLUSTER, *span)
    gather = span_time("all_gather", 2 * params, CLUSTER, *span)
    assert z1.comm["dp"] == pytest.approx(scatter + gather)
    streamed = 16 * (2 * gather + scatter)  # per micro-batch: forward + backward gathers
    busy = 16 * 4 * (work.layer_fwd_s + work.layer_bwd_s)
    assert z3.comm["dp"] == pytest.approx(max(gather / 4, streamed - busy))
    assert z1.optimizer == pytest.approx(ddp.optimizer / 2)  # Adam on a 1/dp shard


def test_no_pipeline_no_bubble_and_step_total_adds_up():
    _, step = _step(BASE, tp=8, pp=1, dp=8)
    assert step.bubble == 0.0 and step.comm["pp"] == 0.0
    total = step.compute + sum(step.comm.values()) + step.bubble + step.optimizer
    assert step.total == pytest.approx(total)


def test_context_parallel_ring_is_hidden_behind_attention_when_it_can_be():
    cfg = replace(BASE, tp=8, pp=1, dp=4, cp=2)
    work, step = _step(cfg)
    ring = span_time("send_recv", work.cp_bytes, CLUSTER, 8, 2)
    exposed = max(0.0, ring - work.attn_fwd_s) + max(0.0, 4 * ring - 2 * work.attn_fwd_s)
    assert step.comm["cp"] == pytest.approx(16 * 16 * exposed)


def test_uneven_pipeline_stages_price_the_most_loaded_stage():
    assert stage_layers(126, 16) == 8
    assert stage_layers(126, 16, 4) == 8  # 2 layers per chunk, 4 chunks
    assert stage_layers(16, 4, 2) == 4
    shape = ModelShape.gpt(layers=18, hidden=4096, heads=32, seq=2048, vocab=51200)
    cfg = replace(BASE, pp=4)
    work = shape_workload(shape, cfg, 1, CLUSTER.gpu)
    step = step_time(work, cfg, CLUSTER, micro_batches=16, schedule="1f1b", virtual=1,
                     recompute="none")  # fmt: skip
    per_layer = work.layer_fwd_s + work.layer_bwd_s
    assert step.compute == pytest.approx(16 * (5 * per_layer + max(work.pre_s, work.post_s)))
