"""Step time of a whole plan: compute, exposed communication per mesh axis, pipeline bubble.

Algorithm (`step_time`):
1. One micro-batch on the bottleneck stage: ⌈L/(p·v)⌉·v layers × (forward + backward + recompute
   forward) plus the end-stage work (embedding; final norm, LM head and loss).
2. Tensor parallelism: 2 collectives on the [b, s/c, h] activation per layer per pass
   (forward, backward, and the recompute forward under full recompute), on the critical path.
3. Context parallelism: c−1 ring exchanges of the local K,V per forward (and recompute
   forward), c of K,V,dK,dV backward, overlapped with the attention kernels: only the excess
   over them is exposed.
4. Expert parallelism: dispatch + combine all-to-alls per layer per pass, exposed.
5. Pipeline: a send and a receive of the boundary activation per micro-batch per virtual
   stage; the bubble is (p−1)/v micro-batch times (GPipe and 1F1B: v = 1).
6. Data parallelism (gradients of dense weights over dp·cp, of experts over dp·cp/ep): fp32
   reduce-scatter + bf16 all-gather (ZeRO-1/2) or all-reduce (stage 0), once per step, hidden
   behind the last micro-batch's backward when overlap is on (the last layer's bucket is
   always exposed). ZeRO-3 gathers bf16 weights per micro-batch per pass and reduce-scatters
   gradients per micro-batch, prefetched behind compute; the first layer's gather is exposed.
7. Optimizer: Adam reads and writes ~34 B per local parameter shard at HBM speed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cost.comm import span_time
from cost.compute import MEMORY_BW_FRACTION
from cost.config import ParallelConfig, stage_layers
from cost.hardware import Cluster
from cost.workload import Workload

ADAM_BYTES_PER_PARAM = 34  # read fp32 master, m, v, grad + bf16 param; write the same back


@dataclass(frozen=True, kw_only=True)
class StepBreakdown:
    """Seconds of one optimizer step on the critical path."""

    compute: float
    comm: dict[str, float]
    bubble: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.compute + sum(self.comm.values()) + self.bubble + self.optimizer


def _spans(cfg: ParallelConfig) -> dict[str, tuple[int, int]]:
    """(stride, size) in global rank order of each communication group; mesh pp, dp, cp, tp
    (outermost first) with ep the inner part of dp."""
    t, c, d, e = cfg.tp, cfg.cp, cfg.dp or 1, cfg.ep
    return {"tp": (1, t), "cp": (t, c), "ep": (t * c, e), "dp": (t, d * c),
            "dp_expert": (t * c * e, d // e), "pp": (t * c * d, cfg.pp)}  # fmt: skip


# (kind, nbytes, stride, size) -> seconds: prices one collective over a rank span
Collective = Callable[[str, float, int, int], float]


def _default(cluster: Cluster) -> Collective:
    return lambda kind, nbytes, stride, size: span_time(kind, nbytes, cluster, stride, size)


def _passes(recompute: str) -> int:
    return 3 if recompute == "full" else 2


def _layer_comm(work: Workload, cfg: ParallelConfig, coll: Collective, spans: dict,
                recompute: str) -> dict:  # fmt: skip
    """Exposed seconds per micro-batch per layer for tp, cp and ep (steps 2–4)."""
    passes = _passes(recompute)
    tp = work.tp_calls * coll("all_reduce", work.tp_bytes, *spans["tp"])
    ep = work.ep_calls * coll("all_to_all", work.ep_bytes, *spans["ep"])
    ring = coll("send_recv", work.cp_bytes, *spans["cp"])
    attn = work.attn_fwd_s
    forward = max(0.0, work.cp_calls * ring - attn)
    cp = (passes - 1) * forward + max(0.0, 2 * cfg.cp * ring - 2 * attn)
    return {"tp": passes * tp, "cp": cp if cfg.cp > 1 else 0.0, "ep": passes * ep}


def _dp_comm(work: Workload, cfg: ParallelConfig, coll: Collective, spans: dict,
             micro_batches: int, recompute: str, per_stage: int) -> float:  # fmt: skip
    """Exposed data-parallel seconds per step (step 6), for `per_stage` layers on the rank."""
    groups = (
        (per_stage * work.layer_dense_params + work.edge_params, spans["dp"]),
        (per_stage * work.layer_expert_params, spans["dp_expert"]),
    )

    def each(kind: str, bytes_per_param: int) -> float:
        return sum(coll(kind, bytes_per_param * p, *span) for p, span in groups)

    if cfg.zero == 0:
        reduce = each("all_reduce", 4)
    else:
        reduce = each("reduce_scatter", 4) + (each("all_gather", 2) if cfg.zero < 3 else 0.0)
    if cfg.zero == 3:
        gather = each("all_gather", 2)
        streamed = micro_batches * (_passes(recompute) * gather + reduce)
        busy = micro_batches * per_stage * (work.layer_fwd_s + work.layer_bwd_s)
        return max(gather / max(per_stage, 1.0), streamed - busy)
    if not cfg.overlap_grad_reduce:
        return reduce
    return max(reduce / max(per_stage, 1.0), reduce - per_stage * work.layer_bwd_s)


def step_time(work: Workload, cfg: ParallelConfig, cluster: Cluster, *, micro_batches: int,
              schedule: str, virtual: int, recompute: str, spans: dict | None = None,
              collective: Collective | None = None) -> StepBreakdown:  # fmt: skip
    """Seconds of one training step of `micro_batches` micro-batches per data-parallel rank;
    `spans` (axis → (stride, size)) and `collective` override the Megatron layout and the
    flat two-level link model (the planner passes other nestings and its topology)."""
    spans = spans or _spans(cfg)
    coll = collective or _default(cluster)
    v = virtual if schedule == "interleaved" else 1
    per_stage = stage_layers(work.layers, cfg.pp, v)
    ends = work.pre_s + work.post_s if cfg.pp == 1 else max(work.pre_s, work.post_s)
    layer = work.layer_fwd_s + work.layer_bwd_s + work.recompute_s[recompute]
    compute_mb = per_stage * layer + ends
    layer_comm = _layer_comm(work, cfg, coll, spans, recompute)
    comm_mb = {k: per_stage * v for k, v in layer_comm.items()}
    p2p = coll("send_recv", work.boundary_bytes, *spans["pp"])
    comm_mb["pp"] = 2 * v * p2p if cfg.pp > 1 else 0.0
    per_mb = compute_mb + sum(comm_mb.values())
    comm = {k: micro_batches * x for k, x in comm_mb.items()}
    comm["dp"] = _dp_comm(work, cfg, coll, spans, micro_batches, recompute, per_stage)
    params = per_stage * (work.layer_dense_params + work.layer_expert_params) + work.edge_params
    shard = cfg.data_parallel if cfg.zero >= 1 else 1
    optimizer = ADAM_BYTES_PER_PARAM * params / shard / (cluster.gpu.hbm_bw * MEMORY_BW_FRACTION)
    return StepBreakdown(compute=micro_batches * compute_mb, comm=comm,
                         bubble=(cfg.pp - 1) / v * per_mb, optimizer=optimizer)  # fmt: skip
