"""verify: run the per-rank programs and the single-device model on the same inputs and
compare outputs and every parameter gradient, by one path for every mesh.

Algorithm:
1. Compile the model for ``mesh`` (virtual: no processes) and read the program through its
   wrappers (:func:`program_view`): the batch axes present (dp, then ep), the programs on the
   other axes (the whole tp / cp one, or each pipeline stage), the expert parameters.
2. Single device: forward, then backward of sum(output * cotangent) over every floating
   output leaf, cotangents drawn from a fixed seed (with a scalar loss: the loss scaled by
   one random number); under pp the scalar loss alone.
3. Each rank of a persistent Gloo worker pool runs on its slice of the batch over the batch
   axes its module forward + backward with its shard of the cotangents (batched ones sliced
   too, and scaled by dp under a mean loss over dp), or under pp its share's pipeline step;
   under dp in torch's DDP / FSDP2.  The job runs twice; an output or gradient that is not
   bitwise identical across the runs fails as nondeterministic (a race, uninitialised memory).
4. Per batch replica and program: batched outputs concatenated over the replicas, expert
   gradients over ep; split tensors reassembled by their layouts, every replica of a
   replicated one compared, each row at its worst (autopar.compare: the relative error and
   the non-finite and shape checks).
5. An fp32 run that fails on tolerance alone runs again on float64 copies of the model and
   inputs.  A relu whose input lies within fp32 rounding of zero takes a different branch in
   two summation orders and moves a gradient by a whole unit (seen on OPT: one of 98k
   pre-activations at 1.5e-8 vs -3.1e-8); in float64 that needs an input within 1e-16 of
   the kink.  The report passes when the float64 run passes at the same tolerance and shows
   both; a wrong collective fails both.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar.api import autoparallelize
from autopar.axes.data_parallel import batch_slices
from autopar.codegen import shard_tensor
from autopar.compare import (
    TensorCheck,
    VerifyReport,
    bitwise_equal,
    check,
    failed,
    scale_of,
    wholes,
)
from autopar.frontend.trace import join_pieces
from autopar.ir import meta
from autopar.ir.layout import Layout
from autopar.mesh import Mesh
from autopar.ops import collectives
from autopar.program import Program, StageProgram
from autopar.runtime.pool import get_pool


def verify(model: nn.Module, mesh: Mesh, example_inputs: Sequence[Any],
           loss_fn: Callable[..., torch.Tensor] | None = None, *,
           example_kwargs: dict[str, Any] | None = None, rtol: float = 1e-4, seed: int = 0,
           reference_dtype: torch.dtype | None = None,
           **compile_options: Any) -> VerifyReport:  # fmt: skip
    """Compare ``model`` with its parallel program on ``mesh`` (steps 1-5).

    ``reference_dtype=torch.float64`` runs the single-device reference on a float64 copy of
    the model: the truth, for programs whose kernels round differently from the model's own
    (ring attention): a gradient that is exactly zero in exact arithmetic (a key bias under
    softmax) is then compared with zero, not with the fp32 kernel's rounding noise."""
    report = _verify(model, mesh, example_inputs, loss_fn, example_kwargs=example_kwargs,
                     rtol=rtol, seed=seed, reference_dtype=reference_dtype,
                     **compile_options)  # fmt: skip
    if report.ok or not _recheckable(report, model, reference_dtype):
        return report
    wide = copy.deepcopy(model).to(torch.float64)
    inputs, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: t.to(torch.float64) if t.dtype == torch.float32 else t,
        (tuple(example_inputs), example_kwargs))  # fmt: skip
    try:
        again = _verify(wide, mesh, inputs, loss_fn, example_kwargs=kwargs, rtol=rtol, seed=seed,
                        **compile_options)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - an op without a float64 kernel: keep the fp32 verdict
        return dataclasses.replace(report, recheck_error=f"{type(exc).__name__}: {exc}"[:300])
    return dataclasses.replace(report, recheck=again)


def _recheckable(report: VerifyReport, model: nn.Module, reference_dtype: Any) -> bool:
    """Step 5 applies to fp32 runs that failed on tolerance alone (no NaN, no race)."""
    params = list(model.parameters())
    return (reference_dtype is None and bool(params)
            and all(p.dtype == torch.float32 and not p.is_meta for p in params)
            and all(r.ok or not r.note for r in report.rows))  # fmt: skip


def _verify(model: nn.Module, mesh: Mesh, example_inputs: Sequence[Any],
            loss_fn: Callable[..., torch.Tensor] | None = None, *,
            example_kwargs: dict[str, Any] | None = None, rtol: float = 1e-4, seed: int = 0,
            reference_dtype: torch.dtype | None = None,
            **compile_options: Any) -> VerifyReport:  # fmt: skip
    """Steps 1-4 once."""
    prog = autoparallelize(model, mesh, example_inputs, loss_fn,
                           example_kwargs=example_kwargs, **compile_options)  # fmt: skip
    mesh = getattr(getattr(prog, "search", None), "mesh", prog.mesh)  # Mesh.auto: the chosen one
    if reference_dtype is not None:
        model = _in_dtype(model, reference_dtype)
    view = program_view(prog)
    ref_out, ref_grads, cots = _reference(model, example_inputs, example_kwargs, loss_fn, seed,
                                          unit_cotangent=view.pipeline)  # fmt: skip
    jobs = rank_jobs(view, example_inputs, example_kwargs, cots)
    pool = get_pool(prog.mesh.world_size)
    runs = [pool.run(_rank_step, prog.mesh.axes, jobs) for _ in range(2)]
    return VerifyReport(mesh=str(mesh), rtol=rtol, rows=tuple(_rows(view, runs, ref_out,
                                                                    ref_grads, rtol)))  # fmt: skip


def _in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` in ``dtype`` whose floating inputs are cast to it on the way in (an
    fp32 input would otherwise meet float64 weights, e.g. in a LayerNorm)."""
    copied = copy.deepcopy(model).to(dtype)
    cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
    copied.register_forward_pre_hook(lambda _, args, kwargs: pytree.tree_map_only(
        torch.Tensor, cast, (args, kwargs)), with_kwargs=True)  # fmt: skip
    return copied


def _reference(model: nn.Module, args: Sequence[Any], kwargs: dict | None,
               loss_fn: Callable | None, seed: int,
               unit_cotangent: bool = False) -> tuple[list, dict, list]:  # fmt: skip
    """Step 2: output leaves, gradients under every parameter name, cotangents."""
    model.zero_grad(set_to_none=True)
    kwargs = kwargs or {}
    out = loss_fn(model(*args[:-1], **kwargs), args[-1]) if loss_fn else model(*args, **kwargs)
    leaves, gen = pytree.tree_leaves(out), torch.Generator().manual_seed(seed)
    wanted = [isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad
              and (x.dim() == 0 or not unit_cotangent) for x in leaves]  # fmt: skip
    cots = [None if not w else torch.ones(()) if unit_cotangent  # pp: the scalar loss alone
            else torch.randn(x.shape, generator=gen, dtype=x.dtype)
            for x, w in zip(leaves, wanted, strict=True)]  # fmt: skip
    _seed_backward(leaves, cots)
    named = model.named_parameters(remove_duplicate=False)  # a tied weight under every name
    grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
    return [x.detach() for x in leaves], grads, cots


def _seed_backward(leaves: list, cots: list) -> None:
    terms = [(x * c).sum() for x, c in zip(leaves, cots, strict=True) if c is not None]
    if terms:
        torch.stack(terms).sum().backward()


@dataclass(frozen=True, kw_only=True)
class ProgramView:
    """What autoparallelize returned, read through its dp / ep wrappers (step 1)."""

    top: Any  # the returned program: its module(rank), or under pp its share(rank), runs
    batch: tuple[tuple[str, int], ...]  # the batch axes present (dp, then ep) and their sizes
    units: tuple[tuple[int | None, StageProgram], ...]  # (stage, or None: no pp; its program)
    experts: frozenset[str]  # expert parameters: each ep rank holds its experts (dim 0)
    data: tuple[int, str, tuple[str, ...]] | None  # dp: ZeRO stage, reduction, ZeRO axes
    scale: int  # cotangent factor of batched outputs: dp under a mean loss
    replicas: tuple[tuple[int, ...], ...]  # every batch replica: a coordinate per batch axis

    @property
    def pipeline(self) -> bool:
        return self.units[0][0] is not None


def program_view(prog: Program) -> ProgramView:
    """Step 1: the batch axes (dp, then ep), the ZeRO settings, the expert weights and the
    stage programs of ``prog``."""
    batch, data, scale = [], None, 1
    if prog.plan.dp:
        dp, section = prog.mesh.size("dp"), prog.plan.dp
        batch.append(("dp", dp))
        data = (section.zero, section.reduction, section.zero_axes)
        scale = dp if section.reduction == "mean" else 1
    if prog.plan.ep:
        batch.append(("ep", prog.mesh.size("ep")))
    experts = frozenset(w for layer in prog.layers for w in layer.weights)
    units = (tuple(enumerate(prog.stages)) if prog.pipeline is not None
             else ((None, prog.stages[0]),))  # fmt: skip
    replicas = tuple(itertools.product(*(range(n) for _, n in batch)))
    return ProgramView(top=prog, batch=tuple(batch), units=units, experts=experts, data=data,
                       scale=scale, replicas=replicas)  # fmt: skip


def output_layouts(prog: Program) -> list[Layout | None]:
    out = next(n for n in prog.graph_module.graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(out.args[0])
    return [meta.layout(a) if isinstance(a, torch.fx.Node) else None for a in leaves]


def _batched(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() > 0


def _batch_slice(t: Any, view: ProgramView, coords: dict[str, int]) -> Any:
    """A rank's slice of a batched tensor: its dp slice, then its ep slice of that."""
    for axis, n in view.batch if _batched(t) else ():
        t = batch_slices(t, n)[coords[axis]]
    return t


def rank_jobs(view: ProgramView, args: Sequence[Any], kwargs: dict | None,
              cots: list) -> list[tuple]:  # fmt: skip
    """Per rank, the arguments of :func:`_rank_step` (step 3)."""
    jobs, mesh = [], view.top.mesh
    lays = [] if view.pipeline else output_layouts(view.units[0][1])
    for rank in range(mesh.world_size):
        at = mesh.coordinates(rank)
        mine = (tuple(_batch_slice(a, view, at) for a in args),
                {k: _batch_slice(v, view, at) for k, v in (kwargs or {}).items()})  # fmt: skip
        if view.pipeline:
            jobs.append((view.top.share(rank), *mine, None, view.data))
            continue
        local = [_batch_slice(c, view, at) * view.scale if _batched(c) else c for c in cots]
        local = [shard_tensor(c, lay, mesh, at) if c is not None and lay is not None else c
                 for c, lay in zip(local, lays, strict=True)]  # fmt: skip
        jobs.append((view.top.module(rank), *mine, local, view.data))
    return jobs


def _rank_step(rank: int, groups: dict, target: Any, args: tuple, kwargs: dict,
               cots: list | None, data: tuple | None) -> tuple[list, dict]:  # fmt: skip
    """One rank: its module's forward + backward of ``cots``, or (``cots`` None) its pipeline
    share's step; under dp (``data``) in torch's engines.  Returns the output leaves and
    {stage (None without pp): {parameter: this rank's gradient, ZeRO shards gathered}}."""
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.runtime import DataAxis, DataParallelModule, PipelineRunner

    collectives.bind(groups)  # dp too: global batch statistics (batch_mean over dp)
    if data is not None:
        zero, reduction, axes = data
        name = "_".join(axes)  # the ZeRO group: dp, or the pool's flattened dp x cp
        mesh = DeviceMesh.from_group(groups[name], "cpu", mesh_dim_names=(name,))
    if cots is None:
        axis = data and DataAxis(group=groups["dp"], mesh=mesh, zero=zero, reduction=reduction,
                                 shard_group=groups[name])  # fmt: skip
        runner = PipelineRunner(target, groups["pp"], data=axis)
        loss = runner.step(*args, **kwargs)
        return [loss], {s: _grads(m) for s, m in runner.modules.items()}
    target.zero_grad(set_to_none=True)
    module = target if data is None else DataParallelModule(
        target, group=groups["dp"], dp_mesh=mesh, zero=zero, reduction=reduction,
        shard_group=groups[name])  # fmt: skip
    leaves = pytree.tree_leaves(module(*args, **kwargs))
    _seed_backward(leaves, cots)
    return [x.detach() for x in leaves], {None: module.full_grads() if data else _grads(target)}


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.detach()
            for n, p in module.named_parameters() if p.grad is not None}  # fmt: skip


def replica(view: ProgramView, results: list, stage: int | None, prog: Program,
            choice: tuple[int, ...]) -> list[tuple[list, dict]]:  # fmt: skip
    """Per rank of ``prog`` in batch replica ``choice`` (step 4): its outputs, batched ones
    concatenated over every replica, and its gradients, expert ones concatenated over ep."""
    at = {}
    for rank, (outs, grads) in enumerate(results):
        c = view.top.mesh.coordinates(rank)
        if stage in grads:
            at[(tuple(c[a] for a, _ in view.batch), prog.mesh.rank_of(
                {a: c.get(a, 0) for a, _ in prog.mesh.axes}))] = (outs, grads[stage])  # fmt: skip
    peers = [b for b in view.replicas  # choice and its replicas over ep
             if all(a == "ep" or x == y for (a, _), x, y in zip(view.batch, b, choice))]  # noqa: B905
    out = []
    for k in range(prog.mesh.world_size):
        outs, grads = at[(choice, k)]
        outs = [torch.cat([at[(b, k)][0][i] for b in view.replicas]) if _batched(x) else x
                for i, x in enumerate(outs)]  # fmt: skip
        held = {n: [at[(b, k)][1][n] for b in peers if n in at[(b, k)][1]] for n in view.experts}
        out.append((outs, {**grads, **{n: torch.cat(gs) for n, gs in held.items() if gs}}))
    return out


def _rows(view: ProgramView, runs: list[list], ref_out: list, ref_grads: dict,
          rtol: float) -> list[TensorCheck]:  # fmt: skip
    """Step 4: every output and gradient, its candidates from every batch replica of the
    first run; one differing bitwise between the two runs (step 3) fails."""
    found: dict[str, list] = {}  # row name -> [kind, reference, candidates (None: missing), same]

    def add(name: str, kind: str, ref: torch.Tensor, wholes: list | None, same: bool) -> None:
        row = found.setdefault(name, [kind, ref, [], True])
        row[2] = None if wholes is None or row[2] is None else row[2] + wholes
        row[3] &= same

    if view.pipeline:  # the loss over the whole batch (mean of micro-batch losses), every rank
        ref_out = [next(x for x in ref_out if x.dim() == 0)]
        add("loss", "output", ref_out[0], [outs[0] for outs, _ in runs[0]],
            all(bitwise_equal(a[0][0], b[0][0]) for a, b in zip(*runs, strict=True)))  # fmt: skip
    for choice, (stage, prog) in itertools.product(view.replicas, view.units):
        first, second = (replica(view, run, stage, prog, choice) for run in runs)
        pairs = list(zip(first, second, strict=True))
        outputs = [] if view.pipeline else zip(output_layouts(prog), ref_out, strict=True)
        for i, (lay, r) in enumerate(outputs):
            if isinstance(r, torch.Tensor) and r.is_floating_point():
                add(f"output[{i}] {tuple(r.shape)}", "output", r,
                    wholes([o[i] for o, _ in first], lay, prog.mesh),
                    all(bitwise_equal(a[0][i], b[0][i]) for a, b in pairs))  # fmt: skip
        layouts = {prog.traced.params[n.name]: meta.layout(n) for n in prog.graph_module.graph.nodes
                   if n.op == "placeholder" and n.name in prog.traced.params}  # fmt: skip
        order, groups = {n: i for i, (n, _) in enumerate(prog.plan.params)}, {}
        pieces = prog.traced.pieces
        for n in sorted(layouts, key=lambda n: order.get(n, len(order))):  # user FQN -> pieces
            groups.setdefault(pieces[n].fqn if n in pieces else n, []).append(n)
        for fqn, names in groups.items():
            if fqn in ref_grads:
                add(fqn + ("" if stage is None else f" (stage {stage})"), "grad", ref_grads[fqn],
                    _grad_wholes(prog, fqn, names, layouts, [g for _, g in first]),
                    all(bitwise_equal(a[1].get(n), b[1].get(n))
                        for a, b in pairs for n in names))  # fmt: skip
    scale = {"output": scale_of(ref_out), "grad": scale_of(list(ref_grads.values()))}
    rows = [failed(name, kind, "no gradient on some rank") if ours is None else
            check(name, kind, ours, None, ref, view.top.mesh, rtol, scale[kind])
            for name, (kind, ref, ours, _) in found.items()]  # fmt: skip
    note = "nondeterministic across identical runs"
    return [r if found[r.name][3] else dataclasses.replace(
        r, ok=False, note="; ".join(filter(None, [r.note, note]))) for r in rows]  # fmt: skip


def _grad_wholes(prog: Program, fqn: str, names: list[str], layouts: dict,
                 per_rank: list[dict]) -> list[torch.Tensor] | None:  # fmt: skip
    """The whole gradients of parameter ``fqn`` held under ``names`` (pieces side by side per
    rank; a padded vocabulary cut back to its size), None where a rank has none."""
    pieces = prog.traced.pieces
    names = sorted(names, key=lambda n: pieces[n].start if n in pieces else 0)
    cols = [[grads.get(name) for grads in per_rank] for name in names]
    if any(g is None for col in cols for g in col):
        return None
    cols = [wholes(col, layouts[name], prog.mesh) for name, col in zip(names, cols, strict=True)]
    whole = cols[0] if len(cols) == 1 else [  # a reassembled piece: the same on every rank
        join_pieces([c[min(r, len(c) - 1)] for c in cols], [pieces[n] for n in names])
        for r in range(max(map(len, cols)))]  # fmt: skip
    rows = prog.traced.padded.get(fqn)
    return whole if rows is None else [w[:rows] for w in whole]
