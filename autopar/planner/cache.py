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
4. The tp planner's answers (:class:`SolveCache`, ``DIR/solve/``): one entry per question
   `autopar.planner.tp.solve_axis` is asked (a stage's or a whole model's graph, the axis, its
   size, link, GPU and solver options), keyed by a SHA-256 of all of it up to names
   (:class:`Canonical`: nodes by position, numbers in module paths and parameter names
   renumbered by first appearance; every node's op, target, arguments, shapes, strides,
   dtypes, module stack, autopar record and source line) and the compiler's source.  The
   answer is stored by position and mapped onto the asking graph's names, so pipeline stages
   of identical blocks at other layers share one entry; it is read back only when the graph
   has the recorded node count and each decided node the recorded op (else recomputed, with a
   warning).  The compile of the configuration Mesh.auto chooses (and a fixed mesh's compile)
   then runs its passes but no ILP.  A solve that warned is not kept (its warnings must be
   seen again).
5. Skipping the trace of the whole example: ``DIR/models/<key>.json`` names the namespace a
   run of the model with that :func:`model_key` (class, configuration, parameters, example
   shapes, options, cluster shape, compiler: no trace needed) used, and each namespace keeps
   the `graph_digest` of every trace a run made (``trace_<rows>``).  A warm search starts from
   that namespace's entries without tracing; the plan stands when the traces the run did make
   (the chosen slice's) hash as recorded (else the whole example is traced and must hash to
   the namespace; if not, the run plans again from its own trace, with a warning).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx

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


def model_key(model: Any, example: Any, loss_fn: Any, cluster: Cluster, options: Any) -> str:
    """Step 5: a SHA-256 of what a trace of ``model`` follows from, read without tracing: its
    class, configuration, parameters and buffers (names, shapes, dtypes, trainable), the
    example's structure, shapes and dtypes, the loss function's name, the options, the cluster
    shape, torch's version and the compiler.  A guess (the model's code is not in it), checked
    against the traces of the run (`autopar.planner.auto._kept`)."""
    from torch.utils import _pytree as pytree

    leaves, spec = pytree.tree_flatten((example.args, example.kwargs))
    h = hashlib.sha256()
    for part in (f"{type(model).__module__}.{type(model).__qualname__}",
                 str(getattr(model, "config", "")),
                 repr([(n, tuple(p.shape), str(p.dtype), p.requires_grad)
                       for n, p in model.named_parameters()]),
                 repr([(n, tuple(b.shape), str(b.dtype)) for n, b in model.named_buffers()]),
                 str(spec), repr([_val(x, detail=True) if isinstance(x, torch.Tensor) else repr(x)
                                  for x in leaves]),
                 f"{getattr(loss_fn, '__module__', '')}.{getattr(loss_fn, '__qualname__', repr(loss_fn))}",
                 repr(dataclasses.replace(options, plan_cache=None)),
                 repr(dataclasses.replace(cluster, nodes=1)), torch.__version__,
                 compiler_digest()):  # fmt: skip
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def graph_digest(traced: Any) -> str:
    """Step 1: a SHA-256 of a trace's graph: ops, targets, arguments, shapes, dtypes, paths."""
    h = hashlib.sha256()
    for n in traced.gm.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        path = next(reversed(stack.values()))[0] if stack else ""
        h.update(f"{n.op}|{n.name}|{n.target}|{n.args}|{n.kwargs}|"
                 f"{_val(n.meta.get('val'))}|{path}\n".encode())  # fmt: skip
    h.update(json.dumps([sorted(traced.params.items()), sorted(traced.buffers.items()),
                         list(traced.user_inputs), sorted(traced.trainable),
                         sorted(traced.padded.items())]).encode())  # fmt: skip
    return h.hexdigest()


def _val(v: Any, detail: bool = False) -> str:
    if isinstance(v, torch.Tensor):
        more = f"{v.stride()}{v.requires_grad}" if detail else ""
        return f"{v.dtype}{tuple(v.shape)}{more}"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_val(x, detail) for x in v) + ")"
    return type(v).__name__ if v is not None else ""


class _Entries:
    """Steps 2-3: one folder of JSON entries, written atomically, read back checked."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.hits = self.misses = 0

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


class PlanCache(_Entries):
    """Steps 1-3 for one traced model on one cluster shape."""

    def __init__(self, folder: str | os.PathLike, traced: Any, cluster: Cluster,
                 param_dtype: torch.dtype) -> None:  # fmt: skip
        shape = dataclasses.replace(cluster, nodes=1)
        h = hashlib.sha256()
        for part in (graph_digest(traced), str(param_dtype), repr(shape), compiler_digest()):
            h.update(part.encode() + b"\0")
        super().__init__(Path(folder) / h.hexdigest()[:32])

    @classmethod
    def known(cls, folder: str | os.PathLike, key: str) -> PlanCache | None:
        """Step 5: the cache of the namespace a run of the model ``key`` (`model_key`) used,
        or None."""
        path = Path(folder) / "models" / f"{key}.json"
        try:
            space = json.loads(path.read_text()).get("namespace")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(space, str) or len(space) != 32 or not space.isalnum():
            return None
        cache = cls.__new__(cls)
        _Entries.__init__(cache, Path(folder) / space)
        return cache

    def put_known(self, key: str) -> None:
        models = _Entries(self.folder.parent / "models")
        models._write(key, {"namespace": self.folder.name})

    def trace_digest(self, rows: int) -> str | None:
        """Step 5: the `graph_digest` of the trace of ``rows`` sequences a run recorded."""
        data = self._read(f"trace_{rows}")
        return data if isinstance(data, str) else None

    def put_trace_digest(self, rows: int, digest: str) -> None:
        self._write(f"trace_{rows}", digest)

    # ------------------------------------------------------------ entries

    def graph(self, rows: int) -> Any:
        """The priced graph of a trace of ``rows`` sequences, or MISS."""
        data = self._read(f"graph_{rows}")
        return data if data is MISS else self._checked(f"graph_{rows}", _graph_from, data)

    def put_graph(self, rows: int, model: GraphModel) -> None:
        self._write(f"graph_{rows}", _graph_to(model))

    def solved(self, t: int, c: int, rows: int, overlap: str = "auto") -> Any:
        """(GraphModel, collectives, ring) of the sub-mesh program, None (refused), or MISS
        (``overlap``: the tp overlap mode it was compiled with)."""
        name = _solved_name(t, c, rows, overlap)
        data = self._read(name)
        if data is MISS or data is None:
            return data
        return self._checked(name, _solved_from, data)

    def put_solved(self, t: int, c: int, rows: int, solved: Any, overlap: str = "auto") -> None:
        """``solved``: (GraphModel, collectives, ring) or None."""
        data = None if solved is None else _solved_to(*solved)
        self._write(_solved_name(t, c, rows, overlap), data)

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


class Canonical:
    """Step 4: a graph up to its names, as the tp planner sees it.  Node ``i`` (graph order,
    which is topological) reads ``%i``; each number in a module path or parameter name is
    renumbered by its first appearance under its parent (a stage starting at layer 7 reads
    ``layers.7.mlp`` as ``layers.#0.mlp``), so stages that cover different layers of
    identical blocks, or a model traced under other node names, read the same."""

    def __init__(self, traced: Any) -> None:
        self.traced = traced
        self.nodes = list(traced.gm.graph.nodes)
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self._numbers: dict[str, dict[str, int]] = {}

    def ref(self, name: str) -> str:
        """A node's name as its position; any other name unchanged."""
        i = self.index.get(name)
        return name if i is None else f"%{i}"

    def path(self, path: str) -> str:
        """A module path or parameter name with its numbers renumbered (see the class)."""
        out: list[str] = []
        for part in path.split("."):
            if part.isdigit():
                seen = self._numbers.setdefault(".".join(out), {})
                part = f"#{seen.setdefault(part, len(seen))}"
            out.append(part)
        return ".".join(out)

    @staticmethod
    def signature(n: fx.Node) -> str:
        """What a stored decision checks its node by: the op and, for a call, its target."""
        return f"{n.op}:{n.target}" if n.op == "call_function" else n.op

    def digest(self) -> str:
        """A SHA-256 of every node in detail (op, target, arguments by position, shapes,
        strides, dtypes, requires_grad, the module stack, the autopar record without its
        stage number, run dtype, source line; a placeholder's parameter or buffer with its
        trainable flag, padding, piece and persistence) and of the inputs (user, gradient).
        The trace's records are read only for this graph's placeholders (a stage's trace keeps
        the whole model's), and its name is left out (the planner does not read it)."""
        h = hashlib.sha256()
        for n in self.nodes:
            h.update(self._node(n).encode() + b"\n")
        t = self.traced
        h.update(repr([[self.ref(x) for x in t.user_inputs],
                       sorted(self.ref(x) for x in t.grad_inputs)]).encode())  # fmt: skip
        return h.hexdigest()

    def _node(self, n: fx.Node) -> str:
        stack = [(self.path(p), str(c)) for p, c in (n.meta.get("nn_module_stack") or {}).values()]
        target = self.ref(n.name) if n.op in ("placeholder", "get_attr") else str(n.target)
        args = fx.map_arg((n.args, n.kwargs), lambda a: f"%{self.index[a.name]}")
        record = n.meta.get("autopar")
        if dataclasses.is_dataclass(record) and hasattr(record, "stage"):
            record = dataclasses.replace(record, stage=None)
        return (f"{n.op}|{target}|{args}|{_val(n.meta.get('val'), detail=True)}|{stack}|"
                f"{record!r}|{n.meta.get('run_dtype')}|{n.meta.get('stack_trace')}|"
                f"{self._stands(n.name)}")  # fmt: skip

    def _stands(self, name: str) -> str:
        """What a placeholder stands for, in canonical names."""
        t = self.traced
        fqn = t.params.get(name) or t.buffers.get(name)
        if fqn is None:
            return ""
        piece = t.pieces.get(fqn)
        part = piece and (self.path(piece.fqn), piece.dim, piece.start, piece.stop,
                          *((piece.groups,) if piece.groups > 1 else ()))  # fmt: skip
        return repr((name in t.params, self.path(fqn), fqn in t.trainable, t.padded.get(fqn),
                     part, fqn in t.persistent))  # fmt: skip

    def options(self, options: Any) -> str:
        """The solver's options with the node names they hold as positions."""
        overlap = options.overlap_fixed
        return repr(
            dataclasses.replace(
                options,
                solve_cache=None,
                arrive=tuple((self.ref(n), p) for n, p in options.arrive),
                fixed=tuple((self.ref(n), s) for n, s in options.fixed),
                overlap_fixed=None if overlap is None else tuple(self.ref(n) for n in overlap),
            )
        )


def solve_key(canon: Canonical, question: tuple[Any, ...], options: Any) -> str:
    """Step 4: what determines `solve_axis`'s answer, names aside: the graph in detail
    (`Canonical`), the question (axis, size, link, GPU), every solver option but the cache's
    own folder, the compiler."""
    h = hashlib.sha256()
    for part in (canon.digest(), repr(question), canon.options(options), compiler_digest()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


class SolveCache(_Entries):
    """Step 4: the tp planner's answers, kept under ``DIR/solve/``."""

    def __init__(self, folder: str | os.PathLike) -> None:
        super().__init__(Path(folder) / "solve")

    def answer(self, traced: Any, question: tuple[Any, ...], options: Any,
               solve: Callable[[], Any]) -> Any:  # fmt: skip
        """The `AxisSolution` of ``question`` on ``traced``: read back (stored by position,
        mapped onto this graph's names: any graph that reads the same as `Canonical` shares
        it), else ``solve()``d (its warnings shown) and written when it warned nothing."""
        canon = Canonical(traced)
        name = "axis_" + solve_key(canon, question, options)
        data = self._read(name)
        if data is not MISS:
            found = self._checked(name, lambda d: _solution_from(d, canon), data)
            if found is not MISS:
                return found
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            solution = solve()
        for w in seen:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        if not seen:
            self._write(name, _solution_to(solution, canon))
        return solution


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


def _solved_name(t: int, c: int, rows: int, overlap: str) -> str:
    """The entry of a (tp, cp, rows) sub-mesh solution; another tp overlap mode than the
    default "auto" is another entry (its collectives hide other seconds)."""
    return f"solved_tp{t}_cp{c}_rows{rows}" + ("" if overlap == "auto" else f"_overlap_{overlap}")


_COLLECTIVE = {"kind": str, "axis": str, "dtype": str, "bytes": int, "direction": str,
               "where": str, "hidden_s": (int, float)}  # fmt: skip


def _solved_to(model: GraphModel, collectives: tuple, ring: dict) -> dict[str, Any]:
    return {"model": _graph_to(model),
            "collectives": [{**{k: getattr(c, k) for k in _COLLECTIVE}, "shape": list(c.shape),
                             "regather": c.regather} for c in collectives],
            "ring": {k: float(v) for k, v in ring.items()}}  # fmt: skip


def _solved_from(d: dict[str, Any]) -> tuple[GraphModel, tuple, dict[str, float]]:
    from autopar.plan import Collective

    collectives = []
    for c in d["collectives"]:
        c = _dict(c)
        fields = {k: _typed(c[k], t, k) for k, t in _COLLECTIVE.items()}
        shape = tuple(_typed(x, int, "shape") for x in c["shape"])
        again = c.get("regather", False)
        if not isinstance(again, bool):
            raise TypeError(f"regather: {type(again).__name__} where bool was expected")
        collectives.append(Collective(shape=shape, regather=again, **fields))
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


_SOLUTION = {"compute_s": float, "comm_s": float, "memory_bytes": float, "tied_nodes": int,
             "variables": int, "single_s": float, "param_bytes": float}  # fmt: skip


def _solution_to(sol: Any, canon: Canonical) -> dict[str, Any]:
    """An `AxisSolution` as JSON, by position (`Canonical`): each decision as [node index,
    the node's signature, its strategy by placements' text, lowering and comm]; each unsplit
    weight by the index of its placeholder; the graph's node count."""
    out: dict[str, Any] = {k: getattr(sol, k) for k in _SOLUTION}
    holder = {fqn: name for name, fqn in canon.traced.params.items()}
    out["nodes"] = len(canon.nodes)
    out["unsplit"] = [canon.index[holder[fqn]] for fqn in sol.unsplit]
    out["choice"] = [[canon.index[name], canon.signature(canon.nodes[canon.index[name]]),
                      {"inputs": [str(p) for p in s.inputs],
                       "output": [str(p) for p in s.output]
                       if isinstance(s.output, tuple) else str(s.output),
                       "lowering": s.lowering, "comm": [list(c) for c in s.comm]}]
                     for name, s in sol.choice.items()]  # fmt: skip
    return out


def _solution_from(d: dict[str, Any], canon: Canonical) -> Any:
    """The inverse of `_solution_to` on ``canon``'s graph, refusing an answer for a graph of
    another node count, a position out of range or decided twice, or a node of another op."""
    from autopar.planner.tp import AxisSolution

    d = _dict(d)
    fields = {k: (float(_typed(d[k], (int, float), k)) if t is float else _typed(d[k], t, k))
              for k, t in _SOLUTION.items()}  # fmt: skip
    if _typed(d["nodes"], int, "nodes") != len(canon.nodes):
        raise ValueError(f"an answer for a graph of {d['nodes']} nodes; this one has "
                         f"{len(canon.nodes)}")  # fmt: skip
    choice = {}
    for item in d["choice"]:
        index, signature, strategy = item
        node = _node_at(canon, index)
        if _typed(signature, str, "signature") != canon.signature(node):
            raise ValueError(f"node {index} is {signature!r} in the answer but "
                             f"{canon.signature(node)!r} ({node.name}) in this graph")  # fmt: skip
        if node.name in choice:
            raise ValueError(f"node {index} ({node.name}) is decided twice")
        choice[node.name] = _strategy_from(_dict(strategy))
    unsplit = tuple(canon.traced.params[_node_at(canon, i).name] for i in d["unsplit"])
    return AxisSolution(choice=choice, unsplit=unsplit, **fields)


def _node_at(canon: Canonical, index: Any) -> fx.Node:
    if not 0 <= _typed(index, int, "node index") < len(canon.nodes):
        raise ValueError(f"a decision for node {index}, which the graph does not have")
    return canon.nodes[index]


def _strategy_from(s: dict[str, Any]) -> Any:
    from autopar.ir.layout import parse_placement
    from autopar.rules import Strategy

    out = s["output"]
    output = (tuple(parse_placement(_typed(p, str, "output")) for p in out)
              if isinstance(out, list) else parse_placement(_typed(out, str, "output")))  # fmt: skip
    lowering = s["lowering"]
    return Strategy(
        tuple(parse_placement(_typed(p, str, "inputs")) for p in s["inputs"]),
        output,
        None if lowering is None else _typed(lowering, str, "lowering"),
        tuple((_typed(k, str, "comm"), _typed(b, (int, float), "comm")) for k, b in s["comm"]),
    )
