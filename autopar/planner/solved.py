"""A traced model priced as the compiler builds it: the search's `Priced` for one trace.

The whole-cluster search (`cost.search`, `cost.estimate`) prices a configuration from a
`Workload`; at tp = 1 that is `cost.graph` on the traced graph, the compiled plan's own count.
At tp > 1 a formula (Megatron's column/row pairing, with or without sequence parallelism)
would guess what the tp planner chooses; this model asks the planner instead.

Algorithm (`SolvedModel.workload`):
1. tp = cp = 1: the traced graph's `GraphModel` (each value in its autocast dtype, its
   16-bit RMSNorms fused as the compiled program's: passes.fuse_norms); with
   `retrace`, that of a trace of the micro-batch's rows (traced once per row count).
2. tp = t, cp = c, not both 1, once per (t, c, micro-batch rows) (memoised): compile the
   sub-mesh program the driver builds inside a data axis -- the tp program of `Mesh(tp=t)`
   (the tp ILP, identical blocks solved once, then the passes), or under cp the cp program of
   `Mesh(cp=c, tp=t)` with its dense gradients left to the data axis (`join_cp`) -- on a
   copy of a trace of that many rows (the slice the compiler traces: the tp ILP's choice may
   depend on it, so with `retrace` each slice is traced once; without, the one trace is
   compiled and scaled), and reduce sub-mesh rank 0's program to its `GraphModel`
   (`data_parallel.local_parts`: the count the compiled plan's memory table and predicted
   step read), the collectives its plan lists, and its ring attentions' seconds and bytes
   per layer (`context_parallel.ring_work`, which `cost.graph` does not price).
3. Per configuration: that local model's workload at the configuration's share of its trace,
   the ring's seconds, its K/V message and the tp collectives' messages scaled alike;
   `cost.step.tp_time` and `cost.step.ring_attention` price them on the configuration's
   spans.
4. Under pp, the units the compiled pipeline cuts by (`Workload.cut_s`, `cut_bytes`): the
   whole trace's seconds divided by tp, as `autopar.axes.pipeline.unit_costs` prices them.
Degrees the compiler refuses (a PlanError: nothing splits evenly) keep the formulas.
With ``cache`` (`autopar.planner.cache.PlanCache`), the priced traces of steps 1 and 4 and the
solutions of step 2 are read from (and written to) its folder: another run on the same model,
input shapes and cluster shape, whatever its node count, re-traces and re-solves none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from autopar.errors import PlanError
from autopar.frontend.trace import Traced
from autopar.ir.printing import copy_module
from cost.config import ParallelConfig
from cost.graph import GraphModel
from cost.hardware import GPU, Cluster
from cost.workload import Workload


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Solved:
    """The sub-mesh program of one (tp, cp) degree reduced to what the search prices (step 2):
    rank 0's `GraphModel`, its plan's collectives, and under cp its ring attentions' share of
    a layer at the traced rows (`ring`: the fields `context_parallel.ring_work` adds)."""

    model: GraphModel
    collectives: tuple[Any, ...]  # autopar.plan.Collective
    ring: dict[str, float]


class SolvedModel:
    """`cost.estimate.Priced` of a trace whose tp degrees are priced from the tp planner's
    own solutions (module docstring)."""

    def __init__(self, traced: Traced | Callable[[], Traced], cluster: Cluster,
                 param_dtype: torch.dtype, name: str | None = None,
                 retrace: Callable[[int], Traced] | None = None, cache: Any = None,
                 overlap: str = "auto") -> None:  # fmt: skip
        """``traced``: the trace, or a function making it when first needed (with ``cache``
        a warm search may need none); ``overlap``: the tp overlap mode the compile will run
        (autopar.planner.overlap), so the search prices the collectives it hides."""
        self._cluster, self._dtype, self._retrace, self._cache = cluster, param_dtype, retrace, cache
        self._overlap = overlap
        self._traced = traced if callable(traced) else lambda: traced
        self.graph = self._whole(name)
        self._traces: dict[int, Traced] = {}
        self._graphs: dict[int, GraphModel] = {self.graph.batch: self.graph}
        self._solved: dict[tuple[int, int, int], _Solved | None] = {}

    def _whole(self, name: str | None) -> GraphModel:
        """Step 1's graph of the trace itself (through the cache)."""
        from autopar.planner.cache import MISS

        found = MISS if self._cache is None else self._cache.graph("traced")
        if found is MISS:
            found = _priced(self._traced(), self._dtype, name)
            if self._cache is not None:
                self._cache.put_graph("traced", found)
        return found

    def __getattr__(self, key: str) -> Any:  # shape facts, FLOPs: the traced graph's
        if key.startswith("_") or key == "graph":
            raise AttributeError(key)
        return getattr(self.graph, key)

    def workload(self, cfg: ParallelConfig, b: int, gpu: GPU) -> Workload:
        """Steps 1 and 3."""
        solved = self.solved(cfg.tp, cfg.cp, b) if cfg.tp * cfg.cp > 1 else None
        if solved is None:
            return self._graph_of(b).workload(cfg, b, gpu)
        from autopar.axes.data_parallel import tp_collectives

        local, scale = solved.model, b / solved.model.batch
        whole = dataclasses.replace(cfg, tp=1, cp=1, sequence_parallel=False)
        work = local.workload(whole, b, gpu)
        ring = {k: v * scale for k, v in solved.ring.items()}
        work = dataclasses.replace(
            work, layer_fwd_s=work.layer_fwd_s + ring["fwd"],
            attn_fwd_s=work.attn_fwd_s + ring["fwd"], layer_bwd_s=work.layer_bwd_s + ring["bwd"],
            recompute_s={**work.recompute_s, "full": work.recompute_s["full"] + ring["fwd"]},
            cp_bytes=ring["cp_bytes"] if cfg.cp > 1 else work.cp_bytes,
            attn_out_bytes=ring["out"] if cfg.cp > 1 else work.attn_out_bytes)  # fmt: skip
        return dataclasses.replace(work, tp_collectives=tp_collectives(solved.collectives, scale),
                                   **self._cut(cfg, b, gpu))  # fmt: skip

    def _cut(self, cfg: ParallelConfig, b: int, gpu: GPU) -> dict[str, Any]:
        """Step 4: what the compiled pipeline cuts a tp program's stages by
        (`autopar.axes.pipeline.unit_costs`): the whole traced graph's unit seconds divided
        by tp, its boundary bytes whole; nothing without pp."""
        if cfg.pp == 1:
            return {}
        whole = dataclasses.replace(cfg, tp=1, cp=1, sequence_parallel=False)
        work = self._graph_of(b).workload(whole, b, gpu)
        units = (work.pre_s, work.layer_fwd_s + work.layer_bwd_s, work.post_s)
        return {"cut_s": tuple(x / cfg.tp for x in units), "cut_bytes": work.boundary_bytes}

    def _graph_of(self, rows: int) -> GraphModel:
        """Step 1 on a trace of ``rows`` sequences when the model can be retraced (values
        whose size does not follow the batch, such as RoPE tables, then count as traced)."""
        if self._retrace is None:
            return self.graph
        if rows not in self._graphs:
            from autopar.planner.cache import MISS

            found = MISS if self._cache is None else self._cache.graph(rows)
            if found is MISS:
                found = _priced(self._trace(rows), self._dtype, self.graph.name)
                if self._cache is not None:
                    self._cache.put_graph(rows, found)
            self._graphs[rows] = found
        return self._graphs[rows]

    def _trace(self, rows: int) -> Traced:
        if rows not in self._traces:
            self._traces[rows] = (self._traced() if rows == self.graph.batch else
                                  self._retrace(rows))  # fmt: skip
        return self._traces[rows]

    def solved(self, t: int, c: int = 1, rows: int | None = None) -> _Solved | None:
        """Step 2 for degrees (``t``, ``c``) (memoised) on a trace of ``rows`` sequences (the
        compiler's slice: a micro-batch) when the model can be retraced, else on the one
        trace; None when the compiler refuses it."""
        rows = rows if self._retrace is not None and rows else self.graph.batch
        if (t, c, rows) not in self._solved:
            self._solved[t, c, rows] = self._cached(t, c, rows)
        return self._solved[t, c, rows]

    def _cached(self, t: int, c: int, rows: int) -> _Solved | None:
        """Step 2 through the cache: read back, else solved and written."""
        from autopar.planner.cache import MISS

        if self._cache is None:
            return self._solve(t, c, self._trace(rows))
        found = self._cache.solved(t, c, rows, self._overlap)
        if found is not MISS:
            return None if found is None else _Solved(model=found[0], collectives=found[1],
                                                      ring=found[2])  # fmt: skip
        solved = self._solve(t, c, self._trace(rows))
        self._cache.put_solved(t, c, rows, None if solved is None else
                               (solved.model, solved.collectives, solved.ring),
                               self._overlap)  # fmt: skip
        return solved

    def _solve(self, t: int, c: int, traced: Traced) -> _Solved | None:
        from autopar.axes.data_parallel import local_parts

        try:
            prog = self._compile(t, c, dataclasses.replace(traced, gm=copy_module(traced.gm)))
        except PlanError:
            return None
        gm, model = local_parts(prog, _send_dtype(self._dtype))
        if model is None:
            return None
        return _Solved(model=model, collectives=tuple(prog.plan.collectives),
                       ring=_ring_share(gm, model, self._cluster.gpu, self._dtype))  # fmt: skip

    def _compile(self, t: int, c: int, fresh: Traced) -> Any:
        """The stage program the driver builds for Mesh(cp=c, tp=t) inside a data axis."""
        from autopar.axes.context_parallel import compile_traced_cp
        from autopar.axes.data_parallel import join_cp
        from autopar.axes.tensor_parallel import compile_traced
        from autopar.mesh import Mesh
        from autopar.planner.tp import PlanOptions
        from autopar.program import program_of

        options = PlanOptions(param_dtype=self._dtype, tp_overlap=self._overlap)
        if c == 1:
            return compile_traced(fresh, Mesh(self._cluster, tp=t), options, lambda _: None)
        mesh = Mesh.ordered(tuple((a, n) for a, n in (("cp", c), ("tp", t)) if n > 1), self._cluster)
        prog = compile_traced_cp(fresh, mesh, None, options, None)
        return join_cp(program_of(mesh, [prog]))[0].stages[0]


def _priced(traced: Traced, param_dtype: torch.dtype, name: str | None) -> GraphModel:
    """`cost.graph` on a copy of ``traced``, each value in its autocast dtype, its 16-bit
    RMSNorms fused as the compiled program's are (passes.fuse_norms)."""
    from autopar.frontend.precision import annotate_autocast, mark_run_dtypes
    from passes.fuse_norms import fuse_norms

    gm = copy_module(traced.gm)
    annotate_autocast(gm, param_dtype)
    gm = fuse_norms(gm, None)
    return GraphModel.from_traced(mark_run_dtypes(gm), name=name or traced.model_name,
                                  send_dtype=_send_dtype(param_dtype))  # fmt: skip


def _send_dtype(param_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the compiled pipeline sends activations in: ``param_dtype`` when 16-bit
    (`passes.pipeline_split.boundary_dtype`), else each value's own."""
    return param_dtype if param_dtype.itemsize < 4 else None


def _ring_share(gm: Any, model: GraphModel, gpu: GPU, dtype: torch.dtype) -> dict[str, float]:
    """Per layer at the traced rows: the ring attentions' forward and backward seconds, K/V
    message and output bytes (`context_parallel.ring_work`; zeros without a ring)."""
    from autopar.axes.context_parallel import ring_work

    base = model.workload(ParallelConfig(global_batch=model.batch), model.batch, gpu)
    ringed = ring_work(gm, base, gpu, dtype)
    if ringed is base:
        return {"fwd": 0.0, "bwd": 0.0, "cp_bytes": 0.0, "out": 0.0}
    return {"fwd": ringed.layer_fwd_s - base.layer_fwd_s,
            "bwd": ringed.layer_bwd_s - base.layer_bwd_s, "cp_bytes": ringed.cp_bytes,
            "out": ringed.attn_out_bytes}  # fmt: skip
