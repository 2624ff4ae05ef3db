"""How many tp ILPs a pipeline's stages cost with a fresh plan cache: stages of identical blocks
at other layers share one `solve_axis` answer (autopar.planner.cache.Canonical).

    python benchmarks/stage_solves.py 7 2      # Mesh(pp=7, tp=2)

Llama-3-8B shape on the meta device, bf16, batch 2*pp x 8192, 2*pp micro-batches, memory not
bounded (the planning is measured, not the fit).  Prints, without a cache and with a fresh one,
the seconds, the ILPs solved, the cache entries written and a digest of the printed plan (the
same in both).  Not a test.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autopar import Mesh, autoparallelize
from autopar.planner import tp
from cost.hardware import Cluster


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pp", type=int)
    parser.add_argument("tp", type=int)
    args = parser.parse_args()
    cfg = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      max_position_embeddings=8192, use_cache=False)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    x = torch.randint(0, 128256, (2 * args.pp, 8192), device="meta")
    mesh = Mesh(Cluster.preset("dgx-h100", nodes=(args.pp * args.tp + 7) // 8), pp=args.pp,
                tp=args.tp)  # fmt: skip
    calls, real = [], tp._solve
    tp._solve = lambda *a, **k: calls.append(1) or real(*a, **k)
    for name in ("none", "cache"):
        with tempfile.TemporaryDirectory() as folder:
            calls.clear()
            start = time.perf_counter()
            prog = autoparallelize(model, mesh, (x,), example_kwargs={"labels": x},
                                   param_dtype=torch.bfloat16, n_microbatches=2 * args.pp,
                                   memory_limit=1e15, plan_cache=folder if name == "cache" else None)  # fmt: skip
            seconds = time.perf_counter() - start
            entries = len(list((Path(folder) / "solve").glob("*.json")))
            digest = hashlib.sha256(str(prog.plan).encode()).hexdigest()[:10]
            print(f"pp={args.pp} tp={args.tp} {name:5}: {seconds:6.2f} s, ILPs solved "
                  f"{len(calls)}, solve entries {entries}, load {os.getloadavg()[0]:.1f}, "
                  f"plan={digest}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
