"""Wall time of `autoparallelize()` for HF Llama at the Llama-3-8B and -70B shapes (issue 19).

Algorithm:
1. Pay torch.export's one-time set-up with a 1-layer tiny HF Llama (printed, not counted).
2. Per shape and mesh, build LlamaForCausalLM on the meta device (no weights are
   materialised) and compile it once with verbose=True: 8B on Mesh(tp=8) and on Mesh(tp=1)
   (the inner program of a pure data-parallel mesh), 70B on Mesh(tp=8).
3. Print each call's wall and CPU seconds (CPU: the machine may be shared), its trace /
   solve / passes / packaging split (read off the verbose progress lines) and the per-pass
   times of the pipeline history.

Goals (2-core CPU): 8B < 3 s, 70B < 6 s on tp=8. A measurement, not a test.

Run: PYTHONPATH=. python benchmarks/compile_time.py
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time

import torch
import transformers

from autopar import Mesh, Program, autoparallelize
from autopar.tools.testing import hf_tiny_llama

SEQ = 2048
SHAPES = {
    "llama3-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336),
    "llama3-70b": dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64,
                       num_key_value_heads=8, intermediate_size=28672),
}  # fmt: skip
RUNS = (("llama3-8b", Mesh(tp=8), 3.0), ("llama3-8b", Mesh(tp=1), 3.0),
        ("llama3-70b", Mesh(tp=8), 6.0))  # fmt: skip


def meta_llama(shape: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """LlamaForCausalLM at ``shape`` on the meta device, and [1, SEQ] token ids."""
    cfg = transformers.LlamaConfig(vocab_size=128256, use_cache=False, **SHAPES[shape])
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    return model, torch.zeros(1, SEQ, dtype=torch.long, device="meta")


def compile_once(model: torch.nn.Module, ids: torch.Tensor,
                 mesh: Mesh) -> tuple[Program, float, float, dict[str, float]]:  # fmt: skip
    """One verbose call; the program, its wall and CPU seconds and the progress stamps (s)."""
    log = io.StringIO()
    wall, cpu = time.perf_counter(), time.process_time()
    with contextlib.redirect_stdout(log):
        prog = autoparallelize(model, mesh, (ids,), example_kwargs={"labels": ids},
                               verbose=True)  # fmt: skip
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stamps = {
        m[2]: float(m[1]) for m in re.finditer(r"\[autopar\s+([\d.]+)s\] (\w+)", log.getvalue())
    }
    return prog, wall, cpu, stamps


def report(label: str, goal: float, prog: Program, wall: float, cpu: float,
           stamps: dict[str, float]) -> None:  # fmt: skip
    passes = sum(rec.ms for rec in prog.history) / 1e3
    trace, solve = stamps["traced"], stamps["solved"] - stamps["traced"]
    rest = wall - trace - solve - passes
    print(f"{label}: autoparallelize {wall:.2f} s wall, {cpu:.2f} s CPU (goal < {goal:g} s: "
          f"{'met' if wall < goal else 'NOT met'}); plan {prog.plan.hash}")  # fmt: skip
    for name, s in (("trace", trace), ("solve", solve), ("passes", passes), ("plan+package", rest)):
        print(f"  {name:<14} {s:7.2f} s  {s / wall:6.1%}")
    print("  per pass:")
    for rec in prog.history:
        print(f"    {rec}")


def main() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    print(f"HF LlamaForCausalLM on the meta device, tokens [1, {SEQ}]; torch {torch.__version__}"
          f", {torch.get_num_threads()} threads\n")  # fmt: skip
    tiny = hf_tiny_llama(1)
    ids = torch.zeros(1, 16, dtype=torch.long)
    _, wall, _, _ = compile_once(tiny, ids, Mesh(tp=2))
    print(f"warm-up (1-layer tiny Llama, torch.export's one-time set-up): {wall:.2f} s\n")
    for shape, mesh, goal in RUNS:
        model, ids = meta_llama(shape)
        report(f"{shape} on {mesh}", goal, *compile_once(model, ids, mesh))
        print()


if __name__ == "__main__":
    main()
