"""The planner's front end: search a model shape or a traced model on a cluster, print the plan.

    from autopar.planner.auto import plan_shape
    print(plan_shape(ModelShape.preset("llama3-70b"), Cluster.preset("dgx-h100", nodes=64), 1024))

Algorithm (`plan_shape`):
1. Build the cluster's topology graph (`cost.topology`): collectives are priced by the links
   their groups span.
2. Search (`cost.search.search`); a hand-chosen configuration (`compare`) is ranked exactly.
3. `Ranking.__str__`: search statistics, the ranking (step time, MFU, memory, degrees, settings,
   nesting, the components each runner-up loses on), the best configuration's breakdown
   (`cost.report.render`), the links each axis rides with their share of the step, and where
   the hand-chosen configuration ranks and why.

`compile_auto` (for `Mesh.auto`) compiles the search's best configuration, every axis of it,
or the best the compiler accepts (its own algorithm below).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.mesh import AutoMesh, Mesh
from cost.config import ParallelConfig
from cost.errors import CostInputError
from cost.hardware import Cluster
from cost.search import Choice, SearchResult, SearchSpace, nesting, reprice, search, sp_label, spans
from cost.topology import Topology, axis_links

GIB = 2**30


@dataclass(frozen=True)
class Ranking:
    """A search result with its topology, a hand-chosen configuration's rank, and printing."""

    result: SearchResult
    topology: Topology
    compare: ParallelConfig | None = None
    top: int = 10

    @property
    def best(self) -> Choice:
        return self.result.best

    def compare_rank(self) -> tuple[int, Choice] | None:
        """(1-based rank, its best choice) of the hand-chosen degrees, None if it fits nowhere."""
        if self.compare is None:
            return None
        key = _degrees_key(self.compare, self.result.cluster)
        for i, choice in enumerate(self.result.ranked):
            if choice.key == key:
                return i + 1, choice
        return None

    def links(self, choice: Choice | None = None) -> list[tuple[str, str, float]]:
        """(axis, link, exposed seconds) of a choice (default: the best)."""
        choice = choice or self.best
        c, w = choice.config, choice.work
        params = w.layers * w.layer_dense_params / max(c.pp, 1) + w.edge_params
        volumes = {"tp": ("all_reduce", w.tp_bytes), "cp": ("send_recv", w.cp_bytes),
                   "ep": ("all_to_all", w.ep_bytes), "pp": ("send_recv", w.boundary_bytes),
                   "dp": ("all_reduce", 4 * params)}  # fmt: skip
        order_spans = spans(choice.order, c.tp, c.pp, c.dp, c.cp, c.ep)
        return axis_links(self.topology, order_spans, choice.step.comm, volumes)

    def __str__(self) -> str:
        r, c = self.result, self.result.cluster
        fabric = "rail-optimised" if self.topology.rails else "top-of-rack"
        per = r.seconds / max(r.space, 1)
        lines = [
            f"plan: {r.model.name} on {c.nodes} × {c.gpus_per_node} {c.gpu.name} "
            f"({c.world_size} GPUs, {fabric} fabric), global batch {r.global_batch} × "
            f"{r.model.seq} tokens",
            f"searched {r.space:,} configurations ({r.priced:,} priced, the rest pruned by exact "
            f"memory and time bounds) in {r.seconds:.2f} s: {per * 1e6:.2f} µs per "
            "configuration",
            "",
            _header(),
        ]
        lines += [_row(i + 1, ch, r) for i, ch in enumerate(r.ranked[: self.top])]
        found = self.compare_rank()
        if found is not None and found[0] > self.top:
            lines += ["   ...", _row(found[0], found[1], r)]
        lines += [f"MFU: PaLM convention (6N + 12·L·a·d·s FLOPs per token, recompute not "
                  f"counted) over the {c.gpu.name}'s dense bf16 peak"]
        lines += ["", f"best: {self.best.describe()}", str(r.estimate(self.best)), ""]
        lines += self._link_lines()
        lines += self._compare_lines()
        return "\n".join(lines)

    def _link_lines(self) -> list[str]:
        total = self.best.step_time_s
        lines = ["links: exposed communication per axis and the link it rides (share of step)"]
        for axis, link, seconds in self.links():
            lines.append(f"  {axis:<4} {link:<28} {seconds:9.4f} s  {seconds / total:6.1%}")
        if len(lines) == 1:
            lines.append("  none: no exposed communication")
        return lines

    def _compare_lines(self) -> list[str]:
        if self.compare is None:
            return []
        c = self.compare
        name = f"tp={c.tp} pp={c.pp} dp={c.dp} cp={c.cp} ep={c.ep}"
        found = self.compare_rank()
        if found is None:
            return ["", f"compare {name}: fits nowhere (no micro-batch, recompute or ZeRO "
                        "stage brings it under the GPU's memory)"]  # fmt: skip
        rank, choice = found
        ratio = choice.step_time_s / self.best.step_time_s
        lost = "it is the best" if rank == 1 else f"loses on {self.result.why_lost(choice)}"
        return ["", f"compare {name}: rank {rank} ({choice.describe()}), step "
                    f"{choice.step_time_s:.4f} s = {ratio:.3f}× the best; {lost}"]  # fmt: skip


def _header() -> str:
    return (f"{'rank':>4} {'step s':>9} {'MFU':>6} {'GiB':>6} {'tp':>4} {'pp':>3} {'dp':>5} "
            f"{'cp':>3} {'ep':>3} {'b':>3} {'schedule':<16} {'recomp':<9} {'zero':>4} "
            f"{'sp':<3} {'nesting':<10} loses on")  # fmt: skip


def _row(rank: int, ch: Choice, r: SearchResult) -> str:
    c = ch.config
    mfu = r.estimate(ch).mfu
    sched = c.schedule + (f" v={c.virtual_stages}" if c.schedule == "interleaved" else "")
    why = "-" if rank == 1 else r.why_lost(ch)
    return (f"{rank:>4} {ch.step_time_s:9.4f} {mfu:6.1%} {ch.memory.total / GIB:6.1f} "
            f"{c.tp:>4} {c.pp:>3} {c.dp:>5} {c.cp:>3} {c.ep:>3} {c.micro_batch:>3} {sched:<16} "
            f"{c.recompute:<9} {c.zero:>4} {sp_label(c):<3} "
            f"{nesting(ch.order):<10} {why}")  # fmt: skip


def _degrees_key(cfg: ParallelConfig, cluster: Cluster) -> tuple[int, ...]:
    dp = cfg.dp or cluster.world_size // (cfg.tp * cfg.pp * cfg.cp)
    return (cfg.tp, cfg.pp, dp, cfg.cp, cfg.ep)


def parse_degrees(text: str, global_batch: int = 1) -> ParallelConfig:
    """`tp=8,pp=4,dp=16` → a ParallelConfig with those degrees (dp None when left out)."""
    degrees: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in ("tp", "pp", "dp", "cp", "ep") or not value.strip().isdigit():
            raise CostInputError(
                f"cannot read {part!r} in --compare {text!r}: write degrees as tp=8,pp=4,dp=16 "
                "(axes tp, pp, dp, cp, ep)"
            )
        degrees[name] = int(value)
    return ParallelConfig(global_batch=global_batch, **degrees)


def plan_shape(model, cluster: Cluster, global_batch: int, *, top: int = 10,
               compare: ParallelConfig | None = None, zero: tuple[int, ...] = (0, 1, 2, 3),
               attention: str = "flash", nest: bool = True, rails: bool = True,
               grad_bytes: int = 4, gemm_bytes: int = 2,
               space: SearchSpace | None = None) -> Ranking:  # fmt: skip
    """Search `model` (a ModelShape, preset name or traced graph) on `cluster` (steps 1-2);
    `gemm_bytes` 1 prices the linear layers' GEMMs in FP8 (a shape's analytic workload)."""
    topology = Topology(cluster=cluster, rails=rails)
    space = space or SearchSpace(zero=zero, attention=attention, nest=nest, grad_bytes=grad_bytes,
                                 gemm_bytes=gemm_bytes)  # fmt: skip
    keep = None
    if compare is not None:
        keep = ParallelConfig(tp=compare.tp, pp=compare.pp, dp=compare.dp, cp=compare.cp,
                              ep=compare.ep, global_batch=global_batch)  # fmt: skip
    result = search(model, cluster, global_batch, space=space, top=top, keep=keep,
                    collective=topology.collective)  # fmt: skip
    if keep is not None and keep.dp is None:
        keep = ParallelConfig(tp=keep.tp, pp=keep.pp, cp=keep.cp, ep=keep.ep,
                              dp=_degrees_key(keep, cluster)[2], global_batch=global_batch)  # fmt: skip
    return Ranking(result=result, topology=topology, compare=keep, top=top)


@dataclass(frozen=True)
class AutoChoice:
    """What `Mesh.auto` chose: the ranked plan, its best configuration, the one compiled (the
    best the compiler accepted) and the configurations the compiler refused, with why."""

    plan: Ranking
    best: Choice  # the best of the candidates as the compiler counts them
    compiled: Choice
    mesh: Mesh
    refused: tuple[tuple[Choice, str], ...] = ()
    candidates: tuple[tuple[Choice, Choice], ...] = ()  # (searched, repriced), walk's order

    def __str__(self) -> str:
        lines = [f"Mesh.auto: best {self.best.describe()} ({self.best.step_time_s:.4f} s, "
                 "the compiler's count)"]  # fmt: skip
        lines += self._candidate_lines()
        for choice, why in self.refused:
            lines.append(f"  refused by the compiler: {choice.describe()}: {why}")
        if self.refused:
            ratio = self.compiled.step_time_s / self.best.step_time_s
            lines.append(f"  compiled the best the compiler accepts: {self.compiled.describe()} "
                         f"({ratio:.3f}x the best's step time)")  # fmt: skip
        lines.append(f"  compiled on {self.mesh} ({self.mesh.world_size} of "
                     f"{self.plan.result.cluster.world_size} GPUs) with zero="
                     f"{self.compiled.config.zero}, recompute={self.compiled.config.recompute}")  # fmt: skip
        return "\n".join(lines + ["", str(self.plan)])

    def _candidate_lines(self) -> list[str]:
        """The walk's candidates: the search's step (formula) and the compiler's count."""
        out = ["  the search's first configurations priced as the compiler builds them "
               "(search -> compiler's count):"]  # fmt: skip
        for was, c in self.candidates:
            fits = "" if c.memory.fits else f", does not fit ({c.memory.total / GIB:.1f} GiB)"
            out.append(f"    {c.describe()}: {was.step_time_s:.4f} s -> {c.step_time_s:.4f} s"
                       f"{fits}")  # fmt: skip
        return out if self.candidates else []


MAX_REFUSALS = 4  # ranked configurations tried after the best before giving up
_DECIDED = ("n_microbatches", "virtual_stages", "plan", "cluster")


def compile_auto(model: Any, mesh: AutoMesh, example: Any, loss_fn: Callable[..., Any] | None,
                 options: Any, *, guess: bool = True) -> Any:  # fmt: skip
    """`autoparallelize(model, Mesh.auto(cluster), ...)`.

    Algorithm:
    1. Trace once and price the graph (`cost.graph`).
    2. Search the cluster as the compiler will build it: model state in the dtype the program
       keeps (fp32 weights are their own master; 16-bit ones have an fp32 master), saved
       activations in the dtype each value runs in (the graph traced in `param_dtype`, or
       autocast under `mixed_precision="autocast"`), one
       micro-batch per step outside a pipeline (the data axis does not accumulate), capacity
       `memory_limit` when given, ZeRO stage and recompute fixed when the user fixes them.
    3. Price the ranking's first `MAX_REFUSALS + 1` configurations again as the compiler
       builds them (`cost.search.reprice` on `autopar.planner.solved.SolvedModel`: each tp / cp
       degree from the tp planner's own solution of a trace of its per-rank slice, the count
       the compiled plan reports) and order them by that price: what fits first, fastest
       first.  The search's formula ranks the whole space quickly; the compiler's own count
       decides among the few it compiles.  With ``plan_cache=DIR`` those prices' traces and
       sub-mesh solutions are read from DIR when an earlier run made them
       (`autopar.planner.cache`: keyed by the graph, shapes, dtype, cluster shape, compiler).
    4. Walk those best first: compile every chosen degree (dp, pp, cp, ep, tp) in the
       chosen nesting on every GPU of the cluster, with its ZeRO stage, schedule, micro-batch
       count and recompute mode, through the one driver (`autopar.driver`), which reuses the
       search's trace when the configuration's per-rank slice is the whole example batch (and
       each trace it makes for the next configurations).  A configuration the compiler
       refuses (its memory count is what runs; some axis combinations it cannot build for
       this model) is recorded with the compiler's reason and the next is tried (with
       ``plan_cache``, a refusal of the same mesh, configuration and options is read back
       instead of compiled again).
    5. `prog.search` (AutoChoice) holds the ranking, the candidates as repriced, the best,
       the compiled one and refusals.
    """
    from autopar.driver import compile_model
    from autopar.errors import PlanError
    from autopar.planner.solved import SolvedModel

    _check_decided(options)
    examples = _example_batch(example.args)
    traces = _Traces(examples, _first_trace(model, example, loss_fn, options))
    retrace = _retrace(model, example, loss_fn, examples, traces, options.cast_dtype)
    capacity = _capacity(mesh.cluster, options.memory_limit)
    cache, key, priced = _warm(model, example, loss_fn, capacity, options, guess)
    guessed = cache is not None  # a namespace found by the model's key, to be checked
    if priced is None:  # cold: step 1
        priced = _priced_whole(traces[examples], model)
        if options.plan_cache is not None:
            from autopar.planner.cache import PlanCache

            cache = PlanCache(options.plan_cache, traces[examples], capacity, options.param_dtype)
            cache.put_graph("search", priced)
    plan = plan_shape(priced, capacity, options.global_batch or mesh.global_batch or examples,
                      space=_auto_space(mesh, options))  # fmt: skip
    solved = SolvedModel(lambda: traces[examples], plan.result.cluster, options.autocast_dtype,
                         name=type(model).__name__, retrace=retrace, cache=cache,
                         overlap=options.overlap_mode)  # fmt: skip
    candidates = repriced(plan, solved)
    refused: list[tuple[Choice, str]] = []
    for _, choice in candidates:
        concrete = auto_mesh(choice, mesh.cluster)
        chosen = _choice_options(concrete, choice, examples, options)
        known = None if cache is None else cache.refusal(concrete, choice, chosen)
        if known is not None:  # the compiler refused exactly this before (same key)
            refused.append((choice, known))
            continue
        try:
            prog = compile_model(model, concrete, example, loss_fn, chosen, traces=traces)
        except PlanError as exc:
            refused.append((choice, f"{type(exc).__name__}: {exc}"))
            if cache is not None:
                cache.put_refusal(concrete, choice, chosen, refused[-1][1])
            continue
        if cache is not None and not _kept(cache, traces, key, capacity, options, guessed):
            return compile_auto(model, mesh, example, loss_fn, options, guess=False)
        prog.search = AutoChoice(plan=plan, best=candidates[0][1], compiled=choice, mesh=concrete,
                                 refused=tuple(refused), candidates=tuple(candidates))  # fmt: skip
        if options.verbose or refused:
            print(prog.search.__str__().split("\n\n")[0])
        return prog
    if guessed and not _kept(cache, traces, key, capacity, options, guessed):
        return compile_auto(model, mesh, example, loss_fn, options, guess=False)
    tried = "; ".join(f"{c.describe()}: {why}" for c, why in refused)
    raise PlanError(f"Mesh.auto: the compiler refused the {len(refused)} best configurations "
                    f"of the search ({tried}); give a larger cluster or memory_limit")  # fmt: skip


def repriced(plan: Ranking, model: Any) -> list[tuple[Choice, Choice]]:
    """Step 3: (as searched, as priced on ``model``: the compiler's count) for the ranking's
    first `MAX_REFUSALS + 1` configurations, ordered by the second: what fits first, then
    fastest first (what does not fit: least memory first)."""
    cluster, collective = plan.result.cluster, plan.topology.collective
    pairs = [(c, reprice(c, model, cluster, collective))
             for c in plan.result.ranked[: MAX_REFUSALS + 1]]  # fmt: skip
    return sorted(pairs, key=lambda p: (not p[1].memory.fits, p[1].step_time_s
                                        if p[1].memory.fits else p[1].memory.total))  # fmt: skip


def _retrace(model: Any, example: Any, loss_fn: Callable[..., Any] | None, examples: int,
             traces: dict[int, Any], cast: Any = None) -> Callable[[int], Any]:  # fmt: skip
    """A trace of ``rows`` sequences of the example batch (the per-rank slice the compiler
    traces), shared with the driver's ``traces``; where ``rows`` does not divide the example
    batch, the whole example's (the pricing scales it)."""
    from autopar.axes.data_parallel import split_batch
    from autopar.frontend.trace import trace

    def retrace(rows: int) -> Any:
        rows = rows if rows <= examples and examples % rows == 0 else examples
        if rows not in traces:
            args, kwargs = split_batch(example.args, example.kwargs, examples // rows)
            traces[rows] = trace(model, args, kwargs or None, loss_fn, cast=cast)
        return traces[rows]

    return retrace


class _Traces(dict):
    """rows -> Traced, shared by the search and the driver; the whole example's trace is made
    when first read (a warm plan cache may need none)."""

    def __init__(self, whole: int, make: Callable[[], Any]) -> None:
        super().__init__()
        self.whole, self._make = whole, make

    def __contains__(self, rows: object) -> bool:
        return rows == self.whole or super().__contains__(rows)

    def __missing__(self, rows: int) -> Any:
        if rows != self.whole:
            raise KeyError(rows)
        self[rows] = self._make()
        return self[rows]


def _first_trace(model: Any, example: Any, loss_fn: Callable[..., Any] | None,
                 options: Any) -> Callable[[], Any]:  # fmt: skip
    """Step 1's trace of the whole example, each value annotated with its autocast and run
    dtype."""
    from autopar.frontend.precision import annotate_autocast, mark_run_dtypes
    from autopar.frontend.trace import trace

    def make() -> Any:
        traced = trace(model, example.args, example.kwargs or None, loss_fn,
                       cast=options.cast_dtype)  # fmt: skip
        annotate_autocast(traced.gm, options.autocast_dtype)
        mark_run_dtypes(traced.gm)
        return traced

    return make


def _priced_whole(traced: Any, model: Any) -> Any:
    from cost.graph import GraphModel

    return GraphModel.from_traced(traced.gm, name=type(model).__name__)


def _warm(model: Any, example: Any, loss_fn: Any, capacity: Cluster, options: Any,
          guess: bool) -> tuple[Any, str | None, Any]:  # fmt: skip
    """With ``plan_cache``: the cache of the namespace an earlier run of this model (its
    `autopar.planner.cache.model_key`) traced, that run's priced whole graph, and the key;
    (None, key, None) when there is none: the whole example is traced (step 1)."""
    if options.plan_cache is None:
        return None, None, None
    from autopar.planner.cache import MISS, PlanCache, model_key

    key = model_key(model, example, loss_fn, capacity, options)
    cache = PlanCache.known(options.plan_cache, key) if guess else None
    priced = MISS if cache is None else cache.graph("search")
    if priced is MISS:
        return None, key, None
    return cache, key, priced


def _kept(cache: Any, traces: _Traces, key: str, capacity: Cluster, options: Any,
          guessed: bool) -> bool:  # fmt: skip
    """A plan made from a namespace found by the model's key (``guessed``) stands when the
    traces this run made are the ones that namespace recorded (at least one, none different;
    else the whole example is traced and must hash to the namespace).  Records the traces'
    digests and the key."""
    from autopar.planner.cache import PlanCache, graph_digest

    made = {rows: graph_digest(t) for rows, t in dict.items(traces)}
    recorded = {rows: cache.trace_digest(rows) for rows in made} if guessed else {}
    if guessed and (not any(recorded[r] == d for r, d in made.items()) or any(
            recorded[r] not in (None, d) for r, d in made.items())):  # fmt: skip
        real = PlanCache(options.plan_cache, traces[traces.whole], capacity, options.param_dtype)
        if real.folder != cache.folder:
            import warnings

            warnings.warn(f"plan cache {cache.folder}: the model traces differently from the "
                          "run that wrote it; planning again from its own trace", stacklevel=3)
            return False
        made[traces.whole] = graph_digest(traces[traces.whole])
    for rows, digest in made.items():
        cache.put_trace_digest(rows, digest)
    cache.put_known(key)
    return True


def _check_decided(options: Any) -> None:
    """Options that fix what the search decides are refused rather than ignored."""
    from autopar.errors import PlanError

    given = [k for k in _DECIDED if getattr(options, k) is not None]
    if options.split_points:
        given.append("split_points")
    if given:
        raise PlanError(f"Mesh.auto chooses the mesh and its schedule, but {', '.join(given)} "
                        "was given; compile a fixed Mesh(...) with it instead (e.g. the one "
                        "prog.search reports)")  # fmt: skip


def _capacity(cluster: Cluster, memory_limit: float | None) -> Cluster:
    """The cluster with its GPUs' memory set to `memory_limit` (searched against it)."""
    import dataclasses

    if memory_limit is None:
        return cluster
    return dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu,
                                                                hbm_bytes=memory_limit))  # fmt: skip


def _auto_space(mesh: AutoMesh, options: Any) -> SearchSpace:
    """Step 2: the search space of configurations the compiler builds as priced."""
    import torch

    from cost.search import RECOMPUTE

    zero = mesh.zero if options.zero is None else (options.zero,)
    schedule = options.schedule
    schedules = ("1f1b", "interleaved") if schedule in (None, "1f1b") else (schedule,)
    fp32 = options.param_dtype == torch.float32
    recompute = (options.recompute,) if options.recompute else RECOMPUTE
    return SearchSpace(zero=zero, recompute=recompute, schedules=schedules,
                       weight_bytes=4 if fp32 else 2, accumulate=False)  # fmt: skip


def auto_mesh(choice: Choice, cluster: Cluster) -> Mesh:
    """The mesh of every degree a search choice has, in its nesting (outermost first); cp
    and ep sit in the data block as the search prices them (dp outermost, cp innermost)."""
    c = choice.config
    block = {"pp": [("pp", c.pp)], "tp": [("tp", c.tp)],
             "dp": [("dp", c.dp // c.ep), ("ep", c.ep), ("cp", c.cp)]}  # fmt: skip
    order = choice.order or ("pp", "dp", "tp")
    axes = tuple((a, n) for b in order for a, n in block[b] if n > 1) or (("tp", 1),)
    return Mesh.ordered(axes, cluster)


def _choice_options(concrete: Mesh, choice: Choice, examples: int, options: Any) -> Any:
    """Step 3 for one configuration: the driver's options on its mesh with its settings."""
    c = choice.config
    settings: dict[str, Any] = {"recompute": c.recompute or "none",
                                "zero": c.zero if concrete.sizes.get("dp", 1) > 1 else None}  # fmt: skip
    if c.pp > 1:
        m = choice.micro_batches
        # 1F1B with fewer micro-batches than stages is GPipe (same bubble, m in flight)
        settings["schedule"] = "gpipe" if c.schedule == "1f1b" and m < c.pp else c.schedule
        settings["virtual_stages"] = c.virtual_stages if c.schedule == "interleaved" else None
        settings["n_microbatches"] = m if (examples // c.dp) % m == 0 else None
    return options.replace(**settings)


def load_traced(spec: str, param_dtype: Any = None) -> Any:
    """`FILE.py:FUNCTION` → the priced graph of the (model, example_inputs[, loss_fn]) the
    function returns, traced with torch.export (meta parameters stay on the meta device); with
    a 16-bit ``param_dtype``, traced as ``Mesh.auto`` traces it under
    ``mixed_precision="cast"`` (weights and inputs in that dtype, what the model's code
    upcasts fp32), so activations and messages are priced in the dtypes they run in."""
    import importlib.util
    from pathlib import Path

    from autopar.frontend.trace import trace
    from cost.graph import GraphModel

    path, _, name = spec.rpartition(":")
    if not Path(path).is_file():
        raise CostInputError(f"--model {spec!r}: no file {path!r} (write FILE.py:FUNCTION)")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise CostInputError(f"--model {spec!r}: {path} defines no function {name!r}")
    built = getattr(module, name)()
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise CostInputError(
            f"--model {spec!r}: {name}() must return (model, example_inputs) or "
            f"(model, example_inputs, loss_fn), got {type(built).__name__}"
        )
    model, inputs, loss_fn = (*built, None)[:3]
    cast = param_dtype if param_dtype is not None and param_dtype.itemsize < 4 else None
    traced = trace(model, tuple(inputs), None, loss_fn, cast=cast)
    return GraphModel.from_traced(traced.gm, name=type(model).__name__)


def _example_batch(example_inputs: Sequence[Any]) -> int:
    for x in example_inputs:
        if hasattr(x, "shape") and len(x.shape) > 0:
            return int(x.shape[0])
    raise CostInputError("Mesh.auto needs a tensor example input with a batch dimension")
