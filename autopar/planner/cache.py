"""A folder of the whole-cluster planner's world-independent results, kept across runs.

``Mesh.auto`` prices its first configurations as the compiler builds them
(`autopar.planner.solved.SolvedModel`): each (tp, cp, micro-batch rows) is a sub-mesh compile of
a trace of that slice, and each row count a priced trace.  None of that depends on how many
nodes the cluster has, so an elastic job re-planning for another world (``autopar.elastic``)
reads them back instead of re-tracing and re-solving: ``autoparallelize(..., plan_cache=DIR)``.

Algorithm (:class:`PlanCache`):
1. Namespace: a SHA-256 of the traced graph (every node's op, target, arguments, output shapes
   and dtypes, module path; the placeholders' parameter names), the parameter dtype, the
   cluster with its node count left out, and the compiler's own source (``autopar/``,
   ``cost/``, ``passes/``).  A change to the model, its config, the input shapes or the
   compiler is another folder: nothing stale is ever read.
2. Entries, one JSON file each under ``DIR/<namespace>/``, written atomically (a temporary file
   renamed): the priced graph of a trace of ``rows`` sequences (`cost.graph.GraphModel`) and
   the sub-mesh solution of (tp, cp, rows) (`SolvedModel`'s ``_Solved``, or null when the
   compiler refused the degrees), and the reason the compiler refused a configuration on a
   whole mesh (``refused_<hash of mesh, configuration, options>``: world-dependent, but keyed
   by the world, so a restart on a world seen before skips that compile).
3. Loading parses JSON and checks every field's type: no pickle, nothing runs.  An entry that
   does not read back is recomputed and rewritten, with a warning naming the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cost.graph import GraphModel
from cost.hardware import Cluster

MISS = object()  # an entry not in the cache (None is a cached refusal)
_SOURCES = ("autopar", "cost", "passes")
_source_digest: str | None = None


def compiler_digest() -> str:
    """Step 1: a SHA-256 of the compiler's source files (read once per process)."""
    global _source_digest
    if _source_digest is None:
        root, h = Path(__file__).resolve().parents[2], hashlib.sha256()
        for package in _SOURCES:
            for path in sorted((root / package).rglob("*.py")):
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
        _source_digest = h.hexdigest()
    return _source_digest


def graph_digest(traced: Any) -> str:
    """Step 1: a SHA-256 of a trace's graph: ops, targets, arguments, shapes, dtypes, paths."""
    h = hashlib.sha256()
    for n in traced.gm.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        path = next(reversed(stack.values()))[0] if stack else ""
        h.update(f"{n.op}|{n.name}|{n.target}|{n.args}|{n.kwargs}|{_val(n.meta.get('val'))}|"
                 f"{path}\n".encode())  # fmt: skip
    h.update(json.dumps([sorted(traced.params.items()), sorted(traced.buffers.items()),
                         list(traced.user_inputs), sorted(traced.trainable),
                         sorted(traced.padded.items())]).encode())  # fmt: skip
    return h.hexdigest()


def _val(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{v.dtype}{tuple(v.shape)}"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_val(x) for x in v) + ")"
    return type(v).__name__ if v is not None else ""


class PlanCache:
    """Steps 1-3 for one traced model on one cluster shape."""

    def __init__(self, folder: str | os.PathLike, traced: Any, cluster: Cluster,
                 param_dtype: torch.dtype) -> None:  # fmt: skip
        shape = dataclasses.replace(cluster, nodes=1)
        h = hashlib.sha256()
        for part in (graph_digest(traced), str(param_dtype), repr(shape), compiler_digest()):
            h.update(part.encode() + b"\0")
        self.folder = Path(folder) / h.hexdigest()[:32]
        self.hits = self.misses = 0

    # ------------------------------------------------------------ entries

    def graph(self, rows: int) -> Any:
        """The priced graph of a trace of ``rows`` sequences, or MISS."""
        data = self._read(f"graph_{rows}")
        return data if data is MISS else self._checked(f"graph_{rows}", _graph_from, data)

    def put_graph(self, rows: int, model: GraphModel) -> None:
        self._write(f"graph_{rows}", _graph_to(model))

    def solved(self, t: int, c: int, rows: int) -> Any:
        """(GraphModel, collectives, ring) of the sub-mesh program, None (refused), or MISS."""
        name = f"solved_tp{t}_cp{c}_rows{rows}"
        data = self._read(name)
        if data is MISS or data is None:
            return data
        return self._checked(name, _solved_from, data)

    def put_solved(self, t: int, c: int, rows: int, solved: Any) -> None:
        """``solved``: (GraphModel, collectives, ring) or None."""
        data = None if solved is None else _solved_to(*solved)
        self._write(f"solved_tp{t}_cp{c}_rows{rows}", data)

    def refusal(self, mesh: Any, choice: Any, options: Any) -> str | None:
        """Why the compiler refused ``choice`` compiled on ``mesh`` with ``options`` before,
        or None (never tried, or compiled)."""
        name = self._refusal_name(mesh, choice, options)
        data = self._read(name)
        if data is MISS or isinstance(data, str):
            return None if data is MISS else data
        warnings.warn(f"plan cache {self._path(name)}: not a refusal's text; compiling again",
                      stacklevel=2)  # fmt: skip
        return None

    def put_refusal(self, mesh: Any, choice: Any, options: Any, why: str) -> None:
        self._write(self._refusal_name(mesh, choice, options), why)

    @staticmethod
    def _refusal_name(mesh: Any, choice: Any, options: Any) -> str:
        """The whole mesh (its world too), the configuration, its nesting and micro-batches,
        and every option the compile reads."""
        key = repr((str(mesh), mesh.axes, choice.config, choice.order, choice.micro_batches,
                    dataclasses.replace(options, plan_cache=None)))  # fmt: skip
        return "refused_" + hashlib.sha256(key.encode()).hexdigest()[:24]

    # ------------------------------------------------------------ files (steps 2-3)

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def _read(self, name: str) -> Any:
        path = self._path(name)
        try:
            text = path.read_text()
        except FileNotFoundError:
            self.misses += 1
            return MISS
        try:
            data = json.loads(text)
        except ValueError as e:
            warnings.warn(f"plan cache {path}: not JSON ({e}); recomputing it", stacklevel=3)
            self.misses += 1
            return MISS
        self.hits += 1
        return data

    def _checked(self, name: str, read: Any, data: Any) -> Any:
        try:
            return read(data)
        except (KeyError, TypeError, ValueError) as e:
            warnings.warn(f"plan cache {self._path(name)}: {type(e).__name__}: {e}; recomputing "
                          "it", stacklevel=3)  # fmt: skip
            self.hits -= 1
            self.misses += 1
            return MISS

    def _write(self, name: str, data: Any) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(name)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)


# ---------------------------------------------------------------- JSON <-> the planner's records

_GRAPH_SCALARS = {"name": str, "layers": int, "heads": int, "kv_heads": int, "seq": int,
                  "batch": int, "experts": int}  # fmt: skip
_GRAPH_DICTS = ("params", "saved", "comm")


def _graph_to(m: GraphModel) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(m, k) for k in _GRAPH_SCALARS}
    out["arrays"] = {k: v.astype(np.float64).tolist() for k, v in m.arrays.items()}
    out.update({k: {a: float(b) for a, b in getattr(m, k).items()} for k in _GRAPH_DICTS})
    return out


def _graph_from(d: dict[str, Any]) -> GraphModel:
    scalars = {k: _typed(d[k], t, k) for k, t in _GRAPH_SCALARS.items()}
    arrays = {str(k): np.asarray(v, dtype=np.float64) for k, v in _dict(d["arrays"]).items()}
    if any(a.ndim != 1 for a in arrays.values()):
        raise ValueError("arrays must be one-dimensional")
    dicts = {k: {str(a): float(_typed(b, (int, float), k)) for a, b in _dict(d[k]).items()}
             for k in _GRAPH_DICTS}  # fmt: skip
    return GraphModel(**scalars, arrays=arrays, **dicts)


_COLLECTIVE = {"kind": str, "axis": str, "dtype": str, "bytes": int, "direction": str,
               "where": str, "hidden_s": (int, float)}  # fmt: skip


def _solved_to(model: GraphModel, collectives: tuple, ring: dict) -> dict[str, Any]:
    return {"model": _graph_to(model),
            "collectives": [{**{k: getattr(c, k) for k in _COLLECTIVE}, "shape": list(c.shape)}
                            for c in collectives],
            "ring": {k: float(v) for k, v in ring.items()}}  # fmt: skip


def _solved_from(d: dict[str, Any]) -> tuple[GraphModel, tuple, dict[str, float]]:
    from autopar.plan import Collective

    collectives = []
    for c in d["collectives"]:
        c = _dict(c)
        fields = {k: _typed(c[k], t, k) for k, t in _COLLECTIVE.items()}
        shape = tuple(_typed(x, int, "shape") for x in c["shape"])
        collectives.append(Collective(shape=shape, **fields))
    ring = {str(k): float(_typed(v, (int, float), "ring")) for k, v in _dict(d["ring"]).items()}
    return _graph_from(_dict(d["model"])), tuple(collectives), ring


def _typed(value: Any, kind: Any, what: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{what}: {type(value).__name__} where {kind} was expected")
    return value


def _dict(value: Any) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"{type(value).__name__} where an object was expected")
    return value
