from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopar import InputError, Mesh, TraceError, autoparallelize, verify
from autopar.frontend.trace import trace
from autopar.tools.testing import Config, build, lm_loss, tokens


def test_trace_records_params_inputs_and_splits_biases(mlp):
    traced = trace(mlp, (torch.randn(2, 16),))
    assert set(traced.params.values()) == {"up.weight", "up.bias", "down.weight", "down.bias"}
    assert len(traced.user_inputs) == 1
    targets = [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.linear.default) == 2
    assert targets.count(torch.ops.aten.add.Tensor) == 2  # biases added after the matmul
    for node in traced.gm.graph.nodes:
        if node.target is torch.ops.aten.linear.default:
            assert len(node.args) == 2


def test_trace_with_loss_keeps_model_parameter_names():
    c = Config(layers=1, hidden=32, heads=2, kv_heads=2, ffn=64, vocab=32, seq=8)
    model = build("gpt", c)
    traced = trace(model, tokens(c), loss_fn=lm_loss)
    assert "blocks.0.q.weight" in traced.params.values()
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    assert out.args[0][0].meta["val"].shape == ()


def test_trace_on_meta_device_materialises_nothing():
    c = Config(layers=2, hidden=256, heads=4, kv_heads=4, ffn=512, vocab=512, seq=32)
    with torch.device("meta"):
        model = build("llama", c)
    traced = trace(model, tokens(c), loss_fn=lm_loss)
    assert all(t.is_meta for t in traced.tensors.values())


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow: torch.export cannot trace this
            return self.lin(x)
        return x


def test_untraceable_model_gets_one_clear_error_with_the_user_line():
    with pytest.raises(TraceError) as err:
        autoparallelize(Branchy(), Mesh(tp=2), (torch.randn(2, 8),))
    msg = str(err.value)
    assert "torch.export could not trace Branchy" in msg
    assert "test_trace.py" in msg and "if x.sum() > 0" in msg
    assert "what to do" in msg


class Routed(nn.Module):
    """Token counts per group read from values, as a mixture-of-experts router does."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 2)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(-1)
        order = choice.argsort()
        sizes = nn.functional.one_hot(choice, 2).sum(0).tolist()
        parts = x[order].split(sizes)
        return torch.cat([self.lin(p) for p in parts])


def test_data_dependent_shape_is_a_trace_error_naming_the_line():
    with pytest.raises(TraceError) as err:
        autoparallelize(Routed(), Mesh(tp=2), (torch.randn(6, 8),))
    msg = str(err.value)
    assert "Routed has a data-dependent shape" in msg
    assert "test_trace.py" in msg and ".tolist()" in msg
    assert "what to do" in msg


def test_inputs_that_do_not_fit_name_the_module(mlp):
    with pytest.raises(InputError) as err:
        autoparallelize(mlp, Mesh(tp=2), (torch.randn(2, 5),))
    msg = str(err.value)
    assert "example_inputs do not fit MLP" in msg
    assert "module 'up'" in msg


class ParallelBlock(nn.Module):
    """GPT-J's block: ``attn_out + (mlp_out + bias) + residual``, with an eval-mode dropout."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.attn = nn.Linear(h, h, bias=False)
        self.up, self.down = nn.Linear(h, 2 * h), nn.Linear(2 * h, h)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.attn(x)) + self.drop(self.down(torch.relu(self.up(x)))) + x


def test_parallel_block_sums_its_matmuls_first_and_reduces_once():
    model, x = ParallelBlock().eval(), torch.randn(2, 4, 16)
    traced = trace(model, (x,))
    gm = traced.gm
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.dropout.default]
    adds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    first = next(a for a in adds if a.args[0].target is torch.ops.aten.linear.default
                 and a.args[1].target is torch.ops.aten.linear.default)  # fmt: skip
    assert {a.name for a in first.args} == {"linear", "linear_2"}
    params = [traced.tensors[traced.params[n.name]] for n in gm.graph.nodes if n.name in traced.params]
    assert torch.allclose(gm(*params, x)[0], model(x), atol=1e-6)
    prog = autoparallelize(model, Mesh(tp=2), (x,))
    forward = [c.kind for c in prog.collectives() if c.direction == "fwd"]
    assert forward == ["all_reduce"], forward


class MaskedAttention(nn.Module):
    """SDPA with a mask built from shapes: causal (``tril``), or a sliding window."""

    def __init__(self, window: int | None = None) -> None:
        super().__init__()
        self.qkv, self.window = nn.Linear(16, 48), window

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        i = torch.arange(s, device=x.device)
        mask = i[None, :] <= i[:, None]
        if self.window:
            mask = mask & (i[:, None] - i[None, :] < self.window)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def _sdpa(traced):
    return next(n for n in traced.gm.graph.nodes if "scaled_dot" in str(n.target))


def test_constant_causal_mask_becomes_is_causal():
    model, x = MaskedAttention(), torch.randn(2, 8, 16)
    sdpa = _sdpa(trace(model, (x,)))
    assert sdpa.kwargs.get("is_causal") is True and len(sdpa.args) == 3
    assert not [n for n in sdpa.graph.nodes if n.target is torch.ops.aten.arange.default]
    report = verify(model, Mesh(tp=2), (x,))
    assert report.ok, str(report)


def test_hf_llama_mask_becomes_is_causal():
    from autopar.tools.testing import hf_tiny_llama

    ids = torch.randint(0, 128, (2, 8))
    sdpa = _sdpa(trace(hf_tiny_llama(1), (ids,)))
    assert sdpa.kwargs.get("is_causal") is True and len(sdpa.args) == 3


class PaddedCausalAttention(nn.Module):
    """SDPA with the causal positions and-ed with an all-ones padding mask moved by
    ``.to(x.device, torch.bool)`` (a positional device), read by broadcasting or by indexing
    with (batch, key) positions: HF's ``create_causal_mask`` of the mask BioGPT builds."""

    def __init__(self, indexed: bool) -> None:
        super().__init__()
        self.qkv, self.indexed = nn.Linear(16, 48), indexed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        keep = torch.ones(b, s, device=x.device).to(x.device, torch.bool)
        i = torch.arange(s, device=x.device)
        if self.indexed:
            keep = keep[torch.arange(b, device=x.device)[:, None, None, None], i[None, None, :]]
        else:
            keep = keep[:, None, None, :]
        mask = (i[None, :] <= i[:, None]) & keep
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_padded_causal_mask_becomes_is_causal_on_any_device(device, indexed):
    with torch.device(device):
        model, x = PaddedCausalAttention(indexed), torch.randn(2, 8, 16)
    sdpa = _sdpa(trace(model, (x,)))
    assert sdpa.kwargs.get("is_causal") is True and len(sdpa.args) == 3


def test_sliding_window_mask_stays():
    x = torch.randn(2, 8, 16)
    sdpa = _sdpa(trace(MaskedAttention(window=3), (x,)))
    assert not sdpa.kwargs.get("is_causal") and isinstance(sdpa.args[3], torch.fx.Node)


class PerHeadNorm(nn.Module):
    """q projected, viewed as heads, each head normalised by its own LayerNorm (StableLM's
    per-head q/k norm), then attended and projected back."""

    def __init__(self, heads: int = 8, d: int = 32, split: int = 1, affine: bool = True,
                 norm_over_heads: bool = False, norms: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.heads, self.d, self.split, self.over = heads, d, split, norm_over_heads
        self.use_norms = norms
        self.q, self.o = nn.Linear(heads * d, heads * d), nn.Linear(heads * d, heads * d)
        shape = (split, d) if norm_over_heads else (d,)
        self.norms = nn.ModuleList(nn.LayerNorm(shape, elementwise_affine=affine)
                                   for _ in range(heads // split))  # fmt: skip
        if affine:
            with torch.no_grad():
                for n in self.norms:
                    n.weight.normal_()
                    n.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.d).transpose(1, 2)
        pieces = torch.split(q, self.split, dim=1)
        if not self.use_norms:
            pass
        elif self.over:  # the norm covers the split dim: pieces must stay separate
            pieces = [p.transpose(1, 2) for p in pieces]
            q = torch.cat([n(p) for n, p in zip(self.norms, pieces, strict=True)], dim=2).transpose(1, 2)
        else:
            q = torch.cat([n(p) for n, p in zip(self.norms, pieces, strict=True)], dim=1)
        return self.o(q.transpose(1, 2).reshape(b, s, -1))


class PerHeadNormModel(nn.Module):
    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PerHeadNorm(**kwargs) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("split, affine", [(1, True), (2, True), (1, False)])
def test_per_piece_norms_become_one_norm_over_the_whole_tensor(split, affine):
    model, x = PerHeadNormModel(split=split, affine=affine), torch.randn(2, 64, 256)
    traced = trace(model, (x,))
    targets = [n.target for n in traced.gm.graph.nodes]
    assert torch.ops.aten.split.Tensor not in targets
    assert targets.count(torch.ops.aten.layer_norm.default) == 2  # one per layer
    params = [traced.tensors[traced.params[n.name]] for n in traced.gm.graph.nodes
              if n.name in traced.params]  # fmt: skip
    out = traced.gm(*params, x)
    assert torch.allclose(out[0] if isinstance(out, (tuple, list)) else out, model(x),
                          rtol=1e-5, atol=1e-6)  # fmt: skip
    report = verify(model, Mesh(tp=2), (x,))
    assert report.ok, str(report)

    def forward_bytes(norms: bool) -> list:  # at a realistic size
        with torch.device("meta"):
            big = PerHeadNormModel(heads=16, d=128, split=split, affine=affine, norms=norms)
            xb = torch.empty(1, 2048, 2048)
        prog = autoparallelize(big, Mesh(tp=2), (xb,))
        return sorted(c.bytes for c in prog.collectives() if c.direction == "fwd")

    # each rank normalises its own heads: the norms add no forward communication
    assert forward_bytes(True) == forward_bytes(False)


def test_pieces_normalised_over_the_split_dim_stay_apart():
    model, x = PerHeadNormModel(split=2, norm_over_heads=True), torch.randn(2, 64, 256)
    targets = [n.target for n in trace(model, (x,)).gm.graph.nodes]
    assert targets.count(torch.ops.aten.layer_norm.default) == 8  # 4 per layer
