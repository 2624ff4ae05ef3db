"""Forward communication of GPT-OSS's MoE and DeepSeek's MLA under tp, next to Megatron's.

    python benchmarks/moe_mla_layouts.py [--only gpt-oss mla]

Both are built from transformers configs on the meta device (nothing runs, nothing downloads)
and compiled with ``param_dtype=torch.bfloat16``.  Per row: the forward collectives of layer 0
(upper case: larger than 2 values a token), their bytes, and the hand design's.
- GPT-OSS (interleaved gate / up columns, clamped SwiGLU, per-expert biases, a biased router)
  at tp 2 / 4 (h 2048, 32 / 8 heads) and 8 (h 4096, 32 / 4 heads), b 4, s 2048: the hand
  design is Megatron's 2 [b,s,h] all-reduce equivalents a layer (AG + RS of attention, AG + RS
  of the MoE half).
- DeepSeek-V3's multi-head latent attention (q_lora 1536, kv_lora 512, rope 64, nope 128,
  v 128; the MLPs dense) at DeepSeek-V3's width (h 7168, 128 heads, tp=8) and a V2-Lite-like
  one (h 2048, 16 heads, tp=2), b 1, s 4096: Megatron's layout gathers the input [b,s,h] for
  the replicated compressions and reduce-scatters o_proj (AG + RS of [b,s,h]).
"""

from __future__ import annotations

import argparse
import logging
import warnings

import torch

from autopar import Mesh, autoparallelize


def _compiled(cls: type, cfg: object, b: int, s: int, tp: int):
    """``cls(cfg)`` on the meta device, compiled for Mesh(tp=tp) at [b, s] tokens in bf16."""
    with torch.device("meta"):
        model = cls(cfg)
    ids = torch.zeros(b, s, dtype=torch.long, device="meta")
    return autoparallelize(model, Mesh(tp=tp), (ids,), example_kwargs={"labels": ids},
                           param_dtype=torch.bfloat16)  # fmt: skip


def _layer0(prog) -> tuple[str, float]:
    found = [c for c in prog.collectives() if c.direction == "fwd" and ".layers.0." in c.where]
    cells = [f"{c.kind}{list(c.shape)}@{c.where.split('layers.0.')[-1]}" for c in found]
    return ", ".join(cells), sum(c.bytes for c in found) / 2**20


def gpt_oss(tp: int) -> str:
    import transformers

    h, heads, kv = (2048, 32, 8) if tp < 8 else (4096, 32, 4)
    cfg = transformers.GptOssConfig(
        vocab_size=32000, hidden_size=h, intermediate_size=h, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=h // heads,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
        max_position_embeddings=4096, use_cache=False,
        layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    b, s = 4, 2048
    prog = _compiled(transformers.GptOssForCausalLM, cfg, b, s, tp)
    cells, mib = _layer0(prog)
    hand = 4 * b * s * h * 2 / 2**20  # AG + RS of [b,s,h] twice, bf16
    return f"GPT-OSS h {h} tp={tp}: {mib:.1f} MiB (hand {hand:.1f}): {cells}"


def mla(h: int, heads: int, tp: int) -> str:
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=32000, hidden_size=h, intermediate_size=4 * h, moe_intermediate_size=h // 2,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        first_k_dense_replace=2, n_group=1, topk_group=1, max_position_embeddings=4096,
        use_cache=False)  # fmt: skip
    b, s = 1, 4096
    prog = _compiled(transformers.DeepseekV3ForCausalLM, cfg, b, s, tp)
    found = [c for c in prog.collectives() if c.direction == "fwd" and ".layers.0." in c.where]
    attn = sum(c.bytes for c in found if "self_attn" in c.where or "input_layernorm" in c.where)
    _, mib = _layer0(prog)
    hand = 2 * b * s * h * 2 / 2**20
    compress = 2 * h * (1536 + 512 + 64) * b * s * 3 / 1e9  # fwd + bwd FLOPs, every rank
    return (f"MLA h {h} tp={tp}: attention {attn / 2**20:.1f} MiB (Megatron {hand:.1f}, whose "
            f"replicated compressions cost {compress:.0f} GFLOP a layer on every rank), layer "
            f"{mib:.1f} MiB (Megatron {2 * hand:.1f})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", choices=("gpt-oss", "mla"), default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    only = set(args.only or ("gpt-oss", "mla"))
    if "gpt-oss" in only:
        for tp in (2, 4, 8):
            print(gpt_oss(tp), flush=True)
    if "mla" in only:
        print(mla(7168, 128, 8), flush=True)
        print(mla(2048, 16, 2), flush=True)


if __name__ == "__main__":
    main()
