"""The front door: ``autoparallelize(model, mesh, example_inputs)``.

Algorithm:
1. Validate the options once into a frozen record (autopar.options).
2. ``Mesh.auto(cluster)``: the whole-cluster search chooses the mesh and compiles it
   (autopar.planner.auto); a torch DeviceMesh becomes a virtual :class:`Mesh` (the axes it names,
   the cluster it is priced on).
3. A reloaded ``plan=`` must be for this mesh; the driver takes each axis's decisions from
   it (given options must agree) and checks the program carries them.
4. The one driver (autopar.driver) slices the batch, traces once and builds every axis.
5. With a DeviceMesh, bind the process groups and return this rank's module (or pipeline
   runner, or data-parallel wrapper: autopar.runtime.bind); with a virtual mesh, the program
   itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from autopar.driver import compile_model, example_of
from autopar.errors import InputError, MeshError
from autopar.frontend.trace import gc_paused
from autopar.mesh import AutoMesh, Mesh
from autopar.options import make_options
from autopar.plan import Plan
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
    mixed_precision: str = "cast",
    global_batch: int | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    cp_attention: str | None = None,
    capacity_factor: float | None = None,
    recompute: str | None = None,
    compile: bool | str = False,
    fp8: str | None = None,
    plan_cache: str | os.PathLike | None = None,
    tp_overlap: str = "auto",
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
    stage) shape it.  The program's ``share(rank)`` is what a pipeline rank runs; with a
    DeviceMesh this returns this rank's PipelineRunner (``runner.train_step(optimizer_factory)``).

    ``plan=Plan.load("out/plan.json")`` (or a program's ``prog.plan``) reuses every axis's
    decisions of a saved plan instead of solving: tp strategies (per stage), stage cuts,
    schedule, micro-batches, ZeRO stage, capacity factor, attention choices, recompute.  A
    plan for another mesh or model is refused naming what differs, as is an option that
    contradicts it.
    ``cluster`` prices a DeviceMesh's plan (default: one DGX H100 node; a virtual Mesh carries
    its own, e.g. ``Mesh(Cluster.preset("dgx-a100", nodes=2), pp=2, tp=8)``).

    A mesh with an ``ep`` axis places each MoE layer's experts across ep ranks (the dense part
    data-parallel over ep; autopar.axes.expert_parallel); ``capacity_factor`` caps the tokens per
    expert (default: dropless).

    A mesh with a ``dp`` axis splits the batch (dim 0 of the inputs) over dp and runs the
    program of the other axes on each slice (autopar.axes.data_parallel): ``zero`` forces a ZeRO
    stage (default: the lowest whose per-rank memory fits ``memory_limit`` or the GPU).
    With a DeviceMesh this returns this rank's DataParallelModule (DDP or FSDP2 over the dp
    group).

    ``param_dtype=torch.bfloat16`` trains with fp32 master weights and optimizer state,
    gradients reduced in ``reduce_dtype`` (fp32), and prices the model state, activations and
    collectives in the dtypes they run in.  ``mixed_precision="cast"`` (default) runs as
    FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)``: traced with bf16 weights and inputs,
    the weights cast once per step, activations, the residual stream and every message bf16,
    what the model's code upcasts (norm statistics, the loss) fp32; any mesh.
    ``mixed_precision="autocast"`` runs the fp32-traced program under ``torch.autocast``
    (residual stream and norms fp32; needs a dp or pp axis).

    ``Mesh.auto(cluster)`` searches the degrees on the traced model (``global_batch``
    sequences per step, default the example batch) and compiles the best configuration, every
    axis of it, on every GPU of the cluster (or, if the compiler's memory count refuses it,
    the best it accepts, saying so); ``prog.search`` holds the ranked plan (autopar.planner.auto).
    ``plan_cache=DIR`` keeps the search's world-independent pricing (priced traces of per-rank
    slices, the tp / cp sub-mesh solutions) in DIR as JSON, so a later ``Mesh.auto`` on the same
    model, shapes and kind of cluster, with any node count, re-traces and re-solves none of
    them (autopar.planner.cache; an elastic job's re-plan); it also keeps the tp planner's
    answers (a compile of a configuration compiled before runs no ILP, on a fixed mesh too)
    and lets a warm ``Mesh.auto`` skip the trace of the whole example (the slice it compiles
    is still traced, and must hash as recorded).  The plan chosen is the same.

    A mesh with a ``cp`` axis splits the sequence (autopar.axes.context_parallel); attention runs
    as ring or all-to-all attention, chosen by cost unless ``cp_attention`` forces one.

    ``recompute`` ("none", "selective", "full") trades backward time for activation memory in
    every rank program (autopar.axes.recompute): "full" keeps only each repeated block's inputs and
    re-runs the block in backward (``checkpoint(layers_0, ...)`` in the code), "selective" re-runs
    only the unfused attention core (the [.., s, s] score ops; nothing under a fused SDPA).
    Default "none"; under ``Mesh.auto`` the search chooses unless ``recompute`` is given.

    ``compile=True`` (or a torch.compile backend name, e.g. "aot_eager") runs every rank
    program's repeated blocks under ``torch.compile``, one compile per distinct block
    (``compiled(layers_0, ...)`` in the code; autopar.ops.compiled); plans are unchanged.

    ``fp8="tensorwise"`` or ``"rowwise"`` (torchao's float8 training recipes; needs torchao)
    runs every layer linear's three GEMMs in float8 with dynamic scaling (``fp8_linear(...)``
    in the code; passes/fp8.py): scales of split tensors are reduced over the mesh axes that
    split them, so each rank scales as one device would.  The LM head, MoE routers and
    linears whose local dims are not multiples of 16 stay in high precision; the plan lists
    which linears run FP8 and prices their GEMMs at the GPU's FP8 peak.

    ``tp_overlap`` ("auto", "all", "none") decomposes a tp gather before column-split linears
    and a reduce-scatter after a row-split one (sequence parallelism's pairs) into ring steps
    that run under the partial matmuls (``gather_linear`` / ``linear_scatter`` in the code;
    autopar.ops.overlap).  "auto" keeps each one the cost model prices faster (its link, its
    chunks' GEMM efficiency); the plan lists them and the exposed tp communication before and
    after.  Eager only: "none" under ``compile``, ``fp8`` and autocast.
    """
    options = make_options(
        memory_limit=memory_limit, memory_weight=memory_weight, strict=strict, verbose=verbose,
        n_microbatches=n_microbatches, schedule=schedule, virtual_stages=virtual_stages,
        split_points=split_points, cluster=cluster, zero=zero, param_dtype=param_dtype,
        mixed_precision=mixed_precision, global_batch=global_batch, reduce_dtype=reduce_dtype,
        cp_attention=cp_attention, capacity_factor=capacity_factor, recompute=recompute,
        compile=compile, fp8=fp8, plan_cache=plan_cache, tp_overlap=tp_overlap,
    )  # fmt: skip
    example = example_of(example_inputs, example_kwargs)
    if isinstance(mesh, AutoMesh):
        from autopar.planner.auto import compile_auto

        with gc_paused():  # as below: the search's traces, solves and compiles outlive it
            return compile_auto(model, mesh, example, loss_fn, options.replace(plan=plan))
    device_mesh = None if isinstance(mesh, Mesh) else mesh
    virtual = mesh if isinstance(mesh, Mesh) else Mesh.from_device_mesh(mesh, cluster)
    options = options.replace(plan=_reused(plan, virtual))
    if device_mesh is not None and "dp" in virtual.sizes:
        from autopar.runtime import check_world

        check_world(virtual)  # before compiling: a wrong world would hang in the first collective
    with gc_paused():  # what the compile allocates mostly outlives it (autopar.frontend.trace)
        prog = compile_model(model, virtual, example, loss_fn, options)
    if device_mesh is None:
        return prog
    from autopar.runtime import bind

    return bind(prog, device_mesh, virtual, param_dtype, options.mixed_precision)


def _reused(plan: Plan | None, mesh: Mesh) -> Plan | None:
    """A reloaded plan, if it is for ``mesh``."""
    if plan is None:
        return None
    if not isinstance(plan, Plan):
        raise InputError(f"plan= takes an autopar Plan (prog.plan or Plan.load(path)), not "
                         f"{type(plan).__name__}")  # fmt: skip
    if plan.mesh != mesh.axes:
        raise MeshError(f"the plan was made for Mesh{dict(plan.mesh)} but the mesh is {mesh}")
    return plan
