"""The overlap planner part: which tp gathers / scatters to decompose under their matmuls.

A decomposed pair (passes/overlap_tp.py, autopar.ops.overlap) runs the collective as ring
steps while the partial matmuls run: it hides communication but runs each matmul as ``t``
smaller GEMMs (less efficient) and pays one hop latency per step.  Whether that wins depends
on the layer's shapes and the link, so the cost model decides per collective.

Algorithm (:func:`choose_overlap`, on the lowered tp graph: collectives concrete, shapes local):
1. The candidates of passes.overlap_tp (Megatron-SP's gathers before column-split linears and
   reduce-scatters after row-split ones).
2. Price each per pass (forward: the collective itself; backward: its mirror under the
   input-gradient matmuls): unfused = ``collective_time`` + the whole GEMMs; decomposed =
   ``cost.comm.decomposed_time`` with each step's partial GEMMs priced at their chunk's shape
   (``cost.compute.matmul_efficiency``).  The saving is the difference (negative: it loses).
3. ``mode`` "auto" keeps the candidates that save time, "all" every candidate, "none" none; a
   reloaded plan's keys (``fixed``) are kept as they are, each checked to name a candidate.
4. Re-gather (Megatron-SP's memory): unless ``mode`` is "none" (every tp collective whole,
   as DTensor runs them), every gather candidate keeps only its shard for backward and
   re-gathers it there over the ring under the weight-gradient matmuls
   (``autopar.ops.overlap.gather_linear``, whole or decomposed); each re-gather's exposed
   seconds (``cost.comm.decomposed_time`` of the chunked weight-gradient GEMMs, less those
   GEMMs) are added to the plan's communication, and it is listed as one more backward
   all-gather.  It frees the gathered input's bytes less the shard's (t - 1 of t).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.fx as fx

from autopar.errors import PlanError
from autopar.ir import meta
from cost.comm import collective_time, decomposed_time
from cost.compute import matmul_efficiency, op_time
from cost.hardware import GPU, Link
from passes.overlap_tp import Candidate, candidates

MODES = ("auto", "all", "none")


@dataclass(frozen=True, kw_only=True)
class OverlapChoice:
    """The decomposed candidates' keys, each candidate's saving (forward, backward seconds
    per micro-batch; by key), and how many candidates there were."""

    keys: tuple[str, ...]
    saved: dict[str, tuple[float, float]]
    considered: int
    collectives: dict[str, str] = field(default_factory=dict)  # key -> its collective node
    regather: dict[str, tuple[float, float]] = field(default_factory=dict)  # step 4, by key:
    # (the re-gather's whole all-gather seconds, its exposed seconds under its matmuls)

    @property
    def saved_s(self) -> float:
        return sum(sum(self.saved[k]) for k in self.keys)

    @property
    def regather_s(self) -> float:
        """Exposed seconds the re-gathers add to backward (step 4)."""
        return sum(exposed for _, exposed in self.regather.values())

    @property
    def regathered(self) -> dict[str, float]:
        """Each re-gathered collective node's name -> the seconds its ring hides (the
        re-gather's whole time less its exposed time; what its plan row carries)."""
        return {self.collectives[k]: whole - exposed
                for k, (whole, exposed) in self.regather.items()}  # fmt: skip

    @property
    def hidden(self) -> dict[str, tuple[float, float]]:
        """The chosen ones' savings by collective node name (what the plan's collectives carry)."""
        return {self.collectives[k]: self.saved[k] for k in self.keys}


def choose_overlap(gm: fx.GraphModule, size: int, link: Link, gpu: GPU, mode: str,
                   fixed: Sequence[str] | None = None) -> OverlapChoice:  # fmt: skip
    """Steps 1-3."""
    found = candidates(gm) if size > 1 else []
    saved = {c.key: price(c, size, link, gpu) for c in found}
    if fixed is not None:
        unknown = sorted(set(fixed) - set(saved))
        if unknown:
            raise PlanError(f"the plan decomposes tp collectives this program does not have "
                            f"({', '.join(unknown[:5])}); was it saved for another model? "
                            "re-plan without plan=")  # fmt: skip
        keys = tuple(k for k in saved if k in set(fixed))
    elif mode == "all":
        keys = tuple(saved)
    elif mode == "auto":
        keys = tuple(k for k, (f, b) in saved.items() if f + b > 0)
    else:
        keys = ()
    regather = {c.key: regather_price(c, size, link, gpu) for c in found
                if c.kind == "all_gather" and (mode != "none" or fixed is not None)}  # fmt: skip
    return OverlapChoice(keys=keys, saved=saved, considered=len(found),
                         collectives={c.key: c.collective.name for c in found},
                         regather=regather)  # fmt: skip


def regather_price(cand: Candidate, size: int, link: Link, gpu: GPU) -> tuple[float, float]:
    """Step 4: (whole all-gather seconds, exposed seconds) of re-gathering ``cand``'s shard
    in backward over the ring under the weight-gradient GEMMs."""
    return gather_terms(*_gather_dims(cand), size, link, gpu)[2]


def price(cand: Candidate, size: int, link: Link, gpu: GPU) -> tuple[float, float]:
    """Step 2: (forward, backward) seconds the decomposition saves on ``cand``."""
    coll = cand.collective
    if cand.kind == "all_gather":
        fwd, bwd, _ = gather_terms(*_gather_dims(cand), size, link, gpu)
        return fwd, bwd
    itemsize = meta.dtype(coll).itemsize
    full = coll.args[0].meta["val"]  # the partial sums [.., o]
    h = cand.linears[0].args[0].meta["val"]
    m, k, o = math.prod(h.shape[:-1]), h.shape[-1], full.shape[-1]
    return scatter_terms(m, k, o, cand.dim == len(coll.meta["val"].shape) - 1,
                         full.numel() * itemsize, itemsize, size, link, gpu)  # fmt: skip


def _gather_dims(cand: Candidate) -> tuple:
    coll = cand.collective
    itemsize = meta.dtype(coll).itemsize
    gathered = coll.meta["val"]
    m, k = math.prod(gathered.shape[:-1]), gathered.shape[-1]
    ns = [lin.args[1].meta["val"].shape[0] for lin in cand.linears]
    return (m, k, ns, cand.dim == len(gathered.shape) - 1, gathered.numel() * itemsize,
            itemsize)  # fmt: skip


def gather_terms(m: float, k: float, ns: Sequence[float], last: bool, nbytes: float,
                 itemsize: int, size: int, link: Link,
                 gpu: GPU) -> tuple[float, float, tuple[float, float]]:  # fmt: skip
    """A gather of [m, k] (by chunks of m, or of k: ``last``) for linears of output widths
    ``ns``: the seconds decomposing saves forward ([m, k] x [k, n]) and backward (the input
    gradient [m, n] x [n, k] reduce-scattered), and the re-gather's (whole, exposed)
    seconds under the weight-gradient GEMMs [n, m] x [m, k] (step 4)."""
    fwd = _saving("all_gather", nbytes, size, link, gpu, itemsize,
                  [(m, n, k) for n in ns], 2 if last else 0)  # fmt: skip
    bwd = _saving("reduce_scatter", nbytes, size, link, gpu, itemsize,
                  [(m, k, n) for n in ns], 1 if last else 0)  # fmt: skip
    whole, chunk = _whole_and_chunk([(n, k, m) for n in ns], size, gpu, itemsize,
                                    1 if last else 2)  # fmt: skip
    exposed = max(0.0, decomposed_time(nbytes, size, link, chunk) - whole)
    return fwd, bwd, (collective_time("all_gather", nbytes, size, link), exposed)


def scatter_terms(m: float, k: float, o: float, last: bool, nbytes: float, itemsize: int,
                  size: int, link: Link, gpu: GPU) -> tuple[float, float]:  # fmt: skip
    """A row-split linear's partial [m, o] (from [m, k] x [k, o]) reduce-scattered by chunks
    of m (or of o: ``last``): the seconds decomposing saves forward and backward (the
    gradient's all-gather under the input-gradient GEMM [m, o] x [o, k])."""
    fwd = _saving("reduce_scatter", nbytes, size, link, gpu, itemsize, [(m, o, k)],
                  1 if last else 0)  # fmt: skip
    bwd = _saving("all_gather", nbytes, size, link, gpu, itemsize, [(m, k, o)],
                  2 if last else 0)  # fmt: skip
    return fwd, bwd


def _saving(kind: str, nbytes: float, size: int, link: Link, gpu: GPU, itemsize: int,
            gemms: list[tuple[float, float, float]], split: int) -> float:  # fmt: skip
    """Unfused minus decomposed seconds of ``kind`` over ``gemms`` (m, n, k), each step
    running a 1/size chunk of dim ``split`` (0: m, 1: n, 2: k) of every GEMM."""
    whole, chunk = _whole_and_chunk(gemms, size, gpu, itemsize, split)
    unfused = collective_time(kind, nbytes, size, link) + whole
    return unfused - decomposed_time(nbytes, size, link, chunk)


def _whole_and_chunk(gemms: list[tuple[float, float, float]], size: int, gpu: GPU,
                     itemsize: int, split: int) -> tuple[float, float]:  # fmt: skip
    """Seconds of ``gemms`` (m, n, k) whole, and of one ring step's chunk of them: a 1/size
    piece of dim ``split`` (0: m, 1: n, 2: k) of every GEMM."""
    whole = sum(_gemm_s(g, gpu, itemsize) for g in gemms)
    chunk = sum(_gemm_s(tuple(d / size if i == split else d for i, d in enumerate(g)), gpu,
                        itemsize) for g in gemms)  # fmt: skip
    return whole, chunk


def _gemm_s(g: tuple[float, float, float], gpu: GPU, itemsize: int) -> float:
    m, n, k = g
    moved = (m * k + k * n + m * n) * itemsize
    return op_time(2 * m * n * k, moved, gpu, min(max(itemsize, 2), 4),
                   compute_efficiency=matmul_efficiency(m, n, k))


def exposed_comm(choice: OverlapChoice, comm_s: float) -> float:
    """The solved plan's ``comm_s`` after this part: less what the rings hide, plus what the
    re-gathers expose (the plan's communication seconds)."""
    return max(0.0, comm_s - choice.saved_s) + choice.regather_s


def overlap_line(choice: OverlapChoice, comm_s: float) -> str:
    """The plan's note on the decomposition: how many candidates, and the exposed tp
    communication of the solved plan before and after."""
    after = exposed_comm(choice, comm_s)
    line = (f"tp overlap: {len(choice.keys)} of {choice.considered} gathers / scatters "
            f"decomposed into ring steps under their matmuls (collective matmul)")  # fmt: skip
    if choice.regather:
        line += (f"; {len(choice.regather)} gathered inputs kept as their shards and "
                 "re-gathered in backward under the weight-gradient matmuls (+"
                 f"{choice.regather_s * 1e3:.3f} ms exposed)")  # fmt: skip
    return line + f"; exposed communication {comm_s * 1e3:.3f} ms -> {after * 1e3:.3f} ms per step"

