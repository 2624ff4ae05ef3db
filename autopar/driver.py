"""The one compile driver: slice the batch once, trace once, build the program of every axis.

Algorithm (:func:`compile_model`):
1. Slice the example batch for the batch axes, once: B/dp per data rank (the batch must
   divide by dp, times the micro-batch count when one is given), B/(dp·ep) per expert rank,
   and under pp one micro-batch of that (the schedule and micro-batch count are settled
   first, :func:`autopar.axes.pipeline.pipeline_config`).
2. Trace the slice once (torch.export, autopar.frontend.trace; under ``param_dtype`` 16-bit
   with ``mixed_precision="cast"`` in that dtype, so every value carries the dtype it runs
   in and the planner prices it so); a trace the caller already holds at
   that slice (the whole-cluster search's) is reused.  Every program below is built from
   copies of this one graph: nothing re-traces, nothing calls the front door.
3. Build the program of the mesh without the batch axes (:func:`_core`): pp cuts stages and
   compiles each (tp, or cp x tp); else cp splits the sequence of the tp program; else the
   tp compile.  Each stage is priced in the recompute mode (autopar.axes.recompute.priced),
   and the stages make one :class:`autopar.program.Program` whose one phase is the
   ``recompute`` pass.
4. ep recognises the MoE layers of those stages, prices its section and returns the same
   stages on the ep mesh with the expert-axis phase run first (autopar.axes.expert_parallel).
5. dp chooses the ZeRO stage for the per-rank memory of that program and returns it on the
   whole mesh with its ``global_batch`` phase run last; under a memory limit it re-solves the
   sub-mesh (steps 3-4 on a fresh copy of the trace) for a stage whose fastest plan does not
   fit (autopar.axes.data_parallel).  Every step returns a Program: no axis wraps another's.
6. A reloaded plan is honoured at every step: each axis's section decides that axis, and
   the compiled program must carry the saved decisions (else a PlanError names them).
7. ``fp8=``: a phase rewrites every stage's eligible linears to float8 GEMMs (passes/fp8.py);
   the plan lists them and prices them at the FP8 peak; under ZeRO-2/3 (tensorwise) their
   weights' data-axis gathers move float8 and the dp step is re-priced with them.
8. ``compile=``: a last phase puts every stage's repeated blocks under torch.compile
   (passes/compile_blocks.py); the plan is the eager one, except where inductor's
   micro-pipelined TP runs the tp pairs (CUDA + NCCL): a why-line says so.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from autopar.errors import PlanError
from autopar.frontend.trace import Traced, trace
from autopar.ir.printing import copy_module
from autopar.mesh import Mesh
from autopar.options import Options
from autopar.plan import Plan, check_attention, check_split_points, honoured, section, settle
from autopar.planner.tp import PlanOptions
from autopar.program import Program, program_of


@dataclass(frozen=True, kw_only=True)
class Example:
    """The example call: positional and keyword inputs (the last positional one is the
    loss's target when a ``loss_fn`` is given)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def batch(self) -> int:
        """Dim 0 of the first batched tensor input (0: none)."""
        for t in (*self.args, *self.kwargs.values()):
            if isinstance(t, torch.Tensor) and t.dim():
                return t.shape[0]
        return 0


@dataclass(frozen=True, kw_only=True)
class Capture:
    """The one traced graph of a compile (step 2) and where progress lines go."""

    traced: Traced
    log: Callable[[str], None]

    def fresh(self) -> Traced:
        """A copy of the trace that passes may rewrite (vocab padding edits in place)."""
        t = self.traced
        return dataclasses.replace(t, gm=copy_module(t.gm))


class Progress:
    """Timestamped progress lines under ``verbose=True``."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.start = enabled, time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.enabled:
            print(f"[autopar {time.perf_counter() - self.start:6.2f}s] {msg}", flush=True)


def compile_model(model: nn.Module, mesh: Mesh, example: Example,
                  loss_fn: Callable | None, options: Options, *,
                  traces: dict[int, Traced] | None = None) -> Program:  # fmt: skip
    """Steps 1-6 on a virtual mesh.  ``traces`` (rows -> Traced) holds traces already made at
    a slice of that many rows (the search's); the one this call makes is added to it."""
    log = Progress(options.verbose)
    plan = options.plan
    if options.zero is not None and "dp" not in mesh.sizes:
        raise PlanError(f"zero={options.zero} shards over the data axis, but {mesh} has no dp "
                        "axis; use e.g. Mesh(dp=2, tp=2)")  # fmt: skip
    options = _settled(options, mesh, plan)
    prog = _build(model, mesh, example, loss_fn, options, plan, log, traces)
    return _compiled(_fp8(prog, options), options)


def _fp8(prog: Program, options: Options) -> Program:
    """``fp8=``: every stage's eligible linears in float8 (passes/fp8.py), run now so the
    plan says which linears run FP8, which stay and why, and prices their GEMMs."""
    if options.fp8 is None:
        return prog
    from autopar.program import fp8_phase
    from passes.fp8 import fp8_gathers, fp8_plan, head_paths

    batch = tuple(a for a in ("dp", "ep") if a in prog.mesh.sizes)
    heads = head_paths(prog.final(len(prog.stages) - 1).module)
    out = prog.then(prog.mesh, prog.plan, fp8_phase(options.fp8, heads, batch))
    rows = [row for i in range(len(out.stages)) for row in out.final(i).module.meta["fp8"][1]]
    plan, per_param = fp8_gathers(fp8_plan(out.plan, options.fp8, rows), options.fp8, rows)
    if per_param is not None and plan.dp.step is not None:  # the dp step with float8 gathers
        from autopar.axes.data_parallel import predict_step

        dp = plan.dp
        step = predict_step(out, out.mesh, dp.zero, dp.zero_axes, getattr(torch, dp.param_dtype),
                            gather_bytes=per_param)  # fmt: skip
        plan = dataclasses.replace(plan, dp=dataclasses.replace(
            dp, step=dataclasses.replace(dp.step, dp=step.dp)))  # fmt: skip
    return out.then(out.mesh, plan)


def _compiled(prog: Program, options: Options) -> Program:
    """``compile=``: the blocks of every stage under torch.compile, after every other phase;
    where inductor's micro-pipelined TP fuses the tp pairs (Options.micro_pipeline_tp) the
    plan says so (it priced them whole: autopar decomposed none)."""
    if not options.compile:
        return prog
    from autopar.ops.compiled import micro_pipeline_tp
    from autopar.program import compile_phase

    pipelined = options.micro_pipeline_tp and prog.mesh.sizes.get("tp", 1) > 1
    plan = prog.plan
    if pipelined:
        why = micro_pipeline_tp(options.backend)[1]
        plan = dataclasses.replace(plan, notes=(*plan.notes, f"tp overlap: {why}; priced "
                                                "whole (exposed)"))  # fmt: skip
    return prog.then(prog.mesh, plan, compile_phase(options.backend, pipelined))


def _build(model: nn.Module, mesh: Mesh, example: Example, loss_fn: Callable | None,
           options: Options, plan: Plan | None, log: Progress,
           traces: dict[int, Traced] | None) -> Program:  # fmt: skip
    """Steps 1-6."""
    sliced, config = _slice(mesh, example, options)
    capture = _capture(model, sliced, loss_fn, log, traces, options.cast_dtype)
    if "dp" not in mesh.sizes:
        return _experts(capture, mesh, options, plan, config, example.batch)
    from autopar.axes.data_parallel import compile_data_parallel

    sub, sub_plan = mesh.without("dp"), plan.without("dp") if plan else None
    calls = itertools.count()  # the first build takes the trace itself, re-solves a copy

    def inner(limit: float | None) -> Program:
        take = capture if next(calls) == 0 else dataclasses.replace(capture, traced=capture.fresh())
        return _experts(take, sub, options.replace(memory_limit=limit, plan=sub_plan), sub_plan,
                        config, example.batch // mesh.size("dp"))  # fmt: skip

    prog = compile_data_parallel(mesh, example.batch, inner, zero=options.zero,
                                 memory_limit=options.memory_limit,
                                 param_dtype=options.param_dtype,
                                 mixed_precision=options.mixed_precision,
                                 reduce_dtype=options.reduce_dtype,
                                 refit=plan is None)  # fmt: skip
    return honoured(plan, prog)


def _settled(options: Options, mesh: Mesh, plan: Plan | None) -> Options:
    """Options a reloaded plan decides, taken from it (given ones must agree): the recompute
    mode, ZeRO stage, capacity factor and the pipeline's schedule."""
    recompute = settle("recompute", options.recompute, plan.recompute if plan else None)
    changes: dict[str, Any] = {"recompute": recompute or "none"}
    if "dp" in mesh.sizes:
        saved = section(plan, "dp")
        changes["zero"] = settle("zero", options.zero, saved and saved.zero)
    if "ep" in mesh.sizes:
        saved = section(plan, "ep")
        changes["capacity_factor"] = settle("capacity_factor", options.capacity_factor,
                                            saved.capacity_factor if saved else None)  # fmt: skip
    if "pp" in mesh.sizes:
        saved = section(plan, "pp")
        check_split_points(options.split_points, saved)
        changes["n_microbatches"] = settle("n_microbatches", options.n_microbatches,
                                           saved and saved.n_microbatches)  # fmt: skip
        changes["schedule"] = settle("schedule", options.schedule,
                                     saved and saved.schedule) or "1f1b"  # fmt: skip
        changes["virtual_stages"] = settle("virtual_stages", options.virtual_stages,
                                           saved and saved.virtual_stages)  # fmt: skip
    return options.replace(**changes)


def _slice(mesh: Mesh, example: Example, options: Options) -> tuple[Example, Any]:
    """Step 1: rank 0's slice of the batch for dp and ep, and under pp its first micro-batch
    (with the pipeline's config)."""
    from autopar.axes.data_parallel import split_batch

    args, kwargs = example.args, example.kwargs
    if "dp" in mesh.sizes:
        args, kwargs = split_batch(args, kwargs, mesh.size("dp"), options.n_microbatches or 1)
    if "ep" in mesh.sizes:
        args, kwargs = split_batch(args, kwargs, mesh.size("ep"))
    if "pp" not in mesh.sizes:
        return Example(args=args, kwargs=kwargs), None
    from autopar.axes.pipeline import batch_size, microbatch, pipeline_config

    config = pipeline_config(mesh, batch_size(args, kwargs), options.n_microbatches,
                             options.schedule, options.virtual_stages, options.param_dtype,
                             options.mixed_precision)  # fmt: skip
    args, kwargs = microbatch(args, kwargs, config.n_microbatches)
    return Example(args=args, kwargs=kwargs), config


def _capture(model: nn.Module, sliced: Example, loss_fn: Callable | None,
             log: Callable[[str], None], traces: dict[int, Traced] | None,
             cast: torch.dtype | None = None) -> Capture:  # fmt: skip
    """Step 2: the one trace of the slice (``cast``: in that dtype, weights and inputs cast as
    FSDP2's MixedPrecisionPolicy runs the model; autopar.frontend.trace step 3).  A held trace
    (``traces``, made with the same ``cast``) is kept pristine: this compile rewrites a copy."""
    rows = sliced.batch
    held = traces is not None and rows in traces
    if not held:
        traced = trace(model, sliced.args, sliced.kwargs or None, loss_fn, cast=cast)
        log(f"traced {traced.model_name} on {rows or 'unbatched'} rows: "
            f"{len(traced.gm.graph.nodes)} nodes")  # fmt: skip
        if traces is None:
            return Capture(traced=traced, log=log)
        traces[rows] = traced
    capture = Capture(traced=traces[rows], log=log)
    return dataclasses.replace(capture, traced=capture.fresh())


def _experts(capture: Capture, mesh: Mesh, options: Options, plan: Plan | None, config: Any,
             batch: int) -> Program:  # fmt: skip
    """Step 4 (and 3 below it) on the mesh without dp."""
    if "ep" not in mesh.sizes:
        return _core(capture, mesh, options, plan, config)
    from autopar.axes.expert_parallel import compile_expert_parallel

    sub = mesh.without("ep")
    sub_plan = plan.without("ep") if plan else None
    inner_options = options.replace(strict=options.strict and sub.world_size > 1, plan=sub_plan)
    core = _core(capture, sub, inner_options, sub_plan, config)
    prog = compile_expert_parallel(mesh, batch, core, strict=options.strict,
                                   capacity_factor=options.capacity_factor)  # fmt: skip
    return honoured(plan, prog)


def _core(capture: Capture, mesh: Mesh, options: Options, plan: Plan | None,
          config: Any) -> Program:  # fmt: skip
    """Step 3: the program of the mesh without the batch axes (pp / cp / tp): its stages,
    priced in the recompute mode."""
    from autopar.axes.recompute import priced

    solver = PlanOptions(memory_limit=options.memory_limit, memory_weight=options.memory_weight,
                         strict=options.strict, fixed=plan.choice if plan else (),
                         param_dtype=options.autocast_dtype,
                         tp_overlap=options.overlap_mode,
                         overlap_fixed=plan.overlap if plan and not plan.stages else None,
                         solve_cache=options.plan_cache)  # fmt: skip
    check_attention(options.cp_attention, plan)
    traced, log = capture.traced, capture.log
    pipeline = None
    if "pp" in mesh.sizes:
        from autopar.axes.pipeline import compile_pipeline

        stages, pipeline = compile_pipeline(traced, mesh, config, solver, options.split_points,
                                            log, options.cp_attention, plan=plan)  # fmt: skip
    elif "cp" in mesh.sizes:
        from autopar.axes.context_parallel import check_cp_mesh, compile_traced_cp

        check_cp_mesh(mesh)
        stages = [compile_traced_cp(traced, mesh, options.cp_attention, solver, section(plan, "cp"))]
    else:
        from autopar.axes.tensor_parallel import compile_traced

        stages = [compile_traced(traced, mesh, solver, log)]
    mode = "none" if options.recompute is None else options.recompute
    stages = priced(stages, mode, whole=pipeline is None)
    return honoured(plan, program_of(mesh, stages, pipeline))


def example_of(example_inputs: Sequence[Any], example_kwargs: dict | None) -> Example:
    return Example(args=tuple(example_inputs), kwargs=dict(example_kwargs or {}))
