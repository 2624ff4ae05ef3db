"""The data axis: each dp rank runs the program of the mesh without dp on its slice of the batch.

Algorithm (:func:`compile_data_parallel`):
1. Split the global batch (the driver, :func:`split_batch`): dim 0 of every tensor input (and
   keyword input) must divide by dp (times the micro-batch count under pp); the example
   inputs are sliced to B/dp and traced once.
2. Compile the sub-mesh program (tp, cp, ep and/or pp) from that trace; every dp rank runs
   it.  Under cp the cp ranks join the data axis's gradient reduction (torchtitan's FSDP
   over ``dp_shard_cp``): the cp program leaves its dense parameters' gradients partial
   (``context_parallel.leave_grads_to_data_axis``; under pp every stage, its boundary values
   crossing split over cp) and ZeRO shards and reduces over the flattened dp x cp group,
   once; the loss stays a mean (or sum) over the global tokens.
3. Read the loss's meaning off the traced graph's final reduction (a cross-entropy's reduction
   argument, a mean or a sum): a mean over the global batch stays a mean (gradients averaged
   over dp), a sum stays a sum (gradients summed).
4. Price model state per rank for each ZeRO stage (weights, gradients, optimizer state
   divided over the ZeRO group: dp, or dp x cp; with the saved activations of the sub-mesh
   plan) and pick the lowest stage that fits the memory
   limit (the GPU's memory unless ``memory_limit`` is given); a forced stage that does not fit
   is an error naming the stage that would.  A given ``memory_limit`` also reaches the
   sub-mesh (tp) solver: a stage whose fastest sub-mesh plan does not fit re-solves that plan
   under the limit, with the model state counted as the stage holds it (``_fit_sub_mesh``).
5. List the data-axis traffic per step as torch's engines run it: ZeRO-0 one all-reduce per
   gradient; ZeRO-1 the same plus the updated shards gathered after the optimizer step
   (ZeroRedundancyOptimizer broadcasts them); ZeRO-2 a forward all-gather of the parameters
   and a reduce-scatter of the gradients (= one all-reduce); ZeRO-3 also re-gathers the
   parameters in backward (1.5x DDP).  ZeRO-2/3 gather and reduce one repeated block at a
   time (runtime.shard_per_block); with ``param_dtype`` 16-bit the gathers move 16-bit.
6. Statistics over the batch that feed a non-linear loss term (an MoE load-balancing loss)
   become global over dp where they are computed: the ``global_batch`` pass
   (passes/global_batch.py) on a copy of each of the sub-mesh program's materialized stages
   (:func:`dp_phase`, the program's last phase); a rank's module is cut from it by codegen.
7. Predict the step time (:func:`predict_step`) with the whole-cluster search's functions
   (`cost.step`) on the program's local work (`cost.graph` on rank 0's graph) and its plan's
   tp collectives: each micro-batch (`micro_batch_time`) and the pipeline bubble, the exposed
   gradient traffic over the ZeRO group (once a rank, over all its chunks, as the search
   prices a rank) and the optimizer step.
The runtime (autopar.runtime.DataParallelModule) reuses torch's engines for the reduction.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopar.axes.batch_stats import BatchDecisions
from autopar.errors import FitError, InputError, PlanError
from autopar.mesh import Mesh
from autopar.plan import Collective, DpSection, PlanStep, ZeroMemory, _fmt_bytes
from autopar.program import Materialized, Phase, Program, program_of
from cost.memory import model_state
from cost.topology import Topology, nccl_advice
from passes import PassContext, PassRecord, batch_pipeline

ZERO_STAGES = (0, 1, 2, 3)
_MEAN, _SUM = 1, 2  # aten's reduction enum
_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d_forward",
           "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "kl_div"}  # fmt: skip
_PASS_THROUGH = {"div", "mul", "neg", "clone", "alias", "view", "reshape", "squeeze", "to",
                 "_to_copy", "add", "sub", "contiguous", "detach"}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class StateBytes:
    """Bytes per parameter of each part of the model state (Adam)."""

    weights: float
    grads: float
    optimizer: float

    @staticmethod
    def for_dtype(param_dtype: torch.dtype) -> StateBytes:
        """fp32: weight, gradient, two moments (4+4+8).  16-bit: 2-byte weights, fp32 gradients
        and fp32 master + two moments (2+4+12 = REFERENCE.md's 18 bytes)."""
        if param_dtype == torch.float32:
            return StateBytes(weights=4, grads=4, optimizer=8)
        return StateBytes(weights=2, grads=4, optimizer=12)


def zero_memory(params: int, dp: int, stage: int, per: StateBytes,
                activations: float, kept: int = 0, deferred: bool = False,
                buffers: float = 0.0) -> ZeroMemory:  # fmt: skip
    """Step 4: stage 1 shards the optimizer state over dp, 2 also gradients, 3 also weights
    (the cost model's ``model_state``, with this plan's element sizes); at stage 3 the
    ``kept`` parameters (:func:`kept_gathered`: the root group and the last block) are held
    whole between forward and backward.  ``deferred`` (a pipeline schedule that syncs
    FSDP2's gradients once, after its last micro-batch: zero-bubble, see
    ``autopar.runtime.PipelineRunner`` step 6): stages 2 and 3 hold the whole gradients,
    and stage 3 the whole weights, at the step's peak.  ``buffers``: of ``activations``, the
    pipeline runtime's (:func:`pipeline_buffers`), shown apart."""
    weights, grads, optimizer = model_state(params, 0.0, stage, dp, dp, grad_bytes=per.grads,
                                            weight_bytes=per.weights, optim_bytes=per.optimizer,
                                            kept=kept)  # fmt: skip
    if deferred and stage >= 2:
        grads = per.grads * params
        weights = per.weights * params if stage == 3 else weights
    return ZeroMemory(stage=stage, weights=weights, grads=grads, optimizer=optimizer,
                      activations=activations, buffers=buffers)  # fmt: skip


def choose_zero(table: Sequence[ZeroMemory], limit: float, forced: int | None,
                where: str) -> tuple[int, str]:  # fmt: skip
    """Step 4: the lowest stage that fits ``limit``, or the forced one (checked); and why."""
    fitting = [m.stage for m in table if m.total <= limit]
    if forced is not None:
        if forced not in ZERO_STAGES:
            raise PlanError(f"zero={forced!r}: ZeRO stages are 0 (DDP), 1, 2 and 3")
        if table[forced].total > limit:
            fix = (f"zero={fitting[0]} fits" if fitting
                   else "no ZeRO stage fits; add ranks or tensor/pipeline parallelism")  # fmt: skip
            raise FitError(
                f"zero={forced} does not fit {where}: {table[forced]} > limit "
                f"{_fmt_bytes(limit)}; {fix}"
            )
        return forced, f"ZeRO-{forced} as asked ({_fmt_bytes(table[forced].total)} per rank)"
    if not fitting:
        raise FitError(
            f"no ZeRO stage fits {where} in {_fmt_bytes(limit)} per rank; the smallest is "
            f"{table[-1]}; add ranks or tensor/pipeline parallelism"
        )
    stage = fitting[0]
    why = f"ZeRO-{stage}: the lowest stage whose {_fmt_bytes(table[stage].total)} per rank fits "
    why += f"{_fmt_bytes(limit)}"
    if stage:
        why += f" (ZeRO-{stage - 1} needs {_fmt_bytes(table[stage - 1].total)})"
    return stage, why


def split_batch(example_inputs: Sequence[Any], example_kwargs: dict | None, dp: int,
                micro: int = 1) -> tuple[tuple, dict]:  # fmt: skip
    """Step 1: the first of ``dp`` slices of every tensor input along dim 0."""

    def first(t: Any, name: str) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        if t.shape[0] % (dp * micro):
            times = f" x {micro} micro-batches" if micro > 1 else ""
            raise InputError(
                f"the global batch of {name} (shape {tuple(t.shape)}, batch = dim 0) does not "
                f"divide by dp={dp}{times}; use a batch that is a multiple of {dp * micro}"
            )
        return t[: t.shape[0] // dp]

    args = tuple(first(t, f"example_inputs[{i}]") for i, t in enumerate(example_inputs))
    return args, {k: first(v, f"example_kwargs[{k!r}]") for k, v in (example_kwargs or {}).items()}


def batch_slices(t: torch.Tensor, dp: int) -> list[torch.Tensor]:
    """Every dp rank's slice of a batched tensor (dim 0)."""
    return list(t.chunk(dp, dim=0)) if t.dim() else [t] * dp


def loss_reduction(gm: fx.GraphModule, model_name: str = "the model") -> str:
    """Step 3: 'mean' or 'sum' for a graph whose only output is a scalar loss reduced over the
    batch; 'sum' for any other output (the gradient of a sum over batch elements adds up)."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    leaves = [a for a in torch.utils._pytree.tree_leaves(out.args[0]) if isinstance(a, fx.Node)]
    scalars = [a for a in leaves if _is_scalar(a)]
    if not scalars:
        return "sum"
    found = {_reduction_of(s) for s in scalars}
    if None in found or len(found) > 1:
        warnings.warn(
            f"autopar could not tell whether the scalar output of {model_name} is a "
            "mean or a sum over the batch (its last op is not a loss, mean or sum); treating it "
            "as a mean: gradients are averaged over dp",
            stacklevel=3,
        )
        return "mean"
    return found.pop()


def _is_scalar(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()


def _reduction_of(node: fx.Node) -> str | None:
    for _ in range(16):
        if node.op != "call_function":
            return None
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name in _LOSSES:
            value = node.kwargs.get("reduction", _reduction_arg(node))
            return {_MEAN: "mean", _SUM: "sum"}.get(value)
        if name in ("mean", "sum"):
            return name
        args = [a for a in node.args if isinstance(a, fx.Node) and _is_scalar(a)]
        if name not in _PASS_THROUGH or len(args) != 1:
            return None
        node = args[0]
    return None


def _reduction_arg(node: fx.Node) -> int:
    schema = node.target._schema  # type: ignore[union-attr]
    names = [a.name for a in schema.arguments]
    i = names.index("reduction")
    return node.args[i] if len(node.args) > i else schema.arguments[i].default_value


def dp_collectives(grads: dict[str, tuple[tuple[int, ...], torch.dtype]], stage: int,
                   param_dtype: torch.dtype = torch.float32,
                   reduce_dtype: torch.dtype = torch.float32,
                   kept: frozenset[str] = frozenset(),
                   group: str = "dp") -> list[Collective]:  # fmt: skip
    """Step 5: the scalar loss all-reduce (over dp), then per parameter needing a gradient
    (local shape on its tp/pp coordinate) over the ZeRO ``group`` (``dp`` or ``dp_cp``);
    direction 'step' is after the optimizer step.  Parameter
    all-gathers move ``param_dtype``, gradient reductions ``reduce_dtype``, and ZeRO-1's
    post-step gather the fp32 master weights.  ZeRO-3 re-gathers in backward every parameter
    but those ``kept`` gathered from the end of forward into backward
    (:func:`kept_gathered`)."""
    kinds = {0: [("bwd", "all_reduce")],
             1: [("bwd", "all_reduce"), ("step", "all_gather")],
             2: [("fwd", "all_gather"), ("bwd", "reduce_scatter")],
             3: [("fwd", "all_gather"), ("bwd", "all_gather"), ("bwd", "reduce_scatter")]}[stage]  # fmt: skip
    loss = Collective(kind="all_reduce", axis="dp", shape=(), dtype="float32", bytes=4,
                      direction="fwd", where="loss")  # every rank returns the global loss
    out = [loss]
    for fqn, (shape, master) in grads.items():
        for direction, kind in kinds:
            if stage == 3 and fqn in kept and (direction, kind) == ("bwd", "all_gather"):
                continue
            dtype = (master if direction == "step" else
                     reduce_dtype if kind != "all_gather" else param_dtype)  # fmt: skip
            dtype = master if dtype == torch.float32 else dtype
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            out.append(Collective(kind=kind, axis=group, shape=tuple(shape),
                                  dtype=str(dtype).replace("torch.", ""), bytes=nbytes,
                                  direction=direction, where=fqn.rsplit(".", 1)[0]))  # fmt: skip
    return out


def dp_phase(mesh: Mesh, reduction: str, model: str) -> Phase:
    """Step 6: ``global_batch`` over dp on each materialized stage (the statistics over the
    batch that feed a non-linear loss term made global); a stage it finds nothing in is kept
    as it is."""
    batch = BatchDecisions(axis="dp", reduction=reduction, model=model)

    def run(i: int, stage: Materialized) -> tuple[Materialized, list[PassRecord]]:
        ctx = PassContext(mesh=mesh, grad=frozenset(), traced=stage.traced,
                          sections={"batch": batch})  # fmt: skip
        done, records = stage.rewritten(ctx, batch_pipeline("dp"))
        return (done if records[0].nodes_after != records[0].nodes_before else stage), records

    return Phase(name="global_batch", run=run)


def compile_data_parallel(mesh: Mesh, batch: int,
                          compile_inner: Callable[[float | None], Program], *,
                          zero: int | None, memory_limit: float | None,
                          param_dtype: torch.dtype = torch.float32,
                          reduce_dtype: torch.dtype = torch.float32,
                          mixed_precision: str = "cast",
                          refit: bool = True) -> Program:  # fmt: skip
    """Steps 2-6 (see the module docstring) for a global batch of ``batch`` rows; the driver
    sliced and traced it (step 1) and ``compile_inner(limit)`` builds the program of the mesh
    without dp from that one trace (``limit``: the sub-mesh solver's memory limit, None for
    none).  ``refit=False`` (a reloaded plan) keeps the sub-mesh plan as compiled (no
    re-solve under ``memory_limit``)."""
    inner, axes = join_cp(compile_inner(None))
    shard = math.prod(mesh.size(a) for a in axes)
    per = StateBytes.for_dtype(param_dtype)
    table = memory_table(inner, shard, per)
    limit = memory_limit if memory_limit is not None else mesh.cluster.gpu.hbm_bytes
    where = f"{_model_name(inner)} on {mesh}"
    resolved = None
    if memory_limit is not None and refit:
        inner, table, resolved = _fit_sub_mesh(inner, table, limit, zero, (shard, per), (
            lambda sub_limit: join_cp(compile_inner(sub_limit))[0]))  # fmt: skip
    stage, why = choose_zero(table, limit, zero, where)
    section = DpSection(
        zero=stage, reduction=loss_reduction(_graph(inner), _model_name(inner)), batch=batch,
        zero_axes=axes, memory=table, memory_limit=limit, links=tuple(mesh.describe()),
        param_dtype=_dtype_name(param_dtype), reduce_dtype=_dtype_name(reduce_dtype),
        mixed_precision=mixed_precision, step=predict_step(inner, mesh, stage, axes, param_dtype),
        notes=(why, *([resolved] if resolved else []), *_engine_note(stage, axes)),
        micro_batches=_synced_micro_batches(inner, stage),
    )  # fmt: skip
    traffic = dp_collectives(_grad_shapes(inner), stage, param_dtype, reduce_dtype,
                             kept_gathered(inner), "_".join(axes))  # fmt: skip
    plan = dataclasses.replace(inner.plan, mesh=mesh.axes, dp=section,
                               collectives=(*inner.plan.collectives, *traffic),
                               advice=nccl_advice(Topology(cluster=mesh.cluster), mesh.axes))  # fmt: skip
    return inner.then(mesh, plan, dp_phase(mesh, section.reduction, _model_name(inner)))


def _defers_sync(inner: Program) -> bool:
    """Whether ``inner``'s pipeline syncs FSDP2's gradients once, after its last micro-batch
    (the zero-bubble schedule: its weight pass runs outside autograd's hooks); every other
    schedule syncs each micro-batch (the runtime's ``PipelineRunner`` step 6)."""
    return inner.pipeline is not None and inner.pipeline.config.schedule == "zero_bubble"


def _synced_micro_batches(inner: Program, stage: int) -> int:
    """How many times a step runs ZeRO-2/3's forward/backward gathers and reduce-scatters:
    under pp every micro-batch, unless the schedule defers the sync (:func:`_defers_sync`);
    else once."""
    if stage < 2 or inner.pipeline is None or _defers_sync(inner):
        return 1
    return inner.pipeline.config.n_microbatches


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def join_cp(inner: Program) -> tuple[Program, tuple[str, ...]]:
    """Step 2: a cp program (no ep; one stage, or every pipeline stage, whose boundary values
    cross split over cp) whose dense gradients the data axis can take, and the ZeRO group
    ``("dp", "cp")``; any other sub-mesh program (or one stage that cannot leave them) as it
    is, over ``("dp",)``."""
    from autopar.axes.context_parallel import leave_grads_to_data_axis

    if inner.plan.ep or inner.mesh.size("cp") == 1:
        return inner, ("dp",)
    joined = [leave_grads_to_data_axis(st) for st in inner.stages]
    if any(st is None for st in joined):
        return inner, ("dp",)
    return program_of(inner.mesh, joined, inner.pipeline), ("dp", "cp")


def memory_table(inner: Program, dp: int, per: StateBytes) -> tuple[ZeroMemory, ...]:
    """Step 4: per-rank bytes at each ZeRO stage of sub-mesh program ``inner``: at each
    stage the rank position that needs the most (:func:`position_rows`)."""
    state = _position_state(inner)
    rows = [position_rows(inner, dp, s, per, state) for s in ZERO_STAGES]
    return tuple(max(r, key=lambda m: m.total) for r in rows)


def position_rows(inner: Program, dp: int, stage: int, per: StateBytes,
                  state: tuple | None = None) -> list[ZeroMemory]:  # fmt: skip
    """Per rank position (one per pipeline rank, holding its stages; one without pp) its
    bytes at ZeRO ``stage``: its parameters and saved activations (:func:`saved_activations`;
    under pp times the micro-batches the stage holds at its peak, plus the pipeline runtime's
    buffers: :func:`pipeline_buffers`).  Under pp each micro-batch's backward reduce-scatters
    ZeRO-2/3's gradients (the runtime's ``PipelineRunner`` step 6), except under the
    zero-bubble schedule, which holds them whole (`zero_memory`'s ``deferred``).  ``state``:
    :func:`_position_state` of ``inner`` when already computed."""
    deferred = _defers_sync(inner)
    return [zero_memory(params, dp, stage, per, saved + buffers, kept, deferred, buffers)
            for params, kept, saved, buffers in state or _position_state(inner)]  # fmt: skip


def _position_state(inner: Program) -> tuple[tuple[int, int, float, float], ...]:
    """Per rank position: (parameters, parameters kept gathered, saved activation bytes,
    pipeline buffer bytes)."""
    out = []
    for modules, held in _rank_positions(inner):
        shapes = _grad_shapes_of(modules)
        params = sum(torch.Size(s).numel() for s, _ in shapes.values())
        kept = sum(torch.Size(shapes[n][0]).numel() for n in _kept_in(modules) if n in shapes)
        out.append((params, kept, _held_activations(inner, held), pipeline_buffers(inner, held)))
    return tuple(out)


def _held_activations(inner: Program, held: list[tuple[int, float]]) -> float:
    """A rank position's saved activations at its peak: each stage's blocks times the
    micro-batches it holds; what lies after the blocks (head, loss) likewise, but once on an
    interleaved rank (its last stage runs each forward just before its backward); full
    recompute's one-layer working set once (`cost.memory._rank_breakdown`)."""
    looped = inner.pipeline is not None and inner.pipeline.config.virtual_stages > 1
    saved = working = 0.0
    for i, n in held:
        blocks, layer, post = _activation_parts(inner.stages[i])
        saved += n * blocks + (post if looped else n * post)
        working = max(working, layer)
    return saved + working


def pipeline_buffers(inner: Program, held: list[tuple[int, float]]) -> float:
    """Bytes torch.distributed.pipelining holds on a rank position besides the saved tensors
    of the micro-batches in flight (`cost.memory.pipeline_buffers`, "torch"): per stage it
    holds (index, micro-batches in flight), a receive buffer per micro-batch for its input
    activations (every stage but the first; an in-flight one is its saved input, counted
    already) and for its output gradients (every stage but the last), and the outputs of its
    in-flight micro-batches, kept for their backward; each the size the cut sends across
    that boundary (`StageCut.boundary_bytes`; a gradient buffer only for the values that
    carry a gradient, `StageCut.gradient_bytes`).  0 without pp."""
    from cost.memory import stage_buffers

    pipe = inner.pipeline
    if pipe is None:
        return 0.0
    m, last = pipe.config.n_microbatches, len(inner.stages) - 1
    sent, back = pipe.cut.boundary_bytes, pipe.cut.gradient_bytes
    return sum(stage_buffers(m, n, sent[i - 1] if i > 0 else 0.0, sent[i] if i < last else 0.0,
                             back[i] if i < last else 0.0)
               for i, n in held)  # fmt: skip


def predict_step(inner: Program, mesh: Mesh, stage: int, axes: tuple[str, ...],
                 param_dtype: torch.dtype = torch.float32,
                 gather_bytes: float = 2.0) -> PlanStep:  # fmt: skip
    """Step 7: the plan's step time.  Per rank position (`_rank_positions`) its micro-batch
    seconds (the plan's compute + communication, plus the boundary sends under pp), its
    local work (`local_work`: layers, parameters, per-layer seconds at its local shapes) for
    `cost.step.data_parallel_time` over the ZeRO group, `cost.step.optimizer_time` over
    its parameters and, where the schedule defers the gradient sync, its gradients'
    accumulation over the micro-batches (`cost.step.accumulation_time`, counted with the
    sub-mesh's compute); the slowest position sets the step.  ``gather_bytes``: bytes per
    parameter of a layer's ZeRO-2/3 weight gather (`cost.config.ParallelConfig`; less than 2
    where FP8 weights are gathered in float8)."""
    from cost.step import accumulation_time, bubble_time, data_parallel_time, optimizer_time

    pp = mesh.size("pp")
    m = inner.pipeline.config.n_microbatches if pp > 1 else 1
    v = max(inner.pipeline.config.virtual_stages, 1) if pp > 1 else 1
    deferred = pp > 1 and _defers_sync(inner)  # memory_table's
    cfg = dataclasses.replace(_step_config(mesh, stage, m), gather_bytes=gather_bytes,
                              defer_grad_sync=deferred)  # fmt: skip
    spans = _mesh_spans(mesh, axes)
    new_bytes = 2 if param_dtype in (torch.bfloat16, torch.float16) else 4  # a micro-batch's grads
    best: PlanStep | None = None
    for _, held in _rank_positions(inner):
        stages = [i for i, _ in held]
        works = [plan_work(inner.stages[i], param_dtype) for i in stages]
        per_mb = sum(_micro_batch_s(inner, i, w, mesh, cfg, spans)
                     for w, i in zip(works, stages, strict=True))  # fmt: skip
        rank = _rank_work(works)
        bare = any(w.edge_params for w in works) and not any(w.layers for w in works
                                                              if w.edge_params)  # fmt: skip
        dp = data_parallel_time(rank, cfg, mesh.cluster, micro_batches=m,
                                recompute=inner.stages[stages[0]].recompute,
                                per_stage=rank.layers, spans=spans, bare_edges=bare)  # fmt: skip
        params = sum(w.layers * w.layer_dense_params + w.edge_params for w in works)
        shard = math.prod(mesh.size(a) for a in axes) if stage >= 1 else 1
        accumulate = accumulation_time(params, m, cfg, mesh.cluster.gpu, new_bytes)
        step = PlanStep(sub_mesh=m * per_mb + accumulate, bubble=bubble_time(per_mb, pp, v), dp=dp,
                        optimizer=optimizer_time(params, shard, mesh.cluster.gpu))  # fmt: skip
        best = step if best is None or step.total > best.total else best
    return best


def _rank_work(works: list[Any]) -> Any:
    """One rank position's stages (its chunks under an interleaved schedule) as one
    `Workload` for the data axis: blocks counted together (a block's costs are alike in every
    chunk), edge tables and the seconds around the blocks summed.  The data axis is priced
    once a rank, as the search prices a rank (`cost.step._rank_step`: its blocks over all its
    chunks, one call): a chunk's gradients reduce behind the rank's later backward, so the
    step pays the one-bucket floor (ZeRO-0/1) and the step's first gather (ZeRO-3) once, not
    once a chunk."""
    if len(works) == 1:
        return works[0]
    blocks = [w for w in works if w.layers] or works
    total = lambda field: sum(getattr(w, field) for w in works)  # noqa: E731
    return dataclasses.replace(blocks[0], layers=total("layers"), pre_s=total("pre_s"),
                               post_s=total("post_s"), edge_params=total("edge_params"))


def _step_config(mesh: Mesh, stage: int, micro_batches: int) -> Any:
    from cost.config import ParallelConfig

    sizes = {a: mesh.size(a) for a in ("tp", "pp", "dp", "cp")}
    return ParallelConfig(**sizes, zero=stage, global_batch=sizes["dp"] * micro_batches,
                          micro_batch=1)  # fmt: skip


def _mesh_spans(mesh: Mesh, axes: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """(stride, size) in global rank order of each axis's group on ``mesh`` (`cost.step`'s
    spans), the data axis's being the ZeRO group ``axes`` (dp, or dp x cp: adjacent)."""
    names = [a for a, _ in mesh.axes]
    stride = {a: math.prod(mesh.size(b) for b in names[i + 1:]) for i, a in enumerate(names)}
    out = {a: (stride.get(a, 1), mesh.size(a)) for a in ("tp", "cp", "pp")}
    inner_most = min(axes, key=lambda a: stride[a])
    out["dp"] = (stride[inner_most], math.prod(mesh.size(a) for a in axes))
    return {**out, "ep": (1, 1), "dp_expert": (1, 1)}


def _micro_batch_s(inner: Program, s: int, work: Any, mesh: Mesh, cfg: Any,
                   spans: dict[str, tuple[int, int]]) -> float:  # fmt: skip
    """Seconds of one micro-batch of stage ``s``: `cost.step.micro_batch_time` (what the
    search prices a micro-batch with) on its local work and its plan's tp collectives
    (`plan_work`; a graph the cost model cannot price: its plan's compute and
    communication), plus under pp the send and receive of what its stage passes on."""
    from cost.comm import collective_time
    from cost.step import default_collective, micro_batch_time

    program = inner.stages[s]
    own = program.plan.compute_s + program.plan.comm_s
    if work is not None:
        mode = program.recompute
        compute, comm = micro_batch_time(work, cfg, default_collective(mesh.cluster), spans,
                                         mode, work.layers, 1, mesh.cluster)  # fmt: skip
        own = compute + sum(v for k, v in comm.items() if k != "pp")
    pipe = inner.pipeline
    if pipe is None:
        return own
    sent = pipe.cut.boundary_bytes[s] or (pipe.cut.boundary_bytes[s - 1] if s else 0.0)
    link = mesh.cluster.axis_link(mesh.axes, "pp")
    return own + 2 * collective_time("send_recv", sent, 2, link)


def local_work(program: Any, param_dtype: torch.dtype = torch.float32) -> Any:
    """The cost model's `Workload` of one micro-batch of ``program``'s rank program
    (``cost.graph`` on sub-mesh rank 0's graph at its local shapes, each value in its run-time
    dtype: the functions the search prices a traced model by); a cp program's ring
    attentions, which ``cost.graph`` does not know, are added as the cp pricing prices them.
    None for a graph the cost model cannot price (float64)."""
    from autopar.axes.context_parallel import ring_work
    from cost.config import ParallelConfig

    local, model = _local(program)
    if model is None:
        return None
    gpu = program.mesh.cluster.gpu
    work = model.workload(ParallelConfig(global_batch=model.batch), model.batch, gpu)
    return ring_work(local, work, gpu, param_dtype)


def local_parts(program: Any, send_dtype: torch.dtype | None = None) -> tuple[fx.GraphModule, Any]:
    """``program``'s sub-mesh rank 0 graph at its local shapes, each value marked with its
    run-time dtype, and `cost.graph`'s `GraphModel` of it (what `local_work` prices; the
    whole-cluster search's `autopar.planner.solved` prices a tp / cp degree by it, its
    pipeline boundary in ``send_dtype``); the model is None where the cost model cannot
    price the graph."""
    return _local(program, send_dtype)


def _local(program: Any, send_dtype: torch.dtype | None = None) -> tuple[fx.GraphModule, Any]:
    """A pipeline stage's inputs from the stage before carry a gradient (``grad_inputs``):
    the backward of what reads them runs, to send their gradient back."""
    from autopar.codegen import build_module
    from autopar.frontend.precision import mark_run_dtypes
    from cost.errors import CostInputError
    from cost.graph import GraphModel

    local = mark_run_dtypes(build_module(program.priced_graph, program.traced, program.mesh, 0))
    grad = frozenset(getattr(program.traced, "grad_inputs", frozenset()))
    try:
        return local, GraphModel.from_traced(local, send_dtype=send_dtype, grad_inputs=grad)
    except CostInputError:
        return local, None


def plan_work(program: Any, param_dtype: torch.dtype = torch.float32) -> Any:
    """`local_work` with the tensor-parallel collectives ``program``'s plan lists (each with
    its whole message; `cost.step.tp_time` prices them); None where `local_work` is."""
    work = local_work(program, param_dtype)
    if work is None:
        return None
    return dataclasses.replace(work, tp_collectives=tp_collectives(program.plan.collectives))


def tp_collectives(collectives: Sequence[Collective], scale: float = 1.0) -> tuple[Any, ...]:
    """The ``tp`` collectives of a plan as `cost.workload.TpCollective`s, messages times
    ``scale`` (the search's micro-batch over the traced batch); one outside the blocks is
    after them when a block's comes before it in the plan's (program) order."""
    from cost.graph import in_block
    from cost.workload import TpCollective

    out, seen_block = [], False
    for c in collectives:
        if c.axis != "tp":
            continue
        inside = in_block(c.where)
        seen_block = seen_block or inside
        out.append(TpCollective(kind=c.kind, nbytes=c.bytes * scale, forward=c.direction == "fwd",
                                in_block=inside, after=seen_block and not inside,
                                hidden_s=c.hidden_s * scale))  # fmt: skip
    return tuple(out)


def saved_activations(program: Any) -> float:
    """Bytes autograd keeps for one micro-batch of ``program``'s rank program: the cost
    model's saved-tensor count (``cost.graph``, the count the whole-cluster search prices) on
    sub-mesh rank 0's graph at its local shapes (so every split the plan chose, sequence
    parallelism included, counts) and in each value's run-time dtype, its blocks under its recompute mode plus what lies after
    them (head, loss); a graph the cost model cannot price (float64) falls back to its plan's
    memory less the fp32 model state its solver counts."""
    return sum(_activation_parts(program))


def _activation_parts(program: Any) -> tuple[float, float, float]:
    """:func:`saved_activations` in parts: (its blocks' saved bytes, full recompute's one-layer
    working set, what lies after the blocks)."""
    mode = getattr(program, "recompute", "none")
    work = local_work(program)
    if work is None:
        from autopar.codegen import build_module

        local = build_module(program.priced_graph, program.traced, program.mesh, 0)
        state = 16.0 * sum(p.numel() for p in local.parameters() if p.requires_grad)
        return max(0.0, getattr(program.plan, "memory_bytes", 0.0) - state), 0.0, 0.0
    working = work.act_bytes["none"] if mode == "full" else 0.0
    return work.layers * work.act_bytes[mode], working, work.post_act_bytes


def _rank_positions(inner: Program) -> list[tuple[list[Any], list[tuple[int, int]]]]:
    """Per rank position (each pipeline rank, or the one without pp): the modules rank 0 there
    runs (its stages'; under ep they hold this rank's experts) and per stage it holds (its
    index) the micro-batches it holds at the peak."""
    if inner.pipeline is None:
        return [([inner.module(0)], [(0, 1)])]
    config = inner.pipeline.config
    n, out = len(inner.stages), []
    for r in range(inner.mesh.size("pp")):
        rank = inner.mesh.rank_of({a: r if a == "pp" else 0 for a, _ in inner.mesh.axes})
        stages = inner.stages_of(r)
        out.append(([inner.module(rank, s) for s in stages],
                    [(s, config.in_flight(s, n)) for s in stages]))  # fmt: skip
    return out


def _fit_sub_mesh(inner: Any, table: tuple[ZeroMemory, ...], limit: float, zero: int | None,
                  shape: tuple[int, StateBytes], solve: Callable[[float], Any],
                  ) -> tuple[Any, tuple[ZeroMemory, ...], str | None]:  # fmt: skip
    """Step 4 under ``memory_limit``: for each ZeRO stage, lowest first (or the forced one),
    keep the sub-mesh plan if it fits; else re-solve the sub-mesh (tp) plan under the limit,
    its model state counted as this stage holds it: the solver's memory M (fp32 state
    unsharded + activations) must stay below limit + M - total(stage).  The first stage whose
    plan fits wins.  Sub-meshes of one rank and pipelines keep their plan."""
    stages = ZERO_STAGES if zero is None or zero not in ZERO_STAGES else (zero,)
    if inner.plan.pp or inner.plan.ep or inner.mesh.world_size == 1:
        return inner, table, None
    for stage in stages:
        if table[stage].total <= limit:
            return inner, table, None
        sub_limit = limit + inner.plan.memory_bytes - table[stage].total
        try:
            lean = solve(sub_limit)
        except PlanError:
            continue
        lean_table = memory_table(lean, *shape)
        if lean_table[stage].total <= limit:
            why = (f"the sub-mesh plan was re-solved under {_fmt_bytes(sub_limit)} per rank "
                   f"(its state at ZeRO-{stage}); its fastest plan needs "
                   f"{_fmt_bytes(table[stage].total)} there")  # fmt: skip
            return lean, lean_table, why
    return inner, table, None


def _engine_note(stage: int, axes: tuple[str, ...] = ("dp",)) -> list[str]:
    group = " x ".join(axes)
    engine = {0: "torch DDP (bucketed all-reduce overlapped with backward)",
              1: f"torch DDP + ZeroRedundancyOptimizer (optimizer state sharded over {group})",
              2: "torch FSDP2 fully_shard(reshard_after_forward=False) per block: gradients "
                 "reduce-scattered, parameters kept whole between forward and backward",
              3: "torch FSDP2 fully_shard(reshard_after_forward=True) per block (each "
                 "repeated block one group, the rest of the program another): a block's "
                 "parameters gathered just before it runs in forward and again in backward "
                 "(the next block's prefetched), freed after; gradients reduce-scattered "
                 "per block; the rest (as torch's root) and the last block, whose "
                 "backward comes first, stay gathered from the end of forward into "
                 "backward"}  # fmt: skip
    over = f" over the flattened {group} group" if len(axes) > 1 else ""
    return [f"runs on {engine[stage]}{over}"]


def _graph(inner: Any) -> fx.GraphModule:
    return inner.loss_graph


def _model_name(inner: Any) -> str:
    return inner.model_name


def kept_gathered(inner: Any) -> frozenset[str]:
    """Parameters per-block FSDP2 (``runtime.shard_per_block``) keeps gathered from the end of
    forward into backward in a rank program that has blocks: the root group (outside the
    outlined blocks; torch does so for a root) and the last block of each stage module (its
    backward starts as soon as the head's ends, so resharding it would only gather it again
    at once: torchtitan does the same).  None when the program has no blocks: then it is one
    group, resharded as any ZeRO-3 group."""
    return _kept_in(_rank_modules(inner))


def _kept_in(modules: list[Any]) -> frozenset[str]:
    from autopar.axes.recompute import block_targets, blocks_outlined
    from autopar.codegen import outline_blocks

    out: set[str] = set()
    for module in modules:
        if not isinstance(module, fx.GraphModule):
            continue
        outlined = module if blocks_outlined(module) else outline_blocks(module)
        if outlined is None:
            continue
        targets = tuple(f"{t}." for t in block_targets(outlined))
        out |= {n for n, _ in outlined.named_parameters()
                if not n.startswith(targets) or n.startswith(targets[-1])}  # fmt: skip
    return frozenset(out)


def _rank_modules(inner: Any) -> list[Any]:
    """Sub-mesh rank 0's modules (one per pipeline stage)."""
    return [inner.module(0, s) for s in range(len(inner.stages))]  # under ep: its experts' share


def _grad_shapes(inner: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Local shape and dtype of each trainable parameter on sub-mesh rank 0 (every stage)."""
    return _grad_shapes_of(_rank_modules(inner))


def _grad_shapes_of(modules: list[Any]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for module in modules:
        for name, p in module.named_parameters():
            if p.requires_grad:
                out.setdefault(name, (tuple(p.shape), p.dtype))
    return out

