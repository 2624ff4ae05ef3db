"""Memory per rank: model state, saved activations in flight, runtime reserve.

Algorithm (`rank_memory`, per pipeline rank; the most loaded one is the rank's memory):
1. The stages as the compiled pipeline cuts them (`cost.stages.pipeline_ranks`, given by
   `cost.step.pipeline_shares`): each rank's blocks (dense part ÷ tp, experts ÷ ep·tp) plus
   the embedding or LM head shard when it holds an end (without pp: all of them).
2. Model state with Adam and mixed precision: bf16 weights 2 B, fp32 gradient accumulation
   4 B (Megatron's default; 2 B with bf16 gradients), fp32 master + two moments 12 B per
   parameter — 18 B (16 B) for DDP, stage 0; fp32 training without a master copy: 4 B
   weights, 4 B gradients, 8 B moments (16 B). ZeRO-1 shards the
   12 B, ZeRO-2 also the gradients, ZeRO-3 also the weights, over the data-parallel group
   (dp·cp for dense parameters, dp·cp/ep for experts). Per-block ZeRO-3 (FSDP2, as autopar's
   runtime and torchtitan run it) keeps the root group (embedding, final norm, LM head) and
   each stage's last block gathered from the end of forward into backward: those weights
   count whole (`model_state`'s `kept`; the compiled plan's memory table passes its own); a
   table alone in a stage without blocks (`RankShare.bare_edges`) is resharded like any group.
   Without resharding after forward (FSDP2's `reshard_after_forward=False`, torchtitan's
   choice under pp) every block's weights count whole.
3. Activations: saved bytes per layer and micro-batch for the recompute mode × the rank's
   blocks (+ the fp32 logits on the rank holding the LM head) × the micro-batches in flight
   on that rank (`in_flight`: GPipe m, 1F1B min(p − r, m) on rank r, interleaved
   min(m, p + (p − 1 − 2r)/v), its warm-up's chunk forwards plus one; an interleaved head's
   logits once); full recompute also holds one layer's un-recomputed working set during
   backward. Under pp the runtime's buffers come on top
   (`pipeline_buffers`, `ParallelConfig.pp_buffers`): torch.distributed.pipelining allocates
   one receive buffer per micro-batch for a stage's input activations (all but the first
   stage; an in-flight micro-batch's is its saved input, already counted) and one for its
   output gradients (all but the last), and holds a stage's output until its backward.
4. Add a fixed reserve (CUDA context, NCCL buffers, allocator fragmentation) and compare with
   the GPU's HBM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cost.stages import RankShare, pipeline_ranks
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
    buffers: float = 0.0  # of `activations`: the pipeline runtime's buffers (`pipeline_buffers`)

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


def in_flight(schedule: str, pp: int, micro_batches: int, virtual: int, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `rank` (default the first) holds at its
    peak: GPipe all; 1F1B one per rank from it to the last (at most all); interleaved its
    warm-up's chunk forwards plus one, in micro-batches of all its chunks, p + (p − 1 − 2r)/v,
    at most all of them (`autopar.axes.pipeline.PipelineConfig.in_flight`).  An interleaved
    rank's last chunk runs each forward just before its backward: the logits of the rank
    that holds the head are counted once (`_rank_breakdown`)."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(micro_batches)
    if schedule != "interleaved":
        return float(min(pp - rank, micro_batches))
    # torch's ScheduleInterleaved1F1B and Megatron's interleaved schedule warm up with
    # (v - 1)·p + 2·(p - 1 - r) chunk forwards on rank r and run one more before its first
    # backward; from then on each forward is followed by a backward
    chunks = min(micro_batches * virtual, (virtual - 1) * pp + 2 * (pp - 1 - rank) + 1)
    return chunks / virtual


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
                capacity: float, grad_bytes: int = GRAD_BYTES, weight_bytes: int = WEIGHT_BYTES,
                ranks: Sequence[RankShare] | None = None,
                reshard_after_forward: bool = True, gather_bytes: float = WEIGHT_BYTES,
                defer_grad_sync: bool = False, pp_buffers: str = "torch") -> MemoryBreakdown:  # fmt: skip
    """Per-rank memory of the most loaded pipeline rank (see the module docstring); `ranks`
    are the ranks' shares as `cost.step.pipeline_shares` cuts them (default: cut on compute
    alone, boundaries free); `reshard_after_forward` False: every block's ZeRO-3 weights
    stay gathered into backward (FSDP2's option), held at `gather_bytes` per block parameter
    (1: FP8 linears gathered in float8); `defer_grad_sync` (pp, ZeRO >= 2): the stage's
    gradients are held whole, in their dtype, across the micro-batches (FSDP2's unsharded
    accumulator under torch's pipeline schedules) instead of sharded; `pp_buffers` the
    pipeline runtime's buffers (`pipeline_buffers`)."""
    v = virtual if schedule == "interleaved" else 1
    if ranks is None:
        unit = (work.pre_s, work.layer_fwd_s + work.layer_bwd_s, work.post_s)
        held = lambda r: in_flight(schedule, pp, micro_batches, v, r)  # noqa: E731
        ranks = pipeline_ranks(work.layers, unit, pp, v, held, 0.0)
    whole_grads = defer_grad_sync and pp > 1 and zero >= 2
    rows = [_rank_breakdown(work, share, zero, dp_dense, dp_expert, recompute, capacity,
                            grad_bytes, weight_bytes, reshard_after_forward, gather_bytes,
                            whole_grads,
                            pipeline_buffers(work, share, micro_batches, pp_buffers)
                            if pp > 1 else None)
            for share in ranks]  # fmt: skip
    return max(rows, key=lambda m: m.total)


def pipeline_buffers(work: Workload, share: RankShare, micro_batches: int,
                     pp_buffers: str = "torch") -> float:
    """Step 3 under pp: bytes pipeline rank `share`'s runtime holds besides its in-flight
    micro-batches' saved tensors, `ParallelConfig.pp_buffers` being how it keeps them.

    Derivation ("torch": torch.distributed.pipelining's `PipelineStage`, autopar's runtime):
    `_prepare_forward_infra` / `_prepare_backward_infra` allocate, for each of the m
    micro-batches, a receive buffer for the stage's input activations (every stage but the
    first) and one for its output gradients (every stage but the last), kept for the run;
    an in-flight micro-batch's input buffer is its first block's saved input (counted in the
    activations), the other m − held are not.  A stage's output (the boundary it sends) is
    held in its forward cache until its backward: held of them.  "torch_2024" (torch before
    PR 153383, May 2025) keeps every stage's output of every micro-batch until the step ends
    (`output_chunks`): m of them, the last stage's being the logits (`output_bytes`).
    "in_flight" (Megatron, DeepSpeed) holds nothing more.  Each boundary weighs the cut's
    bytes (`cut_bytes`, else `boundary_bytes`); under interleaving every chunk of the rank
    counts the rank's held micro-batches."""
    if pp_buffers == "in_flight":
        return 0.0
    sent = work.boundary_bytes if work.cut_bytes is None else work.cut_bytes
    receives = share.chunks - share.first  # chunks with a previous stage
    sends = share.chunks - share.last  # chunks with a next stage
    keeps = pp_buffers == "torch_2024"
    total = (receives * stage_buffers(micro_batches, share.held, sent, 0.0)
             + sends * stage_buffers(micro_batches, share.held, 0.0, sent, keeps=keeps))  # fmt: skip
    return total + (micro_batches * work.output_bytes if keeps and share.last else 0.0)


def stage_buffers(micro_batches: int, held: float, received: float, sent: float,
                  returned: float | None = None, keeps: bool = False) -> float:  # fmt: skip
    """One pipeline stage's share of `pipeline_buffers` ("torch"): m receive buffers of its
    input boundary (`received` bytes, 0 on the first stage) less the `held` in-flight ones
    (its saved inputs), m receive buffers of the gradient coming back over its output
    boundary (`returned`, default `sent`; 0 on the last stage), and its outputs (`sent`
    bytes) of the held micro-batches, of all m when the runtime `keeps` them to the step's
    end.  The search, the compiled memory table and the cut's fit check all price by it."""
    m = float(micro_batches)
    held = min(held, m)
    back = sent if returned is None else returned
    return (m - held) * received + m * back + (m if keeps else held) * sent


def _rank_breakdown(work: Workload, share: RankShare, zero: int, dp_dense: int, dp_expert: int,
                    recompute: str, capacity: float, grad_bytes: int,
                    weight_bytes: int, reshard: bool = True, gather_bytes: float = WEIGHT_BYTES,
                    whole_grads: bool = False, buffers: float | None = None,
                    ) -> MemoryBreakdown:  # fmt: skip
    """Steps 2-3 for one pipeline rank: its blocks and end tables, its last block per stage
    (and the tables) kept gathered under ZeRO-3, its in-flight micro-batches of activations
    (the epilogue's logits with them, as the compiled memory table counts a stage), one
    layer's working set under full recompute, and under pp its runtime's `buffers`
    (`pipeline_buffers`; None without pp)."""
    dense = share.blocks * work.layer_dense_params + share.edges * work.edge_params
    w_bytes, o_bytes = state_bytes(weight_bytes)
    kept_blocks = min(share.chunks, share.blocks) if reshard else share.blocks
    # 16-bit weights whose blocks are gathered narrower (float8) are held at that size
    narrow = gather_bytes / WEIGHT_BYTES if w_bytes == WEIGHT_BYTES else 1.0
    # the tables stay gathered with their stage's blocks; alone in a stage they are resharded
    tables = 0.0 if reshard and share.bare_edges else share.edges
    kept = tables * work.edge_params + kept_blocks * work.layer_dense_params * narrow
    weights, grads, optim = model_state(
        dense, share.blocks * work.layer_expert_params, zero, dp_dense, dp_expert, grad_bytes,
        w_bytes, o_bytes, kept,
    )
    if whole_grads:  # the unsharded accumulators replace the shards at the step's peak
        grads = grad_bytes * (dense + share.blocks * work.layer_expert_params)
    working = work.act_bytes["none"] if recompute == "full" else 0.0
    # the epilogue's logits: every held micro-batch's, but an interleaved rank's last chunk
    # runs each forward just before its backward, so it holds one's
    logits = work.post_act_bytes * (1.0 if share.chunks > 1 else share.held) if share.last else 0.0
    saved = share.held * share.blocks * work.act_bytes[recompute] + logits
    activations = saved + working if buffers is None else saved + working + buffers
    return MemoryBreakdown(weights=weights, grads=grads, optimizer=optim,
                           activations=activations, reserved=RESERVED_BYTES, capacity=capacity,
                           buffers=buffers or 0.0)  # fmt: skip
