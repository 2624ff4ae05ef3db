"""verify: run the per-rank programs and the single-device model on the same inputs and
compare outputs and every parameter gradient.

Algorithm:
1. Compile the model for ``mesh`` (a virtual mesh: no processes needed for this step).
2. Single device: forward, then backward of sum(output * cotangent) over every floating
   output leaf, with cotangents drawn from a fixed seed (with a scalar loss this is the loss
   scaled by one random number).
3. Ranks: each rank of a persistent Gloo worker pool runs its module on the same inputs with
   its shard of the same cotangents, and returns its outputs and parameter gradients.  The
   job runs twice; any output or gradient that is not bitwise identical across the two runs
   fails as nondeterministic (uninitialised memory, a race, a stray in-place update).
4. Reassemble split outputs and gradients by their layouts; compare every replica of a
   replicated one.  A NaN or infinity in ours or in the reference fails as non-finite.
   Relative error = max |ours - ref| / (max |ref| + 1e-3 * S), S the largest finite
   reference magnitude among tensors of the same kind: a tensor whose exact value is zero
   (a key bias's gradient: softmax ignores a constant shift) is judged against rounding
   noise of its neighbours, not divided by its own noise.
5. An fp32 run that fails on tolerance alone runs again on float64 copies of the model and
   inputs (a fresh compile).  A relu whose input lies within fp32 rounding of zero takes a
   different branch in two summation orders and moves a gradient by a whole unit (seen on
   OPT: one of 98k pre-activations at 1.5e-8 vs -3.1e-8); in float64 that needs an input
   within 1e-16 of the kink.  The report passes when the float64 run passes at the same
   tolerance and shows both; a wrong collective fails both.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from autopar import collectives, meta
from autopar.api import autoparallelize
from autopar.codegen import shard_tensor, unshard_tensors
from autopar.layout import Layout
from autopar.mesh import Mesh
from autopar.pool import get_pool
from autopar.program import Program


@dataclass(frozen=True, kw_only=True)
class TensorCheck:
    """One compared tensor."""

    name: str
    kind: str  # 'output' or 'grad'
    max_abs: float
    max_rel: float
    ok: bool
    note: str = ""  # why it failed beyond the error: non-finite, nondeterministic, shape

    def __str__(self) -> str:
        mark = "ok " if self.ok else "BAD"
        row = f"{mark} {self.kind:<6} {self.name:<52} abs {self.max_abs:9.2e}  rel {self.max_rel:9.2e}"
        return f"{row}  {self.note}" if self.note else row


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """Per-tensor comparison of the parallel program against the single-device model."""

    mesh: str
    rtol: float
    rows: tuple[TensorCheck, ...]
    recheck: VerifyReport | None = None  # the float64 re-run of a failed fp32 one (step 5)
    recheck_error: str = ""  # why that re-run could not run (an op with no float64 kernel)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows) or (self.recheck is not None and self.recheck.ok)

    @property
    def max_rel_error(self) -> float:
        return max((r.max_rel for r in self.rows), default=0.0)

    def __str__(self) -> str:
        head = (f"verify on {self.mesh}: {'OK' if self.ok else 'MISMATCH'} · "
                f"{len(self.rows)} tensors · max relative error {self.max_rel_error:.2e} "
                f"(tolerance {self.rtol:.0e})")  # fmt: skip
        lines = [head, *map(str, self.rows)]
        if self.recheck is not None:
            bad = sum(not r.ok for r in self.rows)
            verdict = ("the fp32 mismatch is rounding amplified by a non-smooth op (a relu or "
                       "max whose input is within rounding of its kink), not the program"
                       if self.recheck.ok else "the program is wrong in float64 too")  # fmt: skip
            lines += [f"fp32: {bad} tensor(s) over tolerance; re-run in float64: "
                      f"{'OK' if self.recheck.ok else 'MISMATCH'}, max relative error "
                      f"{self.recheck.max_rel_error:.2e}: {verdict}"]  # fmt: skip
            if not self.recheck.ok:
                lines += ["float64 run:", *map(str, self.recheck.rows)]
        if self.recheck_error:
            lines += [f"re-run in float64 not possible ({self.recheck_error}): the fp32 verdict "
                      "stands"]  # fmt: skip
        return "\n".join(lines)


def verify(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: Sequence[Any],
    loss_fn: Callable[..., torch.Tensor] | None = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    rtol: float = 1e-4,
    seed: int = 0,
    reference_dtype: torch.dtype | None = None,
    **compile_options: Any,
) -> VerifyReport:
    """Compare ``model`` with its parallel programs on ``mesh`` (steps 1-5).

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
    inputs, kwargs = pytree.tree_map_only(torch.Tensor, _widen,
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


def _widen(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64) if t.dtype == torch.float32 else t


def _verify(model: nn.Module, mesh: Mesh, example_inputs: Sequence[Any],
            loss_fn: Callable[..., torch.Tensor] | None = None, *,
            example_kwargs: dict[str, Any] | None = None, rtol: float = 1e-4, seed: int = 0,
            reference_dtype: torch.dtype | None = None,
            **compile_options: Any) -> VerifyReport:  # fmt: skip
    """Steps 1-4 once."""
    prog = autoparallelize(model, mesh, example_inputs, loss_fn,
                           example_kwargs=example_kwargs, **compile_options)  # fmt: skip
    mesh = getattr(getattr(prog, "search", None), "mesh", mesh)  # Mesh.auto: the chosen mesh
    if reference_dtype is not None:
        model = _in_dtype(model, reference_dtype)
    if "dp" in mesh.sizes:
        return _verify_data_parallel(prog, model, example_inputs, example_kwargs, loss_fn, rtol,
                                     seed)  # fmt: skip
    if "ep" in mesh.sizes:
        return _verify_expert_parallel(prog, model, example_inputs, example_kwargs, loss_fn,
                                       rtol, seed)  # fmt: skip
    if "pp" in mesh.sizes:
        return _verify_pipeline(prog, model, example_inputs, example_kwargs, loss_fn, rtol)
    ref_out, ref_grads, cots = _reference(model, example_inputs, example_kwargs, loss_fn, seed)
    results = run_ranks(prog, example_inputs, example_kwargs, cots)
    again = run_ranks(prog, example_inputs, example_kwargs, cots)
    out_scale = _scale(ref_out)
    grad_scale = _scale(list(ref_grads.values()))
    rows = _compare_outputs(prog, ref_out, [r[0] for r in results], rtol, out_scale)
    rows += _compare_grads(prog, ref_grads, [r[1] for r in results], rtol, grad_scale)
    unstable = unstable_names(prog, results, again)
    rows = [_mark_unstable(r) if r.name in unstable else r for r in rows]
    return VerifyReport(mesh=str(mesh), rtol=rtol, rows=tuple(rows))


def _in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of ``model`` in ``dtype`` whose floating inputs are cast to it on the way in (an
    fp32 input would otherwise meet float64 weights, e.g. in a LayerNorm)."""
    copied = copy.deepcopy(model).to(dtype)

    def cast(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                               and t.is_floating_point() else t, (args, kwargs))  # fmt: skip

    copied.register_forward_pre_hook(cast, with_kwargs=True)
    return copied


def _reference(model: nn.Module, args: Sequence[Any], kwargs: dict | None,
               loss_fn: Callable | None, seed: int,
               unit_cotangent: bool = False) -> tuple[list, dict, list]:  # fmt: skip
    model.zero_grad(set_to_none=True)
    kwargs = kwargs or {}
    out = loss_fn(model(*args[:-1], **kwargs), args[-1]) if loss_fn else model(*args, **kwargs)
    leaves = pytree.tree_leaves(out)
    gen = torch.Generator().manual_seed(seed)
    cots = [torch.randn(x.shape, generator=gen, dtype=x.dtype) if _floating(x) else None
            for x in leaves]  # fmt: skip
    if unit_cotangent:  # pipelines differentiate the scalar loss alone
        cots = [torch.ones(()) if _floating(x) and x.dim() == 0 else None for x in leaves]
    _seed_backward(leaves, cots)
    named = model.named_parameters(remove_duplicate=False)  # a tied weight under every name
    grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
    return [x.detach() for x in leaves], grads, cots


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.requires_grad


def _seed_backward(leaves: list, cots: list) -> None:
    terms = [(x * c).sum() for x, c in zip(leaves, cots, strict=True) if c is not None]
    if terms:
        torch.stack(terms).sum().backward()


def output_layouts(prog: Program) -> list[Layout | None]:
    out = next(n for n in prog.graph_module.graph.nodes if n.op == "output")
    leaves = pytree.tree_leaves(out.args[0])
    return [meta.layout(a) if isinstance(a, torch.fx.Node) else None for a in leaves]


def run_ranks(prog: Program, args: Sequence[Any], kwargs: dict | None, cots: list) -> list:
    """Forward + backward of every rank's module on the worker pool (step 3)."""
    world = prog.mesh.world_size
    lays = output_layouts(prog)
    jobs = []
    for rank in range(world):
        coords = prog.mesh.coordinates(rank)
        local = [shard_tensor(c, lay, prog.mesh, coords) if c is not None and lay is not None
                 else c for c, lay in zip(cots, lays, strict=True)]  # fmt: skip
        jobs.append((prog.module(rank), tuple(args), dict(kwargs or {}), local))
    return get_pool(world).run(_rank_step, prog.mesh.axes, jobs)


def _rank_step(rank: int, groups: dict, module: torch.fx.GraphModule, args: tuple,
               kwargs: dict, cots: list) -> tuple[list, dict]:  # fmt: skip
    collectives.bind(groups)
    module.zero_grad(set_to_none=True)
    leaves = pytree.tree_leaves(module(*args, **kwargs))
    _seed_backward(leaves, cots)
    grads = {n: p.grad.detach() for n, p in module.named_parameters() if p.grad is not None}
    return [x.detach() for x in leaves], grads


def unstable_names(prog: Program, first: list, second: list) -> set[str]:
    """Row names of the outputs and gradients that differ bitwise between two identical runs
    on any rank (step 3)."""
    names = set()
    for (outs_a, grads_a), (outs_b, grads_b) in zip(first, second, strict=True):
        names |= {_output_name(i, a) for i, (a, b) in enumerate(zip(outs_a, outs_b, strict=True))
                  if not bitwise_equal(a, b)}  # fmt: skip
        names |= {n for n in grads_a.keys() | grads_b.keys()
                  if not bitwise_equal(grads_a.get(n), grads_b.get(n))}  # fmt: skip
    return names


def bitwise_equal(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (NaN payloads included); non-tensors by ``==``."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return a is b or (type(a) is type(b) and a == b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return torch.equal(*as_bytes)


def _mark_unstable(row: TensorCheck) -> TensorCheck:
    note = "; ".join(filter(None, [row.note, "nondeterministic across identical runs"]))
    return dataclasses.replace(row, ok=False, note=note)


def _output_name(i: int, ref: Any) -> str:
    return f"output[{i}] {tuple(ref.shape)}" if isinstance(ref, torch.Tensor) else f"output[{i}]"


def _scale(tensors: list) -> float:
    """Largest finite magnitude among floating tensors (non-finite ones fail on their own)."""
    mags = [
        t.detach().abs().nan_to_num(nan=0.0, posinf=0.0).max().item()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()
    ]
    return max(mags, default=0.0)


def _compare_outputs(prog: Program, ref: list, per_rank: list[list], rtol: float,
                     scale: float) -> list:  # fmt: skip
    rows = []
    for i, (lay, r) in enumerate(zip(output_layouts(prog), ref, strict=True)):
        if not isinstance(r, torch.Tensor) or not r.is_floating_point():
            continue
        ours = [outs[i] for outs in per_rank]
        name = _output_name(i, r)
        rows.append(_check(name, "output", ours, lay, r, prog.mesh, rtol, scale))
    return rows


def _compare_grads(prog: Program, ref: dict, per_rank: list[dict], rtol: float,
                   scale: float) -> list:  # fmt: skip
    lays = {fqn: lay for fqn, lay in prog.plan.params}
    layouts = {prog.traced.params[n.name]: meta.layout(n) for n in prog.graph_module.graph.nodes
               if n.op == "placeholder" and n.name in prog.traced.params}  # fmt: skip
    rows = []
    groups = _param_groups(prog.traced.pieces, sorted(layouts, key=list(lays).index))
    for fqn, names in groups.items():
        tied = [
            n
            for n, g in ref.items()
            if n == fqn or prog.traced.tensors.get(n) is prog.traced.tensors[fqn]
        ]
        if not tied:
            continue
        ours, lay = _rank_grads(prog.mesh, prog.traced.pieces, names, layouts, per_rank)
        if ours is None or any(g is None for g in ours):
            rows.append(_failed(fqn, "grad", "no gradient on some rank"))
            continue
        rows.append(_check(fqn, "grad", ours, lay, ref[fqn], prog.mesh, rtol, scale,
                           prog.traced.padded.get(fqn)))  # fmt: skip
    return rows


def _stage_layouts(stage: Any) -> dict[str, Layout | None]:
    """Parameter name -> layout in a compiled stage (or whole) program."""
    return {stage.traced.params[n.name]: meta.layout(n) for n in stage.graph_module.graph.nodes
            if n.op == "placeholder" and n.name in stage.traced.params}  # fmt: skip


def _param_groups(pieces: dict, names: list[str]) -> dict[str, list[str]]:
    """User parameter FQN -> the program's names for it: itself, or its pieces in order
    (a fused projection cut per block, autopar/fused.py)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(pieces[name].fqn if name in pieces else name, []).append(name)
    for group in groups.values():
        group.sort(key=lambda n: pieces[n].start if n in pieces else 0)
    return groups


def _rank_grads(mesh: Mesh, pieces: dict, names: list[str], layouts: dict,
                per_rank: list[dict]) -> tuple[list | None, Layout | None]:  # fmt: skip
    """(each rank's gradient, its layout) of one user parameter held under ``names``: one
    name as it is; pieces assembled per rank (layout None: every rank's whole is checked)."""
    if len(names) == 1 and names[0] not in pieces:
        return [grads.get(names[0]) for grads in per_rank], layouts[names[0]]
    return _assembled(mesh, pieces, names, layouts, per_rank), None


def _assembled(mesh: Mesh, pieces: dict, names: list[str], layouts: dict,
               per_rank: list[dict]) -> list[torch.Tensor] | None:  # fmt: skip
    """Per rank, the whole gradient of a parameter held as pieces: a replicated piece as
    that rank holds it (every replica is checked), a split one reassembled from all ranks."""
    coords = [mesh.coordinates(r) for r in range(mesh.world_size)]
    columns = []
    for name in names:
        shards = [grads.get(name) for grads in per_rank]
        if any(g is None for g in shards):
            return None
        lay = layouts[name]
        if lay is not None and not lay.is_replicated:
            shards = [unshard_tensors(shards, lay, mesh, coords)] * len(shards)
        columns.append(shards)
    dim = pieces[names[0]].dim
    return [torch.cat([col[r] for col in columns], dim) for r in range(len(per_rank))]


def _check(name: str, kind: str, ours: list[torch.Tensor], lay: Layout | None, ref: torch.Tensor,
           mesh: Mesh, rtol: float, kind_scale: float,
           rows: int | None = None) -> TensorCheck:  # fmt: skip
    """Compare (every replica of, or the reassembled) ``ours`` with ``ref``; ``rows`` cuts a
    padded vocabulary back to its size."""
    coords = [mesh.coordinates(r) for r in range(mesh.world_size)]
    if lay is None or lay.is_replicated:
        candidates = ours  # every replica must match
    else:
        candidates = [unshard_tensors(ours, lay, mesh, coords)]
    if rows is not None:
        candidates = [c[:rows] for c in candidates]
    bad = [f"shape {tuple(c.shape)}, expected {tuple(ref.shape)}"
           for c in candidates if c.shape != ref.shape]  # fmt: skip
    if bad:
        return _failed(name, kind, bad[0])
    where = [w for w, ts in (("ours", candidates), ("reference", [ref]))
             if not all(torch.isfinite(t).all() for t in ts)]  # fmt: skip
    if where:
        return _failed(name, kind, f"non-finite (NaN/inf) in {' and '.join(where)}")
    scale = max(_scale([ref]) + 1e-3 * kind_scale, 1e-30)
    worst = max((c.double() - ref.double()).abs().max().item() if ref.numel() else 0.0
                for c in candidates)  # fmt: skip
    return TensorCheck(
        name=name, kind=kind, max_abs=worst, max_rel=worst / scale, ok=worst / scale <= rtol
    )


def _failed(name: str, kind: str, note: str) -> TensorCheck:
    inf = float("inf")
    return TensorCheck(name=name, kind=kind, max_abs=inf, max_rel=inf, ok=False, note=note)


def _verify_pipeline(prog: Any, model: nn.Module, args: Sequence[Any], kwargs: dict | None,
                     loss_fn: Callable | None, rtol: float) -> VerifyReport:  # fmt: skip
    """Pipelines: the loss over the whole batch (mean of micro-batch losses) and every gradient
    (every copy of a tied weight) against one full-batch step on one device."""
    ref_out, ref_grads, _ = _reference(model, args, kwargs, loss_fn, seed=0, unit_cotangent=True)
    ref_loss = next(x for x in ref_out if x.dim() == 0)
    world = prog.mesh.world_size
    jobs = [(prog.share(r), tuple(args), dict(kwargs or {})) for r in range(world)]
    results = get_pool(world).run(_pipeline_rank_step, prog.mesh.axes, jobs)
    again = get_pool(world).run(_pipeline_rank_step, prog.mesh.axes, jobs)
    rows = _pipeline_rows(prog, results, again, ref_loss, ref_grads, rtol)
    return VerifyReport(mesh=str(prog.mesh), rtol=rtol, rows=tuple(rows))


def _pipeline_rows(prog: Any, results: list, again: list, ref_loss: torch.Tensor,
                   ref_grads: dict, rtol: float) -> list[TensorCheck]:  # fmt: skip
    world = prog.mesh.world_size
    unstable = _unstable_pipeline(results, again)
    rows = [_check("loss", "output", [loss for loss, _ in results], None, ref_loss, prog.mesh, rtol,
                   ref_loss.abs().item())]  # fmt: skip
    scale = _scale(list(ref_grads.values()))
    for stage_id, stage in enumerate(prog.stages):
        layouts = _stage_layouts(stage)
        ranks = [r for r in range(world) if stage_id in results[r][1]]
        per_rank = [results[r][1][stage_id] for r in ranks]
        for fqn, names in _param_groups(stage.traced.pieces, list(layouts)).items():
            if fqn not in ref_grads:
                continue
            shards, lay = _rank_grads(stage.mesh, stage.traced.pieces, names, layouts, per_rank)
            name = f"{fqn} (stage {stage_id})"
            if shards is None or any(g is None for g in shards):
                rows.append(_failed(name, "grad", "no gradient on some rank"))
                continue
            rows.append(_check(name, "grad", shards, lay, ref_grads[fqn], stage.mesh, rtol, scale))
    return [_mark_unstable(r) if r.name in unstable else r for r in rows]


def _unstable_pipeline(first: list, second: list) -> set[str]:
    names = set()
    for (loss_a, grads_a), (loss_b, grads_b) in zip(first, second, strict=True):
        names |= set() if bitwise_equal(loss_a, loss_b) else {"loss"}
        names |= {f"{fqn} (stage {s})" for s, grads in grads_a.items() for fqn, g in grads.items()
                  if not bitwise_equal(g, grads_b.get(s, {}).get(fqn))}  # fmt: skip
    return names


def _pipeline_rank_step(rank: int, groups: dict, share: Any, args: tuple, kwargs: dict) -> tuple:
    from autopar.runtime import PipelineRunner

    collectives.bind(groups)
    runner = PipelineRunner(share, groups["pp"])
    loss = runner.step(*args, **kwargs)
    grads = {s: {n: p.grad.detach() for n, p in m.named_parameters() if p.grad is not None}
             for s, m in runner.modules.items()}  # fmt: skip
    return loss, grads


def _verify_data_parallel(prog: Any, model: nn.Module, args: Sequence[Any], kwargs: dict | None,
                          loss_fn: Callable | None, rtol: float, seed: int) -> VerifyReport:  # fmt: skip
    """Data axis: every rank runs its sub-mesh module on its batch slice under DDP / FSDP2;
    batched outputs are concatenated along the batch, scalar ones (the loss, all-reduced) and
    every gradient (after the dp reduction, ZeRO shards gathered) must match on each dp
    replica.  A mean loss averages gradients over dp, so the cotangents of batched outputs
    are scaled by dp to keep their single-device weight."""
    if "pp" in prog.mesh.sizes and "ep" in prog.mesh.sizes:
        return _verify_ep_pipeline(prog.inner, model, args, kwargs, loss_fn, rtol, outer=prog)
    if "pp" in prog.mesh.sizes:
        return _verify_dp_pipeline(prog, model, args, kwargs, loss_fn, rtol)
    if "ep" in prog.mesh.sizes:
        return _verify_dp_expert(prog, model, args, kwargs, loss_fn, rtol, seed)
    return _verify_replicas(prog, model, args, kwargs, loss_fn, rtol, seed, "dp", _dp_job,
                            _dp_rank_step, _dp_replica)  # fmt: skip


def _verify_replicas(prog: Any, model: nn.Module, args: Sequence[Any], kwargs: dict | None,
                     loss_fn: Callable | None, rtol: float, seed: int, axis: str, job: Callable,
                     step: Callable, replica: Callable) -> VerifyReport:  # fmt: skip
    """Run every rank twice on its ``job`` (a dp or ep slice) and compare every replica of the
    inner program (``replica(prog, results, i)`` for each coordinate i of ``axis``) with the
    reference; each row keeps its worst replica."""
    ref_out, ref_grads, cots = _reference(model, args, kwargs, loss_fn, seed)
    jobs = [job(prog, rank, args, kwargs, cots) for rank in range(prog.mesh.world_size)]
    pool = get_pool(prog.mesh.world_size)
    results = pool.run(step, prog.mesh.axes, jobs)
    again = pool.run(step, prog.mesh.axes, jobs)
    replicas = [replica(prog, results, i) for i in range(prog.mesh.size(axis))]
    unstable = unstable_names(prog.inner, results, again)
    out_scale, grad_scale = _scale(ref_out), _scale(list(ref_grads.values()))
    worst: dict[str, TensorCheck] = {}
    for per_inner in replicas:
        rows = _compare_outputs(prog.inner, ref_out, [r[0] for r in per_inner], rtol, out_scale)
        rows += _compare_grads(prog.inner, ref_grads, [r[1] for r in per_inner], rtol, grad_scale)
        for row in rows:
            if row.name not in worst or _worse(row, worst[row.name]):
                worst[row.name] = row
    rows = [_mark_unstable(r) if r.name in unstable else r for r in worst.values()]
    return VerifyReport(mesh=str(prog.mesh), rtol=rtol, rows=tuple(rows))


def _worse(a: TensorCheck, b: TensorCheck) -> bool:
    return (not a.ok and b.ok) or a.max_rel > b.max_rel


def _dp_job(prog: Any, rank: int, args: Sequence[Any], kwargs: dict | None, cots: list) -> tuple:
    from autopar.data_parallel import batch_slices

    dp, d = prog.mesh.size("dp"), prog.mesh.coordinates(rank)["dp"]
    inner_coords = prog.inner_mesh.coordinates(prog.inner_rank(rank))
    scale = dp if prog.plan.reduction == "mean" else 1

    def mine(t: Any) -> Any:
        return batch_slices(t, dp)[d] if isinstance(t, torch.Tensor) and t.dim() else t

    local = []
    for c, lay in zip(cots, output_layouts(prog.inner), strict=True):
        if c is not None and c.dim():
            c = mine(c) * scale
            c = shard_tensor(c, lay, prog.inner_mesh, inner_coords) if lay is not None else c
        local.append(c)
    return (prog.module(rank), tuple(mine(a) for a in args),
            {k: mine(v) for k, v in (kwargs or {}).items()}, local, prog.plan.zero,
            prog.plan.reduction, prog.plan.zero_axes)  # fmt: skip


def _dp_replica(prog: Any, results: list, d: int) -> list[tuple[list, dict]]:
    """Per sub-mesh rank: outputs (batched ones concatenated over dp, scalars of replica d)
    and the gradients of replica ``d``."""
    ranks = {}
    for rank in range(prog.mesh.world_size):
        ranks[(prog.mesh.coordinates(rank)["dp"], prog.inner_rank(rank))] = rank
    out = []
    for r in range(prog.inner_mesh.world_size):
        parts = [results[ranks[(e, r)]][0] for e in range(prog.mesh.size("dp"))]
        mine = results[ranks[(d, r)]]
        outs = [torch.cat([p[i] for p in parts]) if isinstance(x, torch.Tensor) and x.dim()
                else x for i, x in enumerate(mine[0])]  # fmt: skip
        out.append((outs, mine[1]))
    return out


def _dp_rank_step(rank: int, groups: dict, module: torch.fx.GraphModule, args: tuple,
                  kwargs: dict, cots: list, zero: int, reduction: str,
                  zero_axes: tuple[str, ...] = ("dp",)) -> tuple[list, dict]:  # fmt: skip
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.runtime import DataParallelModule

    collectives.bind(groups)  # dp too: global batch statistics (batch_mean over dp)
    name = "_".join(zero_axes)  # the ZeRO group: dp, or the pool's flattened dp x cp
    zero_mesh = DeviceMesh.from_group(groups[name], "cpu", mesh_dim_names=(name,))
    wrapped = DataParallelModule(module, group=groups["dp"], dp_mesh=zero_mesh, zero=zero,
                                 reduction=reduction, shard_group=groups[name])  # fmt: skip
    leaves = pytree.tree_leaves(wrapped(*args, **kwargs))
    _seed_backward(leaves, cots)
    return [x.detach() for x in leaves], wrapped.full_grads()


def _verify_dp_pipeline(prog: Any, model: nn.Module, args: Sequence[Any], kwargs: dict | None,
                        loss_fn: Callable | None, rtol: float) -> VerifyReport:  # fmt: skip
    """dp x pp: every rank runs its pipeline share on its batch slice with its stages under
    DDP / FSDP2; each dp replica's loss (all-reduced) and gradients match one device."""
    from autopar.data_parallel import batch_slices

    ref_out, ref_grads, _ = _reference(model, args, kwargs, loss_fn, seed=0, unit_cotangent=True)
    ref_loss = next(x for x in ref_out if x.dim() == 0)
    dp, jobs = prog.mesh.size("dp"), []
    for rank in range(prog.mesh.world_size):
        d = prog.mesh.coordinates(rank)["dp"]

        def mine(t: Any, d: int = d) -> Any:
            return batch_slices(t, dp)[d] if isinstance(t, torch.Tensor) and t.dim() else t

        jobs.append((prog.share(rank), tuple(mine(a) for a in args),
                     {k: mine(v) for k, v in (kwargs or {}).items()}, prog.plan.zero,
                     prog.plan.reduction))  # fmt: skip
    pool = get_pool(prog.mesh.world_size)
    results = pool.run(_dp_pipeline_rank_step, prog.mesh.axes, jobs)
    again = pool.run(_dp_pipeline_rank_step, prog.mesh.axes, jobs)
    worst: dict[str, TensorCheck] = {}
    for d in range(dp):
        ranks = sorted((prog.inner_rank(r), r) for r in range(prog.mesh.world_size)
                       if prog.mesh.coordinates(r)["dp"] == d)  # fmt: skip
        rows = _pipeline_rows(prog.inner, [results[r] for _, r in ranks],
                              [again[r] for _, r in ranks], ref_loss, ref_grads, rtol)  # fmt: skip
        for row in rows:
            if row.name not in worst or _worse(row, worst[row.name]):
                worst[row.name] = row
    return VerifyReport(mesh=str(prog.mesh), rtol=rtol, rows=tuple(worst.values()))


def _dp_pipeline_rank_step(rank: int, groups: dict, share: Any, args: tuple, kwargs: dict,
                           zero: int, reduction: str) -> tuple:  # fmt: skip
    from torch.distributed.device_mesh import DeviceMesh

    from autopar.runtime import DataAxis, PipelineRunner

    collectives.bind(groups)  # dp too: global batch statistics (batch_mean over dp)
    dp_mesh = DeviceMesh.from_group(groups["dp"], "cpu", mesh_dim_names=("dp",))
    data = DataAxis(group=groups["dp"], mesh=dp_mesh, zero=zero, reduction=reduction)
    runner = PipelineRunner(share, groups["pp"], data=data)
    loss = runner.step(*args, **kwargs)
    grads = {s: {n: _whole_grad(p.grad) for n, p in m.named_parameters() if p.grad is not None}
             for s, m in runner.modules.items()}  # fmt: skip
    return loss, grads


def _whole_grad(g: torch.Tensor) -> torch.Tensor:
    return g.full_tensor() if hasattr(g, "full_tensor") else g.detach()


def _verify_expert_parallel(prog: Any, model: nn.Module, args: Sequence[Any],
                            kwargs: dict | None, loss_fn: Callable | None, rtol: float,
                            seed: int) -> VerifyReport:  # fmt: skip
    """Expert axis: every rank runs its module on its batch slice (the loss is global in
    forward, each rank's share in backward, so cotangents are not scaled); batched outputs
    are concatenated over ep, expert gradients over ep on dim 0, and every ep replica's dense
    gradients must match."""
    if "pp" in prog.mesh.sizes:
        return _verify_ep_pipeline(prog, model, args, kwargs, loss_fn, rtol)
    return _verify_replicas(prog, model, args, kwargs, loss_fn, rtol, seed, "ep", _ep_job,
                            _rank_step, _ep_replica)  # fmt: skip


def _ep_job(prog: Any, rank: int, args: Sequence[Any], kwargs: dict | None, cots: list) -> tuple:
    from autopar.data_parallel import batch_slices

    ep, e = prog.mesh.size("ep"), prog.mesh.coordinates(rank)["ep"]
    inner_coords = prog.inner_mesh.coordinates(prog.inner_rank(rank))

    def mine(t: Any) -> Any:
        return batch_slices(t, ep)[e] if isinstance(t, torch.Tensor) and t.dim() else t

    local = []
    for c, lay in zip(cots, output_layouts(prog.inner), strict=True):
        if c is not None and c.dim():
            c = mine(c)
            c = shard_tensor(c, lay, prog.inner_mesh, inner_coords) if lay is not None else c
        local.append(c)
    return (prog.module(rank), tuple(mine(a) for a in args),
            {k: mine(v) for k, v in (kwargs or {}).items()}, local)  # fmt: skip


def _ep_replica(prog: Any, results: list, e: int) -> list[tuple[list, dict]]:
    """Per sub-mesh rank: outputs (batched ones concatenated over ep, scalars of replica e),
    expert gradients concatenated over ep, dense gradients of replica ``e``."""
    ranks = {(prog.mesh.coordinates(r)["ep"], prog.inner_rank(r)): r
             for r in range(prog.mesh.world_size)}  # fmt: skip
    experts = {w for layer in prog.plan.layers for w in layer.weights}
    out = []
    for r in range(prog.inner_mesh.world_size):
        parts = [results[ranks[(i, r)]] for i in range(prog.mesh.size("ep"))]
        outs, grads = parts[e]
        outs = [torch.cat([p[0][i] for p in parts]) if isinstance(x, torch.Tensor) and x.dim()
                else x for i, x in enumerate(outs)]  # fmt: skip
        names = dict.fromkeys(n for p in parts for n in p[1])  # a per-expert one: one rank
        grads = {n: torch.cat([p[1][n] for p in parts if n in p[1]]) if n in experts
                 else grads[n] for n in names}  # fmt: skip
        out.append((outs, grads))
    return out


def _verify_dp_expert(prog: Any, model: nn.Module, args: Sequence[Any], kwargs: dict | None,
                      loss_fn: Callable | None, rtol: float, seed: int) -> VerifyReport:  # fmt: skip
    """dp x ep: each dp replica runs the expert-parallel program on its batch slice under
    DDP / FSDP2 over dp; batched outputs are concatenated over dp (and ep), gradients of every
    (dp, ep) replica must match."""
    from autopar.data_parallel import batch_slices

    ep_prog, dp = prog.inner, prog.mesh.size("dp")
    ref_out, ref_grads, cots = _reference(model, args, kwargs, loss_fn, seed)
    scale = dp if prog.plan.reduction == "mean" else 1

    def mine(t: Any, d: int) -> Any:
        return batch_slices(t, dp)[d] if isinstance(t, torch.Tensor) and t.dim() else t

    jobs = []
    for rank in range(prog.mesh.world_size):
        d = prog.mesh.coordinates(rank)["dp"]
        local = [mine(c, d) * scale if c is not None and c.dim() else c for c in cots]
        job = _ep_job(ep_prog, prog.inner_rank(rank), tuple(mine(a, d) for a in args),
                      {k: mine(v, d) for k, v in (kwargs or {}).items()}, local)  # fmt: skip
        jobs.append((prog.module(rank), *job[1:], prog.plan.zero, prog.plan.reduction))
    pool = get_pool(prog.mesh.world_size)
    results = pool.run(_dp_rank_step, prog.mesh.axes, jobs)
    again = pool.run(_dp_rank_step, prog.mesh.axes, jobs)
    unstable = unstable_names(ep_prog.inner, results, again)
    at = {(prog.mesh.coordinates(r)["dp"], prog.inner_rank(r)): r for r in range(len(results))}
    per_dp = [[results[at[(d, i)]] for i in range(ep_prog.mesh.world_size)] for d in range(dp)]
    out_scale, grad_scale = _scale(ref_out), _scale(list(ref_grads.values()))
    worst: dict[str, TensorCheck] = {}
    for d in range(dp):
        for e in range(ep_prog.mesh.size("ep")):
            reps = [_ep_replica(ep_prog, per_dp[x], e) for x in range(dp)]
            per_inner = [([torch.cat([reps[x][r][0][i] for x in range(dp)])
                           if isinstance(o, torch.Tensor) and o.dim() else o
                           for i, o in enumerate(reps[d][r][0])], reps[d][r][1])
                         for r in range(len(reps[d]))]  # fmt: skip
            rows = _compare_outputs(ep_prog.inner, ref_out, [p[0] for p in per_inner], rtol,
                                    out_scale)  # fmt: skip
            rows += _compare_grads(ep_prog.inner, ref_grads, [p[1] for p in per_inner], rtol,
                                   grad_scale)  # fmt: skip
            for row in rows:
                if row.name not in worst or _worse(row, worst[row.name]):
                    worst[row.name] = row
    rows = [_mark_unstable(r) if r.name in unstable else r for r in worst.values()]
    return VerifyReport(mesh=str(prog.mesh), rtol=rtol, rows=tuple(rows))


def _verify_ep_pipeline(prog: Any, model: nn.Module, args: Sequence[Any], kwargs: dict | None,
                        loss_fn: Callable | None, rtol: float,
                        outer: Any = None) -> VerifyReport:  # fmt: skip
    """pp x ep (under dp when ``outer`` is the data-parallel program wrapping ``prog``): every
    rank runs its pipeline share on its (dp, then ep) batch slice, its stages under DDP /
    FSDP2 over dp; the loss on every rank and each stage's gradients (expert ones
    concatenated over ep, dense ones on every (dp, ep) replica) against one full-batch step
    on one device."""
    from autopar.data_parallel import batch_slices

    ref_out, ref_grads, _ = _reference(model, args, kwargs, loss_fn, seed=0, unit_cotangent=True)
    ref_loss = next(x for x in ref_out if x.dim() == 0)
    top = outer if outer is not None else prog
    world, dp, ep = top.mesh.world_size, top.mesh.size("dp"), prog.mesh.size("ep")
    coords = [top.mesh.coordinates(r) for r in range(world)]

    def mine(t: Any, c: dict[str, int]) -> Any:
        if not (isinstance(t, torch.Tensor) and t.dim()):
            return t
        return batch_slices(batch_slices(t, dp)[c.get("dp", 0)], ep)[c["ep"]]

    jobs = []
    for r in range(world):
        share = outer.share(r) if outer is not None else prog.share(r)
        job = (share, tuple(mine(a, coords[r]) for a in args),
               {k: mine(v, coords[r]) for k, v in (kwargs or {}).items()})  # fmt: skip
        jobs.append((*job, outer.plan.zero, outer.plan.reduction) if outer is not None else job)
    step = _dp_pipeline_rank_step if outer is not None else _pipeline_rank_step
    results = get_pool(world).run(step, top.mesh.axes, jobs)
    again = get_pool(world).run(step, top.mesh.axes, jobs)
    unstable = _unstable_pipeline(results, again)
    worst: dict[str, TensorCheck] = {}
    for d in range(dp):
        ranks = [r for r in range(world) if coords[r].get("dp", 0) == d]
        rows = _ep_pipeline_rows(prog, [results[r] for r in ranks],
                                 [coords[r]["ep"] for r in ranks], ref_loss, ref_grads, rtol)  # fmt: skip
        for row in rows:
            if row.name not in worst or _worse(row, worst[row.name]):
                worst[row.name] = row
    rows = [_mark_unstable(r) if r.name in unstable else r for r in worst.values()]
    return VerifyReport(mesh=str(top.mesh), rtol=rtol, rows=tuple(rows))


def _ep_pipeline_rows(prog: Any, results: list, eps: list[int], ref_loss: torch.Tensor,
                      ref_grads: dict, rtol: float) -> list[TensorCheck]:  # fmt: skip
    """One data replica of a pp x ep run (``results`` of its ranks, ``eps`` their ep
    coordinates): the loss and each stage's gradients."""
    rows = [_check("loss", "output", [loss for loss, _ in results], None, ref_loss, prog.mesh,
                   rtol, ref_loss.abs().item())]  # fmt: skip
    scale = _scale(list(ref_grads.values()))
    experts = {w for layer in prog.plan.layers for w in layer.weights}
    for stage_id, stage in enumerate(prog.inner.stages):
        layouts = _stage_layouts(stage)
        by_ep = [[res[1][stage_id] for res, e_ in zip(results, eps, strict=True)
                  if e_ == e and stage_id in res[1]]
                 for e in range(prog.mesh.size("ep"))]  # fmt: skip
        for fqn, names in _param_groups(stage.traced.pieces, list(layouts)).items():
            if fqn not in ref_grads:
                continue
            got = [_rank_grads(stage.mesh, stage.traced.pieces, names, layouts, gs)
                   for gs in by_ep]  # fmt: skip
            per_ep, lay = [[None] if gs is None else gs for gs, _ in got], got[0][1]
            name = f"{fqn} (stage {stage_id})"
            held = [gs for gs in per_ep if gs and None not in gs]
            others = [g for gs in per_ep for g in gs if not held or gs is not held[0]]
            if fqn in experts and len(held) == 1 and all(g is None for g in others):
                per_ep = held  # a per-expert parameter (autopar.moe_loop): its ep rank's
            elif any(g is None for gs in per_ep for g in gs):
                rows.append(_failed(name, "grad", "no gradient on some rank"))
                continue
            elif fqn in experts:
                per_ep = [[torch.cat(parts) for parts in zip(*per_ep, strict=True)]]
            checks = [_check(name, "grad", shards, lay, ref_grads[fqn], stage.mesh, rtol, scale)
                      for shards in per_ep]  # fmt: skip
            rows.append(max(checks, key=lambda c: (not c.ok, c.max_rel)))
    return rows
