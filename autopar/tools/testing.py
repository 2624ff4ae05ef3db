"""Small GPT-style and Llama-style models for tests, examples and benchmarks (random weights)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True, kw_only=True)
class Config:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 128
    vocab: int = 96
    seq: int = 16
    batch: int = 2
    bias: bool = True
    tied: bool = False
    fused_qkv: bool = False
    attention: str = "sdpa"  # or "unfused": softmax(q·kᵀ/√d + causal mask)·v, scores kept


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, c: Config) -> torch.Tensor:
    """Causal attention over [b, heads, s, d]: fused SDPA, or the unfused [s, s] score ops."""
    if c.attention == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    s = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


class GPTBlock(nn.Module):
    """Pre-LN block: LayerNorm, (fused or separate) QKV attention, GELU MLP."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        self.ln1 = nn.LayerNorm(c.hidden, bias=c.bias)
        if c.fused_qkv:
            self.qkv = nn.Linear(c.hidden, 3 * c.hidden, bias=c.bias)
        else:
            self.q = nn.Linear(c.hidden, c.hidden, bias=c.bias)
            self.k = nn.Linear(c.hidden, c.hidden, bias=c.bias)
            self.v = nn.Linear(c.hidden, c.hidden, bias=c.bias)
        self.proj = nn.Linear(c.hidden, c.hidden, bias=c.bias)
        self.ln2 = nn.LayerNorm(c.hidden, bias=c.bias)
        self.fc = nn.Linear(c.hidden, c.ffn, bias=c.bias)
        self.out = nn.Linear(c.ffn, c.hidden, bias=c.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        a = self.c.heads
        y = self.ln1(x)
        if self.c.fused_qkv:
            q, k, v = self.qkv(y).split(h, dim=-1)
        else:
            q, k, v = self.q(y), self.k(y), self.v(y)
        q, k, v = (t.view(b, s, a, h // a).transpose(1, 2) for t in (q, k, v))
        y = attend(q, k, v, self.c)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c.vocab, c.hidden)
        self.wpe = nn.Embedding(c.seq, c.hidden)
        self.blocks = nn.ModuleList(GPTBlock(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.hidden, bias=c.bias)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        if c.tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LlamaBlock(nn.Module):
    """RMSNorm, GQA attention with RoPE, SwiGLU MLP."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        d = c.hidden // c.heads
        self.attn_norm = RMSNorm(c.hidden)
        self.wq = nn.Linear(c.hidden, c.heads * d, bias=c.bias)
        self.wk = nn.Linear(c.hidden, c.kv_heads * d, bias=c.bias)
        self.wv = nn.Linear(c.hidden, c.kv_heads * d, bias=c.bias)
        self.wo = nn.Linear(c.heads * d, c.hidden, bias=False)
        self.mlp_norm = RMSNorm(c.hidden)
        self.w1 = nn.Linear(c.hidden, c.ffn, bias=False)
        self.w3 = nn.Linear(c.hidden, c.ffn, bias=False)
        self.w2 = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c, d = self.c, self.c.hidden // self.c.heads
        y = self.attn_norm(x)
        q = self.wq(y).view(b, s, c.heads, d).transpose(1, 2)
        k = self.wk(y).view(b, s, c.kv_heads, d).transpose(1, 2)
        v = self.wv(y).view(b, s, c.kv_heads, d).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = attend(q, k, v, c)
        x = x + self.wo(y.transpose(1, 2).reshape(b, s, c.heads * d))
        y = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.c = c
        d = c.hidden // c.heads
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(LlamaBlock(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)
        if c.tied:
            self.lm_head.weight = self.embed.weight
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = torch.arange(idx.shape[1], device=idx.device).float()
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed(idx)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(kind: str, c: Config, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = (GPT if kind == "gpt" else Llama)(c)
    for p in model.parameters():  # non-trivial norm weights and biases
        if p.dim() == 1:
            nn.init.normal_(p, mean=1.0 if p.shape[0] == c.hidden else 0.0, std=0.1)
    return model


def tokens(c: Config, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, c.vocab, (c.batch, c.seq), generator=g)
    y = torch.randint(0, c.vocab, (c.batch, c.seq), generator=g)
    return x, y


__all__ = [
    "MLP",
    "Config",
    "GPT",
    "GPTBlock",
    "Llama",
    "LlamaBlock",
    "build",
    "lm_loss",
    "rope",
    "tokens",
]


class MLP(nn.Module):
    """The smallest Megatron pair: column-split up-projection, row-split down-projection."""

    def __init__(self, d: int = 16, f: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(d, f)
        self.down = nn.Linear(f, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def hf_tiny_llama(layers: int, vocab: int = 128) -> torch.nn.Module:
    """A tiny HF LlamaForCausalLM (hidden 64, 4 heads, 2 KV heads), the same random weights on
    every process (seed 0); for the examples."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def token_batch(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch of token ids and their labels (HF shifts the labels inside the loss)."""
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, vocab, (batch, seq), generator=g),
            torch.randint(0, vocab, (batch, seq), generator=g))  # fmt: skip


def train_loop(loss_of: Callable[[], torch.Tensor], opt: torch.optim.Optimizer, steps: int,
               log: Callable[[str], None] = lambda _: None) -> list[float]:  # fmt: skip
    """``steps`` optimizer steps on ``loss_of()`` (forward, backward, step, zero); the losses."""
    losses = []
    for i in range(steps):
        loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        log(f"step {i + 1:2d}/{steps}  loss {losses[-1]:.6f}")
    return losses


def fsdp2_style_losses(model: torch.nn.Module, loss_of: Callable[[dict], torch.Tensor],
                       steps: int, lr: float, fp32: frozenset[str] = frozenset()) -> list[float]:  # fmt: skip
    """One device as FSDP2's MixedPrecisionPolicy(param_dtype=bf16) trains: each step the fp32
    master weights are cast to a bf16 copy (the names in ``fp32`` stay fp32: weights another
    cast takes from the master, e.g. torchao's float8 all-gather), forward and backward run on
    the copy (``loss_of(copy)``; the model's own code decides what it upcasts), the copy's
    gradients are cast to fp32 onto the masters, and AdamW steps the fp32 masters (its
    moments fp32)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        low = {n: p.detach().to(torch.float32 if n in fp32 else torch.bfloat16).requires_grad_()
               for n, p in model.named_parameters()}  # fmt: skip
        loss = loss_of(low)
        loss.backward()
        for n, p in model.named_parameters():
            p.grad = low[n].grad.float()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_hf_single(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, steps: int,
                    lr: float, weight_decay: float, log: Callable[[str], None]) -> list[float]:  # fmt: skip
    """``steps`` AdamW steps of an unmodified HF causal LM on one batch; the loss per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    return train_loop(lambda: model(ids, labels=labels).loss, opt, steps, log)


def optimizer_step(loss_of: Callable[[], torch.Tensor],
                   opt: torch.optim.Optimizer) -> Callable[[], float]:  # fmt: skip
    """A step function for benchmarks: forward, backward, optimizer step, zero; the loss."""

    def step() -> float:
        loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def slowest_rank_time(step: Callable[[], float]) -> tuple[float, float]:
    """One step's seconds on the slowest rank (after a barrier), and the step's loss."""
    import time

    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    loss = step()
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), loss


def spawn_ranks(rank_main: Callable[..., None], world: int) -> tuple[list[float], bool]:
    """Run ``rank_main(rank, port, results)`` on ``world`` spawned processes (each puts
    ``(rank, losses)`` on ``results``); rank 0's losses and whether every rank agrees."""
    from autopar.runtime.pool import free_port, rank_context, start_ranks

    results = rank_context().SimpleQueue()
    start_ranks(rank_main, (free_port(), results), world)
    per_rank = dict(results.get() for _ in range(world))
    agree = all(per_rank[r] == per_rank[0] for r in range(world))
    print(f"every rank returned rank 0's losses: {agree}", flush=True)
    return per_rank[0], agree


def run_rank_scripts(script: str, world: int, *args: str, timeout: float,
                     root: str | None = None) -> tuple[list[int], list[str]]:  # fmt: skip
    """Run ``script`` as ``world`` real processes, each as ``python script RANK PORT *args``
    would (its ``__main__`` block runs, one compute thread, ``root`` on the path), and return
    their exit codes and stderr; no process is left behind, whatever happened (a test of dying
    or hanging ranks needs processes the pool cannot give). The ranks are forked from
    ``start_ranks``'s server, which has the heavy modules imported: seconds saved per rank."""
    import tempfile
    import time
    from pathlib import Path

    from autopar.runtime.pool import free_port, rank_context, with_environment

    ctx, port = rank_context(), str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        logs = [str(Path(tmp) / f"rank{r}.err") for r in range(world)]
        procs = [ctx.Process(target=with_environment,
                             args=(r, dict(os.environ), _script_rank, script, port, args, root,
                                   log))
                 for r, log in enumerate(logs)]  # fmt: skip
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(deadline - time.monotonic(), 0.0))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        return [p.exitcode for p in procs], [Path(log).read_text() for log in logs]


def _script_rank(rank: int, script: str, port: str, args: tuple[str, ...], root: str | None,
                 log: str) -> None:  # fmt: skip
    """One rank of ``run_rank_scripts``: stderr into ``log``, stdout dropped, the path and
    argv as the interpreter sets them for ``python script RANK PORT *args``; then the script."""
    import runpy
    import sys

    for fd, path in ((2, log), (1, os.devnull)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ["OMP_NUM_THREADS"] = "1"
    sys.path[:0] = [os.path.dirname(os.path.abspath(script)), *([root] if root else [])]
    sys.argv = [script, str(rank), port, *args]
    runpy.run_path(script, run_name="__main__")


def compare_losses(
    single: list[float], parallel: list[float], label: str, tolerance: float
) -> bool:
    """Print two loss curves side by side with the relative difference per step; True when
    every step is within ``tolerance``."""
    print(f"\n{'step':>4}  {'single-device':>14}  {label:>18}  {'rel. diff':>9}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(single, parallel, strict=True), start=1):
        rel = abs(a - b) / abs(a)
        worst = max(worst, rel)
        print(f"{step:>4}  {a:>14.8f}  {b:>18.8f}  {rel:>9.2e}")
    ok = worst <= tolerance
    print(f"max relative difference {worst:.2e} ({'within' if ok else 'EXCEEDS'} {tolerance:g})")
    return ok


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """A reference MoE language model: embedding, ``layers`` x (RMS norm, routed experts over
    stacked weights, optional shared expert, residual), head."""

    layers: int = 2
    hidden: int = 32
    expert_ffn: int = 16
    experts: int = 4
    top_k: int = 2
    vocab: int = 64
    seq: int = 8
    batch: int = 4
    sigmoid: bool = False  # DeepSeek-V3 routing: sigmoid scores, a bias that picks, not weighs
    shared: bool = False
    capacity: int = 0  # > 0: keep the first `capacity` rows of each expert (one-device rule)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]`` (HF transformers' exportable op;
    MoEBlock imports its module before any trace: transformers imported while torch.export
    runs leaves its output classes unregistered as pytrees)."""
    return torch.ops.transformers.grouped_mm_fallback(x, w, offs)


class MoEBlock(nn.Module):
    """Router -> top-k -> rows grouped by expert -> grouped SwiGLU -> weighted combine."""

    def __init__(self, c: MoEConfig) -> None:
        import transformers.integrations.moe  # noqa: F401 - registers grouped_mm_fallback

        super().__init__()
        self.c = c
        self.norm = RMSNorm(c.hidden)
        self.router = nn.Linear(c.hidden, c.experts, bias=False)
        if c.sigmoid:
            self.score_bias = nn.Parameter(0.1 * torch.randn(c.experts), requires_grad=False)
        self.gate_up = nn.Parameter(torch.randn(c.experts, 2 * c.expert_ffn, c.hidden) / c.hidden**0.5)
        self.down = nn.Parameter(torch.randn(c.experts, c.hidden, c.expert_ffn) / c.expert_ffn**0.5)
        self.shared = MLP(c.hidden, 2 * c.expert_ffn) if c.shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.c
        flat = self.norm(x).reshape(-1, c.hidden)
        logits = self.router(flat)
        if c.sigmoid:
            scores = torch.sigmoid(logits)
            experts = torch.topk(scores + self.score_bias, c.top_k).indices
            weights = scores.gather(1, experts)
        else:
            weights, experts = torch.topk(F.softmax(logits, dim=-1), c.top_k)
        if c.top_k > 1:  # top-1 keeps the raw score (Switch): normalised it would be 1
            weights = weights / weights.sum(-1, keepdim=True)
        ids, perm = torch.sort(experts.reshape(-1), stable=True)
        rows = flat[perm // c.top_k]
        counts = torch.histc(ids.float(), bins=c.experts, min=0, max=c.experts - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = grouped_mm(rows, self.gate_up.transpose(-2, -1), offs).chunk(2, -1)
        out = grouped_mm(F.silu(gate) * up, self.down.transpose(-2, -1), offs)
        if c.capacity:
            out = out * keep_mask(counts, c.capacity).unsqueeze(-1)
        out = out * weights.reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel())
        moe = out[inv].view(-1, c.top_k, c.hidden).sum(1).view_as(x)
        return x + moe + (self.shared(flat).view_as(x) if self.shared is not None else 0)


def keep_mask(counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """1 for the first ``capacity`` rows of each expert's group, 0 for the dropped ones."""
    starts = torch.cumsum(counts, 0) - counts
    ids = torch.repeat_interleave(torch.arange(counts.numel()), counts.long())
    pos = torch.arange(ids.numel()) - starts.long()[ids]
    return (pos < capacity).float()


class MoEModel(nn.Module):
    """Embedding, ``c.layers`` MoE blocks (``block(c)``, default :class:`MoEBlock`), head."""

    def __init__(self, c: Any, block: Callable[[Any], nn.Module] | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList((block or MoEBlock)(c) for _ in range(c.layers))
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_moe(c: Any, seed: int = 0, block: Callable[[Any], nn.Module] | None = None) -> MoEModel:
    """A seeded :class:`MoEModel` whose blocks' norm weights are drawn around 1."""
    torch.manual_seed(seed)
    model = MoEModel(c, block)
    for block in model.blocks:
        nn.init.normal_(block.norm.weight, mean=1.0, std=0.1)
    return model


def train_pipeline_rank(rank: int, groups: dict, share: Any, x: torch.Tensor, y: torch.Tensor,
                        zero: int, steps: int, lr: float) -> tuple:  # fmt: skip
    """A worker-pool job: ``steps`` AdamW steps of one pipeline rank (under DDP / FSDP2 when
    the mesh has dp).  Returns the losses, the dtypes matrix products saw, the dtype and bytes
    of what a stage module that is not the last returned per micro-batch (what it sends on),
    and the dtypes of the parameters, gradients and Adam moments."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.ops import collectives
    from autopar.runtime import DataAxis, PipelineRunner

    seen: set[str] = set()

    class Matmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm,
                                       torch.ops.aten.bmm):  # fmt: skip
                seen.update(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
            return func(*args, **(kwargs or {}))

    collectives.bind({a: g for a, g in groups.items() if a != "dp"})
    data = None
    if "dp" in groups:
        dp_mesh = DeviceMesh.from_group(groups["dp"], "cpu", mesh_dim_names=("dp",))
        data = DataAxis(group=groups["dp"], mesh=dp_mesh, zero=zero, reduction="mean")
    runner = PipelineRunner(share, groups["pp"], data=data)
    sent: list = []
    for s, m in runner.modules.items():
        if s < share.n_stages - 1:
            m.register_forward_hook(lambda mod, i, out: sent.append(
                [(str(t.dtype), t.numel() * t.element_size()) for t in out]))
    opt = runner.optimizer(torch.optim.AdamW, lr=lr)
    losses, grads = [], set()
    for _ in range(steps):
        with Matmuls():
            loss = runner.step(x, y)
        grads = {str(p.grad.dtype) for p in runner.parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params, moments = state_dtypes(opt, runner.parameters())
    return losses, seen, sent[-1] if sent else None, (params, grads, moments)


def state_dtypes(opt: Any, parameters: Any) -> tuple[set[str], set[str]]:
    """The dtypes of ``parameters`` and of the optimizer's moments (non-scalar state; a
    wrapping optimizer's ``.optim`` is looked through)."""
    state = getattr(opt, "optim", opt).state.values()
    moments = {str(t.dtype) for s in state for t in s.values() if t.dim()}
    return {str(p.dtype) for p in parameters}, moments
