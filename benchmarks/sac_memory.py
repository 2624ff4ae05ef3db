"""What torchtitan's op-level selective recompute saves, eager vs torch.compile, measured.

A stack of torchtitan-style Llama blocks (eager RMSNorm with fp32 copies, complex rotary,
SDPA, SwiGLU) at Llama-3 8B's proportions scaled down 8x (h 512, 4 heads of 128, 1 K/V head,
ffn 1792, batch 2), each checkpointed with torchtitan's policy (save mm outputs but every
second one, and SDPA's; recompute the rest), runs one forward and backward on the CPU, eager
and with each block under torch.compile. From the profiler's allocation events: the live
bytes at the end of forward (the saved set; two depths give the bytes a layer saves) and the
backward's peak above that. Printed next to `cost.workload.activation_bytes` for the same
shape, eager and compiled.

Algorithm:
1. Build L blocks; wrap each in `torch.utils.checkpoint` with the selective policy; compile
   each (compiled run) or not (eager run). Two warm-up steps.
2. Profile one step with `profile_memory=True`; order the [memory] events; the running sum at
   a marker between forward and backward is the saved set, its maximum the peak.
3. Repeat at two depths: the difference over the layers is the bytes one layer saves a token.

Run: PYTHONPATH=. python benchmarks/sac_memory.py   (about 5 minutes on 2 cores)
"""

from __future__ import annotations

import collections

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

H, HEADS, KV, HD, FF, B, S = 512, 4, 1, 128, 1792, 2, 1024
DT = torch.bfloat16
aten = torch.ops.aten
SAVE = {aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default}  # fmt: skip


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d, dtype=DT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x) * self.w


def _rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        lin = lambda i, o: nn.Linear(i, o, bias=False, dtype=DT)  # noqa: E731
        self.n1, self.n2 = RMSNorm(H), RMSNorm(H)
        self.wq, self.wk, self.wv = lin(H, HEADS * HD), lin(H, KV * HD), lin(H, KV * HD)
        self.wo, self.w1, self.w3, self.w2 = lin(HEADS * HD, H), lin(H, FF), lin(H, FF), lin(FF, H)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.n1(x)
        q = _rope(self.wq(h).view(b, s, HEADS, HD), freqs)
        k = _rope(self.wk(h).view(b, s, KV, HD), freqs).repeat_interleave(HEADS // KV, dim=2)
        v = self.wv(h).view(b, s, KV, HD).repeat_interleave(HEADS // KV, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)  # fmt: skip
        x = x + self.wo(o.transpose(1, 2).contiguous().view(b, s, -1))
        g = self.n2(x)
        return x + self.w2(F.silu(self.w1(g)) * self.w3(g))


def _policy():
    """torchtitan's op-level policy (parallelize_llama.py @9dec370 `_get_custom_policy`)."""
    count = collections.defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == aten.mm.default:
            count[mode] += 1
        save = func in SAVE and not (func == aten.mm.default and count[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Checkpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, freqs, use_reentrant=False, context_fn=_policy,
                          preserve_rng_state=False)  # fmt: skip


def measure(layers: int, compiled: bool) -> tuple[int, int]:
    """(live bytes at the end of forward, the backward's peak) of one step (steps 1-2)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    blocks = [Checkpointed(Block()) for _ in range(layers)]
    if compiled:
        blocks = [torch.compile(b) for b in blocks]
    freqs = torch.polar(torch.ones(S, HD // 2), torch.randn(S, HD // 2)).view(1, S, 1, HD // 2)
    x0 = torch.randn(B, S, H, dtype=DT, requires_grad=True)

    def step() -> None:
        x = x0
        for block in blocks:
            x = block(x, freqs)
        loss = x.float().pow(2).mean()
        with record_function("BACKWARD"):
            pass
        loss.backward()

    step(), step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = list(prof.profiler.kineto_results.events())
    mark = next(e.start_ns() for e in events if e.name() == "BACKWARD")
    allocs = sorted((e.start_ns(), e.nbytes()) for e in events
                    if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = peak = 0
    saved = None
    for t, nbytes in allocs:
        if saved is None and t >= mark:
            saved = live
        live += nbytes
        peak = max(peak, live)
    return saved, peak


def main() -> None:
    from dataclasses import replace

    from cost.config import ParallelConfig
    from cost.model import ModelShape
    from cost.workload import activation_bytes

    shape = ModelShape.llama(name="8b/8", layers=2, hidden=H, heads=HEADS, kv_heads=KV, ffn=FF,
                             seq=S, vocab=1000)  # fmt: skip
    cfg = ParallelConfig(global_batch=B, micro_batch=B, recompute="selective",
                         selective="matmuls")  # fmt: skip
    tokens = B * S
    print(f"h {H}, {HEADS} heads x {HD}, {KV} K/V head, ffn {FF}, {tokens} tokens; bytes a token")
    print(f"{'run':8s} {'saved a layer':>14s} {'model':>8s} {'backward above saved':>22s}")
    for compiled in (False, True):
        (s2, p2), (s4, _) = measure(2, compiled), measure(4, compiled)
        per_layer = (s4 - s2) / 2 / tokens
        kernels = "fused" if compiled else "eager"
        model = activation_bytes(shape, replace(cfg, kernels=kernels), B)["selective"] / tokens
        print(f"{'compile' if compiled else 'eager':8s} {per_layer:14.0f} {model:8.0f} "
              f"{(p2 - s2) / tokens:22.0f}")


if __name__ == "__main__":
    main()
