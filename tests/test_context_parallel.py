"""The context-parallel axis: Mesh(cp=...) alone, with dp, tp and pp on real Gloo ranks.

Loss and every gradient equal the single-device model (fp32, relative 1e-5) for ring and
all-to-all attention; the ring issues cp-1 K/V exchanges per attention forward and all-to-all
attention 4 all-to-alls; HF Llama / Qwen2 verify; bad input fails with one clear error each.

Ring attention computes blocks one precision up (fp64 for fp32 inputs) and so is compared
with a float64 reference (``reference_dtype``): a key bias's gradient is exactly zero and the
fp32 SDPA kernel leaves ~1e-5 of verify's metric of rounding noise on it.  All-to-all
attention runs the model's own SDPA kernel on whole sequences and is compared with the fp32
model, whose rounding it shares.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar import InputError, Mesh, autoparallelize, verify
from autopar.axes.context_parallel import ContextParallelError
from autopar.ops import cp_ops
from autopar.runtime.pool import get_pool
from autopar.tools.testing import Config, build, lm_loss, tokens

MESHES = [{"cp": 2}, {"cp": 4}, {"dp": 2, "cp": 2}, {"cp": 2, "tp": 2}]


def reference(strategy: str) -> torch.dtype | None:
    return torch.float64 if strategy == "ring" else None


def rtol(strategy: str, axes: dict) -> float:
    """1e-5; all-to-all attention under tp uses the tp tests' 1e-4: there the tp program's
    own SDPA leaves ~1e-5 of rounding noise on a key bias's exactly-zero gradient
    (tests/test_data_parallel.py)."""
    return 1e-4 if strategy == "all_to_all" and "tp" in axes else 1e-5


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["gpt", "llama"]))
    axes = draw(st.sampled_from(MESHES))
    strategy = draw(st.sampled_from(["ring", "all_to_all"]))
    heads = draw(st.sampled_from([4, 8]))
    kv = heads if kind == "gpt" else draw(st.sampled_from([1, 2, heads]))
    seq = draw(st.sampled_from([32, 64, 128, 256]))
    c = Config(layers=draw(st.integers(1, 2)), hidden=heads * 8, heads=heads, kv_heads=kv,
               ffn=heads * 16, vocab=draw(st.sampled_from([48, 64])), seq=seq,
               batch=axes.get("dp", 1) * draw(st.integers(1, 2)), bias=draw(st.booleans()))  # fmt: skip
    return kind, c, axes, strategy


@settings(max_examples=10)
@given(cases())
def test_equals_single_device(case):
    kind, c, axes, strategy = case
    model = build(kind, c)
    x, y = tokens(c)
    report = verify(model, Mesh(**axes), (x, y), lm_loss, rtol=rtol(strategy, axes),
                    cp_attention=strategy, reference_dtype=reference(strategy))  # fmt: skip
    assert report.ok, f"{kind} {c} {axes} {strategy}\n{report}"
    assert len([r for r in report.rows if r.kind == "grad"]) == len(list(model.parameters()))


@pytest.mark.parametrize(("causal", "mask", "groups"), [(True, None, 1), (True, None, 2),
                                                     (False, "window", 1), (False, "float", 2)])
def test_blockwise_attention_equals_sdpa(causal, mask, groups):
    """The ring's block kernels over one rank's runs (4 chunks), in one process, against SDPA
    in float64: forward, and backward through the flash-style recomputation."""
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, 16, 8
    q = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, h // groups, s, d, generator=g, dtype=torch.float64) for _ in "kv")
    pos = torch.arange(s)
    m = None
    if mask == "window":
        m = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < 5)
    elif mask == "float":
        m = torch.randn(1, h, s, s, generator=g, dtype=torch.float64)
    runs = [(0, 4), (12, 16), (4, 8), (8, 12)]  # a rank's chunks, then the others
    order = torch.cat([torch.arange(a, e) for a, e in runs])
    qs, ks, vs = (t[..., order, :] for t in (q, k, v))
    o = torch.zeros_like(qs)
    lse = torch.full(qs.shape[:-1], float("-inf"), dtype=qs.dtype)
    kx, vx = cp_ops._expand(ks, groups), cp_ops._expand(vs, groups)
    cp_ops._attend(qs, kx, vx, m, runs, runs, causal, d**-0.5, o, lse)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, attn_mask=m, is_causal=causal,
                                         enable_gqa=groups > 1)  # fmt: skip
    torch.testing.assert_close(o, ref.detach()[..., order, :], rtol=1e-12, atol=1e-12)
    do = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(do)
    dq, dk, dv = torch.zeros_like(qs), torch.zeros_like(qs), torch.zeros_like(qs)
    dos = do[..., order, :]
    cp_ops._attend_backward(qs, kx, vx, dos, (dos * o).sum(-1), lse, m, runs, runs, causal,
                            d**-0.5, dq, dk, dv)  # fmt: skip
    for ours, want in ((dq, ref_in[0]), (cp_ops._fold(dk, groups), ref_in[1]),
                       (cp_ops._fold(dv, groups), ref_in[2])):  # fmt: skip
        torch.testing.assert_close(ours, want.grad[..., order, :], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
def test_outputs_without_loss_are_gathered_whole(strategy):
    c = Config(seq=32)
    model = build("gpt", c)
    x, _ = tokens(c)
    report = verify(model, Mesh(cp=2), (x,), rtol=1e-5, cp_attention=strategy,
                    reference_dtype=reference(strategy))  # fmt: skip
    assert report.ok, report


@pytest.mark.parametrize(("kind", "strategy"), [("llama", "ring"), ("gpt", "all_to_all")])
def test_pipeline_stages_split_the_sequence(kind, strategy):
    c = Config(seq=32, kv_heads=2 if kind == "llama" else 4, batch=4)
    model = build(kind, c)
    report = verify(model, Mesh(pp=2, cp=2), tokens(c), lm_loss, rtol=1e-5, n_microbatches=2,
                    cp_attention=strategy, reference_dtype=reference(strategy))  # fmt: skip
    assert report.ok, report


def _hf(name: str) -> nn.Module:
    import transformers

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    if name == "mistral_window":  # sliding window 8 < sequence 32: HF builds the mask
        return transformers.MistralForCausalLM(transformers.MistralConfig(**kw, sliding_window=8))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kw))


def shifted_loss(out, labels: torch.Tensor) -> torch.Tensor:
    """Causal-LM loss with labels shifted outside the model (-100 ignored)."""
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def shifted(labels: torch.Tensor) -> torch.Tensor:
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


@pytest.mark.parametrize(("name", "axes", "strategy"), [
    ("llama", {"cp": 2}, "ring"), ("llama", {"cp": 2}, "all_to_all"),
    ("qwen2", {"cp": 2}, "ring"), ("qwen2", {"cp": 2}, "all_to_all"),
    ("llama", {"cp": 2, "tp": 2}, "ring"), ("qwen2", {"cp": 2, "tp": 2}, "all_to_all"),
    ("mistral_window", {"cp": 2}, "ring"), ("mistral_window", {"cp": 2}, "all_to_all"),
])  # fmt: skip
def test_hf_causal_lm(name, axes, strategy):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 32), generator=g)
    labels = shifted(torch.randint(0, 128, (2, 32), generator=g))
    report = verify(_hf(name), Mesh(**axes), (ids, labels), shifted_loss, rtol=1e-5,
                    cp_attention=strategy)  # fmt: skip
    assert report.ok, report


# ---------------------------------------------------------------- masks built by the model


class BuiltMask(nn.Module):
    """Attention with a mask the model builds from positions: ``kind`` picks how."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(32, 32)
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)

    def mask(self, s: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        pos = torch.arange(s, device=device)
        if self.kind == "bool":  # HF's form: key position <= query position, and-ed with truth
            same_doc = torch.zeros(s, device=device)[:, None] == torch.zeros(s, device=device)
            return (pos[None, :] <= pos[:, None]) & same_doc
        if self.kind == "float":  # -inf above the diagonal
            full = torch.full((s, s), float("-inf"), device=device, dtype=dtype)
            return torch.triu(full, diagonal=1)
        if self.kind == "window":  # a causal band of 4
            return (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - 4)
        return pos[None, :] >= pos[:, None]  # "anti": keys at or after the query

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape
        q, k, v = self.qkv(self.emb(x)).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(s, x.device, q.dtype))
        return self.out(o.transpose(1, 2).reshape(b, s, 32)).pow(2).sum()


def _sdpa_causal(prog) -> list:
    return [n.args[7] for n in prog.graph_module.graph.nodes
            if n.target is cp_ops.ring_attention_out]  # fmt: skip


@pytest.mark.parametrize("kind", ["bool", "float", "window"])
def test_causal_mask_recognised_from_its_structure(kind, monkeypatch):
    """With evaluation of masks switched off (``MASK_LIMIT = 0``), a causal mask built from
    position comparisons (or ``triu`` of -inf) is still recognised: balanced chunks, the ring
    told ``causal``, and the program equals the model with its mask.  A causal band (the
    causal comparison and-ed with a window) hides at least what causal hides: causal too,
    its mask kept."""
    prog, report = _ring_without_mask_evaluation(kind, monkeypatch)
    assert _sdpa_causal(prog) == [True]
    assert any("4 chunks, rank i holds chunks i and 3-i" in n for n in prog.plan.notes)
    assert report.ok, report


@pytest.mark.parametrize("kind", ["anti"])
def test_masks_that_are_not_causal_stay_masks(kind, monkeypatch):
    prog, report = _ring_without_mask_evaluation(kind, monkeypatch)
    assert _sdpa_causal(prog) == [False]
    assert any("2 chunks, rank i holds chunk i" in n for n in prog.plan.notes)
    assert report.ok, report


def _ring_without_mask_evaluation(kind, monkeypatch):
    """The cp=2 ring program of a ``BuiltMask(kind)`` model and its verify report, with the
    evaluation of masks switched off (only their structure can be read)."""
    from autopar.frontend import canonical

    monkeypatch.setattr(canonical, "MASK_LIMIT", 0)
    x = torch.randint(0, 32, (2, 16))
    prog = autoparallelize(BuiltMask(kind), Mesh(cp=2), (x,), cp_attention="ring")
    report = verify(BuiltMask(kind), Mesh(cp=2), (x,), rtol=1e-5, cp_attention="ring",
                    reference_dtype=torch.float64)  # fmt: skip
    return prog, report


def test_hf_mask_at_32k_tokens_gives_balanced_chunks():
    """HF Llama at 32768 tokens (meta weights, plan only): its 2^30-element causal mask is
    recognised from how it is built, so the sequence gets the balanced layout."""
    import transformers

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768,
              use_cache=False)  # fmt: skip
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    ids = torch.randint(0, 128, (1, 32768))
    prog = autoparallelize(model, Mesh(cp=4), (ids,), example_kwargs={"labels": ids})
    note = "32768 tokens into 8 chunks, rank i holds chunks i and 7-i (causal"
    assert any(note in n for n in prog.plan.notes), prog.plan
    assert note in str(prog.plan)
    assert _sdpa_causal(prog) == [True, True]


# ---------------------------------------------------------------- collectives


def _forward_exchanges(rank: int, groups: dict, module, x, y) -> dict:
    from autopar.ops import collectives

    collectives.bind(groups)
    cp_ops.reset_exchanges()
    loss = module(x, y)
    fwd = cp_ops.reset_exchanges()
    loss.backward()
    return {"fwd": fwd.get("fwd", 0), "bwd": cp_ops.reset_exchanges().get("bwd", 0)}


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_exchanges_kv_cp_minus_one_times_per_attention(cp):
    c = Config(layers=2, seq=32, kv_heads=2)
    model = build("llama", c)
    x, y = tokens(c)
    prog = autoparallelize(model, Mesh(cp=cp), (x, y), lm_loss, cp_attention="ring")
    code = prog.code(0)
    assert code.count("autopar_ops_cp_ops_ring_attention_out(") == c.layers
    sends = re.findall(r"autopar_ops_cp_ops_ring_send\(.*# p2p: send ([\d.]+) KiB", code)
    kv_kib = 2 * c.batch * c.kv_heads * (c.seq // cp) * (c.hidden // c.heads) * 4 / 2**10
    assert [float(k) for k in sends] == [kv_kib] * (c.layers * (cp - 1))  # one node per step
    assert code.count("autopar_ops_cp_ops_ring_recv(") == c.layers * (cp - 1)
    sends = [col for col in prog.collectives() if col.kind == "send_recv"]
    assert len([s for s in sends if s.direction == "fwd"]) == c.layers * (cp - 1)
    kv = sends[0]
    assert kv.shape == (2, c.batch, c.kv_heads, c.seq // cp, c.hidden // c.heads)  # KV heads only
    jobs = [(prog.module(r), x, y) for r in range(cp)]
    counts = get_pool(cp).run(_forward_exchanges, prog.mesh.axes, jobs)
    # forward: cp-1 fused K/V exchanges; backward: cp-1 K/V plus cp dK/dV exchanges
    assert all(n == {"fwd": c.layers * (cp - 1), "bwd": c.layers * (2 * cp - 1)} for n in counts)


def _ring_saved_bytes(rank: int, groups: dict, cp: int) -> tuple[int, int]:
    from autopar.ops import collectives

    collectives.bind(groups)
    b, h, s, d = 1, 4, 64, 8
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(b, h, s // cp, d, generator=g, requires_grad=True) for _ in "qkv")
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block, o, lse = [k, v], None, None
        for step in range(cp):  # as the program runs it: one node per ring step
            pending = cp_ops.ring_send(block, "cp") if step < cp - 1 else None
            o, lse = cp_ops.ring_block(q, *block, o, lse, None, "cp", step, True, 0.5, s, True)
            block = cp_ops.ring_recv(pending) if pending is not None else block
        out = cp_ops.ring_attention_out(q, k, v, o, lse, None, "cp", True, 0.5, s, True)
    out.sum().backward()
    own = 3 * q.numel() * 4 + o.numel() * 8 + lse.numel() * 8  # q, k, v; o, lse in float64
    return sum(seen.values()), own


def test_ring_steps_as_nodes_save_only_this_ranks_blocks():
    """The ring's steps are separate graph nodes, yet backward saves only this rank's q, k, v
    and the merged (o, lse): the blocks received from other ranks are never saved (backward
    passes K/V around the ring again), so saved bytes stay O(S/cp)."""
    for saved, own in get_pool(4).run(_ring_saved_bytes, Mesh(cp=4).axes, [(4,)] * 4):
        assert saved == own, (saved, own)


def test_all_to_all_attention_is_four_all_to_alls_forward():
    c = Config(layers=2, seq=32, kv_heads=2)
    prog = autoparallelize(build("llama", c), Mesh(cp=2), tokens(c), lm_loss,
                           cp_attention="all_to_all")  # fmt: skip
    fwd = [col for col in prog.collectives() if col.kind == "all_to_all" and col.direction == "fwd"]
    assert len(fwd) == 4 * c.layers
    assert prog.code(0).count("autopar_ops_collectives_all_to_all(") == 4 * c.layers
    assert "send_recv" not in {col.kind for col in prog.collectives()}


def test_cost_model_chooses_and_says_why():
    c = Config(layers=1, seq=64, kv_heads=2)
    prog = autoparallelize(build("llama", c), Mesh(cp=2), tokens(c), lm_loss)
    (node, chosen), = prog.plan.cp.attention  # the cp section (plan.choice: tp strategies)
    why = next(n for n in prog.plan.notes if n.startswith(f"attention {node}:"))
    ring, a2a = map(float, re.search(r"\(ring ([\d.]+) us, all-to-all ([\d.]+) us", why).groups())
    assert chosen == ("ring" if ring <= a2a else "all_to_all"), why
    heads2 = Config(layers=1, seq=64, heads=2, kv_heads=2, hidden=32)
    prog = autoparallelize(build("llama", heads2), Mesh(cp=4), tokens(heads2), lm_loss)
    assert prog.plan.cp.attention[0][1] == "ring"  # 2 heads do not split over 4 ranks


def test_activation_memory_falls_with_cp():
    c = Config(layers=2, seq=256, kv_heads=2)
    acts = {}
    for cp in (2, 4):
        prog = autoparallelize(build("llama", c), Mesh(cp=cp), tokens(c), lm_loss)
        note = next(n for n in prog.plan.notes if n.startswith("activations per rank"))
        acts[cp] = float(note.split()[3])
    assert 0.45 < acts[4] / acts[2] < 0.6, acts


# ---------------------------------------------------------------- bad input


def test_sequence_must_divide_into_chunks():
    c = Config(seq=12)
    with pytest.raises(InputError, match=r"12 .* does not divide into 2·cp = 8 chunks"):
        autoparallelize(build("llama", c), Mesh(cp=4), tokens(c), lm_loss)


class Bidirectional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.emb(x)).unsqueeze(1).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v).sum()


def test_sequence_must_divide_by_cp_without_causal_attention():
    x = torch.randint(0, 32, (2, 9))
    with pytest.raises(InputError, match=r"does not divide into cp = 2"):
        autoparallelize(Bidirectional(), Mesh(cp=2), (x,))
    report = verify(Bidirectional(), Mesh(cp=2), (torch.randint(0, 32, (2, 8)),), rtol=1e-5,
                    cp_attention="ring", reference_dtype=torch.float64)  # fmt: skip
    assert report.ok, report


def test_all_to_all_needs_heads_divisible_by_cp():
    c = Config(seq=32, heads=2, kv_heads=2, hidden=32)
    with pytest.raises(InputError, match=r"2 query heads do not divide by cp=4"):
        autoparallelize(build("llama", c), Mesh(cp=4), tokens(c), lm_loss,
                        cp_attention="all_to_all")  # fmt: skip


class EagerAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        scores = h @ h.transpose(1, 2)
        return (scores.softmax(-1) @ h).sum()


def test_attention_the_rules_cannot_split_is_named_with_its_line():
    with pytest.raises(ContextParallelError, match=r"matmul.*test_context_parallel.py.*scores = h @ h.*sdpa"):
        autoparallelize(EagerAttention(), Mesh(cp=2), (torch.randint(0, 32, (2, 8)),))


@pytest.mark.parametrize("axes", [{"cp": 2}, {"cp": 2, "tp": 2}])
def test_hf_shifts_labels_inside_the_model(axes):
    """``LlamaForCausalLM(ids, labels=labels)``: the model pads and shifts the labels itself.
    The shift reads the input alone, so it runs whole on every rank and the loss reads this
    rank's chunks of the shifted labels: no communication, and the loss and logits outputs
    and every gradient equal one device's."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 32), generator=g)
    labels = torch.randint(0, 128, (2, 32), generator=g)
    labels[0, 5] = -100
    model = _hf("llama")
    prog = autoparallelize(model, Mesh(**axes), (ids,), example_kwargs={"labels": labels},
                           cp_attention="ring")  # fmt: skip
    code = prog.code(0)
    assert "aten.pad.default(labels" in code and "cp_localize" in code
    fwd = [c for c in prog.collectives() if c.kind == "send_recv" and c.direction == "fwd"]
    assert len(fwd) == 2  # the ring's, one per layer: the label shift exchanges nothing
    report = verify(model, Mesh(**axes), (ids,), example_kwargs={"labels": labels}, rtol=1e-5,
                    cp_attention="ring", reference_dtype=torch.float64)  # fmt: skip
    assert report.ok, report
    assert len([r for r in report.rows if r.kind == "output"]) == 2  # loss and logits


@pytest.mark.parametrize("strategy", ["ring", "all_to_all"])
def test_hf_padding_mask_from_the_attention_mask_input(strategy):
    """HF builds its mask from ``attention_mask`` (an input): that runs whole on every rank,
    so attention gets the whole padding-and-causal mask (balanced chunks: the mask is the
    causal triangle and-ed with the padding, tests/test_cp_compose.py)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 32), generator=g)
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 24:] = 0  # right padding: every query still sees a key
    labels = ids.masked_fill(mask == 0, -100)
    kwargs = {"attention_mask": mask, "labels": labels}
    report = verify(_hf("llama"), Mesh(cp=2), (ids,), example_kwargs=kwargs, rtol=1e-5,
                    cp_attention=strategy, reference_dtype=reference(strategy))  # fmt: skip
    assert report.ok, report


class SlicedLogits(nn.Module):
    """GPT computing its loss inside, the older HF way: ``logits[:, :-1]`` against
    ``labels[:, 1:]``, and returning the sliced logits too."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.gpt = build("gpt", c)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits = self.gpt(ids)
        shift = logits[:, :-1, :].contiguous()
        loss = F.cross_entropy(shift.view(-1, shift.shape[-1]), labels[:, 1:].reshape(-1))
        return loss, shift


@pytest.mark.parametrize("axes", [{"cp": 2}, {"cp": 2, "tp": 2}])
def test_model_slicing_its_logits_inside(axes):
    """A slice of the split logits stays at full length (no exchange); the labels, shifted
    whole, are padded with ignore_index where the slice dropped positions; the sliced logits
    output is cut from the gathered whole."""
    c = Config(seq=32, bias=True)
    model = SlicedLogits(c)
    x, y = tokens(c)
    y[0, 3] = -100
    prog = autoparallelize(model, Mesh(**axes), (x, y), cp_attention="ring")
    assert "constant_pad_nd.default(" in prog.code(0)
    fwd = [c for c in prog.collectives() if c.kind == "send_recv" and c.direction == "fwd"]
    assert len(fwd) == c.layers  # the ring's only
    report = verify(model, Mesh(**axes), (x, y), rtol=1e-5, cp_attention="ring",
                    reference_dtype=torch.float64)  # fmt: skip
    assert report.ok, report


class TemperedSlice(nn.Module):
    """A sliced activation meeting an input-derived partner of the same shift."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.gpt = build("gpt", c)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor,
                temp: torch.Tensor) -> torch.Tensor:  # fmt: skip
        logits = self.gpt(ids)[:, :-1] * temp[:, 1:, None]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def test_sliced_activation_times_an_input_derived_partner():
    """The partner ``temp[:, 1:]`` is padded whole to the full length, then localized."""
    c = Config(seq=32)
    x, y = tokens(c)
    temp = torch.rand(c.batch, c.seq, generator=torch.Generator().manual_seed(0)) + 0.5
    report = verify(TemperedSlice(c), Mesh(cp=2), (x, y, temp), rtol=1e-5, cp_attention="ring",
                    reference_dtype=torch.float64)  # fmt: skip
    assert report.ok, report


class TemporalDifference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return (h[:, 1:] - h[:, :-1]).pow(2).sum()


def test_differently_shifted_activations_are_refused():
    with pytest.raises(ContextParallelError, match=r"sub.*differently shifted.*halo exchange"):
        autoparallelize(TemporalDifference(), Mesh(cp=2), (torch.randint(0, 32, (2, 8)),))


def test_train_cp_example_matches_single_device() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, str(root / "examples" / "train_cp.py")], cwd=root,
                         env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    rows = re.findall(r"^\s*(\d+)\s+\d+\.\d+\s+\d+\.\d+\s+\S+e[-+]\d+$", run.stdout, re.M)
    assert [int(r) for r in rows] == list(range(1, 21)), out
    assert "within 0.0001" in out and "every rank returned rank 0's losses: True" in out, out


def test_llama3_8b_at_128k_tokens_fits_one_dgx_node_and_says_why():
    from dataclasses import replace

    from autopar import Cluster, ModelShape
    from autopar.axes.context_parallel import fit_sequence

    node = Cluster.preset("dgx-h100")
    fit = fit_sequence(replace(ModelShape.preset("llama3-8b"), seq=131072), node)
    assert fit.best.fits and fit.best.memory_per_rank <= node.gpu.hbm_bytes
    assert fit.best.step_time_s == min(e.step_time_s for e in fit.tried if e.fits)
    c = fit.best.config
    assert c.tp * c.cp * c.pp * c.dp == 8
    assert fit.why and all(any(k in w for k in ("cp=", "tp=", "pp=", "recompute")) for w in fit.why)
    assert "131072 tokens" in str(fit)


def test_plan_prices_the_local_compute():
    """The cp plan's compute is one rank's share: about half of one device's at cp=2 (ring
    attention priced as the attention it does), never zero."""
    c = Config(layers=2, hidden=512, heads=8, kv_heads=8, ffn=1024, vocab=1000, seq=512, batch=2)
    with torch.device("meta"):
        model = build("llama", c)
    one = autoparallelize(model, Mesh(tp=1), tokens(c), loss_fn=lm_loss).plan.compute_s
    two = autoparallelize(model, Mesh(cp=2), tokens(c), loss_fn=lm_loss,
                          cp_attention="ring").plan.compute_s  # fmt: skip
    assert 0.4 < two / one < 0.7, (one, two)
