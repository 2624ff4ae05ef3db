"""A traced model priced as the compiler builds it: the search's `Priced` for one trace.

The whole-cluster search (`cost.search`, `cost.estimate`) prices a configuration from a
`Workload`; at tp = 1 that is `cost.graph` on the traced graph, the compiled plan's own count.
At tp > 1 a formula (Megatron's column/row pairing, with or without sequence parallelism)
would guess what the tp planner chooses; this model asks the planner instead.

Algorithm (`SolvedModel.workload`):
1. tp = 1: the traced graph's `GraphModel` (each value in its autocast dtype).
2. tp = t > 1, once per (t, micro-batch rows) (memoised): compile the tp program of
   `Mesh(tp=t)` on a copy of a trace of that many rows (the slice the compiler traces; the
   tp ILP's choice may depend on it, so with `retrace` each slice is traced once; without,
   the one trace is solved and scaled) -- the tp ILP, identical blocks solved once, then the
   passes -- and reduce sub-mesh rank 0's program to its `GraphModel`
   (`data_parallel.local_model`: the count the compiled plan's memory table and predicted
   step read), with the tp collectives its plan lists.
3. Per configuration: that local model's workload at the configuration's share of its
   trace (cp splitting the sequence as at tp = 1), its tp collectives' messages scaled alike;
   `cost.step.tp_time` prices them on the configuration's tp span.
A degree the planner refuses (a PlanError: nothing splits evenly) keeps the formula.
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
    """The tp program of one degree reduced to what the search prices (step 2)."""

    model: GraphModel
    collectives: tuple[Any, ...]  # autopar.plan.Collective, the plan's tp ones


class SolvedModel:
    """`cost.estimate.Priced` of a trace whose tp degrees are priced from the tp planner's
    own solutions (module docstring)."""

    def __init__(self, traced: Traced, cluster: Cluster, param_dtype: torch.dtype,
                 name: str | None = None,
                 retrace: Callable[[int], Traced] | None = None) -> None:  # fmt: skip
        from autopar.frontend.precision import annotate_autocast, mark_run_dtypes

        self._cluster, self._dtype, self._retrace = cluster, param_dtype, retrace
        gm = copy_module(traced.gm)
        annotate_autocast(gm, param_dtype)
        self.graph = GraphModel.from_traced(mark_run_dtypes(gm), name=name or traced.model_name)
        self._traces: dict[int, Traced] = {self.graph.batch: traced}
        self._solved: dict[tuple[int, int], _Solved | None] = {}

    def __getattr__(self, key: str) -> Any:  # shape facts, FLOPs: the traced graph's
        if key.startswith("_") or key == "graph":
            raise AttributeError(key)
        return getattr(self.graph, key)

    def workload(self, cfg: ParallelConfig, b: int, gpu: GPU) -> Workload:
        """Steps 1 and 3."""
        solved = self.solved(cfg.tp, b) if cfg.tp > 1 else None
        if solved is None:
            return self.graph.workload(cfg, b, gpu)
        from autopar.axes.data_parallel import tp_collectives

        local = solved.model
        work = local.workload(dataclasses.replace(cfg, tp=1, sequence_parallel=False), b, gpu)
        scale = b / local.batch / cfg.cp
        return dataclasses.replace(work, tp_collectives=tp_collectives(solved.collectives,
                                                                       scale))  # fmt: skip

    def solved(self, t: int, rows: int | None = None) -> _Solved | None:
        """Step 2 for degree ``t`` (memoised) on a trace of ``rows`` sequences (the
        compiler's slice: a micro-batch) when the model can be retraced, else on the one
        trace; None when the planner refuses it."""
        rows = rows if self._retrace is not None and rows else self.graph.batch
        if (t, rows) not in self._solved:
            if rows not in self._traces:
                self._traces[rows] = self._retrace(rows)
            self._solved[t, rows] = self._solve(t, self._traces[rows])
        return self._solved[t, rows]

    def _solve(self, t: int, traced: Traced) -> _Solved | None:
        from autopar.axes.data_parallel import local_model
        from autopar.axes.tensor_parallel import compile_traced
        from autopar.mesh import Mesh
        from autopar.planner.tp import PlanOptions

        fresh = dataclasses.replace(traced, gm=copy_module(traced.gm))
        try:
            prog = compile_traced(fresh, Mesh(self._cluster, tp=t),
                                  PlanOptions(param_dtype=self._dtype), lambda _: None)  # fmt: skip
        except PlanError:
            return None
        model = local_model(prog)
        if model is None:
            return None
        return _Solved(model=model, collectives=tuple(prog.plan.collectives))
