"""The front door: ``autoparallelize(model, mesh, example_inputs)``.

Algorithm:
1. Turn a torch DeviceMesh into a virtual :class:`Mesh` (the axes it names, the cluster it is
   priced on).
2. A reloaded ``plan=`` must be for this mesh; options it decides are taken from it (given
   ones must agree), and each branch hands its sub-mesh the plan without its own section.
3. Route by the mesh's axes: ``dp`` to autopar.data_parallel (each dp rank compiles the rest of
   the mesh on its batch slice), ``pp`` to autopar.pipeline (stage cuts, one program per
   stage), otherwise autopar.compile (trace, solve tp, passes, plan).
4. A program compiled from a reloaded plan must come back with the plan's decisions (else a
   PlanError names each difference).
5. With a DeviceMesh, bind the process groups and return this rank's module (or pipeline
   runner, or data-parallel wrapper); with a virtual mesh, the program itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from autopar.compile import Progress, compile_program
from autopar.errors import MeshError, PlanError
from autopar.mesh import AutoMesh, Mesh
from autopar.plan import (
    Plan,
    as_plan,
    check_attention,
    check_split_points,
    honoured,
    section,
    settle,
)
from autopar.planner import PlanOptions
from autopar.recompute import attach, check_mode
from cost.hardware import Cluster


def autoparallelize(
    model: nn.Module,
    mesh: Mesh | Any,
    example_inputs: Sequence[Any] = (),
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    memory_limit: float | None = None,
    memory_weight: float | None = None,
    strict: bool = False,
    verbose: bool = False,
    n_microbatches: int | None = None,
    schedule: str | None = None,
    virtual_stages: int | None = None,
    split_points: Sequence[str] = (),
    plan: Plan | Any | None = None,
    cluster: Cluster | None = None,
    zero: int | None = None,
    param_dtype: torch.dtype = torch.float32,
    global_batch: int | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    cp_attention: str | None = None,
    capacity_factor: float | None = None,
    recompute: str | None = None,
) -> Any:
    """Compile ``model`` for ``mesh``.

    With a virtual :class:`Mesh`, returns a :class:`Program` (plan, per-rank modules and code).
    With a torch ``DeviceMesh`` (inside torchrun / spawned ranks), returns this rank's module,
    trainable with any torch optimizer.  With ``loss_fn``, the traced function is
    ``loss_fn(model(*example_inputs[:-1], **example_kwargs), example_inputs[-1])``.
    ``memory_limit`` (bytes per rank) and ``memory_weight`` (seconds per byte) steer the
    solver toward plans that hold less per rank (e.g. sequence parallelism).

    A mesh with a ``pp`` axis pipelines the model: it must (with ``loss_fn``) return a scalar
    loss; ``n_microbatches`` (default: chosen), ``schedule`` ('gpipe', '1f1b', 'interleaved',
    'zero_bubble'), ``virtual_stages`` and ``split_points`` (module paths that must start a
    stage) shape it.  Returns a PipelineProgram, or with a DeviceMesh this rank's
    PipelineRunner (``runner.train_step(optimizer_factory)``).

    ``plan=Plan.load("out/plan.json")`` (or a program's ``prog.plan``) reuses every axis's
    decisions of a saved plan instead of solving: tp strategies (per stage), stage cuts,
    schedule, micro-batches, ZeRO stage, capacity factor, attention choices, recompute.  A
    plan for another mesh or model is refused naming what differs, as is an option that
    contradicts it.
    ``cluster`` prices a DeviceMesh's plan (default: one DGX H100 node; a virtual Mesh carries
    its own, e.g. ``Mesh(Cluster.preset("dgx-a100", nodes=2), pp=2, tp=8)``).

    A mesh with an ``ep`` axis places each MoE layer's experts across ep ranks (the dense part
    data-parallel over ep; autopar.expert_parallel); ``capacity_factor`` caps the tokens per
    expert (default: dropless).

    A mesh with a ``dp`` axis splits the batch (dim 0 of the inputs) over dp and runs the
    program of the other axes on each slice (autopar.data_parallel): ``zero`` forces a ZeRO
    stage (default: the lowest whose per-rank memory fits ``memory_limit`` or the GPU);
    ``param_dtype=torch.bfloat16`` computes in bf16 (autocast) with fp32 master weights and
    optimizer state, gradients reduced in ``reduce_dtype`` (fp32), and prices the model state,
    activations and collectives so (on a mesh with pp too: stage activations cross in bf16).
    Returns a DataParallelProgram, or with a DeviceMesh this rank's DataParallelModule (DDP
    or FSDP2 over the dp group).

    ``Mesh.auto(cluster)`` searches the degrees on the traced model (``global_batch``
    sequences per step, default the example batch) and compiles the best configuration, every
    axis of it, on every GPU of the cluster (or, if the compiler's memory count refuses it,
    the best it accepts, saying so); ``prog.search`` holds the ranked plan (autopar.search).

    A mesh with a ``cp`` axis splits the sequence (autopar.context_parallel); attention runs
    as ring or all-to-all attention, chosen by cost unless ``cp_attention`` forces one.

    ``recompute`` ("none", "selective", "full") trades backward time for activation memory in
    every rank program (autopar.recompute): "full" keeps only each repeated block's inputs and
    re-runs the block in backward (``checkpoint(layers_0, ...)`` in the code), "selective" re-runs
    only the unfused attention core (the [.., s, s] score ops; nothing under a fused SDPA).
    Default "none"; under ``Mesh.auto`` the search chooses unless ``recompute`` is given.
    """
    if recompute is not None:
        check_mode(recompute)
    if isinstance(mesh, AutoMesh):
        from autopar.search import compile_auto

        return compile_auto(model, mesh, example_inputs, loss_fn, example_kwargs=example_kwargs,
                            global_batch=global_batch, verbose=verbose, recompute=recompute,
                            memory_limit=memory_limit, memory_weight=memory_weight,
                            strict=strict, n_microbatches=n_microbatches, schedule=schedule,
                            virtual_stages=virtual_stages, split_points=split_points, plan=plan,
                            cluster=cluster, zero=zero, param_dtype=param_dtype,
                            reduce_dtype=reduce_dtype, cp_attention=cp_attention,
                            capacity_factor=capacity_factor)  # fmt: skip
    device_mesh = None if isinstance(mesh, Mesh) else mesh
    virtual = mesh if isinstance(mesh, Mesh) else Mesh.from_device_mesh(mesh, cluster)
    plan = _reused(plan, virtual)
    recompute = settle("recompute", recompute, plan.recompute if plan else None) or "none"
    if "dp" in virtual.sizes:
        return _data_parallel(model, virtual, device_mesh, example_inputs, loss_fn, plan,
                              example_kwargs=example_kwargs, zero=zero, memory_limit=memory_limit,
                              param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                              n_microbatches=n_microbatches,
                              memory_weight=memory_weight, strict=strict, verbose=verbose,
                              schedule=schedule, virtual_stages=virtual_stages,
                              split_points=split_points, cp_attention=cp_attention,
                              capacity_factor=capacity_factor, recompute=recompute)  # fmt: skip
    if "ep" in virtual.sizes:
        return _expert_parallel(model, virtual, device_mesh, example_inputs, loss_fn,
                                example_kwargs, plan, strict=strict, verbose=verbose,
                                capacity_factor=capacity_factor, memory_limit=memory_limit,
                                memory_weight=memory_weight, n_microbatches=n_microbatches,
                                schedule=schedule, virtual_stages=virtual_stages,
                                split_points=split_points, recompute=recompute)  # fmt: skip
    if zero is not None:
        raise PlanError(f"zero={zero} shards over the data axis, but {virtual} has no dp axis; "
                        "use e.g. Mesh(dp=2, tp=2)")  # fmt: skip
    options = PlanOptions(memory_limit=memory_limit, memory_weight=memory_weight, strict=strict,
                          fixed=plan.choice if plan else (), param_dtype=param_dtype)  # fmt: skip
    check_attention(cp_attention, plan)
    if "pp" in virtual.sizes:
        from autopar.pipeline import compile_pipeline

        n_microbatches, schedule, virtual_stages = _pipeline_settled(
            plan, n_microbatches, schedule, virtual_stages, split_points)  # fmt: skip
        prog = compile_pipeline(model, virtual, example_inputs, loss_fn, example_kwargs, options,
                                n_microbatches, schedule, virtual_stages, split_points,
                                Progress(verbose), cp_attention, param_dtype, plan=plan)  # fmt: skip
    elif "cp" in virtual.sizes:
        from autopar.context_parallel import compile_context_parallel

        prog = compile_context_parallel(model, virtual, example_inputs, loss_fn, example_kwargs,
                                        cp_attention, options, section(plan, "cp"))  # fmt: skip
    else:
        prog = compile_program(
            model, virtual, example_inputs, loss_fn, example_kwargs, options, verbose
        )
    honoured(plan, attach(prog, recompute))
    if device_mesh is None:
        return prog
    from autopar.runtime import PipelineRunner, bind_mesh

    rank = bind_mesh(device_mesh, virtual, prog.collectives())
    if "pp" in virtual.sizes:
        return PipelineRunner(prog.share(rank), device_mesh.get_group("pp"))
    if param_dtype != torch.float32:
        raise PlanError(f"param_dtype={param_dtype} is applied by the data-parallel and pipeline "
                        f"runtimes; on {virtual} compile without it, or add a dp or pp axis")  # fmt: skip
    return prog.module(rank)


def _data_parallel(model: nn.Module, mesh: Mesh, device_mesh: Any, example_inputs: Sequence[Any],
                   loss_fn: Callable | None, plan: Plan | None, *, example_kwargs: dict | None,
                   zero: int | None,
                   memory_limit: float | None, param_dtype: torch.dtype,
                   reduce_dtype: torch.dtype, n_microbatches: int | None,
                   **inner_options: Any) -> Any:  # fmt: skip
    """The dp branch: compile the sub-mesh program on B/dp, wrap it for the data axis.  A
    reloaded plan fixes the ZeRO stage and hands the sub-mesh its plan (kept as it is: no
    re-solve under the memory limit)."""
    from autopar.data_parallel import compile_data_parallel

    saved = section(plan, "dp")
    zero = settle("zero", zero, saved and saved.zero)
    sub_plan = plan.without("dp") if plan else None

    if device_mesh is not None:
        from autopar.runtime import check_world

        check_world(mesh)  # before compiling: a wrong world would hang in the first collective

    def inner(sub: Mesh, args: tuple, kwargs: dict, limit: float | None) -> Any:
        return autoparallelize(model, sub, args, loss_fn, example_kwargs=kwargs or None,
                               n_microbatches=n_microbatches, memory_limit=limit,
                               param_dtype=param_dtype, plan=sub_plan, **inner_options)  # fmt: skip

    prog = compile_data_parallel(mesh, example_inputs, example_kwargs, inner, zero=zero,
                                 memory_limit=memory_limit, param_dtype=param_dtype,
                                 reduce_dtype=reduce_dtype, micro=n_microbatches or 1,
                                 refit=plan is None)  # fmt: skip
    honoured(plan, prog)
    if device_mesh is None:
        return prog
    from autopar.runtime import wrap_data_parallel

    return wrap_data_parallel(device_mesh, prog, mesh)


def _expert_parallel(model: nn.Module, mesh: Mesh, device_mesh: Any,
                     example_inputs: Sequence[Any], loss_fn: Callable | None,
                     example_kwargs: dict | None, plan: Plan | None, *, strict: bool,
                     capacity_factor: float | None, recompute: str,
                     **inner_options: Any) -> Any:  # fmt: skip
    """The ep branch: compile the sub-mesh program on B/ep, place the experts across ep; the
    recompute mode is priced on the sub-mesh plan and applied after the experts are placed.
    A reloaded plan fixes the capacity factor and hands the sub-mesh its plan (its recompute
    left to this branch)."""
    from autopar.expert_parallel import compile_expert_parallel

    saved = section(plan, "ep")
    capacity_factor = settle("capacity_factor", capacity_factor,
                             saved.capacity_factor if saved else None)  # fmt: skip
    sub_plan = dataclasses.replace(plan.without("ep"), recompute="none") if plan else None

    def inner(sub: Mesh, args: tuple, kwargs: dict) -> Any:  # strict: no rule needed at size 1
        sub_prog = autoparallelize(model, sub, args, loss_fn, example_kwargs=kwargs or None,
                                   strict=strict and sub.world_size > 1, plan=sub_plan,
                                   **inner_options)  # fmt: skip
        return attach(sub_prog, recompute, apply=False)

    prog = compile_expert_parallel(mesh, example_inputs, example_kwargs, inner, strict=strict,
                                   capacity_factor=capacity_factor)  # fmt: skip
    prog.recompute = recompute
    honoured(plan, prog)
    if device_mesh is None:
        return prog
    from autopar.runtime import PipelineRunner, bind_mesh

    rank = bind_mesh(device_mesh, mesh, prog.collectives())
    if "pp" in mesh.sizes:
        return PipelineRunner(prog.share(rank), device_mesh.get_group("pp"))
    return prog.module(rank)


def _pipeline_settled(plan: Plan | None, n_microbatches: int | None, schedule: str | None,
                      virtual_stages: int | None, split_points: Sequence[str],
                      ) -> tuple[int | None, str, int | None]:  # fmt: skip
    """The pp options a reloaded plan decides (given ones must agree; split points must start
    its stages); the schedule defaults to 1F1B."""
    saved = section(plan, "pp")
    check_split_points(split_points, saved)
    return (settle("n_microbatches", n_microbatches, saved and saved.n_microbatches),
            settle("schedule", schedule, saved and saved.schedule) or "1f1b",
            settle("virtual_stages", virtual_stages, saved and saved.virtual_stages))  # fmt: skip


def _reused(plan: Plan | Any | None, mesh: Mesh) -> Plan | None:
    """The one Plan of a reloaded plan (a program's wrapper plan builds it), if it is for
    ``mesh``."""
    if plan is None:
        return None
    plan = as_plan(plan)
    if plan.mesh != mesh.axes:
        raise MeshError(f"the plan was made for Mesh{dict(plan.mesh)} but the mesh is {mesh}")
    return plan
