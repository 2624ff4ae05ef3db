"""Bytes a pipeline stage sends per micro-batch: the compiled program's vs the whole boundary
and Megatron-SP's shard (issue 19.3).

    python benchmarks/pipeline_boundary.py             # HF Llama, 16 layers at the 8B width
    python benchmarks/pipeline_boundary.py --layers 8  # quicker
    python benchmarks/pipeline_boundary.py --cp 2      # Mesh(pp=4, cp=2, tp=4)

Algorithm:
1. Build HF Llama at the Llama-3-8B width on the meta device; compile it for Mesh(pp=4, tp=4)
   in bf16 with micro-batches of 1 x 2048.
2. Per stage: the bytes one rank sends (the plan's "sends": each boundary value's local shard
   in the dtype it crosses in), the bytes of the same values whole, and Megatron-SP's figure
   (the residual stream's [s/t, h] shard in bf16; Megatron recomputes the RoPE tables per
   stage, autopar sends them).  With ``--cp`` the stages also split the sequence: a
   sequence-split boundary value crosses as each cp rank's chunks (whole over tp: the
   Megatron-SP column is then [s/(cp t), h]).
"""

from __future__ import annotations

import argparse
import warnings

import torch

from autopar import Mesh, autoparallelize
from autopar.axes.pipeline import sent_placements
from passes.pipeline_split import boundary_dtype

MIB = 2**20


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    args.add_argument("--layers", type=int, default=16)
    args.add_argument("--cp", type=int, default=1)
    parsed = args.parse_args()
    layers, cp = parsed.layers, parsed.cp
    from transformers import LlamaConfig, LlamaForCausalLM

    seq, h, tp = 2048, 4096, 4
    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=h, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      max_position_embeddings=seq, use_cache=False)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    x = torch.randint(0, 128256, (4, seq), device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mesh = Mesh(pp=4, tp=tp, cp=cp) if cp > 1 else Mesh(pp=4, tp=tp)
        prog = autoparallelize(model, mesh, (x,), example_kwargs={"labels": x},
                               param_dtype=torch.bfloat16, n_microbatches=4)  # fmt: skip
    megatron = seq // (tp * cp) * h * 2
    print(f"HF Llama {layers} layers, h {h}, {mesh}, bf16, micro-batch 1 x {seq}")
    print(f"{'stage':>5} {'sends MiB':>10} {'whole MiB':>10} {'Megatron-SP MiB':>16}  placements sent")
    for i, (stage, graph) in enumerate(zip(prog.stages[:-1], prog.pipeline.graphs[:-1], strict=True)):
        whole = _whole_bytes(graph, prog.pipeline.grad_names)
        sent = sent_placements(stage.graph_module, graph)
        print(f"{i:>5} {prog.pipeline.cut.boundary_bytes[i] / MIB:>10.2f} {whole / MIB:>10.2f} "
              f"{megatron / MIB:>16.2f}  {', '.join(sorted(set(sent.values())))}")  # fmt: skip


def _whole_bytes(graph, grad: frozenset[str]) -> float:  # noqa: ANN001 - a StageGraph
    """The stage's boundary values whole, each in the dtype it crosses in."""
    out = next(n for n in graph.traced.gm.graph.nodes if n.op == "output")
    total = 0.0
    for a, name in zip(torch.utils._pytree.tree_leaves(out.args[0]), graph.outputs, strict=True):
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            dtype = boundary_dtype(v.dtype, v.shape, name in grad, torch.bfloat16)
            total += v.numel() * dtype.itemsize
    return total


if __name__ == "__main__":
    main()
