"""Parallel configuration of a training step and its checks against model and cluster.

Mesh order (outermost first): pp, dp, cp, tp — Megatron's layout: tensor parallelism on
contiguous ranks (inside a node), pipeline stages farthest apart. Expert parallelism splits the
data-parallel axis: dp = dp_expert · ep with ep the inner part.

Algorithm (`validate`):
1. Every degree is >= 1 and the product tp·pp·dp·cp equals the cluster's GPU count.
2. tp fits in a node unless the user allows crossing nodes; heads divide by tp, and so do
   the KV heads when there are at least tp of them (else they are replicated).
3. Every one of the pp·v pipeline chunks gets a unit: a layer, or with pp the embedding or
   the head alone (Llama 3's schedule: the first chunk holds only the embedding, the last
   only the output projection and the loss); uneven splits are allowed (the slowest stage
   holds ⌈L/(p·v)⌉·v layers); ep divides dp and the expert count; the sequence divides
   by 2·cp (zig-zag chunks); the global batch divides by dp·micro_batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost.errors import CostInputError
from cost.hardware import Cluster

SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "flash1", "flash2", "unfused")
KERNELS = ("fused", "eager")
SELECTIVE = ("attention", "matmuls")
# a pipeline rank's boundary transfers per micro-batch and chunk, as they reach the step:
# "paired" (Megatron's send_forward_recv_backward / send_backward_recv_forward, torch's
# batched P2P: a send and a receive at once, two transfer times), "serial" (DeepSpeed's
# pipeline engine: SendGrad, RecvActivation, RecvGrad, SendActivation as four blocking ops)
P2P_TRANSFERS = {"paired": 2, "serial": 4}
# ZeRO-1's gradient synchronisation: "reduce_scatter" (each rank receives the reduced shard
# it steps: Megatron's distributed optimizer, torch's ZeRO), "all_reduce" (the whole
# gradient reduced, then each rank steps its shard: DeepSpeed's BF16_Optimizer, which its
# pipeline engine all-reduces as `get_grads_for_reduction()`, the fp32 accumulators)
GRAD_SYNC = ("reduce_scatter", "all_reduce")
# what a pipeline runtime holds beyond the in-flight micro-batches' saved tensors
# (`cost.memory.pipeline_buffers`): "torch" (torch.distributed.pipelining, autopar's runtime:
# a receive buffer per micro-batch, allocated once and kept, for the activations of every
# stage but the first and the gradients of every stage but the last; a stage's output held
# for its backward), "torch_2024" (as "torch", and every stage keeps its output of every
# micro-batch until the step ends: `output_chunks`, appended on every stage until torch PR
# 153383 of May 2025, the last stage's, the logits, kept for `step()`'s merged return),
# "in_flight" (Megatron, DeepSpeed: receive tensors freed or reused, outputs freed once sent)
PP_BUFFERS = ("torch", "torch_2024", "in_flight")
# when ZeRO-3's backward gathers the next layer's weights (torch FSDP1's BackwardPrefetch):
# "pre" before the current layer's gradient computation (BACKWARD_PRE, FSDP1's default; FSDP2
# and autopar's runtime always), "post" after it (BACKWARD_POST: "This overlaps the current
# reduce-scatter and the next gradient computation", torch's FSDP docs -- the gather itself
# then stands between two layers' backward, exposed; Composer's default)
BACKWARD_PREFETCH = ("pre", "post")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Degrees of parallelism and step settings; a field left None is chosen by `estimate`
    to minimise step time (dp: whatever GPUs remain).

    `attention` "unfused" materialises the s×s scores (pre-FlashAttention kernels); "flash"
    is a fused kernel at its score GEMM's efficiency (FlashAttention-3, cuDNN, or
    FlashAttention-2 on the Ampere it was written for); "flash2" is FlashAttention-2 (torch
    SDPA's flash backend) on any GPU, capped at the GPU's `fa2_fraction` of its peak;
    "flash1" is FlashAttention v1 (flash-attn 1.x), at its published measured throughput on
    the GPU (`GPU.flash1_flops`);
    `overlap_grad_reduce` overlaps data-parallel gradient reduction with backward;
    `sequence_parallel` shards norms/dropout activations over tp (Megatron-SP);
    `tp_across_nodes` permits a tp group larger than a node.
    Model-shape pricing only (a traced graph is priced from its own ops):
    `kernels` "eager" runs the norms, rotary embedding, SwiGLU and GQA head repeat as separate
    PyTorch ops (the Llama reference code unfused; `cost.workload.eager_bytes`), "fused" as
    one kernel each (Megatron / Transformer Engine, or torch.compile);
    `selective` which ops selective recompute replays: "attention" (Megatron: the attention
    core) or "matmuls" (torchtitan's op-level policy: every matmul output but every second
    one, and attention's, is saved; all else is recomputed);
    `checkpoint_every` k > 1 under full recompute checkpoints one layer in k (torchtitan's
    selective layer option k); the others keep all their activations;
    `tp_overlap` pipelines Megatron's per-layer tp collectives with the layer's GEMMs
    (True or "userbuffers": Megatron's userbuffers, 4 chunks; "micro_pipeline": torch's
    micro-pipelined tp, torchtitan's AsyncTP, one chunk a tp rank and a local sum after each
    reduce-scatter, the backward's reduce-scatters unfused; `cost.step.overlapped_tp`,
    `cost.step.tp_time`); a solved tp plan's collectives stay exposed;
    `tp_gather_bytes` 1: the tp all-gathers move FP8 activations (torchao's Float8 tp styles);
    `defer_grad_sync` (pp, ZeRO >= 2): whole-stage gradient accumulators held across the
    micro-batches and one reduce-scatter after the last backward (FSDP2 under torch's
    pipeline schedules);
    `loss_kernels` the loss's kernels when they differ from the blocks' (torchtitan compiles
    the blocks only: its loss runs eager); `reshard_after_forward` False keeps every block's
    ZeRO-3 weights gathered from forward into backward (FSDP2's option; torchtitan sets it
    under pp), True frees them after forward but a stage's last block (autopar's runtime);
    `pp_p2p` how a pipeline rank's boundary transfers reach the step (`P2P_TRANSFERS`);
    `grad_sync` ZeRO-1's gradient collective (`GRAD_SYNC`); every gradient collective moves
    `grad_bytes` per element; `pp_buffers` what the pipeline runtime holds besides the
    in-flight micro-batches' saved tensors (`PP_BUFFERS`); `backward_prefetch` when ZeRO-3's
    backward gathers the next layer's weights (`BACKWARD_PREFETCH`).
    """

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    cp: int = 1
    ep: int = 1
    zero: int = 1
    global_batch: int
    micro_batch: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    recompute: str | None = None
    sequence_parallel: bool = True
    attention: str = "flash"
    overlap_grad_reduce: bool = True
    tp_across_nodes: bool = False
    grad_bytes: int = 4  # gradient element size: fp32 (Megatron's default) or 2 (bf16)
    weight_bytes: int = 2  # 2: bf16 weights + fp32 master in the optimizer; 4: fp32 throughout
    gemm_bytes: int = 2  # element size the linear layers' GEMMs run in: 2 bf16, 1 FP8 (scaled)
    # bytes per parameter of a layer's ZeRO-2/3 weight all-gather: 2 (16-bit); less where FP8
    # linears' weights are gathered in float8 (1 byte each; autopar.ops.fp8 step 4)
    gather_bytes: float = 2.0
    # HSDP: ZeRO-3 shards over groups of this many data-parallel ranks (consecutive, inside a
    # node when it divides one) and all-reduces gradients across the replicas; None: one group
    shard_group: int | None = None
    kernels: str = "fused"
    selective: str = "attention"
    checkpoint_every: int = 1
    tp_overlap: bool | str = False  # True / "userbuffers", or "micro_pipeline"
    # bytes per element of Megatron-SP's activation all-gathers (forward input, backward
    # output gradient): 1 where FP8 linears cast before the gather (torchao's
    # Float8ColwiseParallel / Float8RowwiseParallel / PrepareFloat8ModuleInput); the
    # reduce-scatters stay 16-bit
    tp_gather_bytes: int = 2
    # under pp, ZeRO-2/3 gradients accumulate unsharded over the micro-batches (in the
    # gradient dtype: FSDP2's fp32 `unsharded_accumulated_grad`) and are reduce-scattered once
    # after the last backward; the weights stay gathered from the first forward to then
    # (torch.distributed.pipelining's `backward_maybe_with_nosync` on an FSDP2 stage)
    defer_grad_sync: bool = False
    loss_kernels: str | None = None  # None: as `kernels`
    # an eager loss runs torch's DTensor `loss_parallel` decomposition over vocab-split logits
    # (torchtitan's default under tp): its backward holds more per logit (`cost.workload`)
    loss_parallel: bool = False
    reshard_after_forward: bool = True
    pp_p2p: str = "paired"
    grad_sync: str = "reduce_scatter"
    pp_buffers: str = "torch"
    backward_prefetch: str = "pre"

    def __post_init__(self) -> None:
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("recompute", self.recompute, RECOMPUTE)
        _choice("attention", self.attention, ATTENTION)
        _choice("kernels", self.kernels, KERNELS)
        _choice("loss_kernels", self.loss_kernels, KERNELS)
        _choice("selective", self.selective, SELECTIVE)
        _choice("pp_p2p", self.pp_p2p, tuple(P2P_TRANSFERS))
        _choice("grad_sync", self.grad_sync, GRAD_SYNC)
        _choice("pp_buffers", self.pp_buffers, PP_BUFFERS)
        _choice("backward_prefetch", self.backward_prefetch, BACKWARD_PREFETCH)
        if self.grad_sync == "all_reduce" and self.zero != 1:
            raise CostInputError(f"grad_sync='all_reduce' is ZeRO-1's choice (stage 0 always "
                                 f"all-reduces, 2 and 3 reduce-scatter), got zero={self.zero}")
        if self.tp_overlap not in (False, True, "userbuffers", "micro_pipeline"):
            raise CostInputError(f"tp_overlap must be False, True, 'userbuffers' or "
                                 f"'micro_pipeline', got {self.tp_overlap!r}")  # fmt: skip
        if self.zero not in (0, 1, 2, 3):
            raise CostInputError(f"zero stage must be 0, 1, 2 or 3, got {self.zero}")
        if self.grad_bytes not in (2, 4):
            raise CostInputError(f"gradients are 2 (bf16) or 4 (fp32) bytes, got {self.grad_bytes}")
        if self.gemm_bytes not in (1, 2):
            raise CostInputError(f"GEMMs run in 1 (FP8) or 2 (bf16) bytes, got {self.gemm_bytes}")
        if not 1 <= self.gather_bytes <= 2:
            raise CostInputError(f"weight gathers move 1 to 2 bytes per parameter, got "
                                 f"{self.gather_bytes}")  # fmt: skip
        if self.tp_gather_bytes not in (1, 2):
            raise CostInputError(f"tp activation gathers move 1 (FP8) or 2 (bf16) bytes per "
                                 f"element, got {self.tp_gather_bytes}")  # fmt: skip
        if self.weight_bytes not in (2, 4):
            raise CostInputError(f"weights are 2 (bf16) or 4 (fp32) bytes, got {self.weight_bytes}")
        degrees = {"tp": self.tp, "pp": self.pp, "dp": self.dp or 1, "cp": self.cp,
                   "ep": self.ep, "global_batch": self.global_batch,
                   "micro_batch": self.micro_batch or 1,
                   "virtual_stages": self.virtual_stages or 1,
                   "checkpoint_every": self.checkpoint_every}  # fmt: skip
        bad = [f"{k}={v}" for k, v in degrees.items() if v < 1]
        if bad:
            raise CostInputError(f"parallel degrees must be >= 1, got {', '.join(bad)}")

    @property
    def data_parallel(self) -> int:
        """Ranks that share a dense gradient: dp · cp."""
        return (self.dp or 1) * self.cp

    @property
    def shard_degree(self) -> int:
        """Ranks a sharded (ZeRO) state is split over: dp · cp, or the HSDP shard group."""
        return min(self.shard_group or self.data_parallel, self.data_parallel)

    @property
    def whole_grads(self) -> bool:
        """Whether ZeRO-2/3 gradients stay whole over the micro-batches and are reduced once
        after the last (`defer_grad_sync` under pp), not reduce-scattered each micro-batch."""
        return self.defer_grad_sync and self.pp > 1 and self.zero >= 2


def _choice(field: str, value: str | None, allowed: tuple[str, ...]) -> None:
    if value is not None and value not in allowed:
        raise CostInputError(
            f"{field} must be one of {', '.join(allowed)} (or None), got {value!r}"
        )


def validate(cfg: ParallelConfig, cluster: Cluster, layers: int, heads: int, kv_heads: int,
             seq: int, experts: int) -> None:  # fmt: skip
    """Raise `CostInputError` naming the first inconsistency between config, model and cluster."""
    world = cfg.tp * cfg.pp * (cfg.dp or 1) * cfg.cp
    if world != cluster.world_size:
        raise CostInputError(
            f"tp·pp·dp·cp = {cfg.tp}·{cfg.pp}·{cfg.dp}·{cfg.cp} = {world} but the cluster has "
            f"{cluster.world_size} GPUs ({cluster.nodes} nodes × {cluster.gpus_per_node}); "
            "change the degrees or the node count (leave dp=None to fill the cluster)"
        )
    if cfg.tp > cluster.gpus_per_node and not cfg.tp_across_nodes:
        raise CostInputError(
            f"tp={cfg.tp} is larger than a node ({cluster.gpus_per_node} GPUs); lower tp or pass "
            "tp_across_nodes=True to accept tensor parallelism over the inter-node fabric"
        )
    _divides("heads", heads, "tp", cfg.tp)
    if kv_heads >= cfg.tp:
        _divides("kv_heads", kv_heads, "tp", cfg.tp)
    chunks = cfg.pp * (cfg.virtual_stages or 1)
    units = layers + 2 if cfg.pp > 1 else layers  # with pp the embedding and head are units
    if units < chunks:
        raise CostInputError(
            f"{layers} layers cannot fill pp·virtual_stages = {chunks} pipeline chunks "
            f"({units} units with the embedding and the head); lower pp or virtual_stages"
        )
    _divides("seq", seq, "2·cp", 2 * cfg.cp if cfg.cp > 1 else 1)
    _divides("dp", cfg.dp or 1, "ep", cfg.ep)
    _divides("experts", experts, "ep", cfg.ep)
    _divides("global_batch", cfg.global_batch, "dp·micro_batch",
             (cfg.dp or 1) * (cfg.micro_batch or 1))  # fmt: skip


def _divides(what: str, value: int, by_name: str, by: int) -> None:
    if value % by:
        raise CostInputError(
            f"{what} ({value}) is not divisible by {by_name} ({by}); choose {by_name} to divide "
            f"{value}"
        )
