"""The report's facts for a compiled program (`autopar.program.Program`, on any mesh).

Algorithm (`program_facts`):
1. Stages: the program's stage programs (one without pp); their `Plan` records are the
   source of layouts, collectives, compute and communication seconds.
2. Mesh: each axis's stride in the mesh's row-major rank order and the link
   `Cluster.axis_link` gives it (the one `Mesh.describe` prints).
3. Communication: every collective the program lists (`prog.collectives()`: the stages'
   plus the data axis's gradient reduction), bytes by axis, kind and direction, each as many
   times as a step runs it (`Plan.runs_per_step`: under pp a stage's every micro-batch); the
   time of each stage's step is its plan's `compute_s` and `comm_s`, the expert axis's its `comm_s`.
4. Memory: with a data axis its plan's ZeRO table as recorded (the dp section's `memory`,
   limit `memory_limit`); per pipeline rank the rows `data_parallel.memory_table` takes its
   maximum over, at the chosen stage; without a data axis the same measure at dp = 1.
5. Schedule: the pipeline's simulated timeline (`Program.timeline`'s simulation) and
   the measured events when given; layouts and per-rank code of one rank per pipeline rank.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from autopar.plan import Plan
from autopar.tools.report_facts import AxisRow, Facts, MemoryBar, Schedule, comm_rows, simulated


def program_facts(prog: Any, measured: Any = None) -> Facts:
    """Steps 1-5 (see the module docstring)."""
    plans = core_plans(prog)
    dp = prog.plan.dp
    memory, capacity, note = _memory(prog, dp)
    step, step_note = _step(prog, plans, prog.plan)
    return Facts(
        title=f"{prog.model_name} on {prog.mesh}",
        summary=_summary(prog, plans, dp), cluster=prog.mesh.cluster,
        axes=_axes(prog, plans), comm=comm_rows(list(prog.collectives()), prog.plan.runs_per_step),
        step=step, step_note=step_note, memory=memory, capacity=capacity, memory_note=note,
        pipeline_memory=_pipeline_memory(prog, dp),
        schedule=_schedule(prog, measured), layouts=_layouts(plans), code=_code(prog),
        notes=tuple(n for sec in (prog.plan.dp, prog.plan.ep) if sec for n in sec.notes) + tuple(
            n for p in plans for n in p.notes),
    )  # fmt: skip


def core_plans(prog: Any) -> list[Any]:
    """Step 1: the `Plan` record of each pipeline stage (one without a pipeline)."""
    return [s.plan for s in prog.stages]


def _core_axes(prog: Any) -> list[str]:
    """The axes the stage programs split (tp, cp): not the batch axes, not pp."""
    return [a for a, s in prog.mesh.axes if s > 1 and a not in ("dp", "ep", "pp")]


def _axes(prog: Any, plans: list[Any]) -> tuple[AxisRow, ...]:
    """Step 2; the exposed seconds where one record prices exactly one axis."""
    mesh, cl = prog.mesh, prog.mesh.cluster
    sizes = [s for _, s in mesh.axes]
    ep_s = prog.plan.ep.comm_s if prog.plan.ep else None
    inner_axes = _core_axes(prog)
    core_s = plans[0].comm_s if len(plans) == 1 and len(inner_axes) == 1 else None
    out = []
    for i, (axis, size) in enumerate(mesh.axes):
        if size <= 1:
            continue
        stride = math.prod(sizes[i + 1 :])
        link = cl.axis_link(mesh.axes, axis)
        seconds = ep_s if axis == "ep" else core_s if axis in inner_axes else None
        out.append(AxisRow(axis=axis, size=size, stride=stride, links=(link.name,),
                           in_node=link is cl.intra, exposed_s=seconds))  # fmt: skip
    return tuple(out)


def _step(prog: Any, plans: list[Any], top: Plan) -> tuple[tuple, str]:
    """Step 3: each stage plan's compute and communication seconds, the ep section's."""
    axes = "·".join(_core_axes(prog)) or "none"
    step: list[tuple[str, float]] = []
    for i, plan in enumerate(plans):
        name = f"stage {i} " if len(plans) > 1 else ""
        step.append((f"{name}compute", plan.compute_s))
        if axes != "none":
            step.append((f"{name}{axes} comm", plan.comm_s))
    step += [("ep comm", top.ep.comm_s)] if top.ep else []
    note = (
        "predicted seconds per micro-batch (forward + backward) of each stage's plan"
        if len(plans) > 1
        else "predicted seconds of one step (forward + backward)"
    )
    if top.dp:
        note += "; the data axis's plan records its bytes, not a time"
    return tuple(step), note


def _memory(prog: Any, dp: Any) -> tuple[tuple[MemoryBar, ...], float, str]:
    """Step 4: the ZeRO table of the data-parallel plan, or the same measure at dp = 1."""
    if dp is not None:
        bars = tuple(_bar(f"ZeRO-{m.stage}", m, m.stage == dp.zero) for m in dp.memory)
        return (
            bars,
            dp.memory_limit,
            (
                "per rank, most loaded pipeline rank "
                "(the plan's dp section, memory); no reserve is counted"
            ),
        )
    from autopar.axes.data_parallel import StateBytes, memory_table

    table = memory_table(prog, 1, StateBytes.for_dtype(_param_dtype(prog)))
    note = "per rank without a data axis (data_parallel.memory_table at dp = 1)"
    return (_bar("no ZeRO (dp = 1)", table[0], True),), prog.mesh.cluster.gpu.hbm_bytes, note


def _bar(label: str, m: Any, chosen: bool) -> MemoryBar:
    return MemoryBar(label=label, weights=m.weights, grads=m.grads, optimizer=m.optimizer,
                     activations=m.activations, reserve=0.0, chosen=chosen)  # fmt: skip


def _param_dtype(prog: Any) -> torch.dtype:
    return prog.pipeline.config.param_dtype if prog.pipeline else torch.float32


def position_rows(prog: Any, dp: int, stage: int, param_dtype: torch.dtype) -> list[Any]:
    """Step 4: per pipeline rank the `ZeroMemory` row at `stage` that `memory_table` takes
    its maximum over (`data_parallel.position_rows`, the rows kept)."""
    from autopar.axes import data_parallel as D

    return D.position_rows(prog, dp, stage, D.StateBytes.for_dtype(param_dtype))


def _pipeline_memory(prog: Any, dp: Any) -> tuple[MemoryBar, ...]:
    """Step 4 per pipeline rank (empty without a pipeline)."""
    if prog.mesh.size("pp") <= 1:
        return ()
    if dp is not None:
        rows = position_rows(prog, prog.mesh.size("dp"), dp.zero, getattr(torch, dp.param_dtype))
    else:
        rows = position_rows(prog, 1, 0, _param_dtype(prog))
    top = max(range(len(rows)), key=lambda i: rows[i].total)
    return tuple(_bar(f"pp rank {i}", r, i == top) for i, r in enumerate(rows))


def _schedule(prog: Any, measured: Any) -> Schedule | None:
    """Step 5: the simulated timeline, with measured (rank, F|B, mb, t0, t1) events."""
    if prog.pipeline is None:
        return None
    c, p = prog.pipeline.config, prog.mesh.size("pp")
    sim = simulated(c.order, p, c.n_microbatches, c.virtual_stages,
                    name=f"{c.schedule}, {p} pipeline ranks, {c.n_microbatches} micro-batches, "
                         f"{len(prog.stages)} stages")  # fmt: skip
    events = tuple((int(r), str(k), int(m), float(a), float(b))
                   for r, k, m, a, b in (measured or ()))  # fmt: skip
    return Schedule(name=sim.name, slots=sim.slots, bubble=sim.bubble, measured=events)


def _layouts(plans: list[Any]) -> tuple[tuple[str, str, int], ...]:
    """Step 5: parameter layouts per module-path pattern, over every stage's plan."""
    from autopar.plan import _patterns

    total: Counter = Counter()
    for plan in plans:
        total.update(_patterns(plan.params))
    return tuple((pattern, lay, n) for (pattern, lay), n in total.items())


def _code(prog: Any) -> tuple[tuple[str, str], ...]:
    """Step 5: the per-rank code of the first rank of each pipeline rank."""
    mesh = prog.mesh
    ranks = [mesh.rank_of({"pp": r}) for r in range(mesh.size("pp"))]
    out = []
    for rank in ranks:
        coords = ", ".join(f"{a}={c}" for a, c in mesh.coordinates(rank).items())
        out.append((f"rank {rank} ({coords})", prog.code(rank)))
    return tuple(out)


def _summary(prog: Any, plans: list[Any], dp: Any) -> tuple[tuple[str, str], ...]:
    out = [("mesh", "; ".join(prog.mesh.describe())), ("plan", prog.plan.label),
           ("priced on", plans[0].hardware)]  # fmt: skip
    if prog.pipeline is not None:
        c = prog.pipeline.config
        out.append(("pipeline", f"{len(prog.stages)} stages, {c.schedule}, "
                                f"{c.n_microbatches} micro-batches"))  # fmt: skip
    if dp is not None:
        out.append(("data axis", f"dp={prog.mesh.size('dp')}, ZeRO-{dp.zero}, global batch "
                                 f"{dp.batch}"))  # fmt: skip
    return tuple(out)
