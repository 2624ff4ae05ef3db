"""Sharding rules: the strategy type, the rule registry and shared helpers.

The op families live beside this module (pointwise, views, reductions, matmul, moe,
replicated); ``autopar.rules`` imports them all, which registers their rules.

For each ATen op, the ways it can run split along one mesh axis.

A rule maps a node (global shapes in ``meta["val"]``) to its :class:`Strategy` list.  A
strategy fixes the placement each tensor input must arrive in and the placement of the output;
the op then runs on local shards unchanged, or through a named ``lowering`` (vocab-parallel
embedding, vocab-parallel cross-entropy, ...) that the tensor_parallel pass writes in.

Algorithm of :func:`strategies`:
1. Look up the rule by op; ops without one get the replicated strategy and a warning naming the
   op and the user's source line (an error under ``strict=True``).
2. Every rule offers the fully replicated strategy; the others come from the op's dim
   structure (pointwise broadcasting, view dim groups, matmul batch/m/n/k dims, ...).
3. Shared splits (``ctx.reps``, set where grouped-query attention has fewer K/V heads than
   ranks): a strategy on an axis of size/rep ranks also runs on the whole axis with each piece
   held by rep consecutive ranks (they repeat its computation), when it splits its output
   and makes nothing partial (a partial summand would be counted rep times); every split
   becomes shared, replicated inputs stay replicated.
4. Drop strategies whose split dims do not divide evenly by the axis size (times blocks,
   over rep for shared splits).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.errors import ShardingRuleError
from autopar.frontend.trace import tensor_args
from autopar.ir.layout import Partial, Placement, R, Replicate, Shard
from autopar.ir.meta import source

aten = torch.ops.aten
Out = Placement | tuple[Placement, ...]


@dataclass(frozen=True)
class Strategy:
    """One way to run an op split along an axis."""

    inputs: tuple[Placement, ...]  # one per tensor argument (see trace.tensor_args)
    output: Out
    lowering: str | None = None  # name of the tensor_parallel lowering, if any
    comm: tuple[tuple[str, int], ...] = ()  # collectives inside the lowering: (kind, bytes)

    @functools.cached_property
    def redundant(self) -> bool:
        """Every rank computes the whole op (all inputs and outputs replicated); asked per
        edge pair by the planner, so computed once."""
        outs = self.output if isinstance(self.output, tuple) else (self.output,)
        return all(isinstance(p, Replicate) for p in (*self.inputs, *outs))

    def __str__(self) -> str:
        return self._text

    @functools.cached_property
    def _text(self) -> str:
        """``str(self)``, made once: the nodes of tied blocks share their strategies."""
        ins = ",".join(map(str, self.inputs))
        outs = self.output if isinstance(self.output, tuple) else (self.output,)
        low = f" [{self.lowering}]" if self.lowering else ""
        return f"({ins})->{','.join(map(str, outs))}{low}"


@dataclass(frozen=True)
class RuleContext:
    """What a rule may consult besides the node: axis size and the block counts in play."""

    size: int
    blocks: tuple[int, ...] = (1,)
    reps: tuple[int, ...] = ()  # shared-split replication counts in play (step 3)
    groups: tuple[int, ...] = ()  # head groups the axis size does not divide (interleaved)


Rule = Callable[[fx.Node, RuleContext], list[Strategy]]
RULES: dict[object, Rule] = {}
NAMED_RULES: dict[str, Rule] = {}  # custom ops by qualified name: their library may load late


def _named_rule(target: object) -> Rule | None:
    """The rule of a custom op registered by name (``transformers::grouped_mm_fallback``)."""
    name = getattr(target, "name", None)
    return NAMED_RULES.get(name()) if callable(name) else None



def rule(*ops: object) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        for op in ops:
            RULES[op] = fn
        return fn

    return register


def has_rule(node: fx.Node) -> bool:
    return node.target in RULES or _named_rule(node.target) is not None


def strategies(node: fx.Node, ctx: RuleContext, strict: bool = False) -> list[Strategy]:
    """All valid strategies of ``node`` on an axis of ``ctx.size`` ranks (replicated first)."""
    fn = RULES.get(node.target) or _named_rule(node.target)
    if fn is None:
        msg = f"no sharding rule for {_op_name(node)} at {source(node)}; it runs replicated"
        if strict:
            raise ShardingRuleError(
                msg.replace("it runs replicated", "add a rule in autopar/rules/ (the module of its op family)")
                + " (or pass strict=False to replicate it)"
            )
        warnings.warn(msg, stacklevel=2)
        return [replicated(node)]
    found = [replicated(node)] + [s for s in fn(node, ctx) if not s.redundant]
    for rep in ctx.reps:
        narrow = RuleContext(size=ctx.size // rep, blocks=ctx.blocks)
        found += [shared for s in fn(node, narrow) if (shared := _shared(s, rep)) is not None]
    unique = list(dict.fromkeys(found))
    return [s for s in unique if _divides(node, s, ctx.size)]


def _shared(s: Strategy, rep: int) -> Strategy | None:
    """Step 3: ``s`` with every split shared by ``rep`` ranks (None when it does not apply)."""
    outs = s.output if isinstance(s.output, tuple) else (s.output,)
    places = (*s.inputs, *outs)
    if s.lowering or s.comm or any(isinstance(p, Partial) for p in places):
        return None
    if any(isinstance(p, Shard) and p.rep > 1 for p in places):
        return None  # already shared (grouped-query attention's own strategy)
    if not any(isinstance(p, Shard) and p.rep == 1 for p in outs):
        return None
    lift = lambda p: Shard(p.dim, p.blocks, rep) if isinstance(p, Shard) else p  # noqa: E731
    out = tuple(map(lift, outs)) if isinstance(s.output, tuple) else lift(s.output)
    return Strategy(tuple(map(lift, s.inputs)), out)


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def replicated(node: fx.Node) -> Strategy:
    n_in = len(tensor_args(node))
    val = node.meta.get("val")
    out: Out = tuple(R for _ in val) if isinstance(val, (tuple, list)) else R
    return Strategy((R,) * n_in, out)


def _divides(node: fx.Node, s: Strategy, size: int) -> bool:
    pairs = list(zip(tensor_args(node), s.inputs, strict=True))
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    outs = s.output if isinstance(s.output, tuple) else (s.output,)
    shapes = [a.meta["val"].shape for a, _ in pairs] + [
        v.shape if isinstance(v, torch.Tensor) else () for v in vals
    ]
    for shape, p in zip(shapes, [p for _, p in pairs] + list(outs), strict=True):
        if isinstance(p, Shard) and (
            p.dim >= len(shape) or size % p.rep or shape[p.dim] % (size // p.rep * p.blocks)
        ):
            return False
    return True


def _shape(node: fx.Node) -> torch.Size:
    return node.meta["val"].shape


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


