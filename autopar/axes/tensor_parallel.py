"""The tensor-parallel compile of one traced graph: solve the tp axis, run the passes, package
a :class:`autopar.program.StageProgram`.  ``autopar.driver`` (whole models), ``autopar.axes.pipeline`` (one stage at a
time) and ``autopar.axes.context_parallel`` (the tp program it splits) call it.

Algorithm (:func:`compile_traced`):
1. Pad vocabularies the degree does not divide (autopar.frontend.pad); cut fused projections of
   unequal blocks into one projection per block (autopar.frontend.fused); under mixed precision,
   annotate each value's autocast dtype (autopar.frontend.precision) so memory and collectives are
   priced in it.
2. Solve the tp axis with the cost model (autopar.planner.tp); a whole model must split some
   layer weight.
3. Run the pass pipeline (passes.run_pipeline): layouts, lowerings, collectives, local shapes;
   then the overlap planner part (autopar.planner.overlap) prices decomposing each tp gather /
   scatter under its matmuls and re-gathering the gathered inputs in backward, and
   ``overlap_tp`` applies what it keeps (the graph the cost model prices marks each
   re-gathered gather ``meta["regather"]``: its linears keep the shard).  The solve does not
   see that part, so when its re-gathers expose more than 1% of the step, a second solve
   prices each Megatron-SP re-layout as the overlap part will (``PlanOptions.price_regather``);
   its plan, lowered the same way, is kept when its step after the overlap part is cheaper
   (`_second_proposal`).
4. Build the :class:`Plan`: parameter layouts, one step's collectives, predicted cost, and the
   "why" lines (what the cost model says beyond the choice).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch

from autopar.errors import PlanError
from autopar.frontend.fused import split_fused_projections
from autopar.frontend.pad import pad_vocab
from autopar.frontend.precision import annotate_autocast
from autopar.frontend.trace import Traced
from autopar.ir import meta
from autopar.ir.analysis import block_of, needs_grad
from autopar.ir.printing import copy_module
from autopar.mesh import Mesh
from autopar.plan import Plan
from autopar.planner.overlap import OverlapChoice, choose_overlap, exposed_comm, overlap_line
from autopar.planner.tp import (
    AxisSolution,
    PlanOptions,
    describe_tp_dims,
    memory_weight,
    solve_axis,
)
from autopar.program import StageProgram, collectives_of
from cost.comm import collective_time
from cost.hardware import GPU
from cost.topology import Topology, nccl_advice
from passes import PassContext, TpDecisions, run_pipeline
from passes.overlap_tp import overlap_tp


def compile_traced(traced: Traced, mesh: Mesh, options: PlanOptions,
                   log: Callable[[str], None] = print, whole_model: bool = True) -> StageProgram:  # fmt: skip
    """Steps 2-4 for an already traced graph: the whole model, or one pipeline stage (which
    may hold nothing worth splitting, e.g. only an embedding)."""
    axis = "tp"
    traced = pad_vocab(traced, mesh.size(axis))
    if mesh.size(axis) > 1:
        traced = split_fused_projections(traced, mesh.size(axis))
    annotate_autocast(traced.gm, options.param_dtype)  # values priced in their runtime dtype
    _check_fixed(traced, options.fixed)
    solution = solve_axis(traced, axis, mesh.size(axis), mesh.cluster.axis_link(mesh.axes, axis),
                          mesh.cluster.gpu, options)  # fmt: skip
    log(f"solved {axis}={mesh.size(axis)}: {solution.variables} variables, "
        f"{solution.tied_nodes} nodes tied to an identical block")  # fmt: skip
    if whole_model:
        _check_split(traced, solution, mesh, axis)
    built = _lower(traced, mesh, options, solution, axis)
    if (built.overlap.regather_s > PROPOSAL_SHARE * built.objective(options, mesh.cluster.gpu)
            and not options.fixed and options.overlap_fixed is None):  # fmt: skip
        built = _second_proposal(traced, mesh, options, built, axis, log)
        if whole_model:
            _check_split(traced, built.solution, mesh, axis)
    for rec in built.history:
        log(str(rec))
    plan = _plan(traced, built.priced, mesh, built.solution, axis, built.overlap, built.notes)
    return StageProgram(plan=plan, mesh=mesh, graph_module=built.gm, traced=traced,
                        history=built.history, priced_graph=built.priced)  # fmt: skip


# the second proposal corrects what the solve did not price, the re-gathers' exposed seconds;
# below this share of the step they cannot buy a better plan worth two more solves and a
# lowering (fp32 Llama-3-70B on Mesh(tp=8): 1.7 s of a 6.9 s compile)
PROPOSAL_SHARE = 0.01


@dataclasses.dataclass(frozen=True)
class _Lowered:
    """One solution run through the passes and the overlap part (step 3)."""

    solution: AxisSolution
    gm: torch.fx.GraphModule
    priced: torch.fx.GraphModule  # before overlap_tp: the graph the cost model prices
    history: list
    overlap: OverlapChoice
    notes: tuple[str, ...] = ()

    def objective(self, options: PlanOptions, gpu: GPU) -> float:
        """The predicted step after the overlap part, plus the solver's memory price."""
        sol = self.solution
        return (sol.compute_s + exposed_comm(self.overlap, sol.comm_s)
                + memory_weight(options, gpu) * sol.memory_bytes)  # fmt: skip


def _lower(traced: Traced, mesh: Mesh, options: PlanOptions, solution: AxisSolution,
           axis: str) -> _Lowered:  # fmt: skip
    grad = frozenset(n.name for n in needs_grad(traced))
    ctx = PassContext(mesh=mesh, grad=grad, traced=traced,
                      replicate_outputs=options.replicate_outputs,
                      sections={axis: TpDecisions(axis=axis, choice=solution.choice)})  # fmt: skip
    gm, history = run_pipeline(copy_module(traced.gm), ctx)
    overlap = choose_overlap(gm, mesh.size(axis), mesh.cluster.axis_link(mesh.axes, axis),
                             mesh.cluster.gpu, options.tp_overlap, options.overlap_fixed)  # fmt: skip
    priced = gm
    regathered = overlap.regathered  # what the cost model counts as kept: the shard
    for n in gm.graph.nodes:
        if n.name in regathered:
            n.meta["regather"] = True
    if overlap.keys or overlap.regather:
        tp = dataclasses.replace(ctx.section(axis), overlap=overlap.keys,
                                 regather=tuple(overlap.regather))  # fmt: skip
        gm, more = run_pipeline(copy_module(gm),
                                dataclasses.replace(ctx, sections={**ctx.sections, axis: tp}),
                                [overlap_tp])  # fmt: skip
        history += more
    return _Lowered(solution=solution, gm=gm, priced=priced, history=history, overlap=overlap)


def _second_proposal(traced: Traced, mesh: Mesh, options: PlanOptions, first: _Lowered,
                     axis: str, log: Callable[[str], None]) -> _Lowered:  # fmt: skip
    """Step 3's second proposal: the solve does not see the re-gathers the overlap part adds
    after it, so a plan that gathers more activations for linears (a hidden-split residual
    gathered before each projection) can win the solve and lose once they are added.  Solve
    again with every such gather priced with its re-gather (``price_regather``), lower that
    too, and keep the one whose step after the overlap part is cheaper (ties: the first)."""
    link = mesh.cluster.axis_link(mesh.axes, axis)
    with warnings.catch_warnings():  # the first solve said what there is to say of this graph
        warnings.simplefilter("ignore")
        try:
            proposal = solve_axis(traced, axis, mesh.size(axis), link, mesh.cluster.gpu,
                                  dataclasses.replace(options, price_regather=True))  # fmt: skip
            if proposal.choice == first.solution.choice:
                return first
            # priced as the first was (the overlap part adds the re-gathers): pinned
            pinned = tuple((name, str(s)) for name, s in proposal.choice.items())
            solution = solve_axis(traced, axis, mesh.size(axis), link, mesh.cluster.gpu,
                                  dataclasses.replace(options, fixed=pinned))  # fmt: skip
            second = _lower(traced, mesh, options, solution, axis)
        except PlanError:  # the proposal is optional; the first plan stands
            return first
    gpu = mesh.cluster.gpu
    a, b = first.objective(options, gpu), second.objective(options, gpu)
    if b >= a * (1 - 1e-6):
        return first
    line = (f"re-gather-aware second solve: {b * 1e3:.3f} ms per step after the overlap part, "
            f"vs {a * 1e3:.3f} ms for the first solve's plan (whose solve did not price its "
            f"{len(first.overlap.regather)} re-gathers)")  # fmt: skip
    log(line)
    return dataclasses.replace(second, notes=(line,))


def _check_fixed(traced: Traced, fixed: tuple[tuple[str, str], ...], shown: int = 5) -> None:
    """A reloaded plan's tp strategies must name nodes of this graph; names it lacks mean the
    plan was saved for another model (or another version of this one)."""
    names = {n.name for n in traced.gm.graph.nodes}
    unknown = [n for n, _ in fixed if n not in names]
    if unknown:
        more = f" and {len(unknown) - shown} more" if len(unknown) > shown else ""
        raise PlanError(
            f"the plan does not fit {traced.model_name}: it decides nodes the model does not "
            f"have ({', '.join(repr(n) for n in unknown[:shown])}{more}); was it saved for "
            "another model? re-plan without plan="
        )


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
          axis: str, overlap: OverlapChoice, extra: tuple[str, ...] = ()) -> Plan:  # fmt: skip
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
        *([overlap_line(overlap, sol.comm_s)] if overlap.keys or overlap.regather else []),
        *extra,
    )
    return Plan(
        model=traced.model_name,
        mesh=mesh.axes,
        hardware=f"{mesh.cluster.gpu.name} ×{mesh.cluster.gpus_per_node}/node",
        params=params,
        collectives=tuple(collectives_of(gm, grad, mesh.sizes, names, overlap.hidden,
                                         overlap.regathered)),  # fmt: skip
        choice=tuple((k, str(v)) for k, v in sol.choice.items()),
        compute_s=sol.compute_s,
        comm_s=exposed_comm(overlap, sol.comm_s),
        overlap=overlap.keys,
        memory_bytes=sol.memory_bytes,
        notes=notes,
        advice=nccl_advice(Topology(cluster=mesh.cluster), mesh.axes),
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
