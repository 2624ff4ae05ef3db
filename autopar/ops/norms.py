"""Fused norms of a rank program: HF's RMSNorm on a 16-bit input, keeping what Megatron's fused
norm keeps (what ``rms_norm_16`` nodes call; passes/fuse_norms.py writes them).

``rms_norm_16(x, weight, eps, dtype)`` is HF Llama's ``LlamaRMSNorm.forward`` (Qwen's,
Mistral's: the same code) as torch.export traces it, value for value::

    x32 = x.to(float32); rstd = rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * (x32 * rstd).to(dtype)            # no weight: (x32 * rstd).to(dtype)
    out = ((x32 * rstd) * weight).to(dtype)          # cast_last=True: Gemma's order

Autograd of that chain keeps the fp32 copy ``x32`` (4 bytes an element, for the pow and the
normalizing mul) and the 16-bit ``(x32 * rstd).to(dtype)`` (for the weight's gradient), plus
``rstd``: 6 bytes an element of a 16-bit ``x``.  Gemma's norm (its weight ``1 + w`` in fp32,
multiplied before the cast) keeps ``x32`` and the fp32 ``x32 * rstd``: 8 bytes.  This op keeps
``x`` in its own dtype and the fp32 ``rstd`` [.., 1] (and the weight): 2 bytes an element.

Algorithm:
1. Forward: the chain's ops in the chain's order and dtypes, so the output is bitwise the
   chain's (a float64 ``x`` computes in float64, not through the chain's rounding fp32 copy:
   gradcheck applies), saving ``x``, ``rstd`` and ``weight``.
2. Backward, autograd's formulas for each op of the chain, in its dtypes:
   a. recompute ``x32`` and ``normed = (x32 * rstd).to(dtype)`` (bitwise the forward's);
   b. the weight mul: ``grad_w = (g * normed)`` summed to the weight's shape then cast to its
      dtype (autograd's mul backward and broadcast reduction); ``g = (g * weight)`` cast to
      ``normed``'s dtype;
   c. the down-cast: ``g32 = g.to(float32)`` (``cast_last``: c before b, b on the fp32
      ``x32 * rstd``);
   d. ``x32 * rstd``: ``g32 * rstd`` to ``x32``; ``(g32 * x32)`` summed over the last dim to
      ``rstd``; rsqrt: ``-0.5 * grad * rstd ** 3``; ``+ eps``: identity; mean:
      ``grad.expand / n``; pow 2: ``grad * (2 * x32)``; the two gradients of ``x32`` added;
   e. the up-cast: ``grad_x`` cast back to ``x``'s dtype.
"""

from __future__ import annotations

import torch

from autopar.ops.collectives import graph_op


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in fp32 (the chain's up-cast), a float64 ``x`` as it is (so gradcheck applies)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _through_weight(g: torch.Tensor, value: torch.Tensor, weight: torch.Tensor,
                    grad_weight: bool) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Step 2b, autograd's backward of ``weight * value``: (the gradient of ``value`` in its
    dtype, the weight's: summed to its shape, then in its dtype)."""
    grad_w = (g * value).sum_to_size(weight.shape).to(weight.dtype) if grad_weight else None
    return (g * weight).to(value.dtype), grad_w


class _RmsNorm16(torch.autograd.Function):
    """Steps 1-2; ``weight`` may be None (a norm without an affine weight)."""

    @staticmethod
    def forward(ctx, x, weight, eps, dtype, cast_last):  # noqa: ANN001, ANN205
        x32 = _wide(x)
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        normed = x32 * rstd
        ctx.cast_last = cast_last and weight is not None
        if ctx.cast_last:
            out = (normed * weight).to(dtype)
        else:
            out = normed.to(dtype)
            out = out if weight is None else weight * out
        ctx.save_for_backward(x, rstd, weight)
        ctx.dtype = dtype
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        x, rstd, weight = ctx.saved_tensors
        x32 = _wide(x)
        normed, grad_w = x32 * rstd, None
        if ctx.cast_last:  # the cast's backward, then the fp32 weight multiply's
            g = g.to(torch.promote_types(normed.dtype, weight.dtype))
            g, grad_w = _through_weight(g, normed, weight, ctx.needs_input_grad[1])
        else:
            if weight is not None:
                g, grad_w = _through_weight(g, normed.to(ctx.dtype), weight,
                                            ctx.needs_input_grad[1])  # fmt: skip
            g = g.to(x32.dtype)
        if not ctx.needs_input_grad[0]:
            return None, grad_w, None, None, None
        grad_var = -0.5 * (g * x32).sum(-1, keepdim=True) * rstd.pow(3)
        grad_x = g * rstd + grad_var.expand(x.shape) / x.shape[-1] * (2.0 * x32)
        return grad_x.to(x.dtype), grad_w, None, None, None


@graph_op
def rms_norm_16(x: torch.Tensor, weight: torch.Tensor | None, eps: float, dtype: torch.dtype,
                cast_last: bool = False) -> torch.Tensor:  # fmt: skip
    """HF's RMSNorm of ``x`` (normalized over its last dim, computed in fp32, cast to
    ``dtype``, times ``weight`` when given; ``cast_last``: times ``weight`` before the cast,
    Gemma's order) keeping only ``x`` and the fp32 ``rstd``."""
    return _RmsNorm16.apply(x, weight, eps, dtype, cast_last)
