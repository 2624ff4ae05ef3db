"""The one metadata key: ``node.meta["autopar"]`` holds a frozen :class:`NodeInfo`.

Only the helpers here read or write it.  Shapes stay in ``node.meta["val"]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from autopar.ir.layout import Layout

KEY = "autopar"


@dataclass(frozen=True, kw_only=True)
class NodeInfo:
    """What autopar knows about one node.

    ``layout`` is the output layout (a tuple of layouts for ops returning several tensors);
    ``strategy`` names the sharding strategy chosen for the op; ``origin`` the pass that
    created the node (``None`` for traced nodes); ``stage`` the pipeline stage; ``dtype`` the
    dtype the value has under mixed precision (autocast) when it differs from the traced one
    (autopar.frontend.precision); ``master`` the dtype of the optimizer's master copy of a
    parameter placeholder traced in a cast dtype (``mixed_precision="cast"``: an fp32 weight
    the graph reads cast to bf16), None when the placeholder's own dtype is the master's.
    """

    layout: Layout | tuple[Layout, ...] | None = None
    strategy: str | None = None
    origin: str | None = None
    stage: int | None = None
    cost_s: float | None = None
    dtype: torch.dtype | None = None
    master: torch.dtype | None = None


_EMPTY = NodeInfo()  # frozen: one shared record for every node without one


def info(node: fx.Node) -> NodeInfo:
    """The record of ``node`` (an empty one if none was written)."""
    return node.meta.get(KEY) or _EMPTY


def update(node: fx.Node, **fields: Any) -> NodeInfo:
    """Replace fields of ``node``'s record and return the new record."""
    rec = dataclasses.replace(info(node), **fields)
    node.meta[KEY] = rec
    return rec


def dtype(node: fx.Node) -> torch.dtype:
    """The dtype ``node``'s tensor has when the program runs (its mixed-precision dtype, else
    its traced one)."""
    return info(node).dtype or node.meta["val"].dtype


def nbytes(node: fx.Node) -> float:
    """Bytes of ``node``'s tensor when the program runs."""
    return float(node.meta["val"].numel() * dtype(node).itemsize)


def state_bytes(node: fx.Node) -> float:
    """Bytes a trainable parameter placeholder costs with Adam: weight, gradient and two
    moments in its master dtype, plus the cast copy the graph reads when that differs
    (``master``; REFERENCE.md's 16-bit 18 bytes per parameter counts 2 + 4 + 12)."""
    master = info(node).master
    if master is None:
        return 4 * nbytes(node)
    return float(node.meta["val"].numel() * (4 * master.itemsize + dtype(node).itemsize))


def layout(node: fx.Node) -> Layout | tuple[Layout, ...] | None:
    return info(node).layout


def source(node: fx.Node) -> str:
    """The user's source line for ``node`` ("file:line in fn: code"), or its module path."""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    frames = [ln for ln in lines if ln.startswith("File ")]
    user = [f for f in frames if "site-packages/torch/" not in f]
    frame = (user or frames or [""])[-1]
    code = ""
    if frame and frame in lines:
        idx = lines.index(frame)
        code = (
            lines[idx + 1]
            if idx + 1 < len(lines) and not lines[idx + 1].startswith("File ")
            else ""
        )
    where = frame.replace("File ", "").replace('"', "")
    path = module_path(node)
    parts = [p for p in (path and f"module '{path}'", where, code) if p]
    return ", ".join(parts) if parts else f"node '{node.name}'"


def module_path(node: fx.Node) -> str:
    """Innermost module path of ``node`` in the user's model ('' at top level)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return clean_path(path)


def clean_path(path: str) -> str:
    # torch.export writes "L['self'].layers[0].attn" or "layers.0.attn" depending on mode.
    for junk in ("L['self'].", "L['self']"):
        path = path.replace(junk, "")
    return path.replace("[", ".").replace("]", "").replace("getattr(", "").strip(".")
