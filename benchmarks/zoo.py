"""The model zoo table: every registered HF causal-LM family under tensor parallelism.

Algorithm:
1. For each family of ``autopar.tools.zoo.families()`` (or those named with ``--only``), run
   ``autopar.tools.zoo.check(family, tp)``: verify of the tiny config on the Gloo worker pool, and
   the realistic config (hidden 2048, seq 2048, vocab 32000) compiled on the meta device
   and priced in bf16 (`param_dtype=torch.bfloat16`).
2. Print one row per family as it finishes (traced?, max relative error, forward collectives
   of layer 0 and outside the layers next to the hand-designed ones, all-reduce equivalents,
   per-GPU traffic relative to the hand design, rank 0's share of the layer parameters,
   seconds), then every failure with its one-line reason.

A measurement, not a test (tests/test_zoo.py asserts the same checks).

Run: PYTHONPATH=. python benchmarks/zoo.py [--tp 4] [--only llama gpt2] [--no-verify]
     [--size node --kv-heads 4]   (one 8-GPU node's shape: h 4096, 32 heads, b 4, s 2048)
(``--tp 8``: the GQA families' 4 K/V heads are fewer than the ranks, so each K/V head is
computed by the 2 ranks whose query heads read it; MQA's one head by all of them.)
"""

from __future__ import annotations

import argparse
import logging
import warnings

from autopar.tools import zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel degree: 2 (default), 4 or 8")
    parser.add_argument("--only", nargs="*", default=None, help="family names (default: all)")
    parser.add_argument("--no-verify", action="store_true", help="skip the tiny verify runs")
    parser.add_argument("--size", choices=("realistic", "node"), default="realistic",
                        help="compiled shape: realistic (h 2048, 16 heads, b 1) or node "
                             "(h 4096, 32 heads, head dim 128, b 4, s 2048)")  # fmt: skip
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="K/V heads of every family that takes them (default: the "
                             "family's GQA/MHA setting; multi-query stays 1)")  # fmt: skip
    args = parser.parse_args()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    entries = [zoo.family(n) for n in args.only] if args.only else zoo.families()
    rows = []
    for entry in entries:
        rows.append(zoo.check(entry, args.tp, run_verify=not args.no_verify, size=args.size,
                              kv_heads=args.kv_heads))  # fmt: skip
        print(zoo.table(rows[-1:]).splitlines()[2], flush=True)
    print()
    print(zoo.table(rows))


if __name__ == "__main__":
    main()
