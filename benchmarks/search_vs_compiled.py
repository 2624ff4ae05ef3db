"""The whole-cluster search's price of a configuration next to the compiled plan's (issue 19.5).

    python benchmarks/search_vs_compiled.py            # HF Llama, Llama-3-8B shape, meta, 64 H100
    python benchmarks/search_vs_compiled.py --layers 8 # a quicker, shallower model

For one traced model and each configuration: the search's predicted step time and memory per
rank (`cost.estimate.estimate` on the traced graph, `cost.graph`) and the compiled program's
(`autoparallelize` on the same mesh: the data-parallel plan's predicted step, which prices its
sub-mesh plan's micro-batches, the pipeline bubble, the exposed data-axis traffic and the
optimizer step with the search's `cost.step` functions; the data axis's ZeRO row plus the
runtime reserve).  Ratios far from 1 mean the two halves of autopar price one configuration
differently.

Algorithm:
1. Build the model on the meta device and trace it (with its loss, returned alone) once for
   the search (`autopar.planner.solved.SolvedModel`: `cost.graph` on the trace, each value
   priced in its autocast dtype, as the compiler's memory table prices it; each tp degree
   priced from the tp planner's own solution at that degree on a trace of one micro-batch,
   the slice the compiler traces, solved once per (degree, micro-batch)).
2. Per configuration: estimate it (micro-batch = the per-rank batch: the data axis does not
   accumulate; under pp 1F1B over micro-batches of one sequence; the given ZeRO stage and
   recompute; the tp layouts, sequence splits included, are the solved plan's), compile it
   the same way, read the compiled plan.
3. Print one row per configuration: step time and memory, search vs compiled, and the ratios.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

from autopar import Mesh, autoparallelize
from autopar.frontend.trace import trace
from autopar.planner.solved import SolvedModel
from cost.config import ParallelConfig
from cost.estimate import estimate
from cost.hardware import Cluster
from cost.memory import RESERVED_BYTES

GIB = 2**30
UNLIMITED = 2.0**50  # bytes per rank
# (name, mesh degrees outermost first as the search nests them: pp, dp, cp, tp; zero,
# recompute); dp is what tp·pp·cp leave of the cluster
CONFIGS = [
    ("fsdp", {"dp": 64}, 3, "none"),
    ("fsdp + full recompute", {"dp": 64}, 3, "full"),
    ("tp x fsdp", {"dp": 8, "tp": 8}, 3, "none"),
    ("tp x dp + recompute", {"dp": 8, "tp": 8}, 1, "full"),
    ("tp2 x dp", {"dp": 32, "tp": 2}, 2, "none"),
    ("pp x tp x dp", {"pp": 2, "dp": 4, "tp": 8}, 1, "none"),
    ("dp x cp", {"dp": 32, "cp": 2}, 2, "none"),
]


def _model(layers: int, seq: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                      max_position_embeddings=seq, use_cache=False)  # fmt: skip
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def _loss(out, labels: torch.Tensor) -> torch.Tensor:
    """The traced step returns the loss alone (HF's logits output would be gathered whole)."""
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten())


def _micro_batch(batch: int, degrees: dict) -> int:
    """Rows of one micro-batch: the per-rank batch, or under pp one sequence."""
    return 1 if degrees.get("pp", 1) > 1 else batch // degrees.get("dp", 1)


def _searched(priced: SolvedModel, cluster: Cluster, batch: int, degrees: dict, zero: int,
              recompute: str) -> tuple[float, float]:  # fmt: skip
    """Step 2: the search's (step seconds, bytes per rank) of one configuration."""
    dp, pp = degrees.get("dp", 1), degrees.get("pp", 1)
    cfg = ParallelConfig(tp=degrees.get("tp", 1), pp=pp, dp=dp, cp=degrees.get("cp", 1),
                         zero=zero, global_batch=batch, micro_batch=_micro_batch(batch, degrees),
                         schedule="1f1b", virtual_stages=1, recompute=recompute,
                         sequence_parallel=False)  # fmt: skip
    est = estimate(priced, cluster, cfg)
    return est.step.total, est.memory.total


def _compiled(model, cluster: Cluster, x: torch.Tensor, degrees: dict, zero: int,
              recompute: str) -> tuple[float, float]:  # fmt: skip
    """Step 2: the compiled plan's (step seconds, bytes per rank incl. the reserve)."""
    per_rank = x.shape[0] // degrees.get("dp", 1)  # under pp: micro-batches of one sequence
    options = {"n_microbatches": per_rank} if degrees.get("pp", 1) > 1 else {}
    # memory_limit far above the GPU: a configuration that does not fit is priced all the same
    # (the comparison is of the two prices; whether it fits is the search's and FitError's job)
    prog = autoparallelize(model, Mesh.ordered(tuple(degrees.items()), cluster), (x, x), loss_fn=_loss,
                           zero=zero, recompute=recompute, param_dtype=torch.bfloat16,
                           memory_limit=UNLIMITED, **options)  # fmt: skip
    plan = prog.plan.dp
    return plan.step.total, plan.memory[plan.zero].total + RESERVED_BYTES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    cluster = Cluster.preset("dgx-h100", nodes=8)
    model = _model(args.layers, args.seq)
    x = torch.randint(0, 128256, (args.batch, args.seq), device="meta")
    t0 = time.perf_counter()
    priced = SolvedModel(trace(model, (x, x), None, _loss), cluster, torch.bfloat16, "llama",
                         retrace=lambda rows: trace(model, (x[:rows], x[:rows]), None, _loss))  # fmt: skip
    for _, degrees, _, _ in CONFIGS:  # the sub-mesh compiled once per (degrees, micro-batch)
        t, c = degrees.get("tp", 1), degrees.get("cp", 1)
        if t * c > 1:
            priced.solved(t, c, _micro_batch(args.batch, degrees))
    searched_s = time.perf_counter() - t0
    print(f"HF Llama, {args.layers} layers at the Llama-3-8B width, global batch {args.batch} "
          f"x {args.seq}, 64 H100, bf16 compute; trace + sub-mesh compiles for the search "
          f"{searched_s:.1f} s")  # fmt: skip
    print(f"{'config':<24} {'search s':>9} {'compiled s':>10} {'ratio':>6} "
          f"{'search GiB':>10} {'compiled GiB':>12} {'ratio':>6} {'compile s':>9}")  # fmt: skip
    for name, degrees, zero, recompute in CONFIGS:
        s_time, s_mem = _searched(priced, cluster, args.batch, degrees, zero, recompute)
        t0 = time.perf_counter()
        try:
            c_time, c_mem = _compiled(model, cluster, x, degrees, zero, recompute)
        except Exception as exc:  # a configuration that does not compile is a row too
            print(f"{name:<24} {s_time:9.3f} {'-':>10} {'-':>6} {s_mem / GIB:10.1f}  "
                  f"compile failed: {type(exc).__name__}: {str(exc)[:90]}")  # fmt: skip
            continue
        print(f"{name:<24} {s_time:9.3f} {c_time:10.3f} {c_time / s_time:6.2f} "
              f"{s_mem / GIB:10.1f} {c_mem / GIB:12.1f} {c_mem / s_mem:6.2f} "
              f"{time.perf_counter() - t0:9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
