"""Wall time of `autoparallelize()` for a 32-layer Llama-style (7B-shaped) model on 8-way TP.

Algorithm:
1. Build the model on the meta device (no weights are materialised).
2. Compile it for a virtual Mesh(tp=8) twice (cold: first call in the process, paying
   torch.export's one-time set-up; warm: the same call again), with verbose=True.
3. Print each call's total, its trace / solve / passes / packaging split (read off the
   verbose progress lines) and the per-pass times of the pipeline history.

Goal: < 10 s per call on a 2-core CPU. A measurement, not a test.

Run: PYTHONPATH=. python benchmarks/compile_time.py
"""

from __future__ import annotations

import contextlib
import io
import re
import time

import torch

from autopar import Mesh, Program, autoparallelize
from autopar.testing import Config, build, lm_loss, tokens

CONFIG = Config(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=11008, vocab=32000,
                seq=2048, batch=1, bias=False)  # fmt: skip
MESH = Mesh(tp=8)
GOAL_S = 10.0


def compile_once() -> tuple[Program, float, dict[str, float]]:
    """One verbose call; returns the program, its wall time and the progress timestamps (s)."""
    with torch.device("meta"):
        model = build("llama", CONFIG)
    x, y = (t.to("meta") for t in tokens(CONFIG))
    log = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(log):
        prog = autoparallelize(model, MESH, (x, y), loss_fn=lm_loss,
                               verbose=True)  # fmt: skip
    total = time.perf_counter() - start
    print(log.getvalue(), end="")
    stamps = {
        m[2]: float(m[1]) for m in re.finditer(r"\[autopar\s+([\d.]+)s\] (\w+)", log.getvalue())
    }
    return prog, total, stamps


def report(label: str, prog: Program, total: float, stamps: dict[str, float]) -> None:
    passes = sum(rec.ms for rec in prog.history) / 1e3
    trace, solve = stamps["traced"], stamps["solved"] - stamps["traced"]
    rest = total - trace - solve - passes
    print(f"\n{label}: autoparallelize {total:.2f} s (goal < {GOAL_S:g} s: "
          f"{'met' if total < GOAL_S else 'NOT met'})")  # fmt: skip
    for name, s in (("trace", trace), ("solve", solve), ("passes", passes), ("plan+package", rest)):
        print(f"  {name:<14} {s:7.2f} s  {s / total:6.1%}")
    print("  per pass:")
    for rec in prog.history:
        print(f"    {rec}")


def main() -> None:
    print(f"model: Llama {CONFIG} on the meta device; {MESH}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")  # fmt: skip
    for label in ("cold", "warm"):
        print(f"--- {label} call ---")
        report(label, *compile_once())
        print()


if __name__ == "__main__":
    main()
