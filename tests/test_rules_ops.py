"""Rules for the pointwise, view and reduction ops real models use, and the distributed norms.

Two kinds of check:
1. Every strategy of one op, simulated on two ranks in this process: inputs are cut by the
   strategy's placements (a partial input into two random summands), the op runs per rank,
   and the output reassembled by its placement must equal the single-device output.
2. Whole models at tp=2 through ``verify`` (outputs and every gradient against one device),
   with the plan pinned where the solver would rather gather a tiny toy tensor, and the
   collectives of the plan where the rules must remove an all-gather.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar import Mesh, autoparallelize
from autopar.frontend.trace import tensor_args, trace
from autopar.ir.layout import Partial, Replicate
from autopar.rules import RuleContext, Strategy, strategies
from autopar.verify import verify

T = 2  # ranks simulated / run


# ---------------------------------------------------------------- 1. simulated strategies


class Op(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fn(*xs)


def _values(gm: torch.fx.GraphModule, inputs: tuple) -> dict:
    env: dict = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            env[n] = super().run_node(n)
            return env[n]

    Recorder(gm).run(*inputs)
    return env


def _cut(x: torch.Tensor, p, gen: torch.Generator) -> list[torch.Tensor]:
    if isinstance(p, Replicate):
        return [x] * T
    if isinstance(p, Partial):
        first = torch.randn(x.shape, generator=gen).to(x.dtype)
        return [first, x - first]
    xt = x.movedim(p.dim, 0)
    parts = xt.reshape(p.blocks, T, -1, *xt.shape[1:]).unbind(1)
    return [q.reshape(-1, *xt.shape[1:]).movedim(0, p.dim) for q in parts]


def _join(parts: list[torch.Tensor], p) -> torch.Tensor:
    if isinstance(p, Replicate):
        torch.testing.assert_close(parts[0], parts[1])
        return parts[0]
    if isinstance(p, Partial):
        return parts[0] + parts[1]
    blocks = [q.movedim(p.dim, 0).reshape(p.blocks, -1, *q.movedim(p.dim, 0).shape[1:])
              for q in parts]  # fmt: skip
    whole = torch.stack(blocks, 1)
    return whole.reshape(-1, *whole.shape[3:]).movedim(0, p.dim)


def _run_strategy(node: torch.fx.Node, s: Strategy, env: dict, gen) -> None:
    args = tensor_args(node)
    cut = {a: _cut(env[a], p, gen) for a, p in zip(args, s.inputs, strict=True)}
    outs = []
    for r in range(T):
        local = torch.fx.node.map_arg((node.args, node.kwargs), lambda a, r=r: cut[a][r])
        outs.append(node.target(*_local_groups(node, s, local[0]), **local[1]))
    ref = env[node]
    if isinstance(ref, (tuple, list)):
        for i, p in enumerate(s.output):
            torch.testing.assert_close(_join([o[i] for o in outs], p), ref[i])
    else:
        torch.testing.assert_close(_join(outs, s.output), ref, atol=1e-5, rtol=1e-5)


def _local_groups(node: torch.fx.Node, s: Strategy, args: tuple) -> tuple:
    """A grouped conv split over its channels runs 1/T of its groups (as ``localize`` does)."""
    if "conv" in str(node.target) and len(args) > 6 and args[6] > 1 and s.inputs[0] != Replicate():
        if getattr(s.inputs[0], "dim", None) == 1:
            return (*args[:6], args[6] // T, *args[7:])
    return args


def check_strategies(fn, *inputs: torch.Tensor, op: object, blocks=(1,)) -> list[str]:
    """Simulate every strategy (without a lowering) of each ``op`` node of ``fn(*inputs)``."""
    traced = trace(Op(fn), inputs)
    env = _values(traced.gm, inputs)
    gen = torch.Generator().manual_seed(0)
    nodes = [n for n in traced.gm.graph.nodes if n.target is op]
    assert nodes, f"{op} not in the exported graph of {fn}"
    seen = []
    for node in nodes:
        for s in strategies(node, RuleContext(size=T, blocks=blocks), strict=True):
            if s.lowering is None:
                _run_strategy(node, s, env, gen)
            seen.append(str(s))
    return seen


aten = torch.ops.aten
x4 = torch.randn(2, 4, 6, 8)
y4 = torch.randn(2, 4, 6, 8)
CASES = {
    "where.ScalarOther": (lambda x: torch.where(x > 0, x, 0.0), (x4,)),
    "where.ScalarSelf": (lambda x: torch.where(x > 0, 1.5, x), (x4,)),
    "min.other": (lambda x, y: torch.min(x, y), (x4, y4[:1, :, :1])),
    "max.other": (lambda x, y: torch.max(x, y), (x4, y4)),
    "minimum.default": (lambda x, y: torch.minimum(x, y), (x4, y4[0])),
    "maximum.default": (lambda x, y: torch.maximum(x, y), (x4, y4)),
    "clamp_min.default": (lambda x: torch.clamp_min(x, 0.1), (x4,)),
    "expm1.default": (torch.expm1, (x4,)),
    "log1p.default": (lambda x: torch.log1p(x.abs()), (x4,)),
    "pow.Scalar": (lambda x: torch.pow(2.0, x), (x4,)),
    "polar.default": (lambda x, y: torch.view_as_real(torch.polar(x.abs(), y)), (x4, y4)),
    "view_as_complex.default": (lambda x: torch.view_as_complex(x.reshape(2, 4, 6, 4, 2)), (x4,)),
    "view_as_real.default": (
        lambda x, y: torch.view_as_real(torch.complex(x, y)) * 2, (x4, y4)
    ),
    "complex.default": (lambda x, y: torch.view_as_real(torch.complex(x, y)), (x4, y4)),
    "flatten.using_ints": (lambda x: torch.flatten(x, 1, 2) * 2, (x4,)),
    "numpy_T.default": (lambda x: x.permute(*range(x.dim() - 1, -1, -1)).T * 2, (x4,)),
    "repeat_interleave.self_int": (lambda x: x.repeat_interleave(2, dim=2), (x4,)),
    "mT.default": (lambda x: x.mT * 2, (x4,)),  # litgpt's attention: q @ k.mT
    "mH.default": (lambda x: x.mH * 2, (x4,)),
    "adjoint.default": (lambda x: x.adjoint() * 2, (x4,)),
    "matrix_H.default": (lambda x: x[0, 0].H * 2, (x4,)),
    "swapaxes.default": (lambda x: x.swapaxes(1, 3) * 2, (x4,)),
    "swapdims.default": (lambda x: x.swapdims(0, -2) * 2, (x4,)),
    "movedim.int": (lambda x: x.movedim(1, -1) * 2, (x4,)),
    "movedim.intlist": (lambda x: x.movedim((0, 3), (2, 0)) * 2, (x4,)),
    "moveaxis.intlist": (lambda x: torch.moveaxis(x, (0, 1), (3, 2)) * 2, (x4,)),
    "narrow.default": (lambda x: x.narrow(2, 1, 4) * 2, (x4,)),
    "stack.default": (lambda x, y: torch.stack([x, -y], dim=-1), (x4, y4)),
    "index.Tensor": (  # adjacent index dims, and apart (their result dims go first)
        lambda x, i: (x[:, :, i], x[:, i, i], x[i, :, :, i]), (x4, torch.tensor([[0, 1], [1, 0]]))
    ),
    "mean.dim": (lambda x: x.pow(2).mean(-1, keepdim=True), (x4,)),
    "flip.default": (lambda x: torch.flip(x, (1, 3)) * 2, (x4,)),
    "copy_.default": (lambda x, y: (x * 1.0).copy_(y), (x4, y4[:, :1])),
    "slice_scatter.default": (lambda x, y: torch.slice_scatter(x, y, 2, 1, 4), (x4, y4[:, :, :3])),
    "select_scatter.default": (lambda x, y: torch.select_scatter(x, y, 1, 2), (x4, y4[:, 0])),
    "broadcast_tensors.default": (lambda x, y: torch.broadcast_tensors(x, y), (x4, y4[0, :, :1])),
    "mse_loss.default": (  # the squares, and their sum
        lambda x, y: (F.mse_loss(x, y, reduction="none"), F.mse_loss(x, y, reduction="sum")),
        (x4, y4),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_strategy_of_the_op_reassembles_the_single_device_value(name):
    fn, inputs = CASES[name]
    pkt, overload = name.split(".")
    seen = check_strategies(fn, *inputs, op=getattr(getattr(aten, pkt), overload), blocks=(1, 2))
    assert len([s for s in seen if "S(" in s or "P" in s]) >= 2, seen  # it does split


def test_complex_views_pass_every_dim_but_the_pair():
    seen = check_strategies(CASES["view_as_complex.default"][0], x4, op=aten.view_as_complex.default)
    assert "(S(3))->S(3)" in seen and "(P)->P" in seen
    assert not any(s.startswith("(S(4)") for s in seen)


def test_mean_over_a_split_dim_is_partial_through_a_lowering():
    seen = check_strategies(CASES["mean.dim"][0], x4, op=aten.mean.dim)
    assert "(S(3))->P [partial_mean]" in seen


def test_mse_loss_mean_over_split_elements_is_partial_through_a_lowering():
    seen = check_strategies(F.mse_loss, x4, y4, op=aten.mse_loss.default)
    assert "(S(3),S(3))->P [partial_mean]" in seen and "(S(0),S(0))->P [partial_mean]" in seen


def test_norm_over_a_split_dim_is_a_distributed_norm():
    w = torch.randn(8)
    seen = check_strategies(lambda x, w: F.rms_norm(x, (8,), w), x4, w, op=aten.rms_norm.default)
    assert "(S(3),S(0))->S(3) [distributed_norm]" in seen
    seen = check_strategies(lambda x, w: F.layer_norm(x, (6, 8), w, w), x4, w.repeat(6, 1),
                            op=aten.layer_norm.default)  # fmt: skip
    assert "(S(2),S(0),S(0))->S(2) [distributed_norm]" in seen


# ---------------------------------------------------------------- 2. models at tp=2


MEMORY = 1e-8  # s/byte: with memory priced, toy sizes keep activations split as large ones do


class NormedProjection(nn.Module):
    """QK-norm over the whole projection: column-split linear, norm over its split output."""

    def __init__(self, kind: str, h: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(h, 4 * h, bias=False)
        self.down = nn.Linear(4 * h, h, bias=False)
        self.w = nn.Parameter(torch.rand(4 * h) + 0.5)
        self.b = nn.Parameter(torch.randn(4 * h))
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(x)
        if self.kind == "manual":  # HF's RMSNorm: fp32 pow / mean / rsqrt
            y32 = y.to(torch.float32)
            y = self.w * (y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(y.dtype)
        elif self.kind == "rms_norm":
            y = F.rms_norm(y, (y.shape[-1],), self.w)
        else:
            y = F.layer_norm(y, (y.shape[-1],), self.w, self.b)
        return self.down(torch.tanh(y))


@pytest.mark.parametrize("kind", ["manual", "rms_norm", "layer_norm"])
def test_norm_over_split_projection_matches_single_device(kind):
    torch.manual_seed(0)
    model, x = NormedProjection(kind), (torch.randn(2, 8, 16),)
    prog = autoparallelize(model, Mesh(tp=2), x, memory_weight=MEMORY)
    stats = 2 if kind == "layer_norm" else 1  # layer_norm: the sum, then the sum of squares
    kinds = [(c.kind, c.shape, c.direction) for c in prog.plan.collectives]
    assert kinds.count(("all_reduce", (2, 8, 1), "fwd")) == stats, kinds
    assert kinds.count(("all_reduce", (2, 8, 1), "bwd")) == stats, kinds
    assert "all_gather" not in {k for k, _, _ in kinds}, kinds
    report = verify(model, Mesh(tp=2), x, memory_weight=MEMORY)
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-5


class ComplexRopeAttention(nn.Module):
    """Llama reference-style attention: rotary embedding through torch.polar and complex views."""

    def __init__(self, h: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.d = heads, h // heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h, bias=False) for _ in range(4))

    def rope(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(3).type_as(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        inv = 1.0 / (10000 ** (torch.arange(0, self.d, 2).float() / self.d))
        angles = torch.outer(torch.arange(s).float(), inv)
        freqs = torch.polar(torch.ones_like(angles), angles).view(1, s, 1, self.d // 2)
        q, k, v = (m(x).view(b, s, self.heads, self.d) for m in (self.q, self.k, self.v))
        q, k = self.rope(q, freqs), self.rope(k, freqs)
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(b, s, -1))


def test_complex_rope_keeps_heads_split():
    torch.manual_seed(0)
    model, x = ComplexRopeAttention(), (torch.randn(2, 8, 32),)
    prog = autoparallelize(model, Mesh(tp=2), x)
    assert {c.kind for c in prog.plan.collectives} == {"all_reduce"}, prog.plan.collectives
    report = verify(model, Mesh(tp=2), x)
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-5


img = torch.randn(2, 4, 6, 6)
CONVS = {  # (fn, inputs, op); every channel split but the grouped conv's
    "3x3 padded, bias": (lambda x, w, b: F.conv2d(x, w, b, padding=1),
                         (img, torch.randn(6, 4, 3, 3), torch.randn(6)), aten.conv2d.default),
    "2x2 stride 2": (lambda x, w: F.conv2d(x, w, stride=2), (img, torch.randn(6, 4, 2, 2)),
                     aten.conv2d.default),
    "same padding": (lambda x, w: F.conv2d(x, w, padding="same"), (img, torch.randn(6, 4, 3, 3)),
                     aten.conv2d.padding),
    "1-d": (lambda x, w: F.conv1d(x, w, dilation=2), (x4[0], torch.randn(6, 6, 3)),
            aten.conv1d.default),
    "grouped": (lambda x, w: F.conv2d(x, w, groups=2), (img, torch.randn(6, 2, 3, 3)),
                aten.conv2d.default),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONVS))
def test_every_strategy_of_a_convolution_reassembles_the_single_device_value(name):
    fn, inputs, op = CONVS[name]
    seen = check_strategies(fn, *inputs, op=op, blocks=(1, 2))
    column = [s for s in seen if s.endswith("->S(1)")]
    row = [s for s in seen if s.endswith("->P")]  # tracing moved a bias into an add after it
    assert (len(column), len(row)) == ((1, 0) if name == "grouped" else (1, 2)), seen


def test_every_strategy_of_a_linear_reassembles_the_single_device_value():
    """Rows are independent, so a linear reads any blocked split of a batch dim: the [b*s]
    token merge of a sequence-split [b, s, h] (split in b blocks) feeds a router as it lies."""
    x, w, b = torch.randn(8, 8), torch.randn(5, 8), torch.randn(5)
    seen = check_strategies(F.linear, x, w, op=aten.linear.default, blocks=(1, 2))
    assert "(S(0:2),R)->S(0:2)" in seen, seen
    seen = check_strategies(F.linear, torch.randn(4, 4, 8), w, b, op=aten.linear.default,
                            blocks=(1, 2))  # fmt: skip
    assert {"(S(0:2),R)->S(0:2)", "(S(1:2),R)->S(1:2)"} <= set(seen), seen  # bias split off


def test_a_strided_slice_of_a_split_dim_is_sliced_locally():
    """``x[..., start::step]`` over a dim split in pieces of whole steps (GPT-OSS's
    interleaved gate / up columns): each rank slices its own piece."""
    x = torch.randn(3, 16)
    for fn in (lambda x: x[..., ::2], lambda x: x[..., 1::2], lambda x: x[..., 3::4]):
        seen = check_strategies(fn, x, op=aten.slice.Tensor, blocks=(1, 2))
        assert {"(S(1))->S(1)", "(S(1:2))->S(1:2)"} <= set(seen), seen
    seen = check_strategies(lambda x: x[..., 1::3], torch.randn(3, 12), op=aten.slice.Tensor)
    assert "(S(1))->S(1)" in seen  # 6 a piece: whole steps of 3
    seen = check_strategies(lambda x: x[..., ::4], torch.randn(3, 12), op=aten.slice.Tensor)
    assert "(S(1))->S(1)" not in seen  # 6 a piece: not whole steps of 4


class ConvStack(nn.Module):
    """Two overlapping 3x3 convolutions: column-parallel, then row-parallel (bias added once);
    between them a depthwise 3x3 (ConvNeXt / MobileNet) on this rank's channels."""

    def __init__(self, c: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.up = nn.Conv2d(c, hidden, 3, padding=1)
        self.depthwise = nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden)
        self.down = nn.Conv2d(hidden, c, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.depthwise(F.gelu(self.up(x)))))


def test_conv_stack_splits_channels_megatron_style():
    torch.manual_seed(0)
    model, x = ConvStack(), (torch.randn(2, 8, 6, 6),)
    prog = autoparallelize(model, Mesh(tp=2), x, memory_weight=MEMORY)
    fwd = [(c.kind, c.shape) for c in prog.plan.collectives if c.direction == "fwd"]
    assert len(fwd) == 1 and fwd[0][1] == (2, 8, 6, 6), fwd  # only the row conv's partial sum
    assert fwd[0][0] in ("all_reduce", "reduce_scatter"), fwd
    report = verify(model, Mesh(tp=2), x, memory_weight=MEMORY)
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-5


# ---------------------------------------------------------------- HF families

transformers = pytest.importorskip("transformers")

FAMILIES = {  # tiny configs; each exercises ops that had no rule
    "gptj": ("GPTJConfig", dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64)),
    "cohere": ("CohereConfig", {}),
    "olmo2": ("Olmo2Config", {}),
    "apertus": ("ApertusConfig", {}),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=8)),
    "falcon": ("FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=4)),
}


def hf_model(name: str, device: str = "cpu"):
    cls, extra = FAMILIES[name]
    cfg = getattr(transformers, cls)(**{
        "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64,
        "use_cache": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **extra,
    })  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def hf_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_hf_family_has_a_rule_for_every_op_and_matches_single_device(name, recwarn):
    ids, labels = hf_batch()
    report = verify(hf_model(name), Mesh(tp=2), (ids,), example_kwargs={"labels": labels})
    assert not [str(w.message) for w in recwarn if "no sharding rule" in str(w.message)]
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-5


def test_hf_olmo2_qk_norm_runs_distributed():
    """OLMo2 normalises the whole q / k projection: an all-reduce of [b, s, 1] sums, no gather."""
    ids, labels = hf_batch()
    model, kw = hf_model("olmo2"), {"example_kwargs": {"labels": labels}, "memory_weight": MEMORY}
    prog = autoparallelize(model, Mesh(tp=2), (ids,), **kw)
    qk = [c for c in prog.plan.collectives if c.where.endswith(("q_proj", "k_proj", "_norm"))
          and ".self_attn." in c.where]  # fmt: skip
    assert len(qk) == 2 * 2 * 2, qk  # q and k, forward and backward, two layers
    assert all(c.kind == "all_reduce" and c.shape == (2, 16, 1) for c in qk), qk
    report = verify(model, Mesh(tp=2), (ids,), **kw)
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-5


class SplitRegression(nn.Module):
    """A column-split projection scored by MSE against a target: the loss of split elements."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(h, 8 * h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.up(x))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse_loss_of_a_split_output_reduces_one_scalar(reduction):
    torch.manual_seed(0)
    model, inputs = SplitRegression(), (torch.randn(2, 8, 16), torch.randn(2, 8, 128))
    loss = lambda out, y: F.mse_loss(out, y, reduction=reduction)  # noqa: E731
    prog = autoparallelize(model, Mesh(tp=2), inputs, loss_fn=loss, memory_weight=MEMORY)
    kinds = [(c.kind, c.shape, c.direction) for c in prog.plan.collectives]
    assert kinds == [("all_reduce", (), "fwd")], kinds  # the loss; no gather of the output
    report = verify(model, Mesh(tp=2), inputs, loss_fn=loss, memory_weight=MEMORY)
    assert report.ok, str(report)
    assert report.max_rel_error < 1e-5
