"""Choose each node's sharding strategy on one mesh axis by solving an integer program.

Algorithm (:func:`solve_axis`):
1. Enumerate every node's strategies (``rules.strategies``); parameters may be replicated or
   split on any dim that divides; user inputs arrive replicated.  On a ``tp`` axis, strategies
   that split the batch are dropped (``analysis.batch_dims``): splitting the batch is the data
   axis's job, a tensor-parallel axis exists to split the weights.
2. Tie identical blocks: nodes of repeated sibling modules (``layers.0``, ``layers.1``, ...) whose
   op/shape signature equals the first block's share its decision variables, so a 32-layer model
   is solved as one layer plus the ends.
3. Price every (node, strategy): compute share (1 when every rank repeats the op, 1/size when
   split; a split GEMM at its local shape's tile efficiency), collectives inside lowerings, and
   activation / parameter memory.  Memory is priced by
   default: holding the GPU's whole capacity costs ``MEMORY_PRICE_S`` seconds, so replicating a
   weight is never free.  Every matrix of a block (or outside blocks) must be split unless it is
   ``SMALL_MATRIX_RATIO`` times smaller than the block's median matrix: the user chose the axis
   to divide the weights; whether small ones stay whole (a multi-query key projection, a
   router) is the cost model's call.
4. Price every edge's re-layout from the producer's output to the consumer's required input
   (on a ``tp`` axis a split parameter is used where it lies: gathering weights is ZeRO-3's
   job on the data axis, not tensor parallelism),
   shared per (producer, target layout) as the lowered graph shares it, plus the backward
   all-reduce (or reduce-scatter) a replicated value needs when a split consumer makes its
   gradient partial (free when ``lower_collectives`` moves it to weight gradients, which
   overlap the rest of backward, and only if the plan keeps the region it crosses
   replicated, by a discount tied to that region's choices; priced once per value it lands
   on; discounted to the
   reduce-scatter backward of an all-gather its replicated chain starts from, by a variable
   tied to that gather's edge).  Impossible re-layouts (to partial) are forbidden pairs.  Each collective
   also pays a fixed launch-and-synchronise overhead, so fewer, larger collectives win ties.
   The graph walks these prices need (the replicated region above a value, where its
   reduction lands) are done once per node (``_Walks``), so pricing stays linear in depth;
   an edge's pair prices once per edge (``_pairs``): a tied block only adds itself to the
   groups of the shared prices its pairs pay.
5. Solve exactly with HiGHS (scipy.optimize.milp): binary choice per node, continuous
   linearisation variables per priced edge pair; optional per-rank memory limit.
"""
from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.fx as fx

from autopar.errors import FitError, PlanError
from autopar.frontend.precision import read_dtype
from autopar.frontend.trace import Traced, is_getitem, is_tensor, tensor_args
from autopar.ir import meta
from autopar.ir.analysis import (
    batch_dims,
    block_of,
    needs_grad,
    strategy_splits_batch,
    tie_blocks,
)
from autopar.ir.layout import Partial, Placement, R, Replicate, Shard, parse_placement
from autopar.ir.meta import nbytes as runtime_bytes
from autopar.ir.meta import source
from autopar.rules import RuleContext, Strategy, shared_kv_reps, strategies, view_block_counts
from cost.comm import collective_time
from cost.compute import (
    KERNEL_LAUNCH_S,
    MATMUL_OPS,
    gemm_dims,
    matmul_efficiency,
    node_flops_bytes,
    node_time,
    op_name,
    op_time,
    tensors_of,
    train_factor,
)
from cost.hardware import GPU, Link

aten = torch.ops.aten
COLLECTIVE_OVERHEAD_S = 10e-6  # launch + stream synchronisation per collective call
SMALL_MATRIX_RATIO = 8  # a matrix 8x smaller than its block's median one may stay whole
# GEMMs priced at their local shape; a grouped GEMM's tiles depend on the rows each expert
# receives (routing, unknown at plan time), so it keeps the global time / size
_LOCAL_GEMMS = {"linear", "addmm", "mm", "bmm", "matmul", "baddbmm"}
MEMORY_PRICE_S = 1e-3  # default price of holding the GPU's whole memory, in seconds of step time
# a weight split in blocks (``'tp:4'``) where one contiguous split costs the same is a tie the
# solver would break arbitrarily (and differently whenever the problem grows); this price,
# far below any collective or kernel, breaks it toward the plain split
BLOCKED_TIE_S = 1e-7


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """Knobs of the solver.  ``memory_limit``: bytes per rank; ``memory_weight``: s/byte
    (None: ``MEMORY_PRICE_S`` per GPU capacity)."""

    memory_limit: float | None = None
    memory_weight: float | None = None
    strict: bool = False
    replicate_outputs: bool = False  # graph outputs must be whole
    arrive: tuple[tuple[str, str], ...] = ()  # input -> placement it arrives in (a stage's)
    send_link: Link | None = None  # a pipeline stage: its outputs are sent on over this link
    fixed: tuple[tuple[str, str], ...] = ()  # (node, strategy) pairs to keep (a reloaded Plan)
    param_dtype: torch.dtype = torch.float32  # autocast compute dtype (autopar.frontend.precision)
    tp_overlap: str = "auto"  # which tp gathers / scatters to decompose (planner.overlap.MODES)
    overlap_fixed: tuple[str, ...] | None = None  # a reloaded plan's decomposed collectives
    solve_cache: Any = None  # a folder of earlier answers (autopar.planner.cache.SolveCache)
    # price each activation gather a linear reads with its backward re-gather (planner.overlap
    # step 4), which the overlap part adds after the solve: compile_traced's second proposal
    price_regather: bool = False


def memory_weight(options: PlanOptions, gpu: GPU) -> float:
    """Seconds a byte held per rank costs in the objective: ``options.memory_weight``, else
    ``MEMORY_PRICE_S`` per GPU capacity."""
    if options.memory_weight is not None:
        return options.memory_weight
    return MEMORY_PRICE_S / gpu.hbm_bytes


@dataclass(frozen=True, kw_only=True)
class AxisSolution:
    """The chosen strategy per node name, with the predicted cost of the choice."""

    choice: dict[str, Strategy]
    compute_s: float
    comm_s: float
    memory_bytes: float
    tied_nodes: int = 0  # nodes that reuse the decision of the same node in the first block
    variables: int = 0
    single_s: float = 0.0  # forward + backward seconds of the whole graph on one device
    param_bytes: float = 0.0  # bytes of the trainable parameters (whole)
    unsplit: tuple[str, ...] = ()  # large weights no strategy could split (they stay whole)


@dataclass
class _Problem:
    """The integer program under construction (private to this module)."""

    costs: list[float] = field(default_factory=list)
    integrality: list[int] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)
    aux: dict[tuple, int] = field(default_factory=dict)
    aux_groups: dict[tuple, set] = field(default_factory=lambda: defaultdict(set))
    aux_cost: dict[tuple, float] = field(default_factory=dict)
    aux_mem: dict[tuple, float] = field(default_factory=dict)
    time: list[float] = field(default_factory=list)
    seen_rows: set = field(default_factory=set)
    mem: dict[int, float] = field(default_factory=lambda: defaultdict(float))
    comm_vars: set[int] = field(default_factory=set)
    edges: dict[tuple, dict] = field(default_factory=dict)
    aux_terms: dict[tuple, list[int]] = field(default_factory=lambda: defaultdict(list))
    upper: list[float] = field(default_factory=list)

    def var(self, cost: float, integer: bool, upper: float = 1.0, time: float = 0.0) -> int:
        self.costs.append(cost)
        self.time.append(time)
        self.integrality.append(1 if integer else 0)
        self.upper.append(upper)
        return len(self.costs) - 1

    def row(self, coeffs: dict[int, float], lo: float, hi: float) -> None:
        key = (tuple(sorted(coeffs.items())), lo, hi)
        if key not in self.seen_rows:
            self.seen_rows.add(key)
            self.rows.append((coeffs, lo, hi))


def solve_axis(
    traced: Traced,
    axis: str,
    size: int,
    link: Link,
    gpu: GPU,
    options: PlanOptions,
) -> AxisSolution:
    """The cheapest consistent strategy per node of ``traced.gm`` on ``axis`` (step 1-5).

    On a ``tp`` axis split weights are used where they lie; if some op can only use a weight
    whole (it has no rule that splits it), the solve is repeated with weight gathers allowed
    and a warning says so.  With ``options.solve_cache`` the answer is read back when the same
    question on the same graph was answered before (`autopar.planner.cache.SolveCache`)."""
    if options.solve_cache is None:
        return _solve_axis(traced, axis, size, link, gpu, options)
    from autopar.planner.cache import SolveCache

    return SolveCache(options.solve_cache).answer(
        traced, (axis, size, link, gpu), options,
        lambda: _solve_axis(traced, axis, size, link, gpu, options))


def _solve_axis(traced: Traced, axis: str, size: int, link: Link, gpu: GPU,
                options: PlanOptions) -> AxisSolution:  # fmt: skip
    """`solve_axis` without the cache."""
    if axis != "tp" or size == 1:
        return _solve(traced, axis, size, link, gpu, options, frozenset())
    try:
        return _solve(traced, axis, size, link, gpu, options, weight_views(traced))
    except PlanError:
        if options.memory_limit is not None:
            raise
    warnings.warn(
        f"no plan on {axis}={size} uses every split weight where it lies (an op reads a weight "
        "whole: see the 'no sharding rule' warnings); some weights are all-gathered before use",
        stacklevel=2,
    )
    return _solve(traced, axis, size, link, gpu, options, frozenset())


_WEIGHT_VIEWS = {"t", "transpose", "permute", "view", "reshape", "_unsafe_view", "_to_copy",
                 "numpy_T", "alias", "detach", "clone", "contiguous", "unsqueeze", "squeeze",
                 "expand", "to", "type_as"}  # fmt: skip


def weight_views(traced: Traced) -> frozenset[str]:
    """Parameters and the views / casts of them (a transposed expert weight is still it)."""
    found = set(traced.params)
    for n in traced.gm.graph.nodes:
        name = getattr(n.target, "_opname", "")
        if n.op == "call_function" and name in _WEIGHT_VIEWS and n.args:
            first = n.args[0]
            if isinstance(first, fx.Node) and first.name in found:
                found.add(n.name)
    return frozenset(found)


def _static(traced: Traced) -> frozenset[str]:
    """Values of the weights alone: computed from parameters, with no user input, buffer or
    constant on their way (a per-head norm's stacked scales), which a shared split may read
    as a local slice (`_Pricer.relayout`)."""
    found: set[str] = set(traced.params)
    for n in traced.gm.graph.nodes:
        ins = n.all_input_nodes
        if n.op == "call_function" and ins and all(a.name in found for a in ins):
            found.add(n.name)
    return frozenset(found)


def _solve(traced: Traced, axis: str, size: int, link: Link, gpu: GPU, options: PlanOptions,
           in_place: frozenset[str]) -> AxisSolution:  # fmt: skip
    graph_nodes = list(traced.gm.graph.nodes)
    grad = needs_grad(traced)
    groups = head_groups(graph_nodes, size)
    ctx = RuleContext(size=size, blocks=block_counts(graph_nodes, groups),
                      reps=shared_kv_reps(graph_nodes, size), groups=groups)  # fmt: skip
    rep = tie_blocks(graph_nodes, traced)
    cands = _candidates(graph_nodes, rep, traced, ctx, options.strict, dict(options.arrive))
    if axis == "tp" and size > 1:
        _drop_batch_splits(cands, traced, size)
    weight = memory_weight(options, gpu)
    prob = _Problem()
    pricer = _Pricer(size=size, link=link, fixed_params=in_place, static=_static(traced),
                     gpu=gpu if options.price_regather else None)  # fmt: skip
    walks = _Walks(grad, _small_matrices(cands, traced))
    xvar = _choice_vars(prob, graph_nodes, rep, cands, grad, gpu, pricer, weight)
    for v in graph_nodes:
        _price_inputs(prob, v, rep, cands, xvar, walks, pricer, options)
    _finish_aux(prob, weight)
    unsplit = _require_weight_split(prob, cands, xvar, traced, size) if size > 1 else ()
    _fix(prob, cands, xvar, dict(options.fixed))
    x = _run(prob, options)
    choice = {
        n.name: cands[rep[n]][_picked(x, xvar, rep[n], cands)]
        for n in cands_of(graph_nodes, rep, cands)
    }
    compute = sum(prob.time[i] * x[i] for i in range(len(x)) if prob.integrality[i])
    comm = sum(prob.time[i] * x[i] for i in prob.comm_vars)
    memory = sum(c * x[i] for i, c in prob.mem.items())
    tied = sum(1 for n, r in rep.items() if r is not n)
    single = sum(run_node_time(n, gpu) * train_factor(n, n in grad)
                 for n in graph_nodes if n.op == "call_function")  # fmt: skip
    pbytes = sum(_nbytes(n) for n in graph_nodes if n in grad and n.op == "placeholder")
    return AxisSolution(choice=choice, compute_s=float(compute), comm_s=float(comm),
                        memory_bytes=float(memory), tied_nodes=tied, variables=len(x),
                        single_s=single, param_bytes=pbytes, unsplit=unsplit)  # fmt: skip


def cands_of(nodes: list[fx.Node], rep: dict, cands: dict) -> Iterator[fx.Node]:
    return (n for n in nodes if rep[n] in cands)


def _picked(x: np.ndarray, xvar: dict, node: fx.Node, cands: dict) -> int:
    vals = [x[xvar[(node, i)]] for i in range(len(cands[node]))]
    return int(np.argmax(vals))


# ---------------------------------------------------------------- step 1: candidates


def block_counts(nodes: list[fx.Node], groups: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Block counts worth considering: 1 plus the piece count of equal splits and cats and of
    leading view groups; with interleaved head ``groups`` (:func:`head_groups`) those too,
    alone and times the piece counts (CodeGen's 4 groups x q, v, k = 12 column blocks)."""
    found = {1}
    for n in nodes:
        if n.op != "call_function":
            continue
        name = getattr(n.target, "__name__", "")
        if name.startswith(("split", "chunk")) and isinstance(n.meta.get("val"), (tuple, list)):
            shapes = {tuple(v.shape) for v in n.meta["val"]}
            if len(shapes) == 1 and len(n.meta["val"]) > 1:
                found.add(len(n.meta["val"]))
        found |= view_block_counts(n)
    return tuple(sorted(found | set(groups) | {g * b for g in groups for b in found}))


def head_groups(nodes: list[fx.Node], size: int) -> tuple[int, ...]:
    """Group counts that a view splits out of an inner dim ([.., g*n] <-> [.., g, n]) and
    that ``size`` does not divide: an interleaved layout (CodeGen's 4 groups of heads, each
    with its q, v and k columns) whose every group is split over the axis, so the heads and
    the output projection's rows split blocked by g."""
    if size == 1:
        return ()
    found = {g for n in nodes if n.op == "call_function"
             for g in view_block_counts(n, inner=True) if g % size}  # fmt: skip
    return tuple(sorted(found))


def _candidates(nodes: list[fx.Node], rep: dict, traced: Traced, ctx: RuleContext,
                strict: bool, arrive: dict[str, str]) -> dict[fx.Node, list[Strategy]]:  # fmt: skip
    cands: dict[fx.Node, list[Strategy]] = {}
    for n in nodes:
        if rep[n] is not n or n.op == "output" or is_getitem(n):
            continue
        if n.op == "placeholder" and n.name in arrive:  # sent by the stage before, as it is
            cands[n] = [Strategy((), parse_placement(arrive[n.name]))]
        elif n.op == "placeholder":
            cands[n] = _placeholder_strategies(n, traced, ctx)
        elif n.op == "call_function" and (
            is_tensor(n) or isinstance(n.meta.get("val"), (tuple, list))
        ):
            cands[n] = strategies(n, ctx, strict)
    return cands


def _placeholder_strategies(n: fx.Node, traced: Traced, ctx: RuleContext) -> list[Strategy]:
    if not is_tensor(n):
        return [Strategy((), R)]
    if n.name not in traced.params and n.name not in traced.buffers:
        return [Strategy((), R)]  # user inputs arrive whole on every rank
    shape = n.meta["val"].shape
    found = [Strategy((), R)]
    for d, dim_size in enumerate(shape):
        for b in ctx.blocks:
            for rep in (1, *ctx.reps):
                if dim_size % (b * ctx.size // rep) == 0 and ctx.size > 1:
                    found.append(Strategy((), Shard(d, b, rep)))
    return found


def pieces(s: Strategy, size: int) -> int:
    """How many distinct pieces strategy ``s`` computes on an axis of ``size`` ranks: size,
    over the replication count of a shared output split (attention reading shared K/V heads
    still computes its own query heads: ``size`` pieces)."""
    outs = s.output if isinstance(s.output, tuple) else (s.output,)
    reps = [p.rep for p in outs if isinstance(p, Shard)]
    return size // max(reps, default=1)


def _drop_batch_splits(cands: dict[fx.Node, list[Strategy]], traced: Traced, size: int) -> None:
    """Keep only strategies that leave every batch element on every rank (step 1)."""
    batch, dims = batch_dims(traced)
    if batch == 1:
        return
    for n, strats in cands.items():
        if n.op == "call_function":
            kept = [s for s in strats if not strategy_splits_batch(n, s, dims, size, batch)]
            cands[n] = kept or strats[:1]


# ---------------------------------------------------------------- step 3: node prices


def _choice_vars(prob: _Problem, nodes: list[fx.Node], rep: dict, cands: dict, grad: set,
                 gpu: GPU, pricer: _Pricer, memory_weight: float) -> dict:  # fmt: skip
    size = pricer.size
    mult: dict[fx.Node, int] = defaultdict(int)
    for n in nodes:
        if rep[n] in cands:
            mult[rep[n]] += 1
    xvar = {}
    for n, strats in cands.items():
        base = run_node_time(n, gpu) if n.op == "call_function" else 0.0
        ids = []
        for i, s in enumerate(strats):
            share = 1.0 if s.redundant else 1.0 / pieces(s, size)
            local = _local_gemm_time(n, s, pieces(s, size), gpu) if base > 0 else None
            t = base * share if local is None else local
            t = max(t, min(base, KERNEL_LAUNCH_S)) * train_factor(n, n in grad)
            t += sum(pricer.t(kind, nbytes) for kind, nbytes in s.comm)
            mem = _memory(n, s, pieces(s, size), grad)
            tie = BLOCKED_TIE_S if n.op == "placeholder" and _blocked(s.output) else 0.0
            xvar[(n, i)] = prob.var(
                mult[n] * (t + memory_weight * mem + tie), True, time=mult[n] * t
            )
            prob.mem[xvar[(n, i)]] = mult[n] * mem
            ids.append(xvar[(n, i)])
        prob.row({i: 1.0 for i in ids}, 1.0, 1.0)
    return xvar


def _blocked(p: Placement | tuple) -> bool:
    return any(isinstance(q, Shard) and q.blocks > 1 for q in (p if isinstance(p, tuple) else (p,)))


def _local_gemm_time(n: fx.Node, s: Strategy, size: int, gpu: GPU) -> float | None:
    """Seconds of one rank's GEMM under a split ``s``, at the efficiency of its *local* shape
    and with the bytes it really moves (None for other ops and replicated GEMMs: the global
    time applies).  A column split reads the whole input on every rank, a row (K) split
    writes a whole partial output, a row (M) split reads the whole weight: so splitting a
    head-dim-wide projection (n = 128 -> 64), bound by reading its input, runs no faster
    (step 3)."""
    out = tensors_of(n.meta.get("val"))
    name = op_name(n)
    if s.redundant or name not in _LOCAL_GEMMS or len(out) != 1 or out[0].dim() == 0:
        return None
    first = 1 if name in ("addmm", "baddbmm") else 0
    a, b = (tensors_of(n.args[first + i].meta.get("val")) for i in (0, 1))
    if len(a) != 1 or len(b) != 1:
        return None
    m, cols, k = gemm_dims(n, out[0])
    parts = [a[0].numel(), b[0].numel(), out[0].numel()]  # elements read / written, global
    if isinstance(s.output, Partial):
        k /= size
        parts = [parts[0] / size, parts[1] / size, parts[2]]
    elif isinstance(s.output, Shard) and s.output.dim in (-1, out[0].dim() - 1):
        cols /= size
        parts = [parts[0], parts[1] / size, parts[2] / size]
    elif isinstance(s.output, Shard):
        m /= size
        batch = b[0].dim() == out[0].dim() and s.output.dim < out[0].dim() - 2
        parts = [parts[0] / size, parts[1] / (size if batch else 1), parts[2] / size]
    else:
        return None
    flops, _ = node_flops_bytes(n)
    itemsize = _run_itemsize(n)
    local = op_time(flops / size, sum(parts) * itemsize, gpu, min(max(itemsize, 2), 4),
                    compute_efficiency=matmul_efficiency(m, cols, k))  # fmt: skip
    return min(local, run_node_time(n, gpu))  # a part of a GEMM is never slower than all of it


def _run_itemsize(n: fx.Node) -> int:
    """Element size ``n`` computes in: its autocast dtype under mixed precision
    (:mod:`autopar.frontend.precision`), else its traced one."""
    val = n.meta.get("val")
    return meta.dtype(n).itemsize if isinstance(val, torch.Tensor) else 2


def run_node_time(n: fx.Node, gpu: GPU) -> float:
    """``cost.compute.node_time`` at the dtype the node runs in (step 3; the pipeline's stage
    prices use it too)."""
    val = n.meta.get("val")
    return node_time(n, gpu, _run_itemsize(n) if isinstance(val, torch.Tensor) else None)


def _memory(n: fx.Node, s: Strategy, size: int, grad: set) -> float:
    """Per-rank bytes: parameter state for parameters, saved output for grad-needing ops."""
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    split = size if isinstance(s.output, Shard) else 1
    local = runtime_bytes(n) / split
    if n.op == "placeholder":
        return meta.state_bytes(n) / split if n in grad else local
    return local if n in grad else 0.0


def _require_weight_split(prob: _Problem, cands: dict, xvar: dict, traced: Traced,
                          size: int) -> tuple[str, ...]:  # fmt: skip
    """Forbid replicating every large matrix (step 3); return those no strategy can split
    (they stay whole, with a warning)."""
    mats = [n for n in cands if n.name in traced.params and n.meta["val"].dim() >= 2]
    small = _small_matrices(cands, traced)
    unsplit = []
    for n in mats:
        fqn = traced.params[n.name]
        if n.name in small:
            continue  # small next to its block's typical matrix: the cost model decides
        if all(s.redundant for s in cands[n]):
            unsplit.append(fqn)
            continue
        for i, s in enumerate(cands[n]):
            if s.redundant:
                prob.row({xvar[(n, i)]: 1.0}, 0.0, 0.0)
    if unsplit:
        warnings.warn(
            f"{len(unsplit)} weight(s) cannot be split {size} ways and stay whole on every "
            f"rank: {', '.join(unsplit[:4])}{' ...' if len(unsplit) > 4 else ''} (sizes "
            f"{describe_tp_dims(traced)}); a degree that divides their dims splits them",
            stacklevel=3,
        )
    return tuple(unsplit)


def _fix(prob: _Problem, cands: dict, xvar: dict, fixed: dict[str, str]) -> None:
    """Pin the strategies a reloaded plan chose; the solve then only prices them."""
    for n, strats in cands.items():
        if n.name not in fixed:
            continue
        names = [str(s) for s in strats]
        if fixed[n.name] not in names:
            raise PlanError(
                f"the plan does not fit this model: node '{n.name}' at {source(n)} has no strategy "
                f"{fixed[n.name]} (it has {', '.join(names)}); re-plan without plan="
            )
        prob.row({xvar[(n, names.index(fixed[n.name]))]: 1.0}, 1.0, 1.0)


# ---------------------------------------------------------------- step 4: edge prices


@dataclass(frozen=True)
class _Pricer:
    size: int
    link: Link
    fixed_params: frozenset[str] = frozenset()  # split weights (and views) are never moved
    static: frozenset[str] = frozenset()  # values computed from weights alone (no user input)
    gpu: GPU | None = None  # PlanOptions.price_regather: edges priced as overlapped
    # (kind, bytes) -> seconds: a deep model prices the same few sizes on every edge
    _times: dict[tuple[str, float], float] = field(default_factory=dict, compare=False,
                                                   repr=False)  # fmt: skip
    pairs: dict[tuple, tuple] = field(default_factory=dict, compare=False, repr=False)  # _pairs

    def t(self, kind: str, nbytes: float) -> float:
        found = self._times.get((kind, nbytes))
        if found is None:
            best = collective_time(kind, nbytes, self.size, self.link, algorithm="best")
            found = self._times[(kind, nbytes)] = COLLECTIVE_OVERHEAD_S + best
        return found

    def relayout(self, have: Placement, want: Placement, nbytes: float, grad: bool) -> float | None:
        """Forward + backward seconds of a re-layout; None when impossible."""
        if have == want:
            return 0.0
        if (isinstance(have, Shard) and have.rep > 1 and isinstance(want, Shard) and want.rep == 1
                and have.dim == want.dim and have.blocks == want.blocks == 1):
            return 0.0  # unshare: each sharer keeps its part of the piece, locally
        bwd = 1.0 if grad else 0.0
        if isinstance(have, Replicate) and isinstance(want, Shard) and want.rep > 1:
            # share: each piece repeated rep times, locally, then sliced; backward all-gathers
            # the sharers' parts of the gradient (rep times the value) and sums them.  Only
            # for values of the weights alone (`_pairs`)
            return bwd * self.t("all_gather", nbytes * want.rep)
        if isinstance(want, Partial) or _rep(have) > 1 or _rep(want) > 1:
            return None  # a shared split is otherwise only read as it is
        if isinstance(have, Replicate):  # local slice; backward all-gathers the gradient
            return bwd * self.t("all_gather", nbytes)
        if isinstance(have, Partial):
            if isinstance(want, Replicate):
                return self.t("all_reduce", nbytes)
            return self.t("reduce_scatter", nbytes) + bwd * self.t("all_gather", nbytes)
        if isinstance(want, Replicate):
            return self.t("all_gather", nbytes)
        if have.blocks == 1 and want.blocks == 1:
            return (1 + bwd) * self.t("all_to_all", nbytes / self.size)
        return (1 + bwd) * self.t("all_gather", nbytes)

    def grad_reduce(self, have: Placement, nbytes: float) -> float:
        """Backward cost of a replicated value whose consumers make its gradient partial."""
        return self.t("reduce_scatter" if isinstance(have, Shard) else "all_reduce", nbytes)


def _rep(p: Placement) -> int:
    return p.rep if isinstance(p, Shard) else 1


def _source(arg: fx.Node) -> tuple[fx.Node, int | None]:
    if is_getitem(arg):
        return arg.args[0], arg.args[1]
    return arg, None


def _out(s: Strategy, idx: int | None) -> Placement:
    return s.output[idx] if idx is not None else s.output


def _nbytes(arg: fx.Node) -> float:
    """Bytes of a value as the program holds and moves it (its autocast dtype under mixed
    precision, annotated by autopar.frontend.precision before the solve)."""
    return runtime_bytes(arg)


def _price_inputs(prob: _Problem, v: fx.Node, rep: dict, cands: dict, xvar: dict,
                  walks: _Walks, pricer: _Pricer, options: PlanOptions) -> None:  # fmt: skip
    """Transport variables z[a, b] per edge (sum_b z = x_u[a], sum_a z = x_v[b]) keep the LP
    relaxation tight; shared re-layout costs bound them from above per (producer, target)."""
    grad = walks.grad
    if v.op == "output":
        _price_outputs(prob, v, rep, cands, xvar, pricer, options, walks.grad)
        return
    if rep[v] not in cands:
        return
    vr = rep[v]
    for slot, arg in enumerate(walks.args(v)):
        u, idx = _source(arg)
        ur = rep[u]
        if ur not in cands:
            continue
        edge = (ur, idx, vr, slot)
        fresh = edge not in prob.edges
        z = prob.edges.setdefault(edge, {})
        needs, nbytes = arg in grad, _nbytes(arg)
        moves = u.name not in pricer.fixed_params
        cast = _cast_bytes(v, arg, nbytes)
        every, priced = _pairs(pricer, edge, cands, nbytes, needs, moves, cast)
        for a, b, sa, sb, have, want, cost, key in every if fresh else priced:
            if fresh:
                z[(a, b)] = prob.var(0.0, False, upper=0.0 if cost is None else 1.0)
            if cost is None:
                continue
            if cost > 0:
                mem = _local_bytes(nbytes, want, pricer.size) if needs else 0.0
                _bound_aux(prob, key, (u, idx, key[4]), cost, edge, z[(a, b)], mem)
            if needs and isinstance(want, Replicate) and not sb.redundant:
                late = _deferred_bytes(u, arg, idx, walks) if sa.redundant else nbytes
                g = pricer.grad_reduce(have, min(nbytes, late))
                whole = sa.redundant and idx is None
                hoisted = whole and g > 0 and walks.reduced_at_weights(u)
                gkey, group = ("grad", ur, idx, a), (u, idx)
                if whole and g > 0 and not hoisted:  # one reduction where it lands
                    top = walks.deferred(u)
                    gkey, group = ("grad", rep.get(top, top), None, "deferred"), (top, None)
                _bound_aux(prob, gkey, group, g, edge, z[(a, b)], 0.0)
                if hoisted:
                    _price_weights_backward(prob, gkey, group, g, walks.region(u), rep, cands,
                                            xvar)  # fmt: skip
                elif whole and g > 0:
                    cut = _price_gather_backward(prob, gkey, group, g, u, rep, cands, xvar,
                                                 walks, pricer)  # fmt: skip
                    cut.update(_price_siblings_backward(prob, gkey, group, g, u, rep, cands,
                                                        xvar, walks, pricer))  # fmt: skip
                    if cut:  # one way to lose the reduction: they sum to at most its aux
                        prob.row({**cut, prob.aux[gkey]: -1.0}, -np.inf, 0.0)
        if fresh:
            _transport_rows(prob, z, xvar, ur, vr, len(cands[ur]), len(cands[vr]))


class _Pair(NamedTuple):
    """One (producer strategy ``a``, consumer strategy ``b``) pair of an edge."""

    a: int
    b: int
    sa: Strategy
    sb: Strategy
    have: Placement  # what ``sa`` makes of the edge's value
    want: Placement  # what ``sb`` reads it as
    cost: float | None  # the re-layout's price (None: impossible)
    key: tuple  # the shared re-layout's aux key (``_relayout_key``)


def _pairs(pricer: _Pricer, edge: tuple, cands: dict, nbytes: float, needs: bool,
           moves: bool, cast: float | None = None) -> tuple[list[_Pair], list[_Pair]]:  # fmt: skip
    """Every strategy pair of ``edge`` with its re-layout price, consumer-major (the order its
    transport variables are made in), and the pairs that are priced: a possible re-layout
    that costs something or a gradient reduction.  Memoised per edge, bytes, gradient and
    whether the producer may move: each tied block prices the first block's edges again
    (step 2), and its part is then only the priced pairs (adding itself to their groups).
    ``cast``: the bytes of the value as the consumer reads it, when fewer (`_cast_bytes`): a
    re-layout of a split value moves those, under its own key (the lowered graph casts first
    and shares that copy among the consumers reading it so)."""
    key = (edge, nbytes, needs, moves, cast)
    found = pricer.pairs.get(key)
    if found is None:
        ur, idx, vr, slot = edge
        every = []
        for b, sb in enumerate(cands[vr]):
            want = sb.inputs[slot]
            for a, sa in enumerate(cands[ur]):
                have = _out(sa, idx)
                moved = cast if cast is not None and isinstance(have, Shard) else None
                cost = pricer.relayout(have, want, nbytes if moved is None else moved, needs)
                if pricer.gpu is not None and cost is not None:  # price_regather
                    cost = _as_overlapped(pricer, ur, vr, slot, sa, sb, have, want,
                                          nbytes if moved is None else moved, needs, cost)
                if not moves and isinstance(have, Shard) and have != want:
                    cost = None
                if isinstance(have, Replicate) and _rep(want) > 1 and ur.name not in pricer.static:
                    cost = None  # an activation is shared where it is computed, never after
                key = _relayout_key(ur, idx, a, want) + (() if moved is None else ("cast",))
                every.append(_Pair(a, b, sa, sb, have, want, cost, key))
        priced = [p for p in every if p.cost is not None and (
            p.cost > 0 or (needs and isinstance(p.want, Replicate) and not p.sb.redundant))]
        found = pricer.pairs[key] = (every, priced)
    return found


def _as_overlapped(pricer: _Pricer, ur: fx.Node, vr: fx.Node, slot: int, sa: Strategy,
                   sb: Strategy, have: Placement, want: Placement, nbytes: float, needs: bool,
                   cost: float) -> float:  # fmt: skip
    """``PlanOptions.price_regather``'s edge price: what the overlap part makes of a
    Megatron-SP re-layout next to a split linear, priced by its own terms
    (``autopar.planner.overlap.gather_terms`` / ``scatter_terms``) at the local shapes.
    1. An activation gathered for a column-split linear: the gather and its gradient's
       reduce-scatter less what decomposing them under that linear's GEMMs saves (when it
       saves), plus the backward re-gather's exposed seconds.
    2. A row-split linear's partial output reduce-scattered: the reduce-scatter and its
       gradient's all-gather less the saving.
    A gather several linears read (q, k and v) runs under all their GEMMs, each taken as
    column-split.  Every other pair keeps ``cost``; the proposal is judged after the overlap
    part in any case."""
    from autopar.planner.overlap import gather_terms, scatter_terms

    if not needs or not isinstance(vr.meta.get("val"), torch.Tensor):
        return cost
    if (slot == 0 and vr.target is aten.linear.default and isinstance(have, Shard)
            and isinstance(want, Replicate) and isinstance(sb.output, Shard)
            and sb.output.dim == _out_dims(vr) - 1):  # fmt: skip
        arg = vr.args[0]
        x = arg.meta["val"]
        itemsize = max(1, round(nbytes / max(1, x.numel())))
        ns = [u.args[1].meta["val"].shape[0] / pricer.size for u in arg.users
              if u.target is aten.linear.default and u.args[0] is arg]  # fmt: skip
        fwd, bwd, (_, regather) = gather_terms(
            math.prod(x.shape[:-1]), x.shape[-1], ns, have.dim == x.dim() - 1, nbytes,
            itemsize, pricer.size, pricer.link, pricer.gpu)  # fmt: skip
        return cost - max(0.0, fwd + bwd) + regather
    if (ur.target is aten.linear.default and isinstance(have, Partial)
            and isinstance(want, Shard) and isinstance(sa.output, Partial)):  # fmt: skip
        h, out = ur.args[0].meta["val"], ur.meta["val"]
        itemsize = max(1, round(nbytes / max(1, out.numel())))
        fwd, bwd = scatter_terms(math.prod(h.shape[:-1]), h.shape[-1] / pricer.size,
                                 out.shape[-1], want.dim == out.dim() - 1, nbytes, itemsize,
                                 pricer.size, pricer.link, pricer.gpu)  # fmt: skip
        return cost - max(0.0, fwd + bwd)
    return cost


def _out_dims(n: fx.Node) -> int:
    val = n.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else 0


def _relayout_key(ur: fx.Node, idx: int | None, a: int, want: Placement) -> tuple:
    """The aux key of re-laying producer ``ur``'s output ``idx`` under its strategy ``a`` as
    ``want``, one per (producer, target layout) as the lowered graph shares it.  The target is
    named by its printed form: a string hashes once, where a Placement dataclass hashes in
    Python at each of the ~100k lookups of a deep model's pricing."""
    return ("relayout", ur, idx, a, str(want))


def _cast_bytes(v: fx.Node, arg: fx.Node, nbytes: float) -> float | None:
    """Bytes of ``arg`` as ``v`` reads it when that is fewer (autocast casts a matmul's fp32
    input to 16 bits: a gather or all-to-all of a split ``arg`` for it moves the cast copy,
    ``propagate_layout`` step 2), else None."""
    reads, have = read_dtype(v, arg), meta.dtype(arg)
    return nbytes * reads.itemsize / have.itemsize if reads.itemsize < have.itemsize else None


def _deferred_bytes(u: fx.Node, arg: fx.Node, idx: int | None, walks: _Walks) -> float:
    """Bytes of the partial gradient a replicated ``u`` passes up to where it is cheapest to
    reduce (``lower_collectives`` step 6 hoists the reduction there): back through ops with one
    user and one input that needs a gradient, while that input is not larger (a routed gather
    ``x[index]`` reduces [T, h] instead of its [T*k, h] rows)."""
    if idx is not None:
        return _nbytes(arg)
    return _nbytes(walks.deferred(u))


def _price_gather_backward(prob: _Problem, key: tuple, group: tuple, g: float, u: fx.Node,
                           rep: dict, cands: dict, xvar: dict, walks: _Walks,
                           pricer: _Pricer) -> dict[int, float]:  # fmt: skip
    """``lower_collectives`` step 9: when the chain of ops above the reduction's value (each
    reading one non-weight value that needs a gradient, no larger; weights beside it) is
    replicated and starts at an all-gather, the reduction becomes that gather's reduce-scatter
    backward (and each weight beside the chain gets its own all-reduce).  Per gather edge
    into a chain op ``c``, a discount d (cost: the reduce-scatter and the weights' all-reduces
    minus the reduction ``g``) with d <= the reduction's aux, d <= the edge's split ->
    replicated transport variables, and d <= each chain op's replicated strategies; the
    discounts of one reduction sum to at most its aux (one gather per chain; the caller's
    row, returned here as the new discount variables)."""
    grad = walks.grad
    chain, found = [walks.deferred(u)], []
    while len(chain) <= _MAX_CHAIN:
        c = chain[-1]
        if c.op != "call_function" or _mutates(c) or rep[c] not in cands:
            break
        args = walks.args(c)
        ins = [a for a in dict.fromkeys(args) if a in grad and not walks.is_weight(a)]
        if len(ins) != 1 or _nbytes(ins[0]) > _nbytes(c):
            break
        p, pidx = _source(ins[0])
        edge = (rep[p], pidx, rep[c], args.index(ins[0]))
        if edge in prob.edges:
            found.append((list(chain), edge, _nbytes(ins[0])))
        chain.append(ins[0])
    total: dict[int, float] = {}
    for path, edge, nbytes in found:
        beside = {a for n in path for a in walks.args(n) if a in grad and walks.is_weight(a)}
        saving = g - pricer.t("reduce_scatter", nbytes)
        saving -= sum(pricer.t("all_reduce", _nbytes(w)) for w in beside)
        if saving <= 0:
            continue
        d = _discount(prob, ("gather_bwd", key, edge), group, saving)
        if d is None:
            continue
        total[d] = 1.0
        pr, pidx, cr, slot = edge
        gathers = [zv for (a, b), zv in prob.edges[edge].items()
                   if isinstance(_out(cands[pr][a], pidx), Shard)
                   and isinstance(cands[cr][b].inputs[slot], Replicate)]  # fmt: skip
        prob.row({d: 1.0, **{zv: -1.0 for zv in gathers}}, -np.inf, 0.0)
        _while_replicated(prob, d, path, rep, cands, xvar)
    return total


def _price_siblings_backward(prob: _Problem, key: tuple, group: tuple, g: float, u: fx.Node,
                             rep: dict, cands: dict, xvar: dict, walks: _Walks,
                             pricer: _Pricer) -> dict[int, float]:  # fmt: skip
    """``lower_collectives`` step 10: when the replicated region above ``u`` reads, among
    values that need a gradient, only weights and one value ``f`` of the reduced value's
    bytes (``_Walks.shared_input``: Falcon's two layer norms of one residual), every such
    region of ``f`` whose reduction is paid shares one all-reduce of ``f``.  A shared aux
    s (cost: that all-reduce, once per ``f``) and a discount d (cost -g) with d <= the
    reduction's aux, d <= s and d <= each region op's replicated strategies.  One region
    alone pays s for g: the same price, as the lowering then leaves its reduction where it
    is.  Returns the new discount variables (the caller bounds their sum by the aux)."""
    shared = walks.shared_input(u)
    if shared is None:
        return {}
    f, region = shared
    if pricer.t("all_reduce", _nbytes(f)) != g:
        return {}
    # keyed by what ``f``'s readers are in the first tied block: each block's rows are the
    # first block's, so every block's regions must bound the same variable (``f`` itself is
    # the previous block's output, its own representative in the first block only)
    skey = ("siblings", frozenset(rep.get(x, x) for x in f.users))
    if skey not in prob.aux:
        prob.aux[skey] = prob.var(0.0, False)
        prob.aux_cost[skey], prob.aux_mem[skey] = g, 0.0
        prob.comm_vars.add(prob.aux[skey])
    prob.aux_groups[skey].add((f, None))
    d = _discount(prob, ("siblings_bwd", key), group, g)
    if d is None:
        return {}
    prob.row({d: 1.0, prob.aux[skey]: -1.0}, -np.inf, 0.0)
    _while_replicated(prob, d, [n for n in region if rep.get(n, n) in cands], rep, cands, xvar)
    return {d: 1.0}


def _price_weights_backward(prob: _Problem, key: tuple, group: tuple, g: float,
                            region: frozenset[fx.Node], rep: dict, cands: dict,
                            xvar: dict) -> None:  # fmt: skip
    """``lower_collectives`` step 7 hoists the reduction of a replicated value's partial
    gradient to the weights of the replicated region above it (``_Walks.reduced_at_weights``):
    free, a weight-gradient reduction overlaps like a bucket, but only when the plan keeps
    every op of that region replicated.  A split op in it (a key projection computed on the
    rank's tokens and gathered) stops the hoist: the reduction is then paid where it is.
    A discount d (cost -g) with d <= the reduction's aux and d <= each region op's replicated
    strategies."""
    d = _discount(prob, ("weights_bwd", key), group, g)
    if d is not None:
        prob.row({d: 1.0, prob.aux[key]: -1.0}, -np.inf, 0.0)
        _while_replicated(prob, d, [n for n in region if rep.get(n, n) in cands], rep, cands,
                          xvar)  # fmt: skip


def _discount(prob: _Problem, dkey: tuple, group: tuple, saving: float) -> int | None:
    """A new discount variable of ``saving`` seconds under ``dkey`` (None when the key
    exists: ``group`` then only joins it, a tied block's share)."""
    prob.aux_groups[dkey].add(group)
    if dkey in prob.aux:
        return None
    d = prob.aux[dkey] = prob.var(0.0, False)
    prob.aux_cost[dkey], prob.aux_mem[dkey] = -saving, 0.0
    prob.comm_vars.add(d)
    return d


def _while_replicated(prob: _Problem, d: int, nodes: list[fx.Node], rep: dict, cands: dict,
                      xvar: dict) -> None:  # fmt: skip
    """d <= each node's replicated strategies: the discount holds only while all repeat."""
    for n in nodes:
        reps = [xvar[(rep[n], i)] for i, s in enumerate(cands[rep[n]]) if s.redundant]
        prob.row({d: 1.0, **{xv: -1.0 for xv in reps}}, -np.inf, 0.0)


_MAX_CHAIN = 16  # chain ops between a reduction and the gather it may become (step 9)
_MAX_REGION = 64  # ops walked from a reader of a value to its sibling regions (step 10)


class _Walks:
    """The graph walks step 4 repeats per edge pair, each done once per node: a memo over the
    traced graph, which the solve does not change.  Re-walking the region above a producer
    for every edge it feeds made pricing quadratic in the model's depth."""

    def __init__(self, grad: set[fx.Node], small: frozenset[str]) -> None:
        self.grad = grad
        self.small = small  # matrices step 3 lets stay whole (may be replicated)
        self._args: dict[fx.Node, list[fx.Node]] = {}
        self._roots: dict[fx.Node, fx.Node] = {}
        self._deferred: dict[fx.Node, fx.Node] = {}
        self._reduced: dict[fx.Node, frozenset[fx.Node] | None] = {}
        self._shared: dict[fx.Node, tuple[fx.Node, frozenset[fx.Node]] | None] = {}

    def args(self, n: fx.Node) -> list[fx.Node]:
        """``trace.tensor_args(n)``, computed once."""
        found = self._args.get(n)
        if found is None:
            found = self._args[n] = tensor_args(n)
        return found

    def root(self, f: fx.Node) -> fx.Node:
        """The value a chain of single-input ops (views, casts) starts from."""
        found = self._roots.get(f)
        if found is None:
            node = f
            while node.op == "call_function" and len(self.args(node)) == 1 and not _mutates(node):
                node = self.args(node)[0]
            found = self._roots[f] = node
        return found

    def is_weight(self, f: fx.Node) -> bool:
        return self.root(f).op == "placeholder"

    def deferred(self, u: fx.Node) -> fx.Node:
        """The value whose gradient the reduction of replicated ``u``'s reaches
        (:func:`_deferred_bytes`)."""
        found = self._deferred.get(u)
        if found is None:
            node = u
            while node.op == "call_function" and len(node.users) == 1 and not _mutates(node):
                ins = [a for a in self.args(node) if a in self.grad]
                if len(ins) != 1 or _nbytes(ins[0]) > _nbytes(node):
                    break
                node = ins[0]
            found = self._deferred[u] = node
        return found

    def reduced_at_weights(self, u: fx.Node) -> bool:
        """Whether ``lower_collectives`` (step 7) moves the reduction of replicated ``u``'s
        partial gradient to weights: the replicated region above ``u`` (ops whose users all lie
        in it, e.g. a rotary embedding and a key projection) reads, among values that need a
        gradient, only weights and values that also feed another projection (whose reduction,
        Megatron's f, absorbs it).  A weight-gradient reduction overlaps the rest of backward
        like a data-parallel bucket: it costs the step no time (step 4).  A projection in the
        region must read a matrix step 3 lets stay whole: any other is split, so the replicated
        region (and the lowering's hoist) stops before it.

        Algorithm (once per ``u``):
        1. Grow the region from ``u`` by a work list: an input joins when its last user has.
        2. Stop at the first projection of a split matrix (the answer is no, whatever else
           the region would hold): the region stays within one block.
        3. Check the frontier: the values outside the region that it reads."""
        if u not in self._reduced:
            self._reduced[u] = self._region_reduced(u)
        return self._reduced[u] is not None

    def region(self, u: fx.Node) -> frozenset[fx.Node]:
        """The replicated region :meth:`reduced_at_weights` found above ``u`` (step 1)."""
        return self._reduced[u] if self.reduced_at_weights(u) else frozenset()

    def _region_reduced(self, u: fx.Node) -> frozenset[fx.Node] | None:
        if len(u.users) != 1 or u.op != "call_function" or _mutates(u):
            return None
        grown = self._grow(u)
        if grown is None:
            return None
        region, frontier = grown
        reduced = bool(frontier) and all(self.is_weight(f) or self._projected(f, region)
                                         for f in frontier)  # fmt: skip
        return frozenset(region) if reduced else None

    def shared_input(self, u: fx.Node) -> tuple[fx.Node, frozenset[fx.Node]] | None:
        """The one value ``f`` (and the region) when the region above ``u``, a value only
        projections read, reads among values that need a gradient only weights, values
        another projection reads, and ``f`` (``_price_siblings_backward``)."""
        found = self._region_input(u)
        if found is None or not any(v is not u and self._region_input(v) is not None
                                    and self._region_input(v)[0] is found[0]
                                    for v in self._readers_below(found[0], found[1])):  # fmt: skip
            return None  # one region alone: its reduction stays where it is
        return found

    def _readers_below(self, f: fx.Node, region: frozenset[fx.Node]) -> list[fx.Node]:
        """The ops reached from ``f``'s readers outside ``region`` (at most _MAX_REGION each)."""
        out: list[fx.Node] = []
        for x in f.users:
            if x in region:
                continue
            seen, todo = {x}, [x]
            while todo and len(seen) <= _MAX_REGION:
                n = todo.pop()
                out.append(n)
                for y in n.users:
                    if y not in seen:
                        seen.add(y)
                        todo.append(y)
        return out

    def _region_input(self, u: fx.Node) -> tuple[fx.Node, frozenset[fx.Node]] | None:
        if u not in self._shared:
            self._shared[u] = self._shared_input(u)
        return self._shared[u]

    def _shared_input(self, u: fx.Node) -> tuple[fx.Node, frozenset[fx.Node]] | None:
        if u.op != "call_function" or _mutates(u) or not u.users:
            return None
        if not all(op_name(x) in MATMUL_OPS for x in u.users):
            return None
        grown = self._grow(u)
        if grown is None:
            return None
        region, frontier = grown
        left = [f for f in frontier if not self.is_weight(f) and not self._projected(f, region)]
        return (left[0], frozenset(region)) if len(left) == 1 else None

    def _grow(self, u: fx.Node) -> tuple[set[fx.Node], set[fx.Node]] | None:
        """The region above ``u`` (an input joins when its last user has; None at the first
        projection of a split matrix) and its frontier: the values outside it that it reads."""
        region, todo = {u}, [u]
        while todo:
            n = todo.pop()
            if self._projects_split(n):
                return None
            for a in self.args(n):
                if (a not in region and a in self.grad and a.op == "call_function"
                        and not _mutates(a) and all(x in region for x in a.users)):  # fmt: skip
                    region.add(a)
                    todo.append(a)
        frontier = {a for n in region for a in self.args(n) if a in self.grad and a not in region}
        return region, frontier

    def _projects_split(self, n: fx.Node) -> bool:
        """``n`` is a projection of a matrix step 3 forces to be split."""
        return op_name(n) in MATMUL_OPS and any(
            self.is_weight(a) and self.root(a).name not in self.small for a in self.args(n)
        )

    def _projected(self, f: fx.Node, region: set) -> bool:
        """``f`` also feeds a projection outside the region (a weight every tp plan splits,
        step 3, so ``f``'s gradient is reduced there anyway and the region's share merges
        into it)."""
        return any(op_name(x) in MATMUL_OPS
                   and any(self.is_weight(a) for a in self.args(x) if a is not f)
                   for x in f.users if x not in region)  # fmt: skip


def _small_matrices(cands: dict, traced: Traced) -> frozenset[str]:
    """Placeholder names of the matrices step 3 does not force to be split."""
    mats = [n for n in cands if n.name in traced.params and n.meta["val"].dim() >= 2]
    sizes: dict[str, list[int]] = defaultdict(list)
    for n in mats:
        sizes[block_of(traced.params[n.name])].append(n.meta["val"].numel())
    small = set()
    for n in mats:
        group = sorted(sizes[block_of(traced.params[n.name])])
        if n.meta["val"].numel() * SMALL_MATRIX_RATIO <= group[len(group) // 2]:
            small.add(n.name)
    return frozenset(small)


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is None or schema.is_mutable


def _transport_rows(prob: _Problem, z: dict, xvar: dict, ur: fx.Node, vr: fx.Node, na: int,
                    nb: int) -> None:  # fmt: skip
    for a in range(na):
        prob.row({**{z[(a, b)]: 1.0 for b in range(nb)}, xvar[(ur, a)]: -1.0}, 0.0, 0.0)
    for b in range(nb):
        prob.row({**{z[(a, b)]: 1.0 for a in range(na)}, xvar[(vr, b)]: -1.0}, 0.0, 0.0)


def _price_outputs(prob: _Problem, out: fx.Node, rep: dict, cands: dict, xvar: dict,
                   pricer: _Pricer, options: PlanOptions, grad: set) -> None:  # fmt: skip
    """Partial outputs are reduced; with ``replicate_outputs`` split outputs are gathered too.
    A pipeline stage's outputs (``send_link``) are sent on as they are: a split one sends
    1/t of the bytes but the next stage may gather it, priced as that gather less the send
    time it saves (its latency, on links as fast as tp's)."""
    for arg in tensor_args(out):
        u, idx = _source(arg)
        ur = rep[u]
        if ur not in cands:
            continue
        for a, sa in enumerate(cands[ur]):
            have = _out(sa, idx)
            if isinstance(have, Partial) or (options.replicate_outputs and isinstance(have, Shard)):
                cost = pricer.relayout(have, R, _nbytes(arg), False)
                if cost is None:  # a shared split is never gathered: not an output
                    prob.row({xvar[(ur, a)]: 1.0}, 0.0, 0.0)
                    continue
                key = _relayout_key(ur, idx, a, R)
                _link_aux(prob, key, (u, idx, key[-1]), cost, xvar[(ur, a)])
            elif options.send_link is not None and isinstance(have, Shard) and have.rep == 1:
                cost = _sent_shard_price(pricer, options.send_link, _nbytes(arg), arg in grad)
                if cost > 0:
                    _link_aux(prob, ("sent", ur, idx, a), (u, idx, have), cost, xvar[(ur, a)])


def _sent_shard_price(pricer: _Pricer, link: Link, nbytes: float, needs: bool) -> float:
    """A split boundary value: the gather the next stage may need, less the send time its
    1/t share saves (forward, and its gradient back when it carries one)."""
    def send(b: float) -> float:
        return collective_time("send_recv", b, 2, link)

    saved = (send(nbytes) - send(nbytes / pricer.size)) * (2.0 if needs else 1.0)
    return max(0.0, pricer.t("all_gather", nbytes) - saved)


def _local_bytes(nbytes: float, p: Placement, size: int) -> float:
    return nbytes / size if isinstance(p, Shard) else nbytes


def _bound_aux(prob: _Problem, key: tuple, group: tuple, cost: float, edge: tuple,
               zvar: int, mem: float) -> None:  # fmt: skip
    """aux[key] >= sum of the edge's transport variables that need this re-layout; a
    re-laid value a gradient needs is saved for backward (``mem`` bytes per rank)."""
    if key not in prob.aux:
        prob.aux[key] = prob.var(0.0, False)
        prob.aux_cost[key] = cost
        prob.aux_mem[key] = mem
        prob.comm_vars.add(prob.aux[key])
    prob.aux_groups[key].add(group)
    prob.aux_terms[(key, edge)].append(zvar)


def _link_aux(prob: _Problem, key: tuple, group: tuple, cost: float, xa: int) -> None:
    """aux[key] >= xa: a partial graph output must be all-reduced."""
    if key not in prob.aux:
        prob.aux[key] = prob.var(0.0, False)
        prob.aux_cost[key] = cost
        prob.aux_mem[key] = 0.0
        prob.comm_vars.add(prob.aux[key])
    prob.aux_groups[key].add(group)
    prob.row({xa: 1.0, prob.aux[key]: -1.0}, -np.inf, 0.0)


def _finish_aux(prob: _Problem, memory_weight: float) -> None:
    for key, z in prob.aux.items():
        mult = len(prob.aux_groups[key])
        prob.time[z] = prob.aux_cost[key] * mult
        prob.mem[z] = prob.aux_mem[key] * mult
        prob.costs[z] = prob.time[z] + memory_weight * prob.mem[z]
    for (key, _edge), zs in prob.aux_terms.items():
        prob.row({**{v: 1.0 for v in zs}, prob.aux[key]: -1.0}, -np.inf, 0.0)


# ---------------------------------------------------------------- step 5: solve


def _run(prob: _Problem, options: PlanOptions) -> np.ndarray:
    from scipy.optimize import Bounds, LinearConstraint, milp  # HiGHS: loaded on first solve
    from scipy.sparse import coo_matrix

    n = len(prob.costs)
    rows, cols, vals, lo, hi = [], [], [], [], []
    for r, (coeffs, a, b) in enumerate(prob.rows):
        for c, v in coeffs.items():
            rows.append(r)
            cols.append(c)
            vals.append(v)
        lo.append(a)
        hi.append(b)
    constraints = [LinearConstraint(coo_matrix((vals, (rows, cols)), shape=(len(lo), n)), lo, hi)]
    if options.memory_limit is not None:
        mem = np.zeros(n)
        for i, c in prob.mem.items():
            mem[i] = c
        constraints.append(LinearConstraint(mem[None, :], -np.inf, options.memory_limit))
    scale = max(max(prob.costs), 1e-30)
    res = milp(np.array(prob.costs) / scale, integrality=np.array(prob.integrality),
               bounds=Bounds(0, np.array(prob.upper)), constraints=constraints)  # fmt: skip
    if res.x is None:
        error = FitError if options.memory_limit is not None else PlanError
        raise error(_infeasible_message(prob, options))
    return np.round(res.x, 6)


def _infeasible_message(prob: _Problem, options: PlanOptions) -> str:
    if options.memory_limit is not None:
        return (
            f"no plan fits memory_limit={options.memory_limit / 2**20:.1f} MiB per rank; "
            "raise the limit or use a larger tensor-parallel degree"
        )
    return "the sharding problem has no consistent solution (an internal rule conflict)"


def describe_tp_dims(traced: Traced) -> str:
    """The model sizes a tensor-parallel degree must divide, for error messages."""
    dims: dict[str, set[int]] = defaultdict(set)
    for ph, fqn in traced.params.items():
        del ph
        t = traced.tensors.get(fqn)
        if t is None or t.dim() == 0:
            continue
        dims[fqn.rsplit(".", 1)[0] or fqn].update(t.shape)
    sizes = sorted({s for v in dims.values() for s in v})
    return ", ".join(map(str, sizes[:12])) + (", ..." if len(sizes) > 12 else "")
