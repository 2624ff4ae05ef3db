"""A zoo of Hugging Face causal-LM families: tiny and realistic builds, checked end to end.

Every family is built from a transformers config with random weights (nothing is
downloaded) and trained with the model's own loss: ``model(ids, labels=labels)`` (the
``labels=`` keyword, HF's shifted cross-entropy), so the traced step is exactly what a user
of that family runs.  Outputs are the loss and the logits; verify compares both.

Algorithm of :func:`check` (one row of the zoo table):
1. Build the tiny config (hidden 64, 2 layers, 4 heads, vocab 128, seq 16, batch 2) on the
   CPU and ``verify`` it at ``Mesh(tp=t)`` on the Gloo worker pool: traced?, max relative
   error over the loss, the logits and every parameter gradient.
2. Build the realistic config (hidden 2048, seq 2048, vocab 32000, 2 layers, 16 heads, kv heads
   by the family's idiom: MHA 16, GQA 4, MQA 1) on the meta device and ``autoparallelize`` it
   (no processes, no weights) with ``param_dtype=torch.bfloat16``: the precision such models
   train in and Megatron's hand design assumes (fp32 GEMMs run ~15x slower on an H100, so an
   fp32 plan may rightly trade collectives for compute the hand design would not).
3. Read its forward collectives (:func:`forward_collectives`), attribute each to a layer by the
   module path it was lowered at, and compare with the hand-designed count
   (:func:`expected_collectives`, REFERENCE.md):
   - plain TP: 2 all-reduces of [b,s,h] per layer (attention out, MLP out);
   - a parallel attention+MLP block sharing one residual add: 1;
   - a QK-norm over the whole q / k projection (not per head): + 2 all-reduces of [b,s,1];
   - MoE under tensor parallelism only (no expert axis): every expert is split on its FFN dim
     like a dense MLP and the router runs replicated, so the routed sum (plus a shared expert)
     stays one partial sum: 1 all-reduce, 2 per layer with the attention;
   - outside the layers: the vocab-parallel embedding (1 all-reduce of [b,s,h]) and the
     vocab-parallel cross-entropy (2 all-reduces of per-token statistics, [b*s] and [b*s,2]);
     never an all-gather of [b,s,V] logits.
   "Within the count" means both: all-reduce equivalents (an all-reduce counts 1; an
   all-gather, reduce-scatter or all-to-all counts 1/2, so Megatron-SP's gather + scatter pair
   equals the all-reduce it replaces) and per-GPU ring traffic are at most the hand design's.
4. The fraction of the layers' parameter bytes rank 0 holds, from the parameter layouts of
   the realistic plan (ideally ~1/t: only norms, biases and routers stay whole).
Each step's exception is caught into the row with a one-line reason.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn

from autopar.api import autoparallelize
from autopar.errors import TraceError
from autopar.mesh import Mesh
from autopar.program import Program


@dataclass(frozen=True, kw_only=True)
class Dims:
    """Model sizes one family config is built from."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int
    experts: int
    top_k: int
    expert_ffn: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINY = Dims(hidden=64, layers=2, heads=4, kv_heads=4, ffn=128, vocab=128, seq=16, batch=2,
            experts=4, top_k=2, expert_ffn=32)  # fmt: skip
REALISTIC = Dims(hidden=2048, layers=2, heads=16, kv_heads=16, ffn=5632, vocab=32000, seq=2048,
                 batch=1, experts=8, top_k=2, expert_ffn=1408)  # fmt: skip
# One 8-GPU node's shape (issue 20's measurement): Llama-2 7B widths at b 4, s 2048; its K/V
# heads are a parameter (8 = tp, 4 < tp) for every family that takes num_key_value_heads.
NODE = Dims(hidden=4096, layers=2, heads=32, kv_heads=32, ffn=11008, vocab=32000, seq=2048,
            batch=4, experts=8, top_k=2, expert_ffn=2816)  # fmt: skip
KV_HEADS = {"mha": {"tiny": 4, "realistic": 16, "node": 32},
            "gqa": {"tiny": 2, "realistic": 4, "node": 8},
            "mqa": {"tiny": 1, "realistic": 1, "node": 1}}  # fmt: skip
SIZES = ("tiny", "realistic", "node")


@dataclass(frozen=True, kw_only=True)
class Family:
    """One causal-LM family of the installed transformers, and its hand-designed TP count."""

    name: str
    model_class: str  # transformers class, e.g. "LlamaForCausalLM"
    config_class: str
    config: Callable[[Dims], dict[str, Any]]  # family's config keywords for the given sizes
    attention: str  # "mha", "gqa" or "mqa": the kv heads of each size (KV_HEADS)
    tags: tuple[str, ...]
    layer_all_reduces: int = 2  # forward all-reduces of [b,s,h] per layer
    layer_small_all_reduces: int = 0  # forward all-reduces of [b,s,1] per layer (QK-norm)
    counting: str = "plain TP: attention out + MLP out"


@dataclass(frozen=True, kw_only=True)
class Message:
    """One forward collective: kind, elements of the full tensor, layer (None: outside)."""

    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all
    numel: int
    layer: int | None
    shape: tuple[int, ...] = ()
    where: str = ""  # module path it was lowered at
    bytes: int = 0  # of the full tensor, in the dtype it moves in


@dataclass(frozen=True, kw_only=True)
class Comm:
    """The forward collectives of one step at one shape."""

    messages: tuple[Message, ...]
    tokens: int  # b * s: messages of at most 2 elements per token are per-token statistics

    def count(self, layer: int | None | str = "all") -> float:
        """All-reduce equivalents: all-reduce 1, the others 1/2."""
        return sum(_WEIGHT[m.kind] for m in self._of(layer))

    def activation_count(self, layer: int | None | str = "all") -> float:
        """All-reduce equivalents of the messages larger than per-token statistics (more than
        2 elements per token: activations, not a norm's or the loss's [b,s] values)."""
        return sum(_WEIGHT[m.kind] for m in self._of(layer) if m.numel > 2 * self.tokens)

    def traffic(self, tp: int, layer: int | None | str = "all") -> float:
        """Elements each GPU sends (ring algorithms)."""
        return sum(_traffic(m, tp) for m in self._of(layer))

    def traffic_bytes(self, tp: int, layer: int | None | str = "all") -> float:
        """Bytes each GPU sends (ring algorithms)."""
        return sum(_traffic(m, tp) * m.bytes / m.numel for m in self._of(layer) if m.numel)

    def summary(self, layer: int | None | str = "all") -> str:
        """'2AR+2ar' style: upper case for [b,s,h]-sized messages, lower for per-token ones."""
        kinds = Counter(_ABBREV[m.kind].lower() if m.numel <= 2 * self.tokens
                        else _ABBREV[m.kind] for m in self._of(layer))  # fmt: skip
        return "+".join(f"{n}{k}" for k, n in sorted(kinds.items())) or "0"

    def detail(self, layer: int | None | str = "all") -> str:
        """Each message as 'AG[2048,6144]@h.0.attn.c_attn'."""
        return ", ".join(f"{_ABBREV[m.kind]}[{','.join(map(str, m.shape))}]@{m.where or '<top>'}"
                         for m in self._of(layer))  # fmt: skip

    def _of(self, layer: int | None | str) -> list[Message]:
        return [m for m in self.messages if layer == "all" or m.layer == layer]


_WEIGHT = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5}
_ABBREV = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}


def _traffic(m: Message, tp: int) -> float:
    if m.kind == "all_reduce":
        return 2 * (tp - 1) / tp * m.numel
    if m.kind == "all_to_all":
        return (tp - 1) / tp * m.numel / tp
    return (tp - 1) / tp * m.numel


@dataclass(frozen=True, kw_only=True)
class CommCheck:
    """Forward collectives at the realistic shape against the hand-designed ones (issue 20's
    criterion): no more all-reduce equivalents of activations than the hand design, nothing
    else but per-token statistics, and no more per-GPU traffic."""

    actual: Comm
    expected: Comm
    tp: int

    @property
    def ok(self) -> bool:
        count_ok = self.actual.activation_count() <= self.expected.activation_count() + 1e-9
        return count_ok and self.actual.traffic(self.tp) <= self.expected.traffic(self.tp) * 1.001

    def __str__(self) -> str:
        a, e, t = self.actual, self.expected, self.tp
        ratio = a.traffic(t) / e.traffic(t) if e.traffic(t) else float("inf")
        return (f"L0 {a.summary(0)} (hand {e.summary(0)}), other {a.summary(None)} "
                f"(hand {e.summary(None)}), {a.activation_count():g}/{e.activation_count():g} "
                f"activation AR-eq, "
                f"traffic x{ratio:.2f}")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Row:
    """One family at one tensor-parallel degree (see the module docstring)."""

    family: str
    tp: int
    traced: bool
    verify_error: float | None  # max relative error (None: verify did not run to the end)
    verify_ok: bool
    verify_reason: str  # '' when verify passed
    comm: CommCheck | None
    comm_reason: str  # '' when the realistic plan compiled
    param_fraction: float | None  # rank 0's share of the layers' parameter bytes
    unruled: tuple[str, ...]  # ops replicated for lack of a sharding rule
    seconds: float

    @property
    def ok(self) -> bool:
        frac_ok = self.param_fraction is not None and abs(self.param_fraction * self.tp - 1) < 0.1
        verified = self.verify_ok or self.verify_reason == "not run"  # --no-verify tables
        return verified and self.comm is not None and self.comm.ok and frac_ok


def families() -> list[Family]:
    """The registry: every family below builds with the installed transformers."""
    return list(_FAMILIES)


def family(name: str) -> Family:
    """The registry entry called ``name``."""
    for f in _FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"no zoo family {name!r}; known: {', '.join(f.name for f in _FAMILIES)}")


@contextlib.contextmanager
def tiny_as(sizes: Dims) -> Iterator[None]:
    """Build ``size="tiny"`` models at ``sizes`` inside the block (tests that choose a plan at
    one shape and verify it on another)."""
    global TINY
    saved, TINY = TINY, sizes
    try:
        yield
    finally:
        TINY = saved


def tiny_for(tp: int) -> Dims:
    """The tiny sizes a verify at degree ``tp`` runs: `TINY`, or at a degree above its heads
    twice its widths with 8 heads (their K/V heads stay `KV_HEADS`' tiny ones: fewer than
    the ranks, shared by ``tp`` / K/V ranks each)."""
    if tp <= TINY.heads:
        return TINY
    return replace(TINY, hidden=2 * TINY.hidden, heads=8, ffn=2 * TINY.ffn, experts=8,
                   expert_ffn=2 * TINY.expert_ffn)  # fmt: skip


def dims(entry: Family, size: str, kv_heads: int | None = None) -> Dims:
    """The sizes of ``entry`` at ``size`` ('tiny', 'realistic' or 'node'); ``kv_heads``
    overrides the K/V heads of every family that is not multi-query (families whose config
    has no K/V-head keyword keep one K/V head per query head whatever it says)."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(map(repr, SIZES))}, not {size!r}")
    kv = KV_HEADS[entry.attention][size]
    if kv_heads is not None and entry.attention != "mqa":
        kv = kv_heads
    base = {"tiny": TINY, "realistic": REALISTIC, "node": NODE}[size]  # read now: tests patch
    return replace(base, kv_heads=kv)


def build(entry: Family, size: str = "tiny", device: str = "cpu", seed: int = 0,
          kv_heads: int | None = None) -> tuple[nn.Module, tuple, dict, None]:  # fmt: skip
    """``(model, example_inputs, example_kwargs, loss_fn)``: the model in eval mode (no
    dropout), token ids as the input, ``labels`` as a keyword (the model's own loss), no
    ``loss_fn``.  On the CPU, 1-D parameters (norm weights, biases) get random values so a
    wrong layout of them cannot hide behind ones and zeros."""
    import transformers

    d = dims(entry, size, kv_heads)
    tokens = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # inside the tiny vocab
    kwargs = {**tokens, **entry.config(d), "use_cache": False}
    cfg = getattr(transformers, entry.config_class)(**kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, entry.model_class)(cfg)
    model.eval()
    if device != "meta":
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, d.vocab, (d.batch, d.seq), generator=g).to(device)
    labels = torch.randint(0, d.vocab, (d.batch, d.seq), generator=g).to(device)
    return model, (ids,), {"labels": labels}, None


_LAYER = re.compile(r"\.(\d+)(?:\.|$)")


def _layer_of(path: str) -> int | None:
    found = _LAYER.search(path)
    return int(found.group(1)) if found else None


def forward_collectives(prog: Program) -> Comm:
    """The forward collectives of ``prog``'s step, each attributed to the layer whose module
    path it was lowered at (None: outside the layers)."""
    msgs = tuple(Message(kind=c.kind, numel=math.prod(c.shape), layer=_layer_of(c.where),
                         shape=c.shape, where=c.where, bytes=c.bytes)
                 for c in prog.collectives() if c.direction == "fwd")  # fmt: skip
    b, s = _tokens_shape(prog)
    return Comm(messages=msgs, tokens=b * s)


def _tokens_shape(prog: Program) -> tuple[int, int]:
    first = next(n for n in prog.traced.gm.graph.nodes if n.name in prog.traced.user_inputs)
    b, s = first.meta["val"].shape[:2]
    return int(b), int(s)


def expected_collectives(entry: Family, d: Dims) -> Comm:
    """The hand-designed forward collectives (module docstring, step 3): the [b,s,h]
    activations in bf16 (Megatron's ``--bf16``), the per-token statistics in fp32."""
    bsh, bs = d.batch * d.seq * d.hidden, d.batch * d.seq

    def ar(numel: int, layer: int | None, size: int) -> Message:
        return Message(kind="all_reduce", numel=numel, layer=layer, bytes=numel * size)

    msgs: list[Message] = []
    for layer in range(d.layers):
        msgs += [ar(bsh, layer, 2)] * entry.layer_all_reduces
        msgs += [ar(bs, layer, 4)] * entry.layer_small_all_reduces
    msgs += [ar(bsh, None, 2), ar(bs, None, 4), ar(2 * bs, None, 4)]
    return Comm(messages=tuple(msgs), tokens=bs)


def layer_param_fraction(prog: Program) -> float:
    """Rank 0's share of the bytes of parameters inside the layers (read from the lowered
    graph's parameter layouts, so it works on the meta device; splits are even, so every
    tensor-parallel rank holds the same share)."""
    from autopar.ir import meta

    held = total = 0
    for node in prog.graph_module.graph.nodes:
        fqn = prog.traced.params.get(node.name) if node.op == "placeholder" else None
        if fqn is None or _layer_of(fqn) is None:
            continue
        t = prog.traced.tensors[fqn]
        total += t.numel() * t.element_size()
        held += (
            math.prod(meta.layout(node).local_shape(t.shape, prog.mesh.sizes)) * t.element_size()
        )
    return held / total if total else float("nan")


def check(entry: Family, tp: int = 2, run_verify: bool = True, size: str = "realistic",
          kv_heads: int | None = None) -> Row:  # fmt: skip
    """One row of the zoo table (module docstring, steps 1-4) with the compiled shape at
    ``size`` ('realistic' or 'node') and ``kv_heads`` (see `dims`); never raises."""
    from autopar.verify import verify

    start = time.perf_counter()
    traced, error, verify_ok, verify_reason = True, None, False, "not run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if run_verify:
            try:
                with tiny_as(tiny_for(tp)):
                    model, args, kwargs, loss_fn = build(entry, "tiny")
                report = verify(model, Mesh(tp=tp), args, loss_fn, example_kwargs=kwargs)
                error, verify_ok = report.max_rel_error, report.ok
                verify_reason = "" if report.ok else _worst(report)
            except Exception as exc:  # noqa: BLE001 - reported in the row
                traced = not isinstance(exc, TraceError)
                verify_reason = _one_line(exc)
        comm, comm_reason, frac = None, "", None
        try:
            model, args, kwargs, loss_fn = build(entry, size, device="meta", kv_heads=kv_heads)
            prog = autoparallelize(model, Mesh(tp=tp), args, loss_fn, example_kwargs=kwargs,
                                   param_dtype=torch.bfloat16)  # fmt: skip
            comm = CommCheck(actual=forward_collectives(prog),
                             expected=expected_collectives(entry, dims(entry, size, kv_heads)),
                             tp=tp)  # fmt: skip
            frac = layer_param_fraction(prog)
        except Exception as exc:  # noqa: BLE001 - reported in the row
            traced = traced and not isinstance(exc, TraceError)
            comm_reason = _one_line(exc)
    return Row(family=entry.name, tp=tp, traced=traced, verify_error=error, verify_ok=verify_ok,
               verify_reason=verify_reason, comm=comm, comm_reason=comm_reason,
               param_fraction=frac, unruled=_unruled(caught),
               seconds=time.perf_counter() - start)  # fmt: skip


def table(rows: list[Row]) -> str:
    """The zoo table, then one line per failure with its reason."""
    head = (f"{'family':<26} {'traced':<6} {'verify tp=' + str(rows[0].tp) if rows else '':<12} "
            f"{'fwd layer 0 (hand)':<22} {'outside layers (hand)':<24} {'AR-eq':<9} "
            f"{'traffic':<8} {'fwd MiB/GPU (hand)':<19} {'rank0':<6} {'s':>5}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        c = r.comm
        lines.append(
            f"{r.family:<26} {'yes' if r.traced else 'NO':<6} {_verify_cell(r):<12} "
            f"{_comm_cells(r) if c else '-':<58} {_bytes_cell(r) if c else '-':<19} "
            f"{f'{r.param_fraction:.3f}' if r.param_fraction is not None else '-':<6} "
            f"{r.seconds:5.1f}"
        )
    failures = [_failure(r) for r in rows if not r.ok]
    lines += ["", f"{len(rows) - len(failures)} of {len(rows)} families pass every check"]
    lines += [f for f in failures if f]
    return "\n".join(lines)


def _verify_cell(r: Row) -> str:
    if r.verify_error is None:
        return "FAIL" if r.verify_reason != "not run" else "-"
    return f"{r.verify_error:.1e}" + ("" if r.verify_ok else " BAD")


def _bytes_cell(r: Row) -> str:
    a, e, t, mib = r.comm.actual, r.comm.expected, r.tp, 2.0**20
    return f"{a.traffic_bytes(t) / mib:.0f} ({e.traffic_bytes(t) / mib:.0f})"


def _comm_cells(r: Row) -> str:
    a, e, t = r.comm.actual, r.comm.expected, r.tp
    ratio = a.traffic(t) / e.traffic(t)
    mark = "" if r.comm.ok else " BAD"
    return (f"{a.summary(0) + ' (' + e.summary(0) + ')':<22} "
            f"{a.summary(None) + ' (' + e.summary(None) + ')':<24} "
            f"{f'{a.activation_count():g}/{e.activation_count():g}':<9} "
            f"{f'x{ratio:.2f}{mark}':<8}")  # fmt: skip


def _failure(r: Row) -> str:
    why = []
    if not r.verify_ok and r.verify_reason != "not run":
        why.append(f"verify: {r.verify_reason}")
    if r.comm is None:
        why.append(f"realistic: {r.comm_reason}")
    elif not r.comm.ok:
        why.append(f"communication over the hand design: {r.comm}; layer 0: "
                   f"{r.comm.actual.detail(0)}")  # fmt: skip
    if r.param_fraction is not None and abs(r.param_fraction * r.tp - 1) >= 0.1:
        why.append(f"rank 0 holds {r.param_fraction:.3f} of the layer parameters")
    if r.unruled:
        why.append(f"ops without a rule: {', '.join(r.unruled)}")
    return f"  {r.family}: " + "; ".join(why) if why else ""


_UNRULED = re.compile(r"no sharding rule for (\S+)")


def _unruled(caught: list[warnings.WarningMessage]) -> tuple[str, ...]:
    ops = (_UNRULED.search(str(w.message)) for w in caught)
    return tuple(sorted({m.group(1) for m in ops if m}))


def _worst(report: Any) -> str:
    bad = sorted((r for r in report.rows if not r.ok), key=lambda r: -r.max_rel)
    names = ", ".join(f"{r.name} {r.max_rel:.1e}" for r in bad[:2])
    return f"{len(bad)} of {len(report.rows)} tensors differ: {names}"


def _one_line(exc: BaseException) -> str:
    """The exception in one line; a worker's traceback shrinks to its first and last line."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    if any(ln.startswith("Traceback") for ln in lines):
        lines = [lines[0], lines[-1]]
    text = " ".join(" ".join(lines).split())
    return f"{type(exc).__name__}: {text[:300]}"


# ---------------------------------------------------------------------------------------------
# The registry.  Config keywords per family; helpers for the common spellings.


def _std(d: Dims, **extra: Any) -> dict[str, Any]:
    """Llama-style config keywords."""
    base = dict(vocab_size=d.vocab, hidden_size=d.hidden, intermediate_size=d.ffn,
                num_hidden_layers=d.layers, num_attention_heads=d.heads,
                num_key_value_heads=d.kv_heads, max_position_embeddings=d.seq)  # fmt: skip
    return {**base, **extra}


def _gpt(d: Dims, **extra: Any) -> dict[str, Any]:
    """GPT-2-style config keywords (n_embd, n_layer, ...)."""
    return dict(vocab_size=d.vocab, n_embd=d.hidden, n_layer=d.layers, n_head=d.heads,
                n_inner=d.ffn, n_positions=d.seq, **extra)  # fmt: skip


def _moe(d: Dims, **extra: Any) -> dict[str, Any]:
    return _std(d, num_experts=d.experts, num_experts_per_tok=d.top_k,
                moe_intermediate_size=d.expert_ffn, **extra)  # fmt: skip


def _rope(partial: float) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": partial}}  # fmt: skip


def _window(d: Dims) -> int:
    return d.seq // 2


_PARALLEL = "parallel attention + MLP share one residual add: one all-reduce of their sum"
_QKNORM = "plain TP + 2 [b,s,1] all-reduces: q/k norm over the whole projection"
_MOE = "attention out + the routed experts' (and shared expert's) partial sum"

_FAMILIES: tuple[Family, ...] = (
    Family(
        name="gpt2",
        model_class="GPT2LMHeadModel",
        config_class="GPT2Config",
        config=lambda d: _gpt(d, activation_function="gelu_new"),
        attention="mha",
        tags=("conv1d", "fused-qkv", "learned-pos", "tied"),
    ),
    Family(
        name="gpt_bigcode",
        model_class="GPTBigCodeForCausalLM",
        config_class="GPTBigCodeConfig",
        config=lambda d: _gpt(d, multi_query=True),
        attention="mqa",
        tags=("fused-qkv", "mqa", "learned-pos", "tied"),
    ),
    Family(
        name="falcon",
        model_class="FalconForCausalLM",
        config_class="FalconConfig",
        config=lambda d: dict(
            vocab_size=d.vocab,
            hidden_size=d.hidden,
            num_hidden_layers=d.layers,
            num_attention_heads=d.heads,
            multi_query=True,
            parallel_attn=True,
            bias=False,
            new_decoder_architecture=False,
            ffn_hidden_size=d.ffn,
            max_position_embeddings=d.seq,
        ),
        attention="mqa",
        tags=("fused-qkv", "mqa", "parallel-block", "rope", "tied"),
        layer_all_reduces=1,
        counting=_PARALLEL,
    ),
    Family(
        name="falcon_new_arch",
        model_class="FalconForCausalLM",
        config_class="FalconConfig",
        config=lambda d: dict(
            vocab_size=d.vocab,
            hidden_size=d.hidden,
            num_hidden_layers=d.layers,
            num_attention_heads=d.heads,
            num_kv_heads=d.kv_heads,
            new_decoder_architecture=True,
            parallel_attn=True,
            bias=False,
            ffn_hidden_size=d.ffn,
            max_position_embeddings=d.seq,
        ),
        attention="gqa",
        tags=("fused-qkv", "interleaved-qkv", "gqa", "parallel-block", "rope", "tied"),
        layer_all_reduces=1,
        counting=_PARALLEL,
    ),
    Family(
        name="bloom",
        model_class="BloomForCausalLM",
        config_class="BloomConfig",
        config=lambda d: dict(
            vocab_size=d.vocab, hidden_size=d.hidden, n_layer=d.layers, n_head=d.heads
        ),
        attention="mha",
        tags=("fused-qkv", "interleaved-qkv", "alibi", "embedding-norm", "tied"),
    ),
    Family(
        name="gpt_neox",
        model_class="GPTNeoXForCausalLM",
        config_class="GPTNeoXConfig",
        config=lambda d: dict(
            vocab_size=d.vocab,
            hidden_size=d.hidden,
            num_hidden_layers=d.layers,
            num_attention_heads=d.heads,
            intermediate_size=d.ffn,
            max_position_embeddings=d.seq,
            use_parallel_residual=True,
            **_rope(0.25),
        ),
        attention="mha",
        tags=("fused-qkv", "interleaved-qkv", "partial-rotary", "parallel-block", "untied"),
        layer_all_reduces=1,
        counting=_PARALLEL,
    ),
    Family(
        name="mpt",
        model_class="MptForCausalLM",
        config_class="MptConfig",
        config=lambda d: dict(
            vocab_size=d.vocab,
            d_model=d.hidden,
            n_layers=d.layers,
            n_heads=d.heads,
            max_seq_len=d.seq,
            expansion_ratio=d.ffn // d.hidden,
        ),
        attention="mha",
        tags=("fused-qkv", "alibi", "no-bias", "tied"),
    ),
    Family(
        name="gptj",
        model_class="GPTJForCausalLM",
        config_class="GPTJConfig",
        config=lambda d: _gpt(d, rotary_dim=d.head_dim // 2),
        attention="mha",
        tags=("partial-rotary", "parallel-block", "lm-head-bias", "untied"),
        layer_all_reduces=1,
        counting=_PARALLEL,
    ),
    Family(
        name="codegen",
        model_class="CodeGenForCausalLM",
        config_class="CodeGenConfig",
        config=lambda d: _gpt(d, rotary_dim=d.head_dim // 2, n_ctx=d.seq),
        attention="mha",
        tags=("fused-qkv", "partial-rotary", "parallel-block", "untied"),
        layer_all_reduces=1,
        counting=_PARALLEL,
    ),
    Family(
        name="persimmon",
        model_class="PersimmonForCausalLM",
        config_class="PersimmonConfig",
        config=lambda d: dict(
            vocab_size=d.vocab,
            hidden_size=d.hidden,
            intermediate_size=d.ffn,
            num_hidden_layers=d.layers,
            num_attention_heads=d.heads,
            max_position_embeddings=d.seq,
            qk_layernorm=True,
            **_rope(0.5),
        ),
        attention="mha",
        tags=(
            "fused-qkv",
            "interleaved-qkv",
            "partial-rotary",
            "per-head-qk-norm",
            "relu2",
            "untied",
        ),
    ),
    Family(
        name="phi",
        model_class="PhiForCausalLM",
        config_class="PhiConfig",
        config=lambda d: _std(d, **_rope(0.5)),
        attention="mha",
        tags=("partial-rotary", "parallel-block", "lm-head-bias", "untied"),
        layer_all_reduces=1,
        counting=_PARALLEL,
    ),
    Family(
        name="phi3",
        model_class="Phi3ForCausalLM",
        config_class="Phi3Config",
        config=lambda d: _std(d, pad_token_id=0),
        attention="gqa",
        tags=("fused-qkv", "fused-gate-up", "gqa", "untied"),
    ),
    Family(
        name="stablelm",
        model_class="StableLmForCausalLM",
        config_class="StableLmConfig",
        config=lambda d: _std(d, **_rope(0.25)),
        attention="gqa",
        tags=("partial-rotary", "gqa", "layernorm", "untied"),
    ),
    Family(
        name="stablelm_parallel_qknorm",
        model_class="StableLmForCausalLM",
        config_class="StableLmConfig",
        config=lambda d: _std(d, use_parallel_residual=True, qk_layernorm=True, **_rope(0.25)),
        attention="gqa",
        tags=("partial-rotary", "gqa", "per-head-qk-norm", "parallel-block", "untied"),
        layer_all_reduces=1,
        counting=_PARALLEL,
    ),
    Family(
        name="llama",
        model_class="LlamaForCausalLM",
        config_class="LlamaConfig",
        config=_std,
        attention="gqa",
        tags=("gqa", "rope", "swiglu", "untied"),
    ),
    Family(
        name="mistral",
        model_class="MistralForCausalLM",
        config_class="MistralConfig",
        config=lambda d: _std(d, sliding_window=_window(d)),
        attention="gqa",
        tags=("gqa", "sliding-window", "swiglu", "untied"),
    ),
    Family(
        name="qwen2",
        model_class="Qwen2ForCausalLM",
        config_class="Qwen2Config",
        config=_std,
        attention="gqa",
        tags=("gqa", "qkv-bias", "swiglu", "untied"),
    ),
    Family(
        name="qwen3",
        model_class="Qwen3ForCausalLM",
        config_class="Qwen3Config",
        config=lambda d: _std(d, head_dim=d.head_dim, tie_word_embeddings=True),
        attention="gqa",
        tags=("gqa", "per-head-qk-norm", "swiglu", "tied"),
    ),
    Family(
        name="gemma",
        model_class="GemmaForCausalLM",
        config_class="GemmaConfig",
        config=lambda d: _std(d, head_dim=d.head_dim),
        attention="mqa",
        tags=("mqa", "geglu", "scaled-embedding", "tied"),
    ),
    Family(
        name="gemma2",
        model_class="Gemma2ForCausalLM",
        config_class="Gemma2Config",
        config=lambda d: _std(
            d,
            head_dim=d.head_dim,
            sliding_window=_window(d),
            layer_types=["sliding_attention", "full_attention"],
            attn_implementation="eager",
        ),
        attention="gqa",
        tags=("gqa", "logit-softcap", "sliding-window", "sandwich-norm", "tied"),
    ),
    Family(
        name="gemma3",
        model_class="Gemma3ForCausalLM",
        config_class="Gemma3TextConfig",
        config=lambda d: _std(
            d,
            head_dim=d.head_dim,
            sliding_window=_window(d),
            layer_types=["sliding_attention", "full_attention"],
        ),
        attention="gqa",
        tags=("gqa", "per-head-qk-norm", "sliding-window", "sandwich-norm", "tied"),
    ),
    Family(
        name="cohere",
        model_class="CohereForCausalLM",
        config_class="CohereConfig",
        config=lambda d: _std(d, use_qk_norm=True),
        attention="gqa",
        tags=("gqa", "parallel-block", "per-head-qk-norm", "logit-scale", "tied"),
        layer_all_reduces=1,
        counting=_PARALLEL,
    ),
    Family(
        name="cohere2",
        model_class="Cohere2ForCausalLM",
        config_class="Cohere2Config",
        config=lambda d: _std(
            d, sliding_window=_window(d), layer_types=["sliding_attention", "full_attention"]
        ),
        attention="gqa",
        tags=("gqa", "parallel-block", "sliding-window", "logit-scale", "tied"),
        layer_all_reduces=1,
        counting=_PARALLEL,
    ),
    Family(
        name="olmo",
        model_class="OlmoForCausalLM",
        config_class="OlmoConfig",
        config=lambda d: _std(d, clip_qkv=8.0),
        attention="mha",
        tags=("non-parametric-norm", "clip-qkv", "swiglu", "untied"),
    ),
    Family(
        name="olmo2",
        model_class="Olmo2ForCausalLM",
        config_class="Olmo2Config",
        config=_std,
        attention="mha",
        tags=("whole-qk-norm", "post-norm", "swiglu", "untied"),
        layer_small_all_reduces=2,
        counting=_QKNORM,
    ),
    Family(
        name="starcoder2",
        model_class="Starcoder2ForCausalLM",
        config_class="Starcoder2Config",
        config=lambda d: _std(d, sliding_window=_window(d)),
        attention="gqa",
        tags=("gqa", "bias", "gelu-mlp", "sliding-window", "tied"),
    ),
    Family(
        name="granite",
        model_class="GraniteForCausalLM",
        config_class="GraniteConfig",
        config=lambda d: _std(
            d,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.015625,
            logits_scaling=8.0,
            tie_word_embeddings=True,
        ),
        attention="gqa",
        tags=("gqa", "multipliers", "swiglu", "tied"),
    ),
    Family(
        name="nemotron",
        model_class="NemotronForCausalLM",
        config_class="NemotronConfig",
        config=lambda d: _std(d, head_dim=d.head_dim, **_rope(0.5)),
        attention="gqa",
        tags=("gqa", "partial-rotary", "relu2", "layernorm1p", "untied"),
    ),
    Family(
        name="mixtral",
        model_class="MixtralForCausalLM",
        config_class="MixtralConfig",
        config=lambda d: _std(
            d,
            intermediate_size=d.expert_ffn,
            num_local_experts=d.experts,
            num_experts_per_tok=d.top_k,
        ),
        attention="gqa",
        tags=("moe", "gqa", "swiglu", "untied"),
        counting=_MOE,
    ),
    Family(
        name="qwen2_moe",
        model_class="Qwen2MoeForCausalLM",
        config_class="Qwen2MoeConfig",
        config=lambda d: _moe(d, shared_expert_intermediate_size=d.ffn),
        attention="gqa",
        tags=("moe", "shared-expert", "gqa", "qkv-bias", "untied"),
        counting=_MOE,
    ),
    Family(
        name="qwen3_moe",
        model_class="Qwen3MoeForCausalLM",
        config_class="Qwen3MoeConfig",
        config=lambda d: _moe(d, head_dim=d.head_dim),
        attention="gqa",
        tags=("moe", "gqa", "per-head-qk-norm", "untied"),
        counting=_MOE,
    ),
    Family(
        name="olmoe",
        model_class="OlmoeForCausalLM",
        config_class="OlmoeConfig",
        config=lambda d: _std(
            d, intermediate_size=d.expert_ffn, num_experts=d.experts, num_experts_per_tok=d.top_k
        ),
        attention="mha",
        tags=("moe", "whole-qk-norm", "untied"),
        layer_small_all_reduces=2,
        counting=_MOE + "; + 2 [b,s,1] for the whole q/k norm",
    ),
    Family(  # builds an all-ones padding mask on the input's device when none is given
        name="biogpt",
        model_class="BioGptForCausalLM",
        config_class="BioGptConfig",
        config=lambda d: dict(
            vocab_size=d.vocab,
            hidden_size=d.hidden,
            num_hidden_layers=d.layers,
            num_attention_heads=d.heads,
            intermediate_size=d.ffn,
            max_position_embeddings=d.seq,
        ),
        attention="mha",
        tags=("learned-pos", "padding-mask", "tied"),
    ),
)


# ---------------------------------------------------------------------------------------------
# More families, from one generic tiny config: every causal LM of the installed transformers
# that a user may bring, checked by verify alone (tests/test_zoo_more.py).

MORE = ("apertus", "arcee", "bitnet", "cohere2_moe", "diffllama", "doge",
        "ernie4_5", "ernie4_5_moe", "exaone4", "gemma3_text", "glm", "glm4", "glm4_moe",
        "gpt_neo", "gpt_oss", "granitemoe", "granitemoeshared", "helium", "hunyuan_v1_dense",
        "hunyuan_v1_moe", "internlm3", "lfm2", "llama4_text", "minimax", "ministral",
        "nanochat", "olmo3", "openai-gpt", "opt", "phimoe", "qwen3_5_text", "qwen3_next",
        "seed_oss", "smollm3", "vaultgemma", "xglm")  # fmt: skip

# The config keywords of a tiny model under every spelling families use; only the ones a
# family's config has are set (hidden 64, 2 layers, 4 heads, 2 KV heads, 4 experts, top-2).
_GENERIC = dict(vocab_size=128, hidden_size=64, intermediate_size=128, ffn_dim=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=64, num_experts=4, num_local_experts=4,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                n_shared_experts=1, shared_expert_intermediate_size=32, ffn_hidden_size=128,
                n_group=1, topk_group=1, first_k_dense_replace=1, moe_topk=2, layer_types=None,
                sliding_window=8, window_size=8, attention_types=[[["global", "local"], 1]],
                linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                use_cache=False)  # fmt: skip


def build_generic(model_type: str, seed: int = 0) -> tuple[nn.Module, tuple, dict]:
    """``(model, (ids,), {"labels": labels})`` of a tiny random ``model_type`` causal LM."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type)
    known = set(vars(cfg)) | set(getattr(cfg, "attribute_map", {}))
    cfg = transformers.AutoConfig.for_model(
        model_type, **{k: v for k, v in _GENERIC.items() if k in known}
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(3, 128, (2, 16), generator=g)
    labels = torch.randint(3, 128, (2, 16), generator=g)
    return model, (ids,), {"labels": labels}
