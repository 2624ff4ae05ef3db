"""Pad a vocabulary that the tensor-parallel degree does not divide (GPT-2's 50257 on 2 ranks).

A table ``W[V, h]`` read by ``embedding`` (ids < V never touch extra rows) and by ``linear`` (the
LM head) gets ``Vp - V`` zero rows, ``Vp`` the next multiple of the degree, so it splits evenly.
The extra logits are made ``-inf`` by adding a ``[Vp]`` mask right after the LM head (a buffer,
split like the logits, so each rank masks its own columns): softmax, log-softmax and
cross-entropy then give exactly the unpadded result, and the extra rows get zero gradient.

Algorithm (:func:`pad_vocab`):
1. Candidates: 2-D parameters whose dim 0 the degree does not divide, read only as an
   embedding table or a linear weight.
2. Follow each linear's output forward through ops that keep the vocab as the last dim and
   keep ``-inf`` meaning "never chosen" (views, dtype casts, clones, scaling by a positive
   number) to its ends: cross-entropy over classes, (log-)softmax over the last dim, or a graph
   output.  Anything else (a soft-cap ``tanh``, a slice of the vocab) leaves the table unpadded.
3. Rewrite: the parameter's value and every node on the chains get the padded size (view
   arguments too); the mask is added after each linear; graph outputs are sliced back to ``V``.
4. Record ``padded[fqn] = V`` on the traced model, so gradients and checkpoints are cut back.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx

from autopar.frontend.trace import Traced

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_KEEP = (aten._to_copy.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
         aten.to.dtype, aten.to.dtype_layout, aten.detach.default)  # fmt: skip
_SCALE = (aten.mul.Scalar, aten.div.Scalar, aten.mul.Tensor, aten.div.Tensor)
_SOFTMAX = (aten._log_softmax.default, aten.log_softmax.int, aten._softmax.default,
            aten.softmax.int)  # fmt: skip


def pad_vocab(traced: Traced, size: int) -> Traced:
    """``traced`` with every paddable table padded to a multiple of ``size`` (steps 1-4)."""
    if size <= 1:
        return traced
    padded: dict[str, int] = {}
    tensors = dict(traced.tensors)
    buffers = dict(traced.buffers)
    for ph in [n for n in traced.gm.graph.nodes if n.name in traced.params]:
        fqn = traced.params[ph.name]
        plan = _plan(ph, size)
        if plan is None:
            continue
        heads, chains, outputs = plan
        vocab = ph.meta["val"].shape[0]
        full = math.ceil(vocab / size) * size
        _rewrite(traced.gm.graph, ph, heads, chains, outputs, vocab, full, buffers, tensors, fqn)
        original = tensors[fqn]
        extra = original.new_zeros((full - vocab, *original.shape[1:]))
        tensors[fqn] = torch.cat([original.detach(), extra]).requires_grad_(original.requires_grad)
        padded[fqn] = vocab
    if not padded:
        return traced
    traced.gm.graph.lint()
    traced.gm.recompile()
    return dataclasses.replace(traced, tensors=tensors, buffers=buffers,
                               padded={**traced.padded, **padded})  # fmt: skip


def _plan(ph: fx.Node, size: int) -> tuple[list, list, list] | None:
    """Step 1-2: the linears, the nodes whose last dim becomes padded, and the outputs."""
    val = ph.meta["val"]
    if val.dim() != 2 or val.shape[0] % size == 0 or not ph.users:
        return None
    heads, chain, outputs = [], [], []
    for user in ph.users:
        if user.target is aten.embedding.default and user.args[0] is ph:
            continue
        if user.target is aten.linear.default and user.args[1] is ph and user.args[0] is not ph:
            heads.append(user)
            if not _follow(user, val.shape[0], chain, outputs):
                return None
            continue
        return None
    return heads, chain, outputs


def _follow(node: fx.Node, vocab: int, chain: list, outputs: list) -> bool:
    """Collect the nodes reached from ``node`` whose last dim is the vocab (step 2)."""
    for user in node.users:
        if user.op == "output":
            outputs.append(node)
            continue
        if user.target is aten.cross_entropy_loss.default and user.args[0] is node:
            if node.meta["val"].dim() != 2:
                return False
            continue
        if user.target in _SOFTMAX and user.args[1] in (-1, node.meta["val"].dim() - 1):
            chain.append(user)
            if not _follow(user, vocab, chain, outputs):
                return False
            continue
        last = user.meta.get("val")
        if not isinstance(last, torch.Tensor) or last.dim() == 0 or last.shape[-1] != vocab:
            return False
        if user.target in _VIEWS or user.target in _KEEP or _positive_scale(user, node):
            if user not in chain:
                chain.append(user)
                if not _follow(user, vocab, chain, outputs):
                    return False
            continue
        return False
    return True


def _positive_scale(user: fx.Node, node: fx.Node) -> bool:
    if user.target not in _SCALE or user.args[0] is not node:
        return False
    other = user.args[1]
    return isinstance(other, (int, float)) and other > 0


def _rewrite(graph: fx.Graph, ph: fx.Node, heads: list, chain: list, outputs: list, vocab: int,
             full: int, buffers: dict, tensors: dict, fqn: str) -> None:  # fmt: skip
    """Step 3."""
    ph.meta["val"] = _grown(ph.meta["val"], 0, full)
    mask_fqn = f"{fqn.rsplit('.', 1)[0]}._autopar_vocab_mask" if "." in fqn else "_autopar_vocab_mask"
    mask = torch.zeros(full, dtype=ph.meta["val"].dtype)
    mask[vocab:] = float("-inf")
    first_input = next(n for n in graph.nodes if n.op == "placeholder" and n.name not in buffers
                       and not n.name.startswith("p_"))  # fmt: skip
    with graph.inserting_before(first_input):
        mask_ph = graph.placeholder(f"b_{mask_fqn.replace('.', '_')}")
    mask_ph.meta["val"] = torch.empty(full, dtype=mask.dtype, device="meta")
    buffers[mask_ph.name] = mask_fqn
    tensors[mask_fqn] = mask
    for node in [*heads, *chain]:
        node.meta["val"] = _grown(node.meta["val"], -1, full)
        if node.target in _VIEWS:
            shape = list(node.args[1])
            if shape and shape[-1] == vocab:
                shape[-1] = full
            node.args = (node.args[0], shape, *node.args[2:])
    for head in heads:
        with graph.inserting_after(head):
            masked = graph.call_function(aten.add.Tensor, (head, mask_ph))
        masked.meta.update({k: v for k, v in head.meta.items() if k != "autopar"})
        _reroute(head, masked)
        if head in outputs:
            outputs[outputs.index(head)] = masked
    out = next(n for n in graph.nodes if n.op == "output")
    for node in outputs:
        with graph.inserting_before(out):
            cut = graph.call_function(aten.slice.Tensor, (node, -1, 0, vocab))
        cut.meta.update({k: v for k, v in node.meta.items() if k != "autopar"})
        cut.meta["val"] = _grown(node.meta["val"], -1, vocab)
        out.replace_input_with(node, cut)


def _reroute(head: fx.Node, masked: fx.Node) -> None:
    """Every reader of ``head`` except ``masked`` reads ``masked`` instead."""
    for user in list(head.users):
        if user is not masked:
            user.replace_input_with(head, masked)


def _grown(val: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    shape = list(val.shape)
    shape[dim] = n
    return torch.empty(shape, dtype=val.dtype, device="meta")
