"""Mixed precision analysis: the dtype each value of a traced graph has under autocast.

A program compiled with ``param_dtype=torch.bfloat16`` runs its fp32-traced graph under
``torch.autocast``: matrix products (and attention) compute in bf16, norms and losses stay in
fp32, element-wise ops promote.  What a value costs to hold for backward, and what a collective
on it moves, follows that dtype, so the planner prices it from there.

Algorithm (:func:`annotate_autocast`):
1. Make a fake CPU tensor of each placeholder's traced shape and dtype (no memory allocated).
2. Interpret the graph under ``FakeTensorMode`` and ``torch.autocast("cpu", dtype)``: autocast's
   own op lists decide every output's dtype.  A node the fake run cannot execute (a
   data-dependent op, a meta-device constant) keeps its traced dtype and the run goes on.
3. Record, in each node's metadata record (``meta.update(node, dtype=...)``), the dtype of
   every call whose autocast dtype differs from its traced one; :func:`autopar.ir.meta.dtype`
   reads it back (placeholders, i.e. the fp32 weights, are never annotated).

:func:`read_dtype` says what a consumer reads a value in: a matrix product reads its fp32
inputs in bf16 (autocast casts them), so a re-layout that only moves such an input (a gather,
an all-to-all) can move it cast, half the bytes (Megatron-SP gathers the bf16 normed input).
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.ir import meta


def autocast_dtypes(gm: fx.GraphModule, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """Steps 1-2: node name -> dtype of its tensor output under ``dtype`` autocast."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    found: dict[str, torch.dtype] = {}

    class Run(fx.Interpreter):
        def run_node(self, n: fx.Node) -> object:
            try:
                out = super().run_node(n)
            except Exception:  # noqa: BLE001 - step 2: keep the traced dtype
                out = _fake_like(n.meta.get("val"))
            if isinstance(out, torch.Tensor):
                found[n.name] = out.dtype
            return out

    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level, fake_log.level = fake_log.level, logging.CRITICAL  # step 2's misses are expected
    # a grad-mode region (wrap_with_set_grad_enabled) that fails part-way would leave grad
    # mode off in the user's process: no_grad restores it on exit whatever ran inside
    try:
        with torch.no_grad(), mode:
            args = [_fake_like(n.meta.get("val")) for n in gm.graph.nodes
                    if n.op == "placeholder"]  # fmt: skip
            with torch.autocast("cpu", dtype=dtype):
                Run(gm).run(*args)
    finally:
        fake_log.level = level
    return found


def annotate_autocast(gm: fx.GraphModule, dtype: torch.dtype) -> int:
    """Step 3; returns how many values changed dtype (0 for fp32: nothing to do)."""
    if dtype == torch.float32:
        return 0
    found = autocast_dtypes(gm, dtype)
    changed = 0
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        d = found.get(n.name)
        if n.op == "call_function" and isinstance(val, torch.Tensor) and d not in (None, val.dtype):
            meta.update(n, dtype=d)
            changed += 1
    return changed


LOW = (torch.bfloat16, torch.float16)


def read_dtype(consumer: fx.Node, arg: fx.Node) -> torch.dtype:
    """The dtype ``consumer`` reads its input ``arg`` in when the program runs: autocast casts
    the fp32 inputs of a lower-precision op (matmuls, attention) down to the op's dtype, seen
    as an op whose run-time output is 16-bit where its traced output is fp32; any other
    consumer reads ``arg`` in its own run-time dtype."""
    have, val = meta.dtype(arg), consumer.meta.get("val")
    if consumer.op != "call_function" or not isinstance(val, torch.Tensor):
        return have
    run = meta.dtype(consumer)
    lowered = run in LOW and val.dtype == torch.float32 and have == torch.float32
    return run if lowered else have


def _fake_like(val: object) -> object:
    """A tensor of ``val``'s shape and dtype on the CPU (fake under the active mode)."""
    if isinstance(val, torch.Tensor):
        return torch.empty(tuple(val.shape), dtype=val.dtype, device="cpu")
    if isinstance(val, (tuple, list)):
        return type(val)(_fake_like(v) for v in val)
    return val


def mark_run_dtypes(gm: fx.GraphModule) -> fx.GraphModule:
    """Record on every call's tensor value the dtype it has when the program runs (its
    autocast dtype, else its traced one) as ``node.meta["run_dtype"]``, which ``cost.graph``
    prices saved activations in; returns ``gm``."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor):
            n.meta["run_dtype"] = meta.dtype(n)
    return gm
