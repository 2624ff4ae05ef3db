"""Model shapes: the few numbers that price a transformer, and named presets.

A `ModelShape` describes a decoder-only transformer (GPT or Llama style, dense or MoE) by its
dimensions. Traced models are priced from their graph instead (`cost.graph`); named shapes let a
user price models far too large to trace here.

Parameter counts (per layer): attention h·(a+2g)·d + a·d·h (+ biases; d = h/a unless given),
MLP 2·h·f or 3·h·f when gated (SwiGLU), times E experts for MoE plus an h·E router; two norms.
Embedding V·h, LM head V·h unless tied.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost.errors import CostInputError


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Dimensions of a decoder-only transformer.

    `kv_heads` None means multi-head attention (g = a); `ffn` None means 4·h; `gated` selects a
    SwiGLU MLP (three matrices); `experts` > 1 makes every MLP a top-`top_k` MoE layer; `dropout`
    marks hidden/attention dropout layers (they cost memory traffic and saved masks);
    `head_size` the width d of one head where it is not h/a (Qwen3, Gemma: the query
    projection is a·d wide, the output projection a·d by h).
    """

    name: str = "custom"
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    kv_heads: int | None = None
    ffn: int | None = None
    gated: bool = False
    norm: str = "layernorm"
    dropout: bool = False
    biases: bool = False
    tied_embeddings: bool = False
    experts: int = 1
    top_k: int = 1
    head_size: int | None = None

    def __post_init__(self) -> None:
        dims = {"layers": self.layers, "hidden": self.hidden, "heads": self.heads,
                "seq": self.seq, "vocab": self.vocab, "kv_heads": self.g, "ffn": self.f,
                "experts": self.experts, "top_k": self.top_k}  # fmt: skip
        if self.head_size is not None:
            dims["head_size"] = self.head_size
        bad = [f"{k}={v}" for k, v in dims.items() if v < 1]
        if bad:
            raise CostInputError(f"model {self.name}: dimensions must be >= 1, got {bad}")
        if (self.hidden % self.heads and not self.head_size) or self.heads % self.g:
            raise CostInputError(
                f"model {self.name}: hidden ({self.hidden}) must divide by heads ({self.heads}) "
                f"(or give head_size) and heads by kv_heads ({self.g})"
            )
        if self.top_k > self.experts:
            raise CostInputError(f"model {self.name}: top_k {self.top_k} > experts {self.experts}")

    @property
    def g(self) -> int:
        return self.kv_heads or self.heads

    @property
    def f(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def attn_params(self) -> int:
        h, d = self.hidden, self.head_dim
        bias = (self.heads + 2 * self.g) * d + h if self.biases else 0
        return h * (self.heads + 2 * self.g) * d + self.heads * d * h + bias

    @property
    def expert_params(self) -> int:
        """Parameters of one expert's (or the dense) MLP."""
        mats = 3 if self.gated else 2
        bias = self.f + self.hidden if self.biases else 0
        return mats * self.hidden * self.f + bias

    @property
    def layer_params(self) -> int:
        """All parameters of one layer: attention, every expert, router, two norms."""
        norms = 2 * self.hidden * (2 if self.norm == "layernorm" else 1)
        router = self.hidden * self.experts if self.experts > 1 else 0
        return self.attn_params + self.experts * self.expert_params + router + norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters: layers, embedding, LM head unless tied, final norm."""
        head = 0 if self.tied_embeddings else self.embedding_params
        final_norm = self.hidden * (2 if self.norm == "layernorm" else 1)
        return self.layers * self.layer_params + self.embedding_params + head + final_norm

    @property
    def active_params(self) -> int:
        """The PaLM N: parameters a token multiplies by — every layer's active weights (top-k
        experts) and the LM head (tied or not), not the input embedding or final norm."""
        active_layer = self.layer_params - (self.experts - self.top_k) * self.expert_params
        return self.layers * active_layer + self.embedding_params

    def with_seq(self, seq: int) -> ModelShape:
        """The same model at another sequence length."""
        return replace(self, seq=seq)

    @staticmethod
    def gpt(*, layers: int, hidden: int, heads: int, seq: int, vocab: int,
            ffn: int | None = None, name: str = "gpt", dropout: bool = True) -> ModelShape:  # fmt: skip
        """GPT-2/3 / Megatron style: LayerNorm, biases, GeLU MLP of 4·h, dropout, MHA, tied
        input/output embeddings."""
        return ModelShape(name=name, layers=layers, hidden=hidden, heads=heads, seq=seq,
                          vocab=vocab, ffn=ffn, dropout=dropout, biases=True,
                          tied_embeddings=True)  # fmt: skip

    @staticmethod
    def llama(*, layers: int, hidden: int, heads: int, seq: int, vocab: int, kv_heads: int,
              ffn: int, experts: int = 1, top_k: int = 1, head_size: int | None = None,
              name: str = "llama") -> ModelShape:  # fmt: skip
        """Llama / Mixtral / Qwen3 style: RMSNorm, no biases, SwiGLU, GQA, untied embeddings."""
        return ModelShape(name=name, layers=layers, hidden=hidden, heads=heads, seq=seq,
                          vocab=vocab, kv_heads=kv_heads, ffn=ffn, gated=True, norm="rmsnorm",
                          experts=experts, top_k=top_k, head_size=head_size)  # fmt: skip

    @staticmethod
    def preset(name: str) -> ModelShape:
        """A named published shape (see `MODEL_PRESETS`)."""
        if name.lower() not in MODEL_PRESETS:
            raise CostInputError(
                f"unknown model preset {name!r}; known: {', '.join(sorted(MODEL_PRESETS))}. "
                "Use ModelShape.gpt(...) / ModelShape.llama(...) for other shapes."
            )
        return MODEL_PRESETS[name.lower()]


MODEL_PRESETS: dict[str, ModelShape] = {
    "gpt3-175b": ModelShape.gpt(
        name="gpt3-175b", layers=96, hidden=12288, heads=96, seq=2048, vocab=50257
    ),
    "llama3-8b": ModelShape.llama(
        name="llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=8192,
        vocab=128256,
    ),
    "llama3-70b": ModelShape.llama(
        name="llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, seq=8192,
        vocab=128256,
    ),
    "llama3-405b": ModelShape.llama(
        name="llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248,
        seq=8192, vocab=128256,
    ),
    "mixtral-8x7b": ModelShape.llama(
        name="mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=4096,
        vocab=32000, experts=8, top_k=2,
    ),
}  # fmt: skip
