"""Memory per rank: model state, saved activations in flight, runtime reserve.

Algorithm (`rank_memory`):
1. Parameters on the rank: the most loaded stage's ⌈L/(p·v)⌉·v layers (dense part ÷ tp, experts ÷ ep·tp) plus the
   embedding or LM head shard of an end stage.
2. Model state with Adam and mixed precision: bf16 weights 2 B, fp32 gradient accumulation
   4 B (Megatron's default; 2 B with bf16 gradients), fp32 master + two moments 12 B per
   parameter — 18 B (16 B) for DDP, stage 0; fp32 training without a master copy: 4 B
   weights, 4 B gradients, 8 B moments (16 B). ZeRO-1 shards the
   12 B, ZeRO-2 also the gradients, ZeRO-3 also the weights, over the data-parallel group
   (dp·cp for dense parameters, dp·cp/ep for experts). Per-block ZeRO-3 (FSDP2, as autopar's
   runtime and torchtitan run it) keeps the root group (embedding, final norm, LM head) and
   each stage's last block gathered from the end of forward into backward: those weights
   count whole (`model_state`'s `kept`; the compiled plan's memory table passes its own).
3. Activations: saved bytes per layer and micro-batch for the recompute mode × layers on the
   stage × micro-batches in flight on the first stage (GPipe m, 1F1B min(p, m), interleaved
   min(p, m)·(1 + (p−1)/(p·v))); full recompute also holds one layer's un-recomputed working
   set during backward. The last stage instead holds one micro-batch plus its fp32 logits.
4. Add a fixed reserve (CUDA context, NCCL buffers, allocator fragmentation) and compare with
   the GPU's HBM.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost.config import stage_layers
from cost.workload import Workload

RESERVED_BYTES = 3 * 2**30  # CUDA context + NCCL channels + fragmentation, per GPU
WEIGHT_BYTES, GRAD_BYTES, OPTIM_BYTES = 2, 4, 12


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes per rank on the most loaded stage."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    reserved: float
    capacity: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.reserved

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def rows(self) -> list[tuple[str, float]]:
        """(component, bytes) in print order, ending with the total."""
        return [("weights", self.weights), ("gradients", self.grads),
                ("optimizer", self.optimizer), ("activations", self.activations),
                ("reserved", self.reserved), ("total", self.total)]  # fmt: skip


def in_flight(schedule: str, pp: int, micro_batches: int, virtual: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(micro_batches)
    held = float(min(pp, micro_batches))
    return held * (1 + (pp - 1) / (pp * virtual)) if schedule == "interleaved" else held


def model_state(params_dense: float, params_expert: float, zero: int, dp_dense: int,
                dp_expert: int, grad_bytes: float = GRAD_BYTES, weight_bytes: float = WEIGHT_BYTES,
                optim_bytes: float = OPTIM_BYTES, kept: float = 0.0,
                ) -> tuple[float, float, float]:  # fmt: skip
    """(weights, gradients, optimizer) bytes for the parameters on one rank (step 2); the
    element sizes default to mixed precision (bf16 weights, fp32 gradients, Adam in fp32).
    At ZeRO-3 the `kept` dense parameters (held gathered into backward) count whole."""

    def shard(nbytes: float, stage: int) -> float:
        if zero < stage:
            return nbytes * (params_dense + params_expert)
        return nbytes * (params_dense / dp_dense + params_expert / dp_expert)

    held = kept * weight_bytes * (dp_dense - 1) / dp_dense if zero == 3 else 0.0
    return shard(weight_bytes, 3) + held, shard(grad_bytes, 2), shard(optim_bytes, 1)


def state_bytes(weight_bytes: int) -> tuple[int, int]:
    """(weight, optimizer) bytes per parameter: bf16 weights with an fp32 master and two
    moments (2, 12), or fp32 weights that are their own master (4, 8)."""
    return (WEIGHT_BYTES, OPTIM_BYTES) if weight_bytes == WEIGHT_BYTES else (4, 8)


def rank_memory(work: Workload, *, pp: int, zero: int, dp_dense: int, dp_expert: int,
                schedule: str, micro_batches: int, virtual: int, recompute: str,
                capacity: float, grad_bytes: int = GRAD_BYTES,
                weight_bytes: int = WEIGHT_BYTES) -> MemoryBreakdown:  # fmt: skip
    """Per-rank memory of the most loaded stage (see the module docstring)."""
    per_stage = stage_layers(work.layers, pp, virtual)
    dense = per_stage * work.layer_dense_params + work.edge_params
    w_bytes, o_bytes = state_bytes(weight_bytes)
    kept = work.edge_params + work.layer_dense_params  # the root group and the last block
    weights, grads, optim = model_state(
        dense, per_stage * work.layer_expert_params, zero, dp_dense, dp_expert, grad_bytes,
        w_bytes, o_bytes, kept,
    )
    layer = work.act_bytes[recompute]
    working = work.act_bytes["none"] if recompute == "full" else 0.0
    first = per_stage * layer * in_flight(schedule, pp, micro_batches, virtual) + working
    last = per_stage * layer + working + work.post_act_bytes
    return MemoryBreakdown(weights=weights, grads=grads, optimizer=optim,
                           activations=max(first, last), reserved=RESERVED_BYTES,
                           capacity=capacity)  # fmt: skip
