"""Estimate one training configuration: memory per rank, step time, throughput, MFU.

Algorithm (`estimate`):
1. Resolve the model (a `ModelShape`, a preset name, or a traced graph via `cost.graph`) and
   the cluster (default: one DGX H100 node); fill dp with the GPUs that tp·pp·cp leave.
2. Validate the configuration against model and cluster (`cost.config.validate`).
3. Enumerate the fields left None — micro-batch (divisors of the per-rank batch), schedule,
   virtual stages, recompute mode — and price each candidate: `Workload` (built once per
   micro-batch: it does not depend on the others) → memory and step.
4. Keep the fastest candidate that fits in HBM; if none fits, the one needing least memory,
   reported as not fitting (with its breakdown) rather than raised.
5. Throughput: tokens/s, and TFLOP/s per GPU and MFU under two conventions — PaLM (model FLOPs
   6·N + 12·L·a·d·s per token, no recompute; `mfu`) and Megatron-2021 (96·B·s·L·h²·(1 + s/6h +
   V/16Lh), counting the recompute forward; `mfu_megatron`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from cost.config import ParallelConfig, validate
from cost.hardware import GPU, Cluster
from cost.memory import MemoryBreakdown, rank_memory
from cost.model import ModelShape
from cost.report import explain, render
from cost.step import StepBreakdown, pipeline_shares, step_time
from cost.workload import Workload, shape_workload


class Priced(Protocol):
    """What `estimate` needs from a model: shape facts for validation, work, FLOPs."""

    name: str
    layers: int
    heads: int
    seq: int
    experts: int

    @property
    def g(self) -> int: ...

    def workload(self, cfg: ParallelConfig, b: int, gpu: GPU) -> Workload: ...

    def flops_per_token(self) -> tuple[float, float]: ...


@dataclass(frozen=True, kw_only=True)
class ShapeModel:
    """A `ModelShape` as a priced model."""

    shape: ModelShape

    @property
    def name(self) -> str:
        return self.shape.name

    @property
    def layers(self) -> int:
        return self.shape.layers

    @property
    def heads(self) -> int:
        return self.shape.heads

    @property
    def g(self) -> int:
        return self.shape.g

    @property
    def seq(self) -> int:
        return self.shape.seq

    @property
    def experts(self) -> int:
        return self.shape.experts

    def workload(self, cfg: ParallelConfig, b: int, gpu: GPU) -> Workload:
        return shape_workload(self.shape, cfg, b, gpu)

    def flops_per_token(self) -> tuple[float, float]:
        """(PaLM, Megatron-2021) training FLOPs per token."""
        m = self.shape
        attn_fwd = 4 * m.layers * m.heads * m.head_dim * m.seq  # QKᵀ and PV, per token
        head = m.embedding_params
        body = m.active_params - head
        palm = 6 * m.active_params + 3 * attn_fwd
        megatron = 4 * (2 * body + attn_fwd) + 3 * 2 * head
        return float(palm), float(megatron)


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """The priced plan: resolved config, memory per rank, step breakdown, throughput."""

    model: str
    cluster: Cluster
    config: ParallelConfig
    memory: MemoryBreakdown
    step: StepBreakdown
    tokens_per_step: float
    flops_per_token: tuple[float, float]
    micro_batches: int
    work: Workload = field(repr=False)
    shape: ModelShape | None = None

    @property
    def step_time_s(self) -> float:
        """Seconds per optimizer step."""
        return self.step.total

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def memory_per_rank(self) -> float:
        """Bytes on the most loaded rank (breakdown: `memory`)."""
        return self.memory.total

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU, PaLM convention."""
        return self.tokens_per_s * self.flops_per_token[0] / self.cluster.world_size / 1e12

    @property
    def tflops_per_gpu_megatron(self) -> float:
        """TFLOP/s per GPU, Megatron-2021 convention (counts the recompute forward)."""
        return self.tokens_per_s * self.flops_per_token[1] / self.cluster.world_size / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation, PaLM convention (the one `print` leads with)."""
        return self.tflops_per_gpu * 1e12 / self.cluster.gpu.bf16_flops

    @property
    def mfu_megatron(self) -> float:
        return self.tflops_per_gpu_megatron * 1e12 / self.cluster.gpu.bf16_flops

    def __str__(self) -> str:
        return render(self)

    def explain(self) -> str:
        """The closed formulas behind this estimate, with this plan's numbers substituted."""
        return explain(self)


_ANALYSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def as_priced(model) -> Priced:
    """A `ModelShape`, a preset name, or a traced graph (`ExportedProgram` / `GraphModule`);
    a graph is analysed once and cached while it lives and keeps its node count."""
    if isinstance(model, str):
        return ShapeModel(shape=ModelShape.preset(model))
    if isinstance(model, ModelShape):
        return ShapeModel(shape=model)
    if hasattr(model, "workload"):
        return model
    from cost.graph import GraphModel  # torch: only for traced graphs

    graph = getattr(model, "graph", None)
    if graph is None:
        return GraphModel.from_traced(model)  # not a graph: raises the explanation
    key = len(graph.nodes)
    cached = _ANALYSED.get(model)
    if cached is None or cached[0] != key:
        cached = (key, GraphModel.from_traced(model))
        _ANALYSED[model] = cached
    return cached[1]


def _candidates(cfg: ParallelConfig, model: Priced) -> Iterator[ParallelConfig]:
    """Every completion of the None fields of a validated config (step 3)."""
    per_rank = cfg.global_batch // cfg.dp
    micro = [cfg.micro_batch] if cfg.micro_batch else [b for b in range(1, per_rank + 1)
                                                         if per_rank % b == 0]  # fmt: skip
    per_stage = -(-model.layers // cfg.pp)
    interleave = cfg.pp > 1 and per_stage > 1
    schedules = [cfg.schedule] if cfg.schedule else (["interleaved", "1f1b"] if interleave
                                                     else ["1f1b"])  # fmt: skip
    recomputes = [cfg.recompute] if cfg.recompute else ["none", "selective", "full"]
    for schedule in schedules:
        virtuals = [cfg.virtual_stages or 1] if schedule == "interleaved" else [1]
        if schedule == "interleaved" and not cfg.virtual_stages:
            # chunks may be uneven, but every one of the pp·v stages holds a block (as the
            # search's settings: the stage cut has no empty stage)
            virtuals = [v for v in range(2, min(per_stage, 16) + 1) if cfg.pp * v <= model.layers]
        for b in micro:
            for v in virtuals:
                for r in recomputes:
                    yield replace(cfg, micro_batch=b, schedule=schedule, virtual_stages=v,
                                  recompute=r)  # fmt: skip


def price(model: Priced, cluster: Cluster, cfg: ParallelConfig,
          work: Workload | None = None) -> Estimate:  # fmt: skip
    """Price one fully specified configuration; `work` may be passed in when already built
    (it depends on the micro-batch, not on schedule or recompute)."""
    b = cfg.micro_batch
    work = work or model.workload(cfg, b, cluster.gpu)
    m = cfg.global_batch // (cfg.dp * b)
    dp_expert = cfg.shard_degree // cfg.ep if cfg.shard_group else cfg.data_parallel // cfg.ep
    ranks = pipeline_shares(work, cfg, cluster, schedule=cfg.schedule,
                            virtual=cfg.virtual_stages, micro_batches=m)  # fmt: skip
    memory = rank_memory(work, pp=cfg.pp, zero=cfg.zero, dp_dense=cfg.shard_degree,
                         dp_expert=dp_expert, schedule=cfg.schedule, micro_batches=m,
                         virtual=cfg.virtual_stages, recompute=cfg.recompute,
                         capacity=cluster.gpu.hbm_bytes, grad_bytes=cfg.grad_bytes,
                         weight_bytes=cfg.weight_bytes, ranks=ranks,
                         reshard_after_forward=cfg.reshard_after_forward,
                         gather_bytes=cfg.gather_bytes,
                         defer_grad_sync=cfg.defer_grad_sync,
                         pp_buffers=cfg.pp_buffers)  # fmt: skip
    step = step_time(work, cfg, cluster, micro_batches=m, schedule=cfg.schedule,
                     virtual=cfg.virtual_stages, recompute=cfg.recompute, ranks=ranks)  # fmt: skip
    return Estimate(model=model.name, cluster=cluster, config=cfg, memory=memory, step=step,
                    tokens_per_step=float(cfg.global_batch * model.seq),
                    flops_per_token=model.flops_per_token(), micro_batches=m, work=work,
                    shape=getattr(model, "shape", None))  # fmt: skip


def estimate(
    model, cluster: Cluster | None = None, config: ParallelConfig | None = None
) -> Estimate:
    """Price `model` on `cluster` under `config`, choosing the fields left None (see module)."""
    priced = as_priced(model)
    cluster = cluster or Cluster.default()
    config = config or ParallelConfig(global_batch=cluster.world_size)
    if config.dp is None:
        rest = config.tp * config.pp * config.cp
        config = replace(config, dp=max(1, cluster.world_size // rest))
    validate(config, cluster, priced.layers, priced.heads, priced.g, priced.seq, priced.experts)
    best: Estimate | None = None
    works: dict[int, Workload] = {}
    for cand in _candidates(config, priced):
        if cand.micro_batch not in works:
            works[cand.micro_batch] = priced.workload(cand, cand.micro_batch, cluster.gpu)
        est = price(priced, cluster, cand, works[cand.micro_batch])
        if best is None or _better(est, best):
            best = est
    return best


def _better(a: Estimate, b: Estimate) -> bool:
    if a.fits != b.fits:
        return a.fits
    if a.fits:
        return a.step_time_s < b.step_time_s
    return a.memory_per_rank < b.memory_per_rank
