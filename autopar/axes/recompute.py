"""Activation recomputation of a rank program: ``autoparallelize(..., recompute=...)``.

The modes are the cost model's (cost/config.py RECOMPUTE): "none" keeps every activation
autograd saves; "full" keeps only each repeated block's inputs and re-runs the block's forward
in backward; "selective" (Megatron's) does not keep the unfused attention core -- the
score-shaped [.., s, s] ops between QKᵀ and ·V (cost/graph.py ``attention_core``) -- and
re-runs it.

Algorithm (steps 1-2 are the ``recompute`` pass, passes/recompute.py, the last pass on each
materialized stage before codegen shards it; this module decides and prices):
1. "full": outline the repeated blocks (:func:`autopar.codegen.outline_blocks`: each block
   one submodule holding its parameters under their own names, ops on parameters alone such
   as a replicated weight's ``grad_all_reduce`` moved into their block) and turn each block
   call into ``checkpoint(layers_0, ...)`` (``torch.utils.checkpoint``, non-reentrant).  A
   program without separable blocks is an error naming the model.
2. "selective": group the attention-core nodes into connected regions; each region whose values
   are used only after its last node becomes a submodule (``layers.0.attention_core``) called as
   ``checkpoint(...)``.  A fused SDPA has no core (it never keeps the scores): nothing to do.
3. The plan is priced (:func:`annotate`): the cost model's saved bytes and re-run forward time
   per block (cost.graph on the program's traced graph, split as its mesh splits it: the
   search's own numbers) give the memory saved and the time added; the plan's ``compute_s`` /
   ``memory_bytes`` and notes say so.

Collectives inside a checkpointed region run again during backward.  That is safe: every rank
of a group runs the same program, and autograd runs one rank's backward in an order fixed by
the graph (topological, ties by creation order), so each rank re-issues a block's forward
collectives at the same point of its backward collective sequence; a block boundary never
splits a collective from its pair (each is one node inside one region).  Collectives on other
groups (DDP's dp buckets, FSDP2's gathers, pipeline sends) keep their own per-group order.
Under FSDP2 a block's parameters are gathered by its pre-backward hook before the recompute
reads them (FSDP2 skips its forward hooks while in backward).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils.checkpoint

from autopar.codegen import outline_blocks
from autopar.errors import PlanError
from cost.config import RECOMPUTE as MODES
from cost.errors import CostInputError


class RecomputeError(PlanError):
    """The recompute mode cannot be applied to this model's program."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecomputeDecisions:
    """What the ``recompute`` pass reads (``PassContext.sections["recompute"]``)."""

    mode: str  # "none", "selective" or "full"
    model: str  # the model's name, for errors


def checkpoint(region: torch.nn.Module, *args: Any) -> Any:
    """What a recomputing program calls: ``region(*args)``, its activations not kept but
    re-run in backward (non-reentrant ``torch.utils.checkpoint``).  Inside a 16-bit cast
    program's call (``runtime.cast_call``: the parameters are their casts only while it
    runs) the re-run reads the same casts the forward read."""
    from autopar.runtime import casting

    if not casting():
        return torch.utils.checkpoint.checkpoint(region, *args, use_reentrant=False)
    read = dict(region.named_parameters(remove_duplicate=False))

    def contexts() -> tuple[Any, Any]:
        from torch.nn.utils.stateless import _reparametrize_module

        return contextlib.nullcontext(), _reparametrize_module(region, read, tie_weights=True)

    return torch.utils.checkpoint.checkpoint(region, *args, use_reentrant=False,
                                             context_fn=contexts)  # fmt: skip


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise RecomputeError(f"recompute={mode!r}: use one of {', '.join(map(repr, MODES))}")
    return mode


# ---------------------------------------------------------------- the program (steps 1-2)


def block_targets(gm: fx.GraphModule) -> list[str]:
    """The submodules a program calls as blocks: ``call_module`` targets and the regions of
    its top-level ``checkpoint`` calls, in call order."""
    from autopar.ops.compiled import compiled

    out = []
    for n in gm.graph.nodes:
        if n.op == "call_module":
            out.append(n.target)
        elif (n.op == "call_function" and n.target in (checkpoint, compiled)
              and n.args[0].op == "get_attr"):  # fmt: skip
            out.append(n.args[0].target)
    return out


def blocks_outlined(gm: torch.nn.Module) -> bool:
    """Whether ``gm``'s blocks are already outlined: a "full" recompute program (each block
    called under ``checkpoint``) or a compiled one (``compiled``; :func:`block_targets`)."""
    facts = getattr(gm, "meta", {}) if isinstance(gm, fx.GraphModule) else {}
    return facts.get("recompute") == "full" or bool(facts.get("compile"))


def _no_blocks(model: str) -> str:
    return (f"recompute='full' re-runs each repeated block in backward, but no repeated blocks "
            f"were found in {model}: it needs an indexed list of layers (nn.ModuleList / "
            "nn.Sequential, parameters named like layers.0.*, layers.1.*) whose blocks run one "
            "after another and read only their own parameters; use recompute='none', or "
            "'selective' for an unfused attention core")  # fmt: skip


def core_regions(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Connected runs of attention-core nodes (graph order) whose values are used only after
    their last node: the regions selective recompute re-runs."""
    from cost.graph import attention_core

    seq = _seq(gm)
    if seq is None:
        return []
    params = {n.name for n in gm.graph.nodes if n.op == "get_attr"}
    core = {n for n in attention_core(gm.graph, params, seq)  # a local [s, s]-shaped
            if not any(a.op == "get_attr" for a in n.all_input_nodes)}  # projection is no core
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for comp in _components(core):
        region = sorted(comp, key=pos.__getitem__)
        last = pos[region[-1]]
        late = all(pos[u] > last for n in region for u in n.users if u not in comp)
        if late and _between_matmuls(region, seq):
            out.append(region)
    return out


def _between_matmuls(region: list[fx.Node], seq: int) -> bool:
    """A region holds an attention core when a matmul in it makes the scores (QKᵀ) and another
    consumes them (·V); a lone projection that only looks [s, s]-shaped (hidden == seq) is none."""
    def scores(n: fx.Node) -> bool:
        val = n.meta.get("val")
        return isinstance(val, torch.Tensor) and tuple(val.shape[-2:]) == (seq, seq)

    matmuls = [n for n in region if _is_matmul(n)]
    makes = any(scores(n) for n in matmuls)
    uses = any(not scores(n) and any(scores(a) for a in n.all_input_nodes) for n in matmuls)
    return makes and uses


def _seq(gm: fx.GraphModule) -> int | None:
    """The sequence length: dim 1 of the first tensor input."""
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() >= 2:
            return int(val.shape[1])
    return None


def _components(core: set[fx.Node]) -> list[set[fx.Node]]:
    seen: set[fx.Node] = set()
    out = []
    for start in core:
        if start in seen:
            continue
        comp, todo = set(), [start]
        while todo:
            n = todo.pop()
            if n in comp:
                continue
            comp.add(n)
            todo += [m for m in (*n.all_input_nodes, *n.users) if m in core and m not in comp]
        seen |= comp
        out.append(comp)
    return out


def _is_matmul(n: fx.Node) -> bool:
    from cost.compute import MATMUL_OPS, op_name

    return op_name(n) in MATMUL_OPS


# ---------------------------------------------------------------- the plan (step 3)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecomputeEffect:
    """The cost model's view of one rank program's recompute mode (per micro-batch)."""

    mode: str
    blocks: int
    regions: int  # checkpointed regions (blocks, or attention cores)
    extra_s: float  # forward re-run in backward
    saved_none: float  # bytes of saved activations without recompute
    saved: float  # bytes of saved activations kept under the mode
    working: float  # bytes a re-run block holds while its backward runs ("full")

    def __str__(self) -> str:
        if self.mode == "none":
            return "recompute none: every saved activation is kept"
        if self.regions == 0 and self.mode == "full":
            return "recompute full: no repeated block here: nothing to recompute"
        if self.regions == 0:
            return ("recompute selective: nothing to recompute -- attention is a fused kernel "
                    "(SDPA keeps no [s, s] scores, it recomputes them itself), so the plan's "
                    "time and memory are unchanged")  # fmt: skip
        blocks = f"{self.regions} blocks" if self.regions > 1 else "its one block"
        what = (f"re-runs the forward of each of {blocks} in backward"
                if self.mode == "full" else
                f"re-runs the unfused attention core ({self.regions} regions) in backward")  # fmt: skip
        return (f"recompute {self.mode}: {what}: +{self.extra_s * 1e3:.3f} ms per step; saved "
                f"activations {_mib(self.saved_none)} -> {_mib(self.saved + self.working)} per "
                "rank and micro-batch" + (f" (incl. {_mib(self.working)} of one re-run block)"
                          if self.working else ""))  # fmt: skip


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def predict(traced_gm: fx.GraphModule, sizes: dict[str, int], mode: str, regions: int,
            gpu: Any) -> RecomputeEffect:
    """Step 3: the cost model's per-block saved bytes and re-run time (cost.graph, the search's
    own pricing) on the traced graph of a program, split as its mesh splits it (tp, cp)."""
    from cost.config import ParallelConfig
    from cost.graph import GraphModel

    model = GraphModel.from_traced(traced_gm)
    cfg = ParallelConfig(tp=sizes.get("tp", 1), cp=sizes.get("cp", 1), global_batch=model.batch,
                         sequence_parallel=False)  # fmt: skip
    work = model.workload(cfg, model.batch, gpu)
    layers = work.layers
    key = mode if regions else "none"
    return RecomputeEffect(
        mode=mode, blocks=layers, regions=regions, extra_s=layers * work.recompute_s[key],
        saved_none=layers * work.act_bytes["none"], saved=layers * work.act_bytes[key],
        working=work.act_bytes["none"] if key == "full" else 0.0)  # fmt: skip


def annotate(plan: Any, effect: RecomputeEffect) -> Any:
    """The plan priced with the recompute mode: time added, memory saved, a note."""
    saved = effect.saved_none - effect.saved - effect.working
    return dataclasses.replace(
        plan, compute_s=plan.compute_s + effect.extra_s,
        memory_bytes=max(plan.memory_bytes - saved, 0.0),
        notes=(*plan.notes, str(effect)))  # fmt: skip


def priced(stages: Sequence[Any], mode: str, whole: bool) -> list[Any]:
    """The stage programs (autopar.program.StageProgram) priced for recompute ``mode`` (step
    3): each a copy whose plan says the mode and its price, and whose recompute phase runs it
    (``none`` on a stage it finds nothing to recompute in).  ``whole``: the stages are one
    whole model (no pp), which must then have blocks for "full"."""
    if check_mode(mode) == "none":
        return list(stages)
    out, found = [], 0
    for stage in stages:
        regions = _regions(stage, mode, whole)
        found += regions
        out.append(_priced_one(stage, mode, regions))
    if found == 0 and mode == "full":
        raise RecomputeError(_no_blocks(stages[0].traced.model_name))
    return out


def _regions(stage: Any, mode: str, whole: bool) -> int:
    """The regions ``mode`` recomputes in ``stage`` (read off its rank 0 module)."""
    sample = stage.module(0)
    if mode != "full":
        return len(core_regions(sample))
    outlined = outline_blocks(sample)
    if outlined is None and whole:
        raise RecomputeError(_no_blocks(stage.traced.model_name))
    return len(block_targets(outlined)) if outlined is not None else 0


def _priced_one(stage: Any, mode: str, regions: int) -> Any:
    """Step 3 on one stage: its plan re-priced (or a note where the cost model cannot price
    it, e.g. float64), the mode asked recorded (reloadable)."""
    plan = stage.plan
    try:
        effect = predict(stage.traced.gm, stage.mesh.sizes, mode, regions, stage.mesh.cluster.gpu)
        plan = annotate(plan, effect)
    except CostInputError as exc:  # the cost model prices fp32/16/8
        effect = None
        plan = dataclasses.replace(plan, notes=(
            *plan.notes, f"recompute {mode} ({regions} regions), not priced: {exc}"))  # fmt: skip
    plan = dataclasses.replace(plan, recompute=mode)
    return stage.priced(plan, mode if regions else "none", effect)


# ---------------------------------------------------------------- measuring it


def saved_bytes(run: Any, exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``run()`` (a
    checkpointed region saves only its inputs), less the storages in ``exclude``
    (parameters: a weight saved by a matmul is no activation)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return sum(seen.values())


def measure_saved(prog: Any, args: tuple, kwargs: dict | None = None,
                  param_dtype: torch.dtype | None = None) -> list[int]:  # fmt: skip
    """Per rank of program ``prog`` (tp / cp), the activation bytes its forward saves,
    measured on the worker pool (:func:`saved_bytes`); ``param_dtype``: run as ``bind`` runs
    a program traced in that dtype (``mixed_precision="cast"``: autopar.runtime.cast_forward,
    whose per-step cast copies of the weights count as saved where an op keeps them)."""
    from autopar.runtime.pool import get_pool

    world = prog.mesh.world_size
    jobs = [(prog.module(r), tuple(args), dict(kwargs or {}), param_dtype) for r in range(world)]
    return get_pool(world).run(_measure_rank, prog.mesh.axes, jobs)


def _measure_rank(rank: int, groups: dict, module: torch.nn.Module, args: tuple,
                  kwargs: dict, param_dtype: torch.dtype | None = None) -> int:  # fmt: skip
    from autopar.ops import collectives
    from autopar.runtime import cast_forward

    collectives.bind(groups)
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    if param_dtype is not None:
        module = cast_forward(module, param_dtype)
    return saved_bytes(lambda: module(*args, **kwargs), params)
