"""Price a traced model: work, saved activations and communication from its torch.export graph.

Algorithm (`GraphModel.from_traced`, once per graph):
1. Find the parameters (graph signature, `p_*` placeholders or get_attr nodes) and the batch
   and sequence length (first user input, [batch, seq, ...]).
2. Group nodes into repeated blocks by module path (`layers.7.mlp.fc1` → `layers.7`); nodes
   before the first block are the embedding end, nodes after the last the head end.
3. Per node: FLOPs and bytes (`cost.compute`; bytes and peak at the dtype the node runs in
   when `meta["run_dtype"]` records it, as the compiler's `node_time` prices it), matmul
   efficiency, backward factor (`cost.compute.backward_factor`: 2.5 for SDPA, which recomputes
   its scores, 2 for other nodes on the gradient path, 0 off it; the end regions too), the
   weight bytes it reads (an embedding reads its gathered rows, not its table: per-token
   bytes, as `cost.compute.node_time` prices it), whether it is attention, and
   whether it is the unfused attention core (score-shaped [.., s, s] tensors and the matmul
   consuming them).
4. Tensor parallelism, Megatron's column/row pairing found in the graph: a parameter linear
   whose output (through dropout/views) feeds a residual `add` is row-parallel, every other
   parameter linear column-parallel; the tp region is what lies downstream of a column linear
   up to a row linear. Each row linear costs one all-reduce of its output per pass.
5. Saved activations (what autograd keeps for backward, per op: `_SAVES`, autopar's ring
   attention included; a product keeps an operand only for the other's gradient; a linear
   reading a re-gathered gather keeps its shard), deduplicated by the view base they alias; tensors in the tp region
   divide by t, the rest only with sequence parallelism. Selective recompute drops the attention-core tensors; full recompute keeps the
   block inputs only.

Limits: expert routing in a traced graph is priced as the dense compute it traces (no
expert-parallel all-to-all); ops outside `cost.compute`'s table cost nothing. The saved-tensor
rules are written for the training IR of `torch.export` (before `run_decompositions`): after
decomposition FLOPs, parameters and communication are unchanged, but copies introduced by the
decompositions make the saved-activation count approximate.

Algorithm (`GraphModel.workload`, per plan, vectorised over nodes):
1. Scale activation FLOPs and bytes by (b / traced batch) / (t · c), weight bytes by 1/t.
2. Roofline every node at once (numpy) and sum per region; a block's share is its total over
   the number of blocks. Traced efficiencies are kept (the shapes are the traced ones).
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx

from cost.compute import (
    KERNEL_LAUNCH_S,
    MATMUL_OPS,
    MEMORY_BW_FRACTION,
    backward_factor,
    node_efficiency,
    node_flops_bytes,
    op_name,
    reads_whole_inputs,
    tensors_of,
)
from cost.config import ParallelConfig
from cost.errors import CostInputError
from cost.hardware import GPU
from cost.workload import Workload

_VIEWS = {"view", "reshape", "permute", "transpose", "t", "unsqueeze",
          "squeeze", "expand", "select", "slice", "split", "split_with_sizes", "chunk",
          "unbind", "alias", "as_strided", "narrow", "unflatten", "flatten", "contiguous",
          "detach", "getitem", "mT", "mH", "adjoint", "matrix_H", "swapaxes", "swapdims",
          "movedim", "moveaxis"}  # fmt: skip
_PASS_THROUGH = _VIEWS | {"dropout", "mul", "div", "_to_copy", "to", "clone"}
# op → (argument indices autograd saves, whether it saves its output); norms and SDPA also
# save fp32 per-row statistics (_STATS_BYTES per row).
_SAVES: dict[str, tuple[tuple[int, ...], bool]] = {
    "linear": ((0,), False), "addmm": ((1, 2), False), "mm": ((0, 1), False),
    "bmm": ((0, 1), False), "matmul": ((0, 1), False), "baddbmm": ((1, 2), False),
    "layer_norm": ((0,), False), "rms_norm": ((0,), False), "group_norm": ((0,), False),
    "softmax": ((), True), "log_softmax": ((), True), "gelu": ((0,), False), "silu": ((0,), False),
    "softplus": ((0,), False), "mish": ((0,), False), "elu": ((), True), "relu": ((), True),
    "tanh": ((), True), "sigmoid": ((), True), "exp": ((), True), "rsqrt": ((), True),
    "sqrt": ((), True), "log": ((0,), False), "pow": ((0,), False), "mul": ((0, 1), False),
    "div": ((0, 1), False), "embedding": ((1,), False), "cross_entropy_loss": ((0, 1), False),
    "scaled_dot_product_attention": ((0, 1, 2), True),
    # autopar's ring attention (autopar.ops.cp_ops): q, k, v and the merged output with its
    # log-sum-exp (the one-node ring saves its own; the per-step ring's last node takes them)
    "ring_attention": ((0, 1, 2), True), "ring_attention_out": ((0, 1, 2, 3, 4), False),
    # autopar's fused 16-bit RMSNorm (autopar.ops.norms): its input in its own dtype and its
    # weight (as the weight multiply it replaces keeps it: nothing when a parameter)
    "rms_norm_16": ((0, 1), False),
}  # fmt: skip
_BILINEAR = {"mul", "div", "mm", "bmm", "matmul"}  # products: each operand kept for the other's gradient
_STATS_BYTES = {"layer_norm": 8, "rms_norm": 4, "group_norm": 8, "scaled_dot_product_attention": 4,
                "ring_attention": 4, "rms_norm_16": 4}  # fmt: skip
_BLOCK = re.compile(r"^(.*?\.\d+)(\.|$)")


# ParallelConfig options that describe kernels a model shape cannot show; a traced graph is
# priced from its own ops, so it refuses them rather than ignore them (their defaults)
SHAPE_ONLY = {"attention": "flash", "gemm_bytes": 2, "kernels": "fused", "loss_kernels": None,
              "selective": "attention", "checkpoint_every": 1}  # fmt: skip
_FLAGS = {"attention": " (--attention)", "gemm_bytes": " (--fp8)"}  # the CLI's spellings


def shape_only(cfg: ParallelConfig, name: str) -> None:
    """Raise when `cfg` sets a `SHAPE_ONLY` option for the traced model `name`."""
    for option, default in SHAPE_ONLY.items():
        value = getattr(cfg, option)
        if value != default:
            raise CostInputError(
                f"{option}={value!r}{_FLAGS.get(option, '')} prices a model shape's kernels; "
                f"the traced model {name!r} "
                f"is priced from its own ops (its SDPA, matmul dtypes and saved tensors), so "
                f"the option would be ignored: leave {option} at {default!r}, or price a model "
                f"shape (--model NAME or --layers/--hidden/...) to use it")


@dataclass(frozen=True, kw_only=True, eq=False)
class GraphModel:
    """A traced model reduced to per-node arrays; `workload` prices a plan from them."""

    name: str
    layers: int
    heads: int
    kv_heads: int
    seq: int
    batch: int
    experts: int = 1
    arrays: dict[str, np.ndarray] = field(repr=False)
    params: dict[str, float] = field(repr=False)
    saved: dict[str, float] = field(repr=False)
    comm: dict[str, float] = field(repr=False)

    @property
    def g(self) -> int:
        return self.kv_heads

    @staticmethod
    def from_traced(traced, name: str = "traced", *, send_dtype: torch.dtype | None = None,
                    grad_inputs: frozenset[str] = frozenset()) -> GraphModel:
        """From a `torch.export.ExportedProgram` or its (lifted or unlifted) `GraphModule`.
        `send_dtype`: the 16-bit dtype a pipeline sends activations in under mixed precision
        (`boundary_bytes`); `grad_inputs`: inputs that carry a gradient (a pipeline stage's
        activations from the stage before), so their consumers' backward runs."""
        if isinstance(traced, torch.export.ExportedProgram):
            gm, sig = traced.graph_module, traced.graph_signature
            params, inputs = set(sig.inputs_to_parameters), set(sig.user_inputs)
        elif isinstance(traced, torch.fx.GraphModule):
            gm, named = traced, dict(traced.named_parameters())
            nodes = list(gm.graph.nodes)
            params = {n.name for n in nodes if (n.op == "get_attr" and n.target in named)
                      or (n.op == "placeholder" and n.name.startswith("p_"))}  # fmt: skip
            inputs = {n.name for n in nodes if n.op == "placeholder"
                      and not n.name.startswith(("p_", "b_", "c_"))}  # fmt: skip
        else:
            raise CostInputError(
                f"cannot price a {type(traced).__name__}: pass a ModelShape, a preset name, or "
                "torch.export.export(model, args, strict=False) (an ExportedProgram)"
            )
        return _analyse(gm.graph, params, inputs, name, send_dtype, grad_inputs)

    def node_times(self, share: float, t: int, gpu: GPU) -> np.ndarray:
        """Roofline seconds of every node for `share` of the traced sequences split over t."""
        a = self.arrays
        peak = np.vectorize(gpu.sustained_flops, otypes=[float])(a["dtype"].astype(int))
        # torch SDPA's FlashAttention-2 (`sdpa_efficiency`) on the SDPA nodes
        eff = np.where(a["sdpa"] > 0, gpu.fa2_efficiency(a["eff"], a["dtype"].astype(int)), a["eff"])
        compute = a["flops"] * share / t / (peak * eff)
        moved = a["act_bytes"] * share / t + a["weight_bytes"] / t
        memory = moved / (gpu.hbm_bw * MEMORY_BW_FRACTION)
        roof = np.maximum(np.maximum(compute, memory), KERNEL_LAUNCH_S)
        return np.where(a["launch"] > 0, roof, 0.0)

    def workload(self, cfg: ParallelConfig, b: int, gpu: GPU) -> Workload:
        """Per-rank, per-micro-batch work of this graph under `cfg` (vectorised roofline);
        a model-shape-only option set away from its default is an error (`shape_only`)."""
        shape_only(cfg, self.name)
        a, t, per = self.arrays, cfg.tp, self.layers
        share = b / self.batch / cfg.cp  # this rank's sequences / tokens before tp
        times = self.node_times(share, t, gpu)
        block = a["region"] == 1

        def layer_sum(values: np.ndarray, mask: np.ndarray = block) -> float:
            return float(values[mask].sum()) / per

        fwd = layer_sum(times)
        s, sp = self.saved, t if cfg.sequence_parallel else 1
        kept = share * (s["inner"] / t + s["outer"] / sp) / per
        return Workload(
            layers=per, layer_fwd_s=fwd, attn_fwd_s=layer_sum(times, block & (a["attn"] > 0)),
            layer_bwd_s=layer_sum(times * a["bwd"]),
            recompute_s={"none": 0.0, "selective": layer_sum(times, block & (a["core"] > 0)),
                         "full": fwd},
            pre_s=float((times * (1 + a["bwd"]))[a["region"] == 0].sum()),
            post_s=float((times * (1 + a["bwd"]))[a["region"] == 2].sum()),
            tp_bytes=self.comm["tp_bytes"] * share, tp_calls=round(self.comm["tp_calls"]),
            cp_bytes=self.comm["kv_bytes"] * share / t / per, cp_calls=cfg.cp - 1,
            ep_bytes=0.0, ep_calls=0, boundary_bytes=self.comm["boundary"] * share / sp,
            act_bytes={"none": kept + share * s["core"] / t / per, "selective": kept,
                       "full": share * s["inputs"] / sp / per},
            post_act_bytes=s["post"] * share / t,
            attn_out_bytes=self.comm["attn_out"] * share / t / per,
            layer_dense_params=self.params["block"] / per / t, layer_expert_params=0.0,
            edge_params=_edges(self.params["pre"], self.params["post"], cfg.pp) / t,
        )  # fmt: skip

    def flops_per_token(self) -> tuple[float, float]:
        """(PaLM: 3 × forward FLOPs, Megatron: 4 × block + 3 × edge forward FLOPs) per token."""
        a = self.arrays
        tokens = self.batch * self.seq
        block = float(a["flops"][a["region"] == 1].sum())
        edges = float(a["flops"][a["region"] != 1].sum())
        return 3 * (block + edges) / tokens, (4 * block + 3 * edges) / tokens


def _edges(pre: float, post: float, pp: int) -> float:
    """Parameters outside the blocks on the most loaded stage: both ends share it when pp = 1."""
    return pre + post if pp == 1 else max(pre, post)


def _name(node: torch.fx.Node) -> str | None:
    if node.op == "call_function" and node.target is operator.getitem:
        return "getitem"
    return op_name(node)


def in_block(path: str) -> bool:
    """Whether module path `path` lies in a repeated block (`layers.7.mlp` does)."""
    return _BLOCK.match(path) is not None


def _block_key(node: torch.fx.Node) -> str | None:
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        match = _BLOCK.match(path)
        if match:
            return match.group(1)
    return None


def _shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _out_bytes(node) -> float:
    """Bytes of a node's tensors; a single tensor at ``node.meta["run_dtype"]`` when the caller
    recorded the dtype it has at run time (a mixed-precision program's autocast dtype)."""
    vals = tensors_of(node.meta.get("val")) if isinstance(node, torch.fx.Node) else []
    run = node.meta.get("run_dtype") if len(vals) == 1 else None
    return float(sum(v.numel() * (run or v.dtype).itemsize for v in vals))


class _Walk:
    """Per-graph facts the analysis shares: parameters, alias bases, regions, tp region, core."""

    def __init__(self, graph: torch.fx.Graph, params: set[str], inputs: set[str],
                 grad_inputs: frozenset[str] = frozenset()):
        self.nodes = [
            n for n in graph.nodes if n.op in ("placeholder", "call_function", "get_attr")
        ]
        self.params = {n for n in self.nodes if n.name in params}
        self.inputs = [n for n in self.nodes if n.name in inputs]
        # parameters, buffers and constants: weights to read, never saved activations
        self.fixed = {n for n in self.nodes if n.op != "call_function" and n.name not in inputs}
        self.keys = {n: _block_key(n) for n in self.nodes if n.op == "call_function"}
        self.base: dict[torch.fx.Node, torch.fx.Node] = {}
        for n in self.nodes:
            src = n.args[0] if n.args else None
            is_view = _name(n) in _VIEWS and isinstance(src, torch.fx.Node)
            self.base[n] = self.base.get(src, src) if is_view else n
        self.grad: set[torch.fx.Node] = set()  # values that depend on a parameter
        for n in self.nodes:
            if n in self.params or n.name in grad_inputs or (n.op == "call_function"
                                    and any(a in self.grad for a in n.all_input_nodes)):  # fmt: skip
                self.grad.add(n)
        self.row = {m for n in self.nodes if _name(n) == "add" and not self._bias_add(n)
                    for a in n.args if (m := self._producer(a, n)) is not None}  # fmt: skip
        self.inside: set[torch.fx.Node] = set()
        for n in self.nodes:
            column = self.param_matmul(n) and n not in self.row
            if column or (n not in self.row and any(a in self.inside for a in n.all_input_nodes)):
                self.inside.add(n)

    def param_matmul(self, node: torch.fx.Node) -> bool:
        """A matmul with a weight operand (directly or through a view, as `mm(x, t(w))`)."""
        operands = node.all_input_nodes
        return _name(node) in MATMUL_OPS and any(self.base.get(a) in self.params for a in operands)

    def _bias_add(self, node: torch.fx.Node) -> bool:
        """`add(linear(x, w), b)`: the bias of a linear autopar's tracing split off."""
        return _name(node) == "add" and any(
            isinstance(a, torch.fx.Node) and self.base.get(a) in self.params for a in node.args[1:2]
        )

    def _producer(self, arg, add: torch.fx.Node) -> torch.fx.Node | None:
        """The parameter matmul feeding residual `add` through dropout/scale/view ops, if any:
        its output must hold the add's elements with the same last dim (a rotary
        `q·cos + ...` add works on head-dim rows, and is no row-parallel output)."""
        while isinstance(arg, torch.fx.Node) and (_name(arg) in _PASS_THROUGH
                                                  or self._bias_add(arg)):  # fmt: skip
            arg = arg.args[0]
        if not isinstance(arg, torch.fx.Node) or not self.param_matmul(arg):
            return None
        mine, theirs = _shape(arg) or (), _shape(add) or ()
        same = math.prod(mine) == math.prod(theirs) and mine[-1:] == theirs[-1:]
        return arg if same else None


def _regions(walk: _Walk) -> dict[torch.fx.Node, int]:
    """0 before the first block node, 1 from it to the last block node, 2 after."""
    calls = [n for n in walk.nodes if n.op == "call_function"]
    inside = [i for i, n in enumerate(calls) if walk.keys[n]]
    if not inside:
        return dict.fromkeys(calls, 1)
    return {n: 0 if i < inside[0] else 2 if i > inside[-1] else 1 for i, n in enumerate(calls)}


def _is_scores(node: torch.fx.Node, seq: int) -> bool:
    """Shaped like the [.., s, s] attention scores: what selective recompute does not keep."""
    return (_shape(node) or ())[-2:] == (seq, seq)


def _is_core(node: torch.fx.Node, seq: int, walk: _Walk) -> bool:
    """Unfused attention core, the work selective recompute repeats: the score-shaped ops and
    the matmul consuming scores (a fused SDPA keeps no scores: nothing to recompute there)."""
    if _is_scores(node, seq):
        return True
    consumes_scores = any(_is_scores(a, seq) for a in node.all_input_nodes)
    return _name(node) in MATMUL_OPS and not walk.param_matmul(node) and consumes_scores


def _run_scale(node: torch.fx.Node) -> tuple[float, int]:
    """(bytes moved per traced byte, element size of the peak) of a node that runs in
    ``meta["run_dtype"]`` (as `cost.compute.node_time` prices it); (1, 2) when none is
    recorded: bf16 peak, traced bytes."""
    run, vals = node.meta.get("run_dtype"), tensors_of(node.meta.get("val"))
    if run is None or not vals:
        return 1.0, 2
    return run.itemsize / vals[0].element_size(), min(max(run.itemsize, 2), 4)


def _saved(node: torch.fx.Node, walk: _Walk) -> list[tuple[object, float]]:
    """(identity, bytes) of what autograd saves for this node's backward (params excluded)."""
    name = _name(node)
    if name == "dropout":  # a 1-byte mask per element of its (first) output
        return [((node, "mask"), float(tensors_of(node.meta.get("val"))[0].numel()))]
    if name == "vocab_parallel_cross_entropy":  # autopar.ops.parallel_ops: fp32 exp(logits - max)
        val = tensors_of(node.args[0].meta.get("val"))[0]  # per local logit, and per row its
        rows = val.numel() / val.shape[-1]  # [sum-exp, target logit], index and two masks
        return [((node, "exp"), 4.0 * val.numel()), ((node, "rows"), 18.0 * rows)]
    if name not in _SAVES:
        return []
    args, output = _SAVES[name]
    if name in ("mul", "div") and not all(isinstance(a, torch.fx.Node) for a in node.args[:2]):
        return []  # scaling by a constant saves nothing
    kept = [node.args[i] for i in args if i < len(node.args) and _needed(node, i, walk)]
    kept = [_shard_of(a) for a in kept if isinstance(a, torch.fx.Node) and a not in walk.fixed]
    out = [(walk.base[a], _out_bytes(walk.base[a])) for a in kept]
    if output:
        out.append((walk.base[node], _out_bytes(walk.base[node])))
    if name in _STATS_BYTES:
        val = tensors_of(node.args[0].meta.get("val"))[0]
        out.append(((node, "stats"), _STATS_BYTES[name] * val.numel() / val.shape[-1]))
    return out


def _shard_of(value: torch.fx.Node) -> torch.fx.Node:
    """What autograd keeps of ``value``: the shard it was gathered from when the program keeps
    that and re-gathers it in backward (``meta["regather"]``, autopar.planner.overlap step 4:
    only linears read such a gather), else the value itself."""
    if value.meta.get("regather") and isinstance(value.args[0], torch.fx.Node):
        return value.args[0]
    return value


def _needed(node: torch.fx.Node, i: int, walk: _Walk) -> bool:
    """Whether autograd keeps argument ``i`` of a product (`_BILINEAR`): an operand is kept for
    the other operand's gradient, so only when that one needs a gradient (``q * cos`` keeps
    ``cos``, not ``q``); a quotient also keeps its divisor for its own gradient."""
    name = _name(node)
    if name not in _BILINEAR or len(node.args) < 2:
        return True
    a, b = node.args[0], node.args[1]
    other = b if i == 0 else a
    return other in walk.grad or (name == "div" and i == 1 and b in walk.grad)


def _no_op(node: torch.fx.Node) -> bool:
    """`contiguous` of a value already contiguous (a pipeline stage's sent output): it returns
    its input, copying nothing."""
    src = node.args[0] if node.args else None
    val = src.meta.get("val") if isinstance(src, torch.fx.Node) else None
    return (_name(node) == "contiguous" and isinstance(val, torch.Tensor)
            and val.is_contiguous())  # fmt: skip


def _node_arrays(walk: _Walk, regions: dict, seq: int) -> dict[str, np.ndarray]:
    """Per call node: FLOPs, activation / weight bytes, efficiency, backward factor, flags."""
    rows = []
    for n in regions:
        flops, moved = node_flops_bytes(n)
        weights = sum(_out_bytes(a) for a in n.all_input_nodes if a in walk.fixed)
        weights = weights if reads_whole_inputs(n) else 0.0  # an embedding: per-token bytes
        scale, peak = _run_scale(n)
        eff = node_efficiency(n)
        bwd = backward_factor(_name(n), n in walk.grad)
        launch = 1.0 if (flops or moved) and not _no_op(n) else 0.0
        core = _is_core(n, seq, walk)
        sdpa = _name(n) == "scaled_dot_product_attention"
        attn = core or sdpa
        rows.append((flops, (moved - weights) * scale, weights * scale, eff, bwd, launch,
                     regions[n], float(core), float(attn), peak, float(sdpa)))  # fmt: skip
    keys = ("flops", "act_bytes", "weight_bytes", "eff", "bwd", "launch", "region", "core", "attn",
            "dtype", "sdpa")  # fmt: skip
    cols = np.array(rows, dtype=np.float64).reshape(-1, len(keys)).T
    return dict(zip(keys, cols, strict=True))


def _saved_totals(walk: _Walk, regions: dict, seq: int) -> dict[str, float]:
    """Saved bytes (traced shapes) split into tp-region / outer / attention core / post, plus
    the bytes entering each block (what full recompute keeps)."""
    totals = dict.fromkeys(("inner", "outer", "core", "post", "inputs"), 0.0)
    seen: set = set()
    for n, region in regions.items():
        for ident, nbytes in _saved(n, walk):
            if ident in seen or region == 0:
                continue
            seen.add(ident)
            owner = ident[0] if isinstance(ident, tuple) else ident
            kind = "post" if region == 2 else (
                "core" if _is_scores(owner, seq)
                else "inner" if owner in walk.inside else "outer")  # fmt: skip
            totals[kind] += nbytes
    entering = {(walk.keys.get(n), a) for n in regions for a in n.all_input_nodes
                if walk.keys.get(n) and a not in walk.fixed and walk.keys.get(a) != walk.keys.get(n)}  # fmt: skip
    totals["inputs"] = sum(_out_bytes(a) for _, a in entering)
    return totals


def _unit_of(walk: _Walk, regions: dict) -> dict[torch.fx.Node, int]:
    """Each call node's pipeline unit (`passes.pipeline_split.cuttable_units`): 0 the nodes
    before the first block, then one per block in order (glue between blocks stays with the
    block before it), then the nodes after the last block."""
    order: dict[str, int] = {}
    out, current = {}, 0
    for n, region in regions.items():
        key = walk.keys.get(n)
        if region == 1 and key and key not in order:
            order[key] = len(order) + 1
        current = order.get(key, current) if region == 1 else current
        out[n] = 0 if region == 0 else current if region == 1 else -1
    return {n: (len(order) + 1 if u == -1 else u) for n, u in out.items()}


def _recomputable(walk: _Walk) -> set[torch.fx.Node]:
    """Call nodes computed from weights, buffers and constants alone, off the gradient path
    (RoPE tables, a constant mask): a pipeline stage recomputes them instead of receiving.
    A rank program's `device_of` (where to make an `arange`) reads no value."""
    free: set[torch.fx.Node] = set()
    for n in walk.nodes:
        if n.op != "call_function" or n in walk.grad:
            continue
        if _name(n) == "device_of" or all(a in free or a in walk.fixed for a in n.all_input_nodes):
            free.add(n)
    return free


def _sent_bytes(node: torch.fx.Node, walk: _Walk, send_dtype: torch.dtype | None) -> float:
    """Bytes of a boundary value as a pipeline sends it (`passes.pipeline_split.boundary_dtype`):
    a floating activation with a gradient in `send_dtype` when that is narrower, any other
    value (token ids, labels, masks) in its own dtype."""
    total = 0.0
    for v in tensors_of(node.meta.get("val")):
        dtype = v.dtype
        if (send_dtype is not None and dtype.is_floating_point and node in walk.grad
                and v.dim() > 0 and send_dtype.itemsize < dtype.itemsize):  # fmt: skip
            dtype = send_dtype
        total += v.numel() * dtype.itemsize
    return total


def _boundary(walk: _Walk, regions: dict, send_dtype: torch.dtype | None) -> float:
    """Bytes a pipeline stage sends on per micro-batch at the traced batch: the values live
    across a cut between units (made before it, read after it: the residual stream, a loss
    target passed through), recomputable values left out, averaged over the cuts between
    units (`passes.pipeline_split.boundary_bytes`, one number for identical blocks).

    1. Number the units (`_unit_of`); a user input is made before unit 0.
    2. For every value the last unit reading it (the graph's output reads after all units).
    3. A value made in unit u and last read in unit w crosses the cuts u+1 .. w."""
    unit = _unit_of(walk, regions)
    free = _recomputable(walk)
    end = max(unit.values(), default=0) + 1
    last: dict[torch.fx.Node, int] = {}
    output = {u for n in walk.nodes for u in n.users if u.op == "output"}
    for n in [*walk.nodes, *output]:
        at = unit.get(n, end)
        for a in n.all_input_nodes:
            if (a in unit or a in walk.inputs) and a not in free:
                last[a] = max(last.get(a, -1), at)
    crossing = [0.0] * (end + 1)
    for a, read in last.items():
        for cut in range(unit.get(a, -1) + 1, read + 1):
            crossing[cut] += _sent_bytes(a, walk, send_dtype)
    inner = crossing[1:end]
    return sum(inner) / len(inner) if inner else 0.0


def _analyse(graph: torch.fx.Graph, params: set[str], inputs: set[str], name: str,
             send_dtype: torch.dtype | None = None,
             grad_inputs: frozenset[str] = frozenset()) -> GraphModel:  # fmt: skip
    """Reduce a graph to a `GraphModel` (module docstring, steps 1–5)."""
    walk = _Walk(graph, params, inputs, grad_inputs)
    users = walk.inputs
    if not users or not _shape(users[0]):
        raise CostInputError("the traced graph has no tensor input to read batch and sequence from")
    shape = _shape(users[0])
    batch, seq = shape[0], shape[1] if len(shape) > 1 else 1
    regions = _regions(walk)
    blocks = {k for k in walk.keys.values() if k}
    sdpa = [n for n in regions if _name(n) == "scaled_dot_product_attention"]
    rows = [n for n in walk.row if regions.get(n) == 1]
    layers = max(len(blocks), 1)
    param_region: dict[torch.fx.Node, int] = {}
    for n in regions:
        for a in n.all_input_nodes:
            if walk.base.get(a) in walk.params:
                param_region.setdefault(walk.base[a], regions[n])
    numel = {p: _out_bytes(p) / p.meta["val"].element_size() for p in param_region}
    heads = _shape(sdpa[0].args[0])[-3] if sdpa else 0
    kv_heads = _shape(sdpa[0].args[1])[-3] if sdpa else 0
    return GraphModel(
        name=name, layers=layers, heads=heads, kv_heads=kv_heads, seq=seq, batch=batch,
        arrays=_node_arrays(walk, regions, seq),
        params={k: sum(v for p, v in numel.items() if param_region[p] == i)
                for i, k in enumerate(("pre", "block", "post"))},
        saved=_saved_totals(walk, regions, seq),
        comm={"tp_calls": len(rows) / layers,
              "tp_bytes": sum(_out_bytes(n) for n in rows) / max(len(rows), 1),
              "kv_bytes": sum(_out_bytes(a) for n in sdpa for a in n.args[1:3]),
              "attn_out": sum(_out_bytes(n) for n in sdpa),
              "boundary": _boundary(walk, regions, send_dtype)},
    )  # fmt: skip


def attention_core(graph: torch.fx.Graph, params: set[str], seq: int) -> set[torch.fx.Node]:
    """The unfused attention-core nodes of `graph` (`_is_core`: what selective recompute
    repeats); `params` names the parameter nodes, `seq` the sequence length."""
    walk = _Walk(graph, params, set())
    return {n for n in walk.nodes if n.op == "call_function" and _is_core(n, seq, walk)}
