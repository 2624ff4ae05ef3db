"""The front door: ``autoparallelize(model, mesh, example_inputs)``.

Algorithm:
1. Trace the model (and loss) with torch.export (autopar.trace).
2. Solve the tensor-parallel axis with the cost model (autopar.planner).
3. Run the pass pipeline (passes.run_pipeline): layouts, lowerings, collectives, local shapes.
4. Package a :class:`Program` with its :class:`Plan`; given a torch DeviceMesh instead of a
   virtual :class:`Mesh`, bind the process groups and return this rank's module.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from autopar import meta
from autopar.analysis import block_of, needs_grad
from autopar.errors import MeshError, PlanError
from autopar.mesh import Mesh
from autopar.pad import pad_vocab
from autopar.plan import Plan
from autopar.planner import AxisSolution, PlanOptions, describe_tp_dims, solve_axis
from autopar.program import Program, collectives_of
from autopar.trace import Traced, trace
from cost.comm import collective_time
from cost.hardware import Cluster
from passes import PassContext, run_pipeline


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
    schedule: str = "1f1b",
    virtual_stages: int | None = None,
    split_points: Sequence[str] = (),
    plan: Plan | None = None,
    cluster: Cluster | None = None,
    zero: int | None = None,
    param_dtype: torch.dtype = torch.float32,
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

    ``plan=Plan.load("out/plan.json")`` reuses a saved plan's strategies instead of solving.
    ``cluster`` prices a DeviceMesh's plan (default: one DGX H100 node; a virtual Mesh carries
    its own, e.g. ``Mesh(Cluster.preset("dgx-a100", nodes=2), pp=2, tp=8)``).

    A mesh with a ``dp`` axis splits the batch (dim 0 of the inputs) over dp and runs the
    program of the other axes on each slice (autopar.data_parallel): ``zero`` forces a ZeRO
    stage (default: the lowest whose per-rank memory fits ``memory_limit`` or the GPU;
    ``param_dtype`` prices the model state).  Returns a DataParallelProgram, or with a
    DeviceMesh this rank's DataParallelModule (DDP or FSDP2 over the dp group).
    """
    device_mesh = None if isinstance(mesh, Mesh) else mesh
    virtual = mesh if isinstance(mesh, Mesh) else Mesh.from_device_mesh(mesh, cluster)
    if "dp" in virtual.sizes:
        return _data_parallel(model, virtual, device_mesh, example_inputs, loss_fn,
                              example_kwargs=example_kwargs, zero=zero, memory_limit=memory_limit,
                              param_dtype=param_dtype, n_microbatches=n_microbatches,
                              memory_weight=memory_weight, strict=strict, verbose=verbose,
                              schedule=schedule, virtual_stages=virtual_stages,
                              split_points=split_points)  # fmt: skip
    if zero is not None:
        raise PlanError(f"zero={zero} shards over the data axis, but {virtual} has no dp axis; "
                        "use e.g. Mesh(dp=2, tp=2)")  # fmt: skip
    options = PlanOptions(memory_limit=memory_limit, memory_weight=memory_weight, strict=strict,
                          fixed=_reused(plan, virtual))  # fmt: skip
    if "pp" in virtual.sizes:
        from autopar.pipeline import compile_pipeline

        prog = compile_pipeline(model, virtual, example_inputs, loss_fn, example_kwargs, options,
                                n_microbatches, schedule, virtual_stages, split_points,
                                _Progress(verbose))  # fmt: skip
    else:
        prog = compile_program(
            model, virtual, example_inputs, loss_fn, example_kwargs, options, verbose
        )
    if device_mesh is None:
        return prog
    from autopar.runtime import PipelineRunner, bind_mesh

    rank = bind_mesh(device_mesh, virtual)
    if "pp" in virtual.sizes:
        return PipelineRunner(prog.share(rank), device_mesh.get_group("pp"))
    return prog.module(rank)


def _data_parallel(model: nn.Module, mesh: Mesh, device_mesh: Any, example_inputs: Sequence[Any],
                   loss_fn: Callable | None, *, example_kwargs: dict | None, zero: int | None,
                   memory_limit: float | None, param_dtype: torch.dtype,
                   n_microbatches: int | None, **inner_options: Any) -> Any:  # fmt: skip
    """The dp branch: compile the sub-mesh program on B/dp, wrap it for the data axis."""
    from autopar.data_parallel import compile_data_parallel

    if device_mesh is not None:
        from autopar.runtime import check_world

        check_world(mesh)  # before compiling: a wrong world would hang in the first collective

    def inner(sub: Mesh, args: tuple, kwargs: dict) -> Any:
        return autoparallelize(model, sub, args, loss_fn, example_kwargs=kwargs or None,
                               n_microbatches=n_microbatches, **inner_options)  # fmt: skip

    prog = compile_data_parallel(mesh, example_inputs, example_kwargs, inner, zero=zero,
                                 memory_limit=memory_limit, param_dtype=param_dtype,
                                 micro=n_microbatches or 1)  # fmt: skip
    if device_mesh is None:
        return prog
    from autopar.runtime import wrap_data_parallel

    return wrap_data_parallel(device_mesh, prog, mesh)


def compile_program(model: nn.Module, mesh: Mesh, example_inputs: Sequence[Any],
                    loss_fn: Callable | None, example_kwargs: dict | None,
                    options: PlanOptions, verbose: bool = False) -> Program:  # fmt: skip
    """Steps 1-4 on a virtual mesh."""
    log = _Progress(verbose)
    traced = trace(model, example_inputs, example_kwargs, loss_fn)
    log(f"traced {traced.model_name}: {len(traced.gm.graph.nodes)} nodes")
    return compile_traced(traced, mesh, options, log)


def compile_traced(traced: Traced, mesh: Mesh, options: PlanOptions,
                   log: Callable[[str], None] = print, whole_model: bool = True) -> Program:  # fmt: skip
    """Steps 2-4 for an already traced graph: the whole model, or one pipeline stage (which
    may hold nothing worth splitting, e.g. only an embedding)."""
    axis = "tp"
    traced = pad_vocab(traced, mesh.size(axis))
    solution = solve_axis(traced, axis, mesh.size(axis), mesh.cluster.axis_link(mesh.axes, axis),
                          mesh.cluster.gpu, options)  # fmt: skip
    log(f"solved {axis}={mesh.size(axis)}: {solution.variables} variables, "
        f"{solution.tied_nodes} nodes tied to an identical block")  # fmt: skip
    if whole_model:
        _check_split(traced, solution, mesh, axis)
    grad = frozenset(n.name for n in needs_grad(traced))
    ctx = PassContext(mesh=mesh, axis=axis, choice=solution.choice, grad=grad, traced=traced,
                      replicate_outputs=options.replicate_outputs)  # fmt: skip
    gm, history = run_pipeline(torch.fx.GraphModule(traced.gm, copy.deepcopy(traced.gm.graph)), ctx)
    for rec in history:
        log(str(rec))
    plan = _plan(traced, gm, mesh, solution, axis)
    return Program(plan=plan, mesh=mesh, graph_module=gm, traced=traced, history=history)


def _reused(plan: Plan | None, mesh: Mesh) -> tuple[tuple[str, str], ...]:
    if plan is None:
        return ()
    if plan.mesh != mesh.axes:
        raise MeshError(f"the plan was made for Mesh{dict(plan.mesh)} but the mesh is {mesh}")
    return plan.choice


def _check_split(traced: Traced, solution: AxisSolution, mesh: Mesh, axis: str) -> None:
    """A tp degree must split some layer weight (any weight, in a model without layers);
    splitting only a padded vocabulary is not tensor parallelism."""
    size = mesh.size(axis)
    layered = [p for p, fqn in traced.params.items() if block_of(fqn)]
    params = layered or list(traced.params)
    if size > 1 and params and all(str(solution.choice[p].output) == "R" for p in params):
        what = "layer weight" if layered else "parameter"
        raise PlanError(
            f"no valid plan: no {what} of {traced.model_name} splits across {size} ranks "
            f"of {mesh}; its sizes are {describe_tp_dims(traced)}; choose a tensor-parallel "
            "degree that divides the heads, hidden or ffn size"
        )


def _plan(traced: Traced, gm: torch.fx.GraphModule, mesh: Mesh, sol: AxisSolution,
          axis: str) -> Plan:  # fmt: skip
    names = {**traced.params, **traced.buffers}
    params = tuple(
        (names[n.name], str(meta.layout(n)))
        for n in gm.graph.nodes
        if n.op == "placeholder" and n.name in traced.params
    )
    grad = {n.name for n in needs_grad(traced, gm)}
    notes = (
        f"solved {axis} exactly (HiGHS) over {sol.variables} variables; "
        f"{sol.tied_nodes} nodes share the decisions of an identical block",
        *_why(sol, mesh, axis),
    )
    return Plan(
        model=traced.model_name,
        mesh=mesh.axes,
        hardware=f"{mesh.cluster.gpu.name} ×{mesh.cluster.gpus_per_node}/node",
        params=params,
        collectives=tuple(collectives_of(gm, grad, mesh.sizes, names)),
        choice=tuple((k, str(v)) for k, v in sol.choice.items()),
        compute_s=sol.compute_s,
        comm_s=sol.comm_s,
        memory_bytes=sol.memory_bytes,
        notes=notes,
    )


def _why(sol: AxisSolution, mesh: Mesh, axis: str) -> list[str]:
    """What the cost model says about this axis beyond the chosen plan."""
    size, out = mesh.size(axis), []
    if axis == "tp" and size > 1:
        out.append(f"{axis} splits the weights (never the batch): rank 0 holds "
                   f"{sol.memory_bytes / 2**30:.2f} GiB of priced memory")  # fmt: skip
        link = mesh.cluster.axis_link(mesh.axes, axis)
        dp = sol.single_s / size + collective_time("all_reduce", sol.param_bytes, size, link)
        tp = sol.compute_s + sol.comm_s
        if dp < tp:
            out.append(
                f"the cost model predicts Mesh(dp={size}) (data parallelism: the batch split, "
                f"gradients all-reduced) at {dp * 1e3:.3g} ms per step vs {tp * 1e3:.3g} ms for "
                f"this plan ({tp / dp:.2f}x faster); split as asked"
            )
    if sol.unsplit:
        out.append(f"stay whole (no even split on {size} ranks): {', '.join(sol.unsplit)}")
    cap = mesh.cluster.gpu.hbm_bytes
    if sol.memory_bytes > cap:
        out.append(f"does not fit: {sol.memory_bytes / 2**30:.1f} GiB per rank > "
                   f"{cap / 2**30:.0f} GiB on {mesh.cluster.gpu.name}")  # fmt: skip
    return out


class _Progress:
    def __init__(self, enabled: bool) -> None:
        self.enabled, self.start = enabled, time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(f"[autopar {time.perf_counter() - self.start:6.2f}s] {msg}", flush=True)
