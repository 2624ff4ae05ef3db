"""In-place writes into views of split activations (``autopar.frontend.inplace``).

1. A family of attention blocks (random sizes, meshes tp=2 / tp=4) that write into a slice of
   the head-split q and k (``copy_``, slice assignment of a broadcast value or a scalar,
   ``fill_``, ``mul_``, ``index_put_``, ``select`` + ``copy_``), along the head dim (the
   split one) or inside a head: ``verify`` compares outputs and every gradient with one
   device.
2. Qwen2.5-Omni's token2wav ``DiTDecoderLayer`` (rotary applied by writing into ``q[:, :1]``)
   in a small denoiser with an MSE loss: no op left without a rule, and it verifies.
3. The traced graph itself: writes through views become scatters that compute what eager
   computes (values, gradients, a buffer written back); a write autopar cannot follow is
   refused with the op and the user's source line.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar import Mesh, autoparallelize
from autopar.errors import TraceError
from autopar.frontend.trace import trace
from autopar.verify import verify

MEMORY = 1e-8  # s/byte: with memory priced, toy sizes keep activations split as large ones do
KINDS = ("copy_", "assign", "scalar", "fill_", "mul_", "index_put_", "select")


@dataclass(frozen=True)
class Case:
    kind: str
    tp: int
    heads: int
    head_dim: int
    dim: int  # 1: the head dim (split), 3: inside a head
    start: int
    stop: int


@st.composite
def cases(draw: st.DrawFn) -> Case:
    tp = draw(st.sampled_from([2, 4]))
    heads = tp * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([4, 8]))
    dim = draw(st.sampled_from([1, 3]))
    n = heads if dim == 1 else head_dim
    start = draw(st.integers(0, n - 1))
    stop = draw(st.integers(start + 1, n))
    return Case(draw(st.sampled_from(KINDS)), tp, heads, head_dim, dim, start, stop)


class WriteIntoSplitHeads(nn.Module):
    """Attention whose q and k get a slice rewritten in place after the head split."""

    def __init__(self, case: Case, hidden: int = 16) -> None:
        super().__init__()
        inner = case.heads * case.head_dim
        self.q, self.v = nn.Linear(hidden, inner), nn.Linear(hidden, inner)
        self.k = nn.Linear(hidden, inner, bias=False)  # a key bias's gradient is ~0 under softmax
        self.o = nn.Linear(inner, hidden)
        self.case = case

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.case
        q, k, v = (p(x).view(b, s, c.heads, c.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))  # fmt: skip
        _write(q, c)
        _write(k, c)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


def _write(t: torch.Tensor, c: Case) -> None:
    at = (slice(None),) * c.dim
    part = at + (slice(c.start, c.stop),)
    if c.kind == "copy_":  # rotary-like: the slice rewritten from itself
        t[part].copy_(torch.tanh(t[part]) + 0.5 * t[part].flip(-1))
    elif c.kind == "assign":  # broadcast source
        t[part] = t[part].mean(-1, keepdim=True) * 2.0
    elif c.kind == "scalar":  # a 0-d tensor filled in: fill_.Tensor
        t[part] = 0.25
    elif c.kind == "fill_":
        t[part].fill_(0.25)
    elif c.kind == "mul_":
        t[part].mul_(-3.0)
    elif c.kind == "index_put_":
        rows = torch.tensor(sorted({c.stop - 1, c.start}, reverse=True))
        t[at + (rows,)] = torch.tanh(t[at + (rows,)]) * 1.5
    else:
        t.select(c.dim, c.start).copy_(t.select(c.dim, c.stop - 1) * 0.5 + 1.0)


@settings(max_examples=10)
@given(cases())
def test_write_into_a_slice_of_split_heads_matches_single_device(case):
    torch.manual_seed(0)
    model, x = WriteIntoSplitHeads(case), (torch.randn(2, 4, 16),)
    mesh = Mesh(tp=case.tp)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "no sharding rule")  # none runs replicated unasked
        prog = autoparallelize(model, mesh, x, memory_weight=MEMORY)
    assert "tp" in dict(prog.plan.params)["v.weight"], prog.plan  # the heads are split
    report = verify(model, mesh, x, memory_weight=MEMORY)
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-5


@pytest.mark.parametrize("kind", ["copy_", "index_put_"])
def test_write_along_the_split_head_dim_at_tp4(kind):
    """The DiT pattern at tp=4: the first head rewritten, heads split four ways."""
    case = Case(kind, tp=4, heads=4, head_dim=8, dim=1, start=0, stop=1)
    torch.manual_seed(0)
    report = verify(WriteIntoSplitHeads(case), Mesh(tp=4), (torch.randn(2, 4, 16),),
                    memory_weight=MEMORY)  # fmt: skip
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-5


# ---------------------------------------------------------------- 2. DiT denoiser


def _dit_denoiser() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    omni = pytest.importorskip("transformers.models.qwen2_5_omni.modeling_qwen2_5_omni")
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import Qwen2_5OmniDiTConfig

    cfg = Qwen2_5OmniDiTConfig(hidden_size=32, num_attention_heads=4, head_dim=8, ff_mult=2,
                               dropout=0.0)  # fmt: skip
    cfg._attn_implementation = "sdpa"

    class Denoiser(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 16)
            self.layer = omni.DiTDecoderLayer(cfg)
            self.rope = omni.Qwen2_5OmniDiTRotaryEmbedding(cfg)

        def forward(self, x: torch.Tensor, t: torch.Tensor, block_diff: torch.Tensor):
            h = self.inp(x)
            pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
            return self.out(self.layer(h, t, self.rope(h, pos), block_diff))

    torch.manual_seed(0)
    b, s = 2, 8
    inputs = (torch.randn(b, s, 16), torch.randn(b, 32), torch.zeros(b, 4, s, s),
              torch.randn(b, s, 16))  # fmt: skip
    return Denoiser(), inputs


def test_dit_decoder_layer_rotary_by_slice_copy_verifies():
    model, inputs = _dit_denoiser()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "no sharding rule")  # copy_, mse_loss, ... have rules
        prog = autoparallelize(model, Mesh(tp=2), inputs, loss_fn=F.mse_loss)
    assert "tp" in dict(prog.plan.params)["layer.attn.to_v.weight"], prog.plan
    report = verify(model, Mesh(tp=2), inputs, loss_fn=F.mse_loss)
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-5


# ---------------------------------------------------------------- 3. the traced graph


class Writes(nn.Module):
    """Writes through slices, a transpose, reshapes and a select; a view taken before a write
    and read after it; a buffer written through a slice."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(4, 4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = x * 1.0
        early = x[:, :1]
        x.mul_(2.0)
        flat = x.view(-1)
        x[:, 1:2] = y
        r = x.reshape(2, 4, 2).transpose(0, 1).reshape(4, 4)  # a copy: not a view of x
        r[0].fill_(3.0)
        x.t()[1:3].mul_(-1.0)
        self.seen[:, :2] = x[:, 2:].detach()
        return early + 1.0, flat * 2.0, x + 0.0, r


def test_writes_through_views_compute_what_eager_computes():
    x, y = torch.randn(4, 4, requires_grad=True), torch.randn(4, 1, requires_grad=True)
    traced = trace(Writes(), (x, y))
    ops = [str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert "aten.fill_.Scalar" not in ops and ops.count("aten.mul_.Tensor") == 1  # x itself
    assert ops.count("aten.copy_.default") == 1  # the buffer, written back
    assert "aten.slice_scatter.default" in ops and "aten.select_scatter.default" in ops
    eager, buf, inputs = Writes(), torch.zeros(4, 4), [x, y]
    args = [buf if n.name in traced.buffers else inputs.pop(0)
            for n in traced.gm.graph.nodes if n.op == "placeholder"]  # fmt: skip
    got, want = traced.gm(*args), eager(x, y)
    weights = [torch.randn(w.shape, generator=torch.Generator().manual_seed(i))
               for i, w in enumerate(want)]  # fmt: skip
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(buf, eager.seen)
    grads = [torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights, strict=True)),
                                 (x, y)) for out in (got, want)]  # fmt: skip
    for g, w in zip(*grads, strict=True):
        torch.testing.assert_close(g, w)


def test_a_graph_without_writes_through_views_is_left_alone():
    class Plain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = x * 2.0
            out.add_(1.0)
            return out[:, :2].transpose(0, 1)

    traced = trace(Plain(), (torch.randn(4, 4),))
    ops = [str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert ops == ["aten.mul.Tensor", "aten.add_.Tensor", "aten.slice.Tensor",
                   "aten.transpose.int"]  # fmt: skip


def test_a_write_through_a_view_it_cannot_invert_is_refused_with_its_source_line():
    class Windows(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x * 1.0
            x.unfold(1, 2, 2)[..., 0].fill_(0.0)
            return x

    with pytest.raises(TraceError, match=r"fill_.*test_inplace.py.*unfold"):
        trace(Windows(), (torch.randn(4, 4),))
