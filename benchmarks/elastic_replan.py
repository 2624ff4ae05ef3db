"""The elastic re-plan time (trace + search + compile) for the Llama-3-8B shape on the meta
device: Mesh.auto on 8 DGX-H100 nodes, then on 7 (a node lost) and 4, global batch 64 x 8192;
without a plan cache, then with one (autopar.planner.cache) as an elastic job keeps it.

    python benchmarks/elastic_replan.py               # all three passes
    python benchmarks/elastic_replan.py --nodes 7     # one world only

Passes (each over the worlds in order, side by side on the same machine):
1. ``none``: no cache (every re-plan traces and solves its candidates' slices);
2. ``job``: one fresh cache folder shared by the worlds in order, as a job that starts on 8
   nodes, loses one, then drops to 4 fills it: each world reads what the earlier ones priced;
3. ``warm``: the same folder again (a world the job has planned before: a node came back).
Not a test: prints seconds per re-plan, the ratio to pass 1, the machine's 1-minute load
average when it ended, and the chosen mesh, ZeRO stage and a digest of the printed plan, which
must be the same in every pass.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autopar import Mesh, autoparallelize
from cost.hardware import Cluster


def replan(nodes: int, cache: str | None) -> tuple[float, str]:
    cfg = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      max_position_embeddings=8192, use_cache=False)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    x = torch.randint(0, 128256, (64, 8192), device="meta")
    start = time.perf_counter()
    prog = autoparallelize(model, Mesh.auto(Cluster.preset("dgx-h100", nodes=nodes)), (x,),
                           example_kwargs={"labels": x}, param_dtype=torch.bfloat16,
                           plan_cache=cache)  # fmt: skip
    seconds = time.perf_counter() - start
    digest = hashlib.sha256(str(prog.plan).encode()).hexdigest()[:10]
    return seconds, f"{prog.search.mesh} zero={prog.search.compiled.config.zero} plan={digest}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, nargs="*", default=[8, 7, 4])
    worlds = parser.parse_args().nodes
    base: dict[int, tuple[float, str]] = {}
    with tempfile.TemporaryDirectory(prefix="autopar-plan-cache-") as folder:
        for name, cache in (("none", None), ("job", folder), ("warm", folder)):
            for nodes in worlds:
                seconds, chosen = replan(nodes, cache)
                base.setdefault(nodes, (seconds, chosen))
                same = "same plan" if chosen == base[nodes][1] else "PLAN DIFFERS"
                print(f"{name:5} {nodes} nodes ({nodes * 8:3} GPUs): re-plan {seconds:6.2f} s "
                      f"(x{seconds / base[nodes][0]:.2f}, load {os.getloadavg()[0]:4.1f}) -> "
                      f"{chosen} [{same}]", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
