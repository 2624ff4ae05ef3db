"""Graph analyses that the planner and the passes share (they only read the traced graph).

- :func:`needs_grad`: which values depend on a trainable parameter.
- :func:`find_blocks` / :func:`tie_blocks`: repeated sibling modules (``layers.0``,
  ``layers.1``, ...) and, for identical ones, the node of the first block each node mirrors.
- :func:`batch_dims`: where the global batch lives in every value, so that an axis that must
  not split the batch (``tp``) can refuse strategies that would.

Algorithm of :func:`batch_dims`:
1. The batch size B is dim 0 of the first user input with a dim; every user input whose
   dim 0 has size B carries the batch there.
2. Walk the graph in order.  For each op, ask its sharding rules (on an axis of B ranks)
   for the strategy whose inputs are split exactly where the batch lives (other inputs
   replicated); its output placement is where the batch lives in the output.  An op whose
   rules have no such strategy (a reduction over the batch, an op without a rule) ends the
   batch there.
3. A split ``Shard(d, blocks)`` on an axis of t ranks of a value whose batch lives at
   ``Shard(d, outer)`` (dim ``d`` = [outer, B, inner]) splits the batch unless every rank still
   holds every batch element of the positions it holds: its pieces either cover whole
   ``[B, inner]`` groups or lie inside one ``inner`` run with all t pieces of a block there.
"""

from __future__ import annotations

import re
import warnings
from collections import defaultdict

import torch
import torch.fx as fx

from autopar.frontend.trace import Traced, is_getitem, tensor_args
from autopar.ir.layout import Placement, R, Shard
from autopar.ir.meta import clean_path
from autopar.rules import RuleContext, Strategy, strategies

# ---------------------------------------------------------------- gradient reachability


def needs_grad(traced: Traced, gm: fx.GraphModule | None = None) -> set[fx.Node]:
    """Floating-point values of ``gm`` (default: the traced graph) that depend on a trainable
    parameter."""
    trainable = {ph for ph, fqn in traced.params.items() if fqn in traced.trainable}
    trainable |= traced.grad_inputs
    out: set[fx.Node] = set()
    for n in (gm or traced.gm).graph.nodes:
        if n.op == "placeholder":
            if n.name in trainable:
                out.add(n)
            continue
        vals = n.meta.get("val")
        floating = any(
            isinstance(v, torch.Tensor) and v.is_floating_point()
            for v in (vals if isinstance(vals, (tuple, list)) else (vals,))
        )
        if floating and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


# ---------------------------------------------------------------- repeated blocks

_INDEXED = re.compile(r"^(.*)\.(\d+)$")


def tie_blocks(nodes: list[fx.Node], traced: Traced) -> dict[fx.Node, fx.Node]:
    """Map each node to the node of the first identical block it mirrors (itself if none)."""
    rep = {n: n for n in nodes}
    blocks = find_blocks(nodes, traced)
    if len(blocks) < 2:
        return rep
    first = blocks[0]
    sig0 = _signature(first, traced)
    for block in blocks[1:]:
        if len(block) == len(first) and _signature(block, traced) == sig0:
            for a, b in zip(block, first, strict=True):
                rep[a] = b
    return rep


def find_blocks(nodes: list[fx.Node], traced: Traced) -> list[list[fx.Node]]:
    """The nodes of each repeated sibling module of the largest indexed container (most nodes:
    a model's 2 layers, not the 3 modules of a small ``nn.Sequential`` beside them), in order."""
    members: dict[str, dict[int, list[fx.Node]]] = defaultdict(lambda: defaultdict(list))
    seen: dict[tuple[str, ...], set[tuple[str, int]]] = {}  # a block's nodes share their paths
    for n in nodes:
        path = traced.params.get(n.name) or traced.buffers.get(n.name) or ""
        paths = (path.rsplit(".", 1)[0],) if path else _stack_paths(n)
        found = seen.get(paths)
        if found is None:
            found = seen[paths] = _indexed_prefixes(paths)
        for container, idx in found:
            members[container][idx].append(n)
    if not members:
        return []
    nodes_in = lambda c: sum(map(len, members[c].values()))  # noqa: E731
    container = max(members, key=lambda c: (nodes_in(c), len(members[c]), -len(c)))
    by_index = members[container]
    return [by_index[i] for i in sorted(by_index)]


def block_of(fqn: str) -> str:
    """The innermost indexed module path of a parameter name ('' outside any block)."""
    parts = fqn.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if _INDEXED.match(".".join(parts[:i])):
            return ".".join(parts[:i])
    return ""


def _stack_paths(n: fx.Node) -> tuple[str, ...]:
    stack = n.meta.get("nn_module_stack") or {}
    return tuple(clean_path(p) for p, _ in stack.values())


def _indexed_prefixes(paths: tuple[str, ...]) -> set[tuple[str, int]]:
    found = set()
    for path in paths:
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            m = _INDEXED.match(".".join(parts[:i]))
            if m:
                found.add((m.group(1), int(m.group(2))))
    return found


def _signature(block: list[fx.Node], traced: Traced) -> list[tuple]:
    index = {n: i for i, n in enumerate(block)}
    sig = []
    for n in block:
        val = n.meta.get("val")
        shape = (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None
        args = tuple(("in", index[a]) if a in index else ("ext",) for a in n.all_input_nodes)
        fqn = traced.params.get(n.name) or traced.buffers.get(n.name) or ""
        sig.append(
            (n.op, str(n.target) if n.op != "placeholder" else fqn.split(".")[-1], shape, args)
        )
    return sig


# ---------------------------------------------------------------- batch dims


BatchDims = dict[fx.Node, Placement | tuple[Placement, ...]]


def batch_dims(traced: Traced) -> tuple[int, BatchDims]:
    """The batch size and, per value that carries the batch, where it lives (steps 1-2)."""
    nodes = list(traced.gm.graph.nodes)
    inputs = [n for n in nodes if n.name in traced.user_inputs and _ndim(n) > 0]
    if not inputs:
        return 1, {}
    batch = inputs[0].meta["val"].shape[0]
    found: BatchDims = {n: Shard(0) for n in inputs if n.meta["val"].shape[0] == batch}
    if batch == 1:
        return 1, found
    ctx = RuleContext(size=batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in nodes:
            if n.op != "call_function":
                continue
            if is_getitem(n):
                parent = found.get(n.args[0])
                if isinstance(parent, tuple) and isinstance(parent[n.args[1]], Shard):
                    found[n] = parent[n.args[1]]
                continue
            args = tensor_args(n)
            want = tuple(_placed(found.get(a)) for a in args)
            if all(p == R for p in want):
                continue
            out = _matching(n, ctx, want)
            if out is not None:
                found[n] = out
    return batch, found


def _placed(p: Placement | tuple | None) -> Placement:
    return p if isinstance(p, Shard) else R


def _matching(n: fx.Node, ctx: RuleContext, want: tuple[Placement, ...]) -> Placement | tuple | None:
    try:
        options = strategies(n, ctx)
    except Exception:  # noqa: BLE001 - an op the rules cannot describe ends the batch here
        return None
    for s in options:
        if s.inputs == want:
            outs = s.output if isinstance(s.output, tuple) else (s.output,)
            if any(isinstance(o, Shard) for o in outs):
                return s.output
    return None


def _ndim(n: fx.Node) -> int:
    val = n.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else 0


def splits_batch(shape: torch.Size, where: Placement, p: Placement, size: int, batch: int) -> bool:
    """Does placing a value (batch at ``where``) as ``p`` on ``size`` ranks split the batch?
    (step 3)"""
    if not isinstance(p, Shard) or not isinstance(where, Shard) or p.dim != where.dim:
        return False
    n, outer = shape[p.dim], where.blocks
    inner = n // (outer * batch)
    piece = n // (p.blocks * size)
    whole_groups = piece % (batch * inner) == 0
    inside_run = inner % (n // p.blocks) == 0
    return not (whole_groups or inside_run)


def strategy_splits_batch(n: fx.Node, s: Strategy, dims: BatchDims, size: int,
                          batch: int) -> bool:  # fmt: skip
    """Does strategy ``s`` of ``n`` split the batch of any input or output?"""
    for a, p in zip(tensor_args(n), s.inputs, strict=True):
        where = dims.get(a)
        if isinstance(where, Shard) and splits_batch(a.meta["val"].shape, where, p, size, batch):
            return True
    where = dims.get(n)
    if where is None:
        return False
    val = n.meta["val"]
    vals = val if isinstance(val, (tuple, list)) else (val,)
    wheres = where if isinstance(where, tuple) else (where,)
    outs = s.output if isinstance(s.output, tuple) else (s.output,)
    return any(
        isinstance(v, torch.Tensor) and splits_batch(v.shape, w, o, size, batch)
        for v, w, o in zip(vals, wheres, outs, strict=False)
    )
