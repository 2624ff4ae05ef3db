"""Run programs inside a distributed job: bind mesh axes to torch DeviceMesh process groups.

:func:`bind` turns a compiled program into what this rank runs: its module, its pipeline
runner (a pp axis) or its data-parallel wrapper (DDP / FSDP2 over dp, a dp axis).

Algorithm (:func:`bind_mesh`):
1. Check the job's world size equals the mesh size (a mismatch would hang in the first
   collective, so it is an error up front), and that every group the plan placed inside a node
   shares one host (:mod:`autopar.runtime.placement`).
2. Bind each named mesh dim to its process group (NCCL on GPU, Gloo on CPU, as the DeviceMesh
   was built) for the collectives in the per-rank program.
3. Return this rank's global rank in the mesh (row-major coordinates).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import MeshError
from autopar.ir.layout import Shard, parse_placement
from autopar.mesh import Mesh
from autopar.ops import collectives
from autopar.runtime.guards import StepInputs


def bind(prog: Any, device_mesh: Any, mesh: Mesh, param_dtype: torch.dtype,
         mixed_precision: str = "cast") -> Any:  # fmt: skip
    """This rank's runnable form of ``prog`` on ``device_mesh`` (the mesh ``mesh`` names).
    Without a dp or pp axis, a 16-bit ``param_dtype`` under ``mixed_precision="cast"`` is
    applied here (:func:`cast_forward`)."""
    from autopar.errors import PlanError

    if "dp" in mesh.sizes:
        return wrap_data_parallel(device_mesh, prog, mesh)
    rank = bind_mesh(device_mesh, mesh, prog.collectives())
    if "pp" in mesh.sizes:
        return PipelineRunner(prog.share(rank), device_mesh.get_group("pp"))
    if param_dtype != torch.float32 and mixed_precision == "cast":
        return cast_forward(prog.module(rank), param_dtype)
    if "ep" not in mesh.sizes and param_dtype != torch.float32:
        raise PlanError(f"param_dtype={param_dtype} with mixed_precision='autocast' is applied by "
                        f"the data-parallel and pipeline runtimes; on {mesh} use "
                        "mixed_precision='cast' (the default), or add a dp or pp axis")  # fmt: skip
    return prog.module(rank)


def cast_forward(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Make ``module`` (a program traced in ``dtype``: ``mixed_precision="cast"``) run as FSDP2's
    ``MixedPrecisionPolicy(param_dtype=dtype)`` runs a module it does not shard: each call casts
    every floating parameter to ``dtype`` once (the cast's backward returns the gradient to the
    fp32 parameter, the optimizer's master) and every floating input, then runs the body with
    the casts in the parameters' places.  Replaces the instance's ``forward`` (DDP's hooks and
    the parameter names stay the module's); returns ``module``."""
    from autopar.codegen import ready

    body = ready(module).forward
    low = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731

    def forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, low, (args, kwargs))
        return cast_call(module, body, dtype, args, kwargs)

    module.forward = forward
    return module


def cast_call(module: torch.nn.Module, body: Any, dtype: torch.dtype, args: tuple,
              kwargs: dict) -> Any:  # fmt: skip
    """``body(*args, **kwargs)`` with every floating parameter of ``module`` replaced by its
    ``dtype`` cast (one cast per tensor: tied weights share it)."""
    from torch.nn.utils.stateless import _reparametrize_module

    casts: dict[int, torch.Tensor] = {}
    swapped = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if p.is_floating_point() and p.dtype != dtype:
            if id(p) not in casts:
                casts[id(p)] = p.to(dtype)
            swapped[name] = casts[id(p)]
    with _reparametrize_module(module, swapped, tie_weights=True):
        _CASTING.append(dtype)
        try:
            return body(*args, **kwargs)
        finally:
            _CASTING.pop()


_CASTING: list[torch.dtype] = []  # the dtypes of the cast_call bodies running now (innermost last)


def casting() -> bool:
    """Whether a :func:`cast_call` body is running: the parameters a module reads now are
    its casts (what a recomputing region must read again in backward)."""
    return bool(_CASTING)


def bind_mesh(device_mesh: Any, mesh: Mesh, plan_collectives: Sequence[Any] = (),
              force_placement: bool | None = None) -> int:  # fmt: skip
    """Bind ``device_mesh``'s named dims to the collectives and return this rank (steps 1-3).
    ``plan_collectives``: the plan's, to price a forced misplacement (``force_placement``)."""
    from autopar.runtime.placement import check_placement

    check_world(mesh)
    check_placement(device_mesh, mesh, plan_collectives, force=force_placement)
    names = device_mesh.mesh_dim_names
    groups = {name: device_mesh.get_group(name) for name in names}
    groups.update(_shared_groups(device_mesh))
    collectives.bind(groups)
    coords = {name: device_mesh.get_local_rank(name) for name in names}
    return mesh.rank_of(coords)


def _shared_groups(device_mesh: Any) -> dict[str, Any]:
    """This rank's sub-groups of every mesh dim (``collectives.shared_groups``; every rank
    creates every one, in the same order)."""
    from autopar.runtime.placement import axis_groups

    layout = torch.as_tensor(device_mesh.mesh).cpu()
    me, mine = dist.get_rank(), {}
    for i, name in enumerate(device_mesh.mesh_dim_names):
        for key, ranks in collectives.shared_groups(name, axis_groups(layout, i)):
            group = dist.new_group(ranks)
            if me in ranks:
                mine[key] = group
    return mine


def check_world(mesh: Mesh) -> None:
    """Step 1: the job's world size must equal the mesh size."""
    if not dist.is_initialized():
        raise MeshError("torch.distributed is not initialised; launch with torchrun")
    world = dist.get_world_size()
    if world != mesh.world_size:
        raise MeshError(
            f"the job has {world} processes but {mesh} needs {mesh.world_size}; launch "
            f"with torchrun --nproc-per-node={mesh.world_size} (or resize the mesh)"
        )


def _stage_kwargs(program: torch.fx.GraphModule, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword inputs the first stage's program takes: a non-tensor one it does not take
    (a flag such as HF's ``use_cache=False``) was a constant when the model was traced, and
    the split left it out of every stage, so it is not passed on (torch's schedule hands every
    keyword to the stage)."""
    takes = {n.target for n in program.graph.nodes if n.op == "placeholder"}
    return {k: v for k, v in kwargs.items() if k in takes or isinstance(v, torch.Tensor)}


class PipelineRunner:
    """This rank's share of a pipelined program, run by torch.distributed.pipelining.

    Algorithm (:meth:`step`):
    1. Every stage the rank holds becomes a ``PipelineStage`` over the pipeline-axis group; the
       schedule (GPipe, 1F1B, interleaved 1F1B, interleaved zero-bubble) splits the batch into
       micro-batches and runs forward and backward; the last stage's output is the loss.
    2. Gradients of a weight held by several stages (tied embeddings) are summed across them.
    3. The mean micro-batch loss is broadcast from the last stage, so every rank returns it.
    4. Mixed precision (the config's ``param_dtype`` 16-bit; :func:`mixed_precision_stage`):
       under ``mixed_precision="cast"`` each stage (traced in ``param_dtype``) runs with its
       weights cast once per step (by FSDP2 under ZeRO-2/3, else by the stage itself) and
       sends its values in the dtypes they were traced in; under "autocast" each stage
       computes under autocast with fp32 weights and the activations it sends on, and their
       gradients coming back, cross in ``param_dtype`` (``passes.pipeline_split.boundary_dtype``,
       as the cut's boundary bytes are priced).
    With a data axis each stage module is wrapped by DDP / FSDP2 over its ZeRO group (dp, or
    dp x cp flattened: :class:`DataAxis`); under FSDP2 over dp x cp the last stage's loss
    gradient is scaled by cp (FSDP2 averages, cp's partial sums must be summed).
    5. Every step records this rank's schedule as it ran: one (pipeline rank, 'F' | 'B',
       micro-batch, start s, end s) event per forward and backward chunk (a zero-bubble weight
       pass counts as 'B'), timed from the step's start (:attr:`events`;
       :meth:`gather_events` collects every pipeline rank's for ``prog.report(measured=...)``).
    6. ZeRO-2/3 keep their promise under the schedule: torch's schedules turn FSDP2's
       gradient sync and reshard-after-backward off until the last micro-batch
       (``backward_maybe_with_nosync``), so a stage would hold its whole gradients, and from
       its first backward its whole weights, for the step -- ZeRO-1's memory at more traffic.
       Each FSDP2 stage therefore runs inside a plain module (:class:`_SyncEachMicroBatch`):
       every micro-batch's backward reduce-scatters its gradients into the shards and
       reshards its weights, as the plan's memory table and step time price it
       (``data_parallel.memory_table``, ``cost.step``: a gather and a reduce-scatter per layer
       per micro-batch).  The zero-bubble schedule keeps torch's deferral: its weight pass
       runs outside autograd's hooks, so only the schedule's own post-backward reduces, and
       the plan counts that stage's gradients and weights whole.
    """

    def __init__(self, share: RankShare, pp_group: Any, device: str = "cpu",
                 data: DataAxis | None = None) -> None:  # fmt: skip
        from torch.distributed.pipelining import PipelineStage

        self.share, self.pp_group, self.data = share, pp_group, data
        self.stage_ids = sorted(share.modules)
        self.modules = share.modules
        if data is not None and data.zero >= 2 and share.tied_shapes:
            raise MeshError("ZeRO-2/3 with pipeline stages that share a tied weight is not "
                            "supported yet; use zero=0 or 1, or untie the weights")  # fmt: skip
        dtype, mode = share.config.param_dtype, share.config.mixed_precision
        sharded = data is not None and data.zero >= 2  # FSDP2 casts the gathered weights
        wrapped = {s: data.wrap(m, dtype) if data else m for s, m in self.modules.items()}
        self.modules = {s: _unwrapped(m) for s, m in wrapped.items()}  # ZeRO-2/3 run per-block
        last = share.n_stages - 1
        if sharded and share.config.schedule != "zero_bubble":  # step 6
            wrapped = {s: _SyncEachMicroBatch(m) for s, m in wrapped.items()}
        if data is not None and data.grad_scale != 1 and last in wrapped:
            wrapped[last] = _ScaledLoss(wrapped[last], data.grad_scale)
        io = {s: tuple(_on_wire(specs, share.config.autocast_dtype) for specs in share.io[s])
              for s in self.stage_ids}  # fmt: skip
        if dtype != torch.float32:
            for s in self.stage_ids:
                mixed_precision_stage(self.modules[s], share.io[s], io[s], dtype, device,
                                      mode=mode, cast_weights=not sharded)  # fmt: skip
        self.stages = [
            PipelineStage(
                wrapped[s],
                s,
                share.n_stages,
                torch.device(device),
                input_args=_examples(io[s][0], device),
                output_args=_examples(io[s][1], device),
                group=pp_group,
            )
            for s in self.stage_ids
        ]  # shapes given up front: inferring them would run a stage on uninitialised ids
        self.events: list[tuple[int, str, int, float, float]] = []
        self._t0 = 0.0
        for stage in self.stages:
            self._time_chunks(stage)
        self.schedule = _schedule(share.config, self.stages)

    def _time_chunks(self, stage: Any) -> None:
        """Step 5: wrap ``stage``'s chunk methods to record when each ran."""
        rank = self.share.coords.get("pp", 0)
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                           ("backward_weight_one_chunk", "B")):  # fmt: skip
            run = getattr(stage, name)

            def timed(chunk: int, *args: Any, _run: Any = run, _kind: str = kind,
                      **kwargs: Any) -> Any:  # fmt: skip
                start = time.perf_counter() - self._t0
                out = _run(chunk, *args, **kwargs)
                self.events.append((rank, _kind, chunk, start, time.perf_counter() - self._t0))
                return out

            setattr(stage, name, timed)

    def gather_events(self) -> list[tuple[int, str, int, float, float]]:
        """Every pipeline rank's events of the last step (collective over the pipeline group:
        every rank calls it), each rank timed from its own step start."""
        gathered: list[Any] = [None] * dist.get_world_size(self.pp_group)
        dist.all_gather_object(gathered, self.events, group=self.pp_group)
        return sorted(e for events in gathered for e in events)

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for m in self.modules.values() for p in m.parameters()]

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One schedule over the batch (steps 1-3, 5); returns the loss on every rank.  The
        call is checked first on every rank (``autopar.runtime.guards.StepInputs``)."""
        self.share.inputs.check(args, kwargs)
        self.events, self._t0 = [], time.perf_counter()
        losses: list[torch.Tensor] = []
        dummy = torch.zeros(self.share.config.n_microbatches)
        first = 0 in self.stage_ids
        if first:
            kwargs = _stage_kwargs(self.modules[0], kwargs)
            self.schedule.step(*args, target=dummy, losses=losses, return_outputs=False, **kwargs)
        else:
            self.schedule.step(target=dummy, losses=losses, return_outputs=False)
        self._sum_tied_grads()
        loss = self._broadcast_loss(losses)
        if self.data is not None:
            dist.all_reduce(loss, group=self.data.group)
            loss /= self.data.size if self.data.reduction == "mean" else 1
        return loss

    def optimizer(self, cls: type, **kwargs: Any) -> torch.optim.Optimizer:
        """``cls`` over this rank's stage parameters (state sharded over dp for ZeRO-1)."""
        return make_optimizer(self.parameters(), cls, self.data, **kwargs)

    def train_step(self, optimizer_factory: Any) -> Any:
        """A callable ``step(*batch) -> loss`` that also updates the parameters."""
        opt = optimizer_factory(self.parameters())

        def step(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = self.step(*args, **kwargs)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return step

    def _sum_tied_grads(self) -> None:
        """Stages may split a tied weight differently: sum whole gradients over the pipeline
        group (ranks without a copy add zeros, so no extra process group is needed), re-split."""
        for fqn, shape in sorted(self.share.tied_shapes.items()):
            copies = [(s, self.modules[s].get_parameter(fqn)) for s in self.stage_ids
                      if _has(self.modules[s], fqn)]  # fmt: skip
            total = torch.zeros(shape)
            for s, p in copies:
                total += _whole(p.grad, self.share.placements[s][fqn])
            dist.all_reduce(total, group=self.pp_group)
            for s, p in copies:
                p.grad = _local(total, self.share.placements[s][fqn])

    def _broadcast_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        holder = (self.share.n_stages - 1) % self.share.mesh.size("pp")
        value = (torch.stack([x.detach().float() for x in losses]).mean() if losses
                 else torch.zeros(()))  # fmt: skip
        src = dist.get_global_rank(self.pp_group, holder)
        dist.broadcast(value, src=src, group=self.pp_group)
        return value


class _SyncEachMicroBatch(torch.nn.Module):
    """An FSDP2 stage inside a plain module (step 6): torch's schedules defer only an
    ``FSDPModule`` stage's gradient sync, so this one reduce-scatters its gradients and
    reshards its weights in every micro-batch's backward (FSDP2's own hooks), and the
    schedule scales the accumulated shards by the micro-batch count at the end."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class _ScaledLoss(torch.nn.Module):
    """The last stage with its loss's gradient scaled by ``scale`` (FSDP2 averages over a
    dp x cp group whose cp ranks hold partial sums: every stage's gradients scaled by cp)."""

    def __init__(self, module: torch.nn.Module, scale: int) -> None:
        super().__init__()
        self.module, self.scale = module, scale

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        def scaled(x: Any) -> Any:
            ok = isinstance(x, torch.Tensor) and x.requires_grad
            return _ScaleGrad.apply(x, self.scale) if ok else x

        return torch.utils._pytree.tree_map(scaled, self.module(*args, **kwargs))


def _unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The stage module that holds the parameters under their own names (DDP's inner one)."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def _on_wire(specs: list, param_dtype: torch.dtype) -> list:
    """(shape, dtype, requires_grad) of a stage's inputs or outputs as they cross the pipeline
    axis (activations in ``param_dtype`` under mixed precision)."""
    from passes.pipeline_split import boundary_dtype

    return [(shape, boundary_dtype(dtype, shape, grad, param_dtype), grad)
            for shape, dtype, grad in specs]  # fmt: skip


def mixed_precision_stage(module: torch.nn.Module, traced: tuple[list, list],
                          wire: tuple[list, list], param_dtype: torch.dtype,
                          device: str, *, mode: str = "autocast",
                          cast_weights: bool = True) -> None:  # fmt: skip
    """Make ``module`` (a stage program, its fp32 weights kept) run as a mixed-precision stage:
    received values (and the first stage's inputs) are cast to their traced dtype; the body
    runs under ``param_dtype`` autocast (``mode="autocast"``), or with its weights cast to
    ``param_dtype`` once per call (``mode="cast"``, the stage traced in it; not when
    ``cast_weights`` is off: FSDP2 gathers them cast); the outputs are cast to their wire dtype
    (each cast's backward casts the gradient the other way, so gradients cross in the wire
    dtype too).  Replaces the instance's ``forward``, so DDP / FSDP2 wrappers and their hooks
    stay outside."""
    from autopar.codegen import ready

    body = ready(module).forward
    ins = [dtype for _, dtype, _ in traced[0]]
    sent = [dtype for _, dtype, _ in wire[1]]

    def forward(*args: Any, **kwargs: Any) -> Any:
        args = tuple(_cast(a, d) for a, d in zip(args, ins, strict=False)) + args[len(ins):]
        if mode == "cast":
            out = (cast_call(module, body, param_dtype, args, kwargs) if cast_weights
                   else body(*args, **kwargs))  # fmt: skip
        else:
            with torch.autocast(device, dtype=param_dtype):
                out = body(*args, **kwargs)
        leaves, spec = torch.utils._pytree.tree_flatten(out)
        cast = [_cast(x, d) for x, d in zip(leaves, sent, strict=True)]
        return torch.utils._pytree.tree_unflatten(cast, spec)

    module.forward = forward


def _cast(x: Any, dtype: torch.dtype) -> Any:
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype != dtype else x


def _whole(grad: torch.Tensor, placement: str) -> torch.Tensor:
    p = parse_placement(placement)
    return collectives._gather(grad, "tp", p.dim, p.blocks) if isinstance(p, Shard) else grad


def _local(total: torch.Tensor, placement: str) -> torch.Tensor:
    p = parse_placement(placement)
    return (
        collectives._slice(total, "tp", p.dim, p.blocks) if isinstance(p, Shard) else total.clone()
    )


def _examples(specs: list[tuple[tuple[int, ...], torch.dtype, bool]], device: str) -> tuple:
    return tuple(torch.zeros(shape, dtype=dtype, device=device).requires_grad_(grad)
                 for shape, dtype, grad in specs)  # fmt: skip


def _has(module: Any, fqn: str) -> bool:
    try:
        module.get_parameter(fqn)
    except AttributeError:
        return False
    return True


def _schedule(config: Any, stages: list) -> Any:
    from torch.distributed import pipelining as pl

    loss = _loss_is_output
    m = config.n_microbatches
    if config.schedule == "gpipe":
        return pl.ScheduleGPipe(stages[0], m, loss_fn=loss)
    if config.schedule == "1f1b":
        return pl.Schedule1F1B(stages[0], m, loss_fn=loss)
    if config.schedule == "interleaved":
        return pl.ScheduleInterleaved1F1B(stages, m, loss_fn=loss)
    return pl.ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss)


def _loss_is_output(output: Any, target: Any) -> torch.Tensor:
    """The last stage already returns the loss; the schedule's target is a placeholder."""
    del target
    return output[0] if isinstance(output, (tuple, list)) else output


@dataclass(frozen=True, kw_only=True)
class RankShare:
    """What one rank of a pipelined program needs to run (picklable)."""

    modules: dict[int, Any]  # stage index -> this rank's module of it
    n_stages: int
    config: Any  # autopar.axes.pipeline.PipelineConfig
    tied_shapes: dict[str, tuple[int, ...]]  # weight held by several stages -> full shape
    mesh: Mesh
    coords: dict[str, int]
    io: dict[int, tuple[list, list]]  # stage -> (shape, dtype, requires_grad) of inputs, outputs
    placements: dict[int, dict[str, str]]  # stage -> tied weight -> its placement on 'tp'
    inputs: StepInputs  # what a step's call must be


class DataParallelModule(torch.nn.Module):
    """This rank's sub-mesh module wrapped for the data axis with torch's own engines.

    Algorithm:
    1. ZeRO 0 and 1: torch DDP over the ZeRO group (gradients all-reduced in buckets as
       they fill during backward; ``gradient_as_bucket_view``: the gradients are views into
       the buckets, so no per-step copy in or out); ZeRO 1 adds ZeroRedundancyOptimizer
       (:meth:`optimizer`).
       ZeRO 2 and 3: FSDP2 ``fully_shard`` over the ZeRO group's mesh, parameters resharded
       after forward only for 3.  The ZeRO group is dp, or the flattened dp x cp group
       (``shard_group``) when the cp program left its dense gradients partial over cp.
    2. Gradients are summed over the ZeRO group and divided by dp for a mean loss (over cp
       they are partial sums of one replica's gradient), by 1 for a sum loss: a DDP comm
       hook where the divisor is not the group's size; under FSDP2, which averages over
       its group, the outputs' gradients are scaled by group size / divisor.
    3. Every floating scalar output (the loss) returns its global value (mean or sum over dp:
       one scalar all-reduce) while its gradient stays this rank's, so ``loss.backward()``
       computes the right gradient.  The all-reduce is launched asynchronously and the loss
       waits for it only when its value is read (:class:`PendingScalar`), so it overlaps
       backward and the optimizer step.
    4. Mixed precision (``param_dtype`` 16-bit): the parameters stay fp32 (the optimizer's
       master weights).  ``mixed_precision="cast"`` (the program traced in ``param_dtype``):
       FSDP2 gathers the weights cast and casts the inputs (``MixedPrecisionPolicy``); under
       DDP the module casts its weights and inputs once per forward (:func:`cast_forward`).
       ``"autocast"``: forward runs under autocast to ``param_dtype`` (matrix products in
       16-bit, reductions and norms as autocast keeps them); FSDP2 also gathers the weights in
       16-bit; under DDP autocast casts them per use.  Gradients reach the fp32 parameters and
       are reduced in ``reduce_dtype`` (fp32 by default).
    5. FP8 (``fp8="tensorwise"`` programs) under ZeRO 2/3: the weights only float8 linears
       read are all-gathered in float8 (:func:`shard_per_block`; ``float8_all_gather=False``
       gathers them in their own dtype and casts after, the same numbers).
    """

    def __init__(self, module: torch.nn.Module, *, group: Any, dp_mesh: Any, zero: int,
                 reduction: str, param_dtype: torch.dtype = torch.float32,
                 reduce_dtype: torch.dtype = torch.float32,
                 shard_group: Any = None, mixed_precision: str = "cast",
                 float8_all_gather: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.group, self.zero, self.reduction = group, zero, reduction
        self.shard_group = group if shard_group is None else shard_group
        self.dp = dist.get_world_size(group)
        self.param_dtype = param_dtype
        mixed = _is_mixed(module, param_dtype)
        divisor = self.dp if reduction == "mean" else 1
        cast = mixed and mixed_precision == "cast"
        if cast and zero <= 1:
            cast_forward(module, param_dtype)
        if zero <= 1:
            self.engine = _ddp(module, self.shard_group, divisor, param_dtype if mixed else None,
                               reduce_dtype, bucket_view=True)  # fmt: skip
        else:
            self.engine = shard_per_block(module, dp_mesh, reshard_after_forward=zero == 3,
                                          mp_policy=_mp_policy(param_dtype if mixed else None,
                                                               reduce_dtype),
                                          float8=float8_all_gather)  # fmt: skip
        # FSDP2 averages; another divisor needs PREMUL_SUM, which Gloo lacks, so the outputs'
        # gradients are scaled by group size / divisor instead (exact for powers of two)
        size = dist.get_world_size(self.shard_group)
        self.grad_scale = size // divisor if zero >= 2 else 1
        self.autocast = param_dtype if mixed and not cast else None
        self.device_type = next(iter(module.parameters()), torch.empty(())).device.type

    @property
    def local(self) -> torch.nn.Module:
        """The wrapped sub-mesh module."""
        return self.engine.module if self.zero <= 1 else self.engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.autocast is None:
            out = self.engine(*args, **kwargs)
        else:
            with torch.autocast(self.device_type, dtype=self.autocast):
                out = self.engine(*args, **kwargs)
        if self.grad_scale != 1:
            out = torch.utils._pytree.tree_map(self._scale_grad, out)
        return torch.utils._pytree.tree_map(self._global_scalar, out)

    def _scale_grad(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not x.requires_grad:
            return x
        return _ScaleGrad.apply(x, self.grad_scale)

    def _global_scalar(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.dim() or not x.is_floating_point():
            return x
        scale = 1.0 / self.dp if self.reduction == "mean" else 1.0
        return _GlobalScalar.apply(x, self.group, scale)

    def optimizer(self, cls: type, **kwargs: Any) -> torch.optim.Optimizer:
        """``cls(parameters, **kwargs)`` with its state sharded over dp for ZeRO >= 1 (FSDP2's
        parameters are already dp shards for ZeRO 2/3)."""
        data = DataAxis(group=self.shard_group, mesh=None, zero=self.zero,
                        reduction=self.reduction)  # fmt: skip
        return make_optimizer(self.parameters(), cls, data, **kwargs)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's gradient on this rank's sub-mesh coordinate (ZeRO shards gathered)."""
        out = {}
        for name, p in self.local.named_parameters():
            if p.grad is None:
                continue
            g = p.grad
            out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g.detach()
        return out

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (ZeRO-3 shards gathered)."""
        return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                for name, p in self.local.named_parameters()}  # fmt: skip


class PendingScalar(torch.Tensor):
    """A scalar whose value an asynchronous all-reduce is still writing: any op that reads
    it (``.item()``, printing, arithmetic, ``detach``) first waits for the all-reduce and then
    runs on the plain result; ops that only need its shape and dtype (``ones_like``, what
    ``loss.backward()`` seeds the gradient with) do not wait."""

    _METADATA_ONLY = frozenset({torch.ops.aten.ones_like.default, torch.ops.aten.zeros_like.default,
                                torch.ops.aten.empty_like.default})  # fmt: skip

    @staticmethod
    def __new__(cls, value: torch.Tensor, work: Any) -> PendingScalar:
        out = torch.Tensor._make_wrapper_subclass(cls, value.shape, dtype=value.dtype,
                                                  device=value.device)  # fmt: skip
        out._value, out._work = value, work
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def wait(self) -> torch.Tensor:
        """The reduced value (waits for the all-reduce once)."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self._value

    def __repr__(self) -> str:  # noqa: D105
        return repr(self.wait())

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        read = func not in cls._METADATA_ONLY

        def plain(x: Any) -> Any:
            if not isinstance(x, PendingScalar):
                return x
            return x.wait() if read else x._value

        args, kwargs = torch.utils._pytree.tree_map(plain, (args, kwargs or {}))
        return func(*args, **kwargs)


class _GlobalScalar(torch.autograd.Function):
    """Forward: ``scale`` x the sum of ``x`` over ``group``, all-reduced asynchronously (a
    :class:`PendingScalar`); backward: the gradient passes to this rank's ``x`` unchanged."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any, scale: float) -> PendingScalar:
        total = x.detach() * scale if scale != 1.0 else x.detach().clone()
        return PendingScalar(total, dist.all_reduce(total, group=group, async_op=True))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


def _is_mixed(module: torch.nn.Module, param_dtype: torch.dtype) -> bool:
    return any(p.is_floating_point() and p.dtype != param_dtype for p in module.parameters())


def _ddp(module: torch.nn.Module, group: Any, divisor: int, param_dtype: torch.dtype | None,
         reduce_dtype: torch.dtype, bucket_view: bool = False) -> torch.nn.Module:  # fmt: skip
    """torch DDP over ``group``, gradients summed and divided by ``divisor`` (DDP's default
    divides by the group's size; 1 for a sum loss, dp for a mean over a dp x cp group).  Mixed precision: DDP's own
    ``_MixedPrecision`` needs CUDA streams, so the parameters stay fp32 and the caller's
    autocast casts them to ``param_dtype`` at each matrix product (cached for the forward);
    gradients land fp32 and are reduced in fp32, or in ``reduce_dtype`` (a comm hook that
    casts each bucket down, reduces, and casts back: torch's ``bf16_compress_hook`` needs NCCL).
    """
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(module, process_group=group, forward_sync_buffers=False,
                                  gradient_as_bucket_view=bucket_view)  # fmt: skip
    if param_dtype is not None and reduce_dtype != torch.float32:
        ddp.register_comm_hook(_LowPrecision(group, reduce_dtype, divisor), _low_precision_hook)
    elif divisor != dist.get_world_size(group):
        ddp.register_comm_hook(_Divided(group, divisor), _divided_hook)
    return ddp


@dataclass(frozen=True)
class _LowPrecision:
    group: Any
    dtype: torch.dtype
    divisor: int


def _low_precision_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP rejects string annotations
    """DDP comm hook: reduce the bucket in ``state.dtype`` (divided by ``state.divisor``)."""
    buf = bucket.buffer()
    low = buf.to(state.dtype)
    if state.divisor != 1:
        low.div_(state.divisor)
    fut = dist.all_reduce(low, group=state.group, async_op=True).get_future()

    def back(f):  # noqa: ANN001, ANN202
        buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


def _mp_policy(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if param_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


@dataclass(frozen=True)
class _Divided:
    group: Any
    divisor: int


def _divided_hook(state, bucket):  # noqa: ANN001, ANN202 - DDP rejects string annotations
    """DDP comm hook: the bucket summed over the group, divided by ``state.divisor`` (DDP's
    default divides by the group's size)."""
    buf = bucket.buffer()
    if state.divisor != 1:
        buf.div_(state.divisor)
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def wrap_data_parallel(device_mesh: Any, prog: Any, mesh: Mesh) -> Any:
    """Bind the mesh and wrap this rank's sub-mesh module (or pipeline stages) for dp: its
    ZeRO group the dp dim, or the dp and cp dims flattened (``plan.zero_axes``)."""
    rank = bind_mesh(device_mesh, mesh, prog.collectives())
    dp = prog.plan.dp
    axes, param_dtype, reduce_dtype = dp.zero_axes, getattr(torch, dp.param_dtype), getattr(
        torch, dp.reduce_dtype)  # fmt: skip
    zero_mesh = device_mesh[axes]._flatten("_".join(axes)) if len(axes) > 1 else device_mesh["dp"]
    if "pp" in mesh.sizes:
        data = DataAxis(group=device_mesh.get_group("dp"), mesh=zero_mesh, zero=dp.zero,
                        reduction=dp.reduction, reduce_dtype=reduce_dtype,
                        shard_group=zero_mesh.get_group())  # fmt: skip
        return PipelineRunner(prog.share(rank), device_mesh.get_group("pp"), data=data)
    return DataParallelModule(prog.module(rank), group=device_mesh.get_group("dp"),
                              dp_mesh=zero_mesh, zero=dp.zero, reduction=dp.reduction,
                              param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                              shard_group=zero_mesh.get_group(),
                              mixed_precision=dp.mixed_precision)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class DataAxis:
    """The data axis a pipeline rank's stages reduce over: the dp process group (the loss's
    and the divisor's) and the ZeRO group with its 1-D DeviceMesh (``shard_group`` /
    ``mesh``: dp, or dp x cp flattened when the cp stages left their dense gradients partial
    over cp)."""

    group: Any
    mesh: Any
    zero: int
    reduction: str
    reduce_dtype: torch.dtype = torch.float32  # gradient reduction dtype under mixed precision
    shard_group: Any = None  # the ZeRO group (None: ``group``)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def shards(self) -> Any:
        """The ZeRO group: gradients are reduced and state sharded over it."""
        return self.group if self.shard_group is None else self.shard_group

    @property
    def grad_scale(self) -> int:
        """What the loss's gradient is scaled by under FSDP2 (ZeRO 2/3), which averages over
        the ZeRO group: its size over dp's (cp's partial sums are summed, not averaged)."""
        if self.zero < 2 or self.shard_group is None:
            return 1
        return dist.get_world_size(self.shard_group) // self.size

    def wrap(self, module: torch.nn.Module,
             param_dtype: torch.dtype = torch.float32) -> torch.nn.Module:  # fmt: skip
        """DDP (ZeRO 0/1, its divisor dp) or FSDP2 (2/3) over the ZeRO group around one
        stage module; the pipeline schedule defers their gradient reduction to the last
        micro-batch.  Mixed precision as
        :class:`DataParallelModule` (step 4): FSDP2 gathers in ``param_dtype``; gradients are
        reduced in ``reduce_dtype``."""
        mixed = param_dtype if _is_mixed(module, param_dtype) else None
        if self.zero <= 1:
            divisor = self.size if self.reduction == "mean" else 1
            return _ddp(module, self.shards, divisor, mixed, self.reduce_dtype)
        return shard_per_block(module, self.mesh, reshard_after_forward=self.zero == 3,
                               mp_policy=_mp_policy(mixed, self.reduce_dtype))  # fmt: skip


def shard_per_block(module: torch.nn.Module, dp_mesh: Any, *, reshard_after_forward: bool,
                    mp_policy: Any = None, float8: bool = True) -> torch.nn.Module:  # fmt: skip
    """FSDP2 over ``dp_mesh`` with one parameter group per repeated block: the program's
    blocks become submodule calls (:func:`autopar.codegen.outline_blocks`), each block is
    ``fully_shard``-ed, then the rest of the program.  FSDP2 gathers a block's parameters
    just before it runs (forward, and again in backward for ZeRO-3) and frees them after; each
    block's pre-hook issues the next block's gather (forward and backward prefetch), so on an
    asynchronous process group it overlaps the running block.  The last block is not
    resharded after forward (its backward comes first: ``data_parallel.kept_gathered``).  A
    program without separable blocks is one group.  ``float8``: the weights only tensorwise
    ``fp8_linear`` s read are all-gathered in float8, cast before the gather with the whole
    weight's scale (torchao's FSDP2 extension; autopar.ops.fp8 step 4).  Returns the module
    that runs (the outlined one when blocks were found)."""
    from torch.distributed.fsdp import fully_shard

    from autopar.axes.recompute import block_targets, blocks_outlined
    from autopar.codegen import outline_blocks
    from autopar.ops.fp8 import gather_in_float8

    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    outlined = outline_blocks(module) if isinstance(module, torch.fx.GraphModule) else None
    if blocks_outlined(module):  # recompute="full": already outlined, each block checkpointed
        outlined = module
    module = module if outlined is None else outlined
    if float8:
        gather_in_float8(module)
    blocks = []
    if outlined is not None:
        targets = block_targets(module)
        for i, target in enumerate(targets):  # the last block is kept gathered into backward
            last = i == len(targets) - 1  # (data_parallel.kept_gathered)
            blocks.append(fully_shard(module.get_submodule(target), mesh=dp_mesh,
                                      reshard_after_forward=reshard_after_forward and not last,
                                      **policy))  # fmt: skip
    # the rest (embedding, head, final norm) is FSDP2's root: with blocks, as torch's default
    # for a root, kept gathered from the end of forward into backward (its parameters are
    # needed again at once; dp_collectives prices no backward gather for them)
    rest = None if blocks and reshard_after_forward else reshard_after_forward
    root = fully_shard(module, mesh=dp_mesh, reshard_after_forward=rest, **policy)
    for i, block in enumerate(blocks):  # issue the next block's gather before this one runs
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
    return root


def make_optimizer(params: Any, cls: type, data: DataAxis | None, **kwargs: Any) -> Any:
    """``cls(params, **kwargs)``; ZeroRedundancyOptimizer over dp for ZeRO-1."""
    if data is not None and data.zero == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=data.shards,
                                       **kwargs)  # fmt: skip
    return cls(params, **kwargs)


def gathered_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(bytes of whole parameters FSDP2 holds gathered right now, bytes of the dp shards) under
    ``module``: the storages of every FSDP parameter's all-gather outputs that are allocated
    (FSDP2 frees them by resizing to 0 when it reshards), plus a group's in-flight (prefetched)
    all-gather buffer not yet copied out, and the local shards that stay."""
    from torch.distributed.fsdp import FSDPModule

    seen: dict[int, int] = {}
    shards = 0
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        pending = getattr(group, "_all_gather_result", None)
        if pending is not None and pending.all_gather_output is not None:
            storage = pending.all_gather_output.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        for fp in group.fsdp_params if group is not None else ():
            shards += fp._sharded_local_tensor.untyped_storage().nbytes()
            for t in (*fp.all_gather_outputs, *getattr(fp, "_unsharded_inner_tensors", ())):
                storage = t.untyped_storage()
                if storage.nbytes():
                    seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()), shards
