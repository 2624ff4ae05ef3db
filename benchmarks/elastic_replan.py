"""The elastic re-plan time (trace + search + compile) for the Llama-3-8B shape on the meta
device: Mesh.auto on 8 DGX-H100 nodes, then on 7 (a node lost) and 4, global batch 64 x 8192.

    python benchmarks/elastic_replan.py

Not a test: prints seconds per re-plan and the mesh chosen for each world.
"""

from __future__ import annotations

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autopar import Mesh, autoparallelize
from cost.hardware import Cluster


def main() -> None:
    cfg = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      max_position_embeddings=8192, use_cache=False)  # fmt: skip
    for nodes in (8, 7, 4):
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        x = torch.randint(0, 128256, (64, 8192), device="meta")
        start = time.perf_counter()
        prog = autoparallelize(model, Mesh.auto(Cluster.preset("dgx-h100", nodes=nodes)), (x,),
                               example_kwargs={"labels": x}, param_dtype=torch.bfloat16)  # fmt: skip
        print(
            f"{nodes} nodes ({nodes * 8} GPUs): re-plan {time.perf_counter() - start:.2f} s "
            f"-> {prog.search.mesh} (zero={prog.search.compiled.config.zero})",
            flush=True,
        )


if __name__ == "__main__":
    main()
