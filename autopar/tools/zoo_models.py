"""Models that are not causal LMs (issue 20.5): a registry and one check per model.

Each entry builds a model with random weights (nothing is downloaded) and trains it with the
model's own loss: Hugging Face models from a config (``labels=``): an image classifier (ViT),
encoder classifiers (BERT, DistilBERT) and encoder-decoders (T5, BART); litgpt's models from
its own config registry (:class:`LitGPT`: Gemma-2, next-token cross-entropy); and plain modules
written here: a diffusion transformer (:class:`DiT`, noise-prediction MSE).

Algorithm of :func:`check` (one row of the table):
1. Build the tiny config on the CPU and ``verify`` it at ``Mesh(tp=t)`` on the Gloo pool:
   max relative error over the loss, the outputs and every parameter gradient.
2. Build the realistic config (ViT-B / BERT-base widths: hidden 768, 12 heads, 2 layers) on the
   meta device and ``autoparallelize`` it with ``param_dtype=torch.bfloat16``.
3. Read its forward collectives (zoo.forward_collectives, with :func:`tokens`: messages of at
   most 2 elements per token print in lower case) and count the weight all-gathers:
   forward all-gathers of a value that reads a parameter through views and casts only
   (Megatron gathers none).
4. Rank 0's share of the layers' parameter bytes (zoo.layer_param_fraction; ideally 1/t).
Each step's exception is caught into the row with a one-line reason.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.api import autoparallelize
from autopar.mesh import Mesh
from autopar.program import Program
from autopar.tools import zoo


@dataclass(frozen=True, kw_only=True)
class Model:
    """One non-causal-LM model of the installed transformers."""

    name: str
    model_class: str  # a transformers class, or '' for ``module``
    config_class: str
    config: Callable[[str], dict[str, Any]]  # config keywords at 'tiny' or 'realistic'
    module: Callable[..., nn.Module] | None = None  # built from the config keywords instead
    inputs: Callable[[str, Any, torch.Generator], tuple[tuple, dict]]  # (args, kwargs)
    tags: tuple[str, ...]
    requires: tuple[str, ...] = ("transformers",)  # packages the build imports


@dataclass(frozen=True, kw_only=True)
class Row:
    """One model at one tensor-parallel degree (see the module docstring)."""

    model: str
    tp: int
    verify_error: float | None
    verify_reason: str  # '' when verify passed
    comm: zoo.Comm | None
    weight_gathers: tuple[str, ...]  # 'AG[768,3,16,16]@where' per weight all-gather
    comm_reason: str
    param_fraction: float | None
    seconds: float

    @property
    def ok(self) -> bool:
        frac_ok = self.param_fraction is not None and abs(self.param_fraction * self.tp - 1) < 0.1
        return (not self.verify_reason and self.comm is not None and not self.weight_gathers
                and frac_ok)  # fmt: skip


_SIZES = {"tiny": dict(hidden=64, heads=4, ffn=128, vocab=128, seq=16, batch=2, image=32,
                       patch=8, latent=16, latent_patch=4),
          "realistic": dict(hidden=768, heads=12, ffn=3072, vocab=32000, seq=512, batch=4,
                            image=224, patch=16, latent=32, latent_patch=2)}  # fmt: skip


def _timestep_frequencies(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """[b] timesteps -> [b, dim] cosines and sines at geometric frequencies (transformer
    positions, for diffusion time)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device) / half)
    angles = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=-1)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    """A transformer block conditioned by adaLN-Zero: SiLU + Linear(c) -> 6 vectors (shift,
    scale, gate for attention and for the MLP), LayerNorms without affine, gated residuals."""

    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, n, h = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, h))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(c).chunk(6, dim=1)
        x = x + gate1.unsqueeze(1) * self.attention(_modulate(self.norm1(x), shift1, scale1))
        mlp = self.fc2(F.gelu(self.fc1(_modulate(self.norm2(x), shift2, scale2)), approximate="tanh"))
        return x + gate2.unsqueeze(1) * mlp


class DiT(nn.Module):
    """A class-conditional diffusion transformer on latents [b, c, s, s] (Peebles & Xie's DiT):
    conv2d patchify + fixed 2-D sine-cosine positions, timestep embedding (frequencies ->
    MLP) plus label embedding as the condition, adaLN-Zero blocks, a modulated final layer,
    unpatchify; ``forward(x, t, y, target)`` returns the noise prediction's MSE.

    Weights keep PyTorch's default initialisation (DiT zeroes the modulation and output
    layers, which would make most gradients zero and a verify vacuous).
    """

    def __init__(self, *, latent: int, patch: int, channels: int, hidden: int, heads: int,
                 ffn: int, layers: int, classes: int, freq_dim: int = 256) -> None:  # fmt: skip
        super().__init__()
        self.patch, self.channels, self.freq_dim, self.grid = patch, channels, freq_dim, latent // patch
        self.patchify = nn.Conv2d(channels, hidden, patch, stride=patch)
        self.register_buffer("pos", self._positions(self.grid, hidden), persistent=False)
        self.time = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.label = nn.Embedding(classes, hidden)
        self.blocks = nn.ModuleList(DiTBlock(hidden, heads, ffn) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden))
        self.out = nn.Linear(hidden, patch * patch * channels)

    @staticmethod
    def _positions(grid: int, hidden: int) -> torch.Tensor:
        """[1, grid*grid, hidden]: half the channels encode the row, half the column."""
        axis = torch.arange(grid, dtype=torch.float32)
        rows, cols = torch.meshgrid(axis, axis, indexing="ij")
        quarter = hidden // 4
        freqs = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float32) / quarter)
        parts = [f(pos.reshape(-1, 1) * freqs) for pos in (rows, cols) for f in (torch.sin, torch.cos)]
        return torch.cat(parts, dim=1).unsqueeze(0)

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:  # fmt: skip
        b = x.shape[0]
        tokens = self.patchify(x).flatten(2).transpose(1, 2) + self.pos
        c = self.time(_timestep_frequencies(t, self.freq_dim)) + self.label(y)
        for block in self.blocks:
            tokens = block(tokens, c)
        shift, scale = self.final_modulation(c).chunk(2, dim=1)
        patches = self.out(_modulate(self.norm(tokens), shift, scale))
        g, p = self.grid, self.patch
        image = patches.reshape(b, g, g, p, p, self.channels).permute(0, 5, 1, 3, 2, 4)
        return F.mse_loss(image.reshape(b, self.channels, g * p, g * p), target)


class LitGPT(nn.Module):
    """litgpt's ``GPT`` from its config registry, ``Config.from_name(name, **overrides)`` (the
    named model's architecture flags kept, the sizes overridden), trained by next-token
    cross-entropy: ``forward(idx, targets)`` returns the mean loss over ``[b, s]`` tokens.
    litgpt's training forward (no ``input_pos``: no KV cache; its rope tables are buffers made
    for ``block_size``)."""

    def __init__(self, name: str, **overrides: Any) -> None:
        super().__init__()
        from litgpt.config import Config
        from litgpt.model import GPT

        self.gpt = GPT(Config.from_name(name, **overrides))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.gpt(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _gemma2(size: str) -> dict[str, Any]:
    """litgpt's Gemma-2 (local sliding-window and global layers alternating, attention-logit
    and final-logit softcapping, post-attention and post-MLP RMSNorms, GQA, GeGLU MLP, scaled
    embeddings). Tiny: the registry's widths with 2 K/V groups of 2 query heads; realistic:
    gemma-2-2b's own (h 2304, 8 heads of 256, 4 K/V groups, ffn 9216) but the registry's
    vocabulary. Two layers, one of each kind; the window is half the sequence so the local
    mask cuts."""
    d = _SIZES[size]
    shape = dict(n_layer=2, block_size=d["seq"], sliding_window_size=d["seq"] // 2,
                 sliding_window_indices=[1, 0], vocab_size=d["vocab"],
                 padded_vocab_size=d["vocab"])  # fmt: skip
    if size == "tiny":
        shape |= dict(n_embd=d["hidden"], n_head=d["heads"], n_query_groups=d["heads"] // 2,
                      head_size=d["hidden"] // d["heads"],
                      attention_scores_scalar=d["hidden"] // d["heads"],
                      intermediate_size=d["ffn"])  # fmt: skip
    return dict(name="gemma-2-2b", **shape)


def _bert(size: str) -> dict[str, Any]:
    d = _SIZES[size]
    return dict(vocab_size=d["vocab"], hidden_size=d["hidden"], num_hidden_layers=2,
                num_attention_heads=d["heads"], intermediate_size=d["ffn"],
                max_position_embeddings=d["seq"], num_labels=4)  # fmt: skip


def _distilbert(size: str) -> dict[str, Any]:
    d = _SIZES[size]
    return dict(vocab_size=d["vocab"], dim=d["hidden"], n_layers=2, n_heads=d["heads"],
                hidden_dim=d["ffn"], max_position_embeddings=d["seq"], num_labels=4)  # fmt: skip


def _vit(size: str) -> dict[str, Any]:
    d = _SIZES[size]
    return dict(hidden_size=d["hidden"], num_hidden_layers=2, num_attention_heads=d["heads"],
                intermediate_size=d["ffn"], image_size=d["image"], patch_size=d["patch"],
                num_labels=10)  # fmt: skip


def _t5(size: str) -> dict[str, Any]:
    d = _SIZES[size]
    return dict(vocab_size=d["vocab"], d_model=d["hidden"], d_kv=d["hidden"] // d["heads"],
                d_ff=d["ffn"], num_layers=2, num_decoder_layers=2, num_heads=d["heads"],
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip


def _bart(size: str) -> dict[str, Any]:
    d = _SIZES[size]
    return dict(vocab_size=d["vocab"], d_model=d["hidden"], encoder_layers=2, decoder_layers=2,
                encoder_attention_heads=d["heads"], decoder_attention_heads=d["heads"],
                encoder_ffn_dim=d["ffn"], decoder_ffn_dim=d["ffn"],
                max_position_embeddings=d["seq"], pad_token_id=1, bos_token_id=0,
                eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)  # fmt: skip


def _dit(size: str) -> dict[str, Any]:
    d = _SIZES[size]
    return dict(latent=d["latent"], patch=d["latent_patch"], channels=4, hidden=d["hidden"],
                heads=d["heads"], ffn=d["ffn"], layers=2, classes=10)  # fmt: skip


def _denoise(size: str, device: Any, g: torch.Generator) -> tuple[tuple, dict]:
    d = _SIZES[size]
    shape = (d["batch"], 4, d["latent"], d["latent"])
    x, noise = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    t = torch.randint(0, 1000, (d["batch"],), generator=g)
    y = torch.randint(0, 10, (d["batch"],), generator=g)
    return (x.to(device), t.to(device), y.to(device)), {"target": noise.to(device)}


def _next_token(size: str, device: Any, g: torch.Generator) -> tuple[tuple, dict]:
    d = _SIZES[size]
    ids, targets = (torch.randint(0, d["vocab"], (d["batch"], d["seq"]), generator=g) for _ in "it")
    return (ids.to(device),), {"targets": targets.to(device)}


def _text_cls(size: str, device: Any, g: torch.Generator) -> tuple[tuple, dict]:
    d = _SIZES[size]
    ids = torch.randint(3, d["vocab"], (d["batch"], d["seq"]), generator=g).to(device)
    return (ids,), {"labels": torch.randint(0, 4, (d["batch"],), generator=g).to(device)}


def _image_cls(size: str, device: Any, g: torch.Generator) -> tuple[tuple, dict]:
    d = _SIZES[size]
    pixels = torch.randn(d["batch"], 3, d["image"], d["image"], generator=g).to(device)
    return (pixels,), {"labels": torch.randint(0, 10, (d["batch"],), generator=g).to(device)}


def _seq2seq(size: str, device: Any, g: torch.Generator) -> tuple[tuple, dict]:
    d = _SIZES[size]
    ids = torch.randint(3, d["vocab"], (d["batch"], d["seq"]), generator=g).to(device)
    labels = torch.randint(3, d["vocab"], (d["batch"], d["seq"]), generator=g).to(device)
    return (ids,), {"labels": labels}


_MODELS: tuple[Model, ...] = (
    Model(name="hf_vit", model_class="ViTForImageClassification", config_class="ViTConfig",
          config=_vit, inputs=_image_cls, tags=("vision", "conv-patch", "cls-token", "head")),
    Model(name="hf_bert_cls", model_class="BertForSequenceClassification",
          config_class="BertConfig", config=_bert, inputs=_text_cls,
          tags=("encoder", "pooler", "head")),
    Model(name="hf_distilbert_cls", model_class="DistilBertForSequenceClassification",
          config_class="DistilBertConfig", config=_distilbert, inputs=_text_cls,
          tags=("encoder", "head")),
    Model(name="hf_t5", model_class="T5ForConditionalGeneration", config_class="T5Config",
          config=_t5, inputs=_seq2seq, tags=("encoder-decoder", "cross-attention", "rel-bias")),
    Model(name="hf_bart", model_class="BartForConditionalGeneration", config_class="BartConfig",
          config=_bart, inputs=_seq2seq, tags=("encoder-decoder", "cross-attention")),
    Model(name="dit", model_class="", config_class="", config=_dit, inputs=_denoise,
          module=DiT, tags=("vision", "diffusion", "conv-patch", "adaln", "mse"), requires=()),
    Model(name="litgpt_gemma2", model_class="", config_class="", config=_gemma2,
          inputs=_next_token, module=LitGPT, requires=("litgpt",),
          tags=("litgpt", "decoder", "sliding-window", "softcap", "gqa", "post-norm")),
)  # fmt: skip


def models() -> list[Model]:
    """The registry."""
    return list(_MODELS)


def model(name: str) -> Model:
    """The registry entry called ``name``."""
    for m in _MODELS:
        if m.name == name:
            return m
    raise KeyError(f"no model {name!r}; known: {', '.join(m.name for m in _MODELS)}")


def build(entry: Model, size: str = "tiny", device: str = "cpu",
          seed: int = 0) -> tuple[nn.Module, tuple, dict]:  # fmt: skip
    """``(model, args, kwargs)`` in eval mode; on the CPU 1-D parameters get random values."""
    if size not in _SIZES:
        raise ValueError(f"size must be 'tiny' or 'realistic', not {size!r}")
    torch.manual_seed(seed)
    if entry.module is not None:
        with torch.device(device):
            net = entry.module(**entry.config(size))
    else:
        import transformers

        cfg = getattr(transformers, entry.config_class)(**entry.config(size), use_cache=False)
        with torch.device(device):
            net = getattr(transformers, entry.model_class)(cfg)
    net.eval()
    if device != "meta":
        with torch.no_grad():
            for p in net.parameters():
                if p.dim() == 1:
                    p.add_(0.1 * torch.randn_like(p))
    args, kwargs = entry.inputs(size, device, torch.Generator().manual_seed(seed + 1))
    return net, args, kwargs


def tokens(entry: Model, size: str = "realistic") -> int:
    """Batch times sequence length of the realistic build: image patches for vision models
    (the zoo reads ``[b, s]`` off the first input, which is an image here)."""
    d = _SIZES[size]
    if "diffusion" in entry.tags:
        return d["batch"] * (d["latent"] // d["latent_patch"]) ** 2
    if "vision" in entry.tags:
        return d["batch"] * ((d["image"] // d["patch"]) ** 2 + 1)  # + the class token
    return d["batch"] * d["seq"]


_READS = {"view", "reshape", "t", "transpose", "permute", "_to_copy", "to", "alias", "clone",
          "contiguous", "unsqueeze", "squeeze", "expand", "numpy_T", "mT", "swapaxes",
          "swapdims", "movedim", "moveaxis"}  # ops that only move a value


def weight_gathers(prog: Program) -> tuple[str, ...]:
    """Forward all-gathers of a parameter (module docstring, 3): the plan's forward all-gather
    messages of the shape of a gathered value that reads a parameter placeholder through
    views and casts only (an activation that happens to share a weight's shape, BERT's pooled
    [b, h] beside a [labels, h] classifier at b = labels, is not one)."""
    from autopar.ops import collectives

    gathered = {tuple(n.meta["val"].shape) for st in prog.stages
                for n in st.graph_module.graph.nodes
                if n.target is collectives.all_gather
                and _reads_parameter(n.args[0], st.traced.params)}  # fmt: skip
    return tuple(f"AG[{','.join(map(str, c.shape))}]@{c.where or '<top>'}"
                 for c in prog.collectives()
                 if c.direction == "fwd" and c.kind == "all_gather"
                 and tuple(c.shape) in gathered)  # fmt: skip


def _reads_parameter(node: Any, params: dict[str, str]) -> bool:
    while getattr(node, "op", None) == "call_function" and node.args and (
            getattr(node.target, "__name__", "").split(".")[0] in _READS):  # fmt: skip
        node = node.args[0]
    return getattr(node, "op", None) == "placeholder" and node.name in params


def check(entry: Model, tp: int = 2, run_verify: bool = True) -> Row:
    """One row of the table (module docstring, steps 1-4); never raises."""
    from autopar.verify import verify

    start = time.perf_counter()
    error, verify_reason = None, "not run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if run_verify:
            try:
                net, args, kwargs = build(entry, "tiny")
                report = verify(net, Mesh(tp=tp), args, None, example_kwargs=kwargs)
                error = report.max_rel_error
                verify_reason = "" if report.ok else zoo._worst(report)
            except Exception as exc:  # noqa: BLE001 - reported in the row
                verify_reason = zoo._one_line(exc)
        comm, gathers, comm_reason, frac = None, (), "", None
        try:
            net, args, kwargs = build(entry, "realistic", device="meta")
            prog = autoparallelize(net, Mesh(tp=tp), args, None, example_kwargs=kwargs,
                                   param_dtype=torch.bfloat16)  # fmt: skip
            comm = dataclasses.replace(zoo.forward_collectives(prog), tokens=tokens(entry))
            gathers = weight_gathers(prog)
            frac = zoo.layer_param_fraction(prog)
        except Exception as exc:  # noqa: BLE001 - reported in the row
            comm_reason = zoo._one_line(exc)
    return Row(model=entry.name, tp=tp, verify_error=error, verify_reason=verify_reason,
               comm=comm, weight_gathers=gathers, comm_reason=comm_reason,
               param_fraction=frac, seconds=time.perf_counter() - start)  # fmt: skip


def table(rows: list[Row]) -> str:
    """One line per row, then the weight all-gathers and failure reasons."""
    lines = [f"{'model':<20} {'tp':>2} {'verify err':>10} {'fwd collectives':<22} "
             f"{'weight AG':>9} {'L0 share':>8} {'s':>5}"]  # fmt: skip
    for r in rows:
        err = f"{r.verify_error:.1e}" if r.verify_error is not None else "-"
        comm = r.comm.summary() if r.comm is not None else "-"
        frac = f"{r.param_fraction:.3f}" if r.param_fraction is not None else "-"
        lines.append(f"{r.model:<20} {r.tp:>2} {err:>10} {comm:<22} {len(r.weight_gathers):>9} "
                     f"{frac:>8} {r.seconds:>5.0f}")  # fmt: skip
    for r in rows:
        for why in (r.verify_reason, r.comm_reason):
            if why and why != "not run":
                lines.append(f"  {r.model} tp={r.tp}: {why}")
        if r.weight_gathers:
            lines.append(f"  {r.model} tp={r.tp} weight gathers: {', '.join(r.weight_gathers)}")
    return "\n".join(lines)
