"""Models that are not causal LMs: verify error, forward collectives at the realistic shape,
weight all-gathers and rank 0's layer weight share, per model and tp degree.

    PYTHONPATH=$PWD python benchmarks/zoo_models.py [--tp 2 4] [--no-verify] [--models NAME ...]
"""

from __future__ import annotations

import argparse
import logging

from autopar.tools import zoo_models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--models", nargs="+", default=None, help="registry names (default: all)")
    args = parser.parse_args()
    entries = [zoo_models.model(n) for n in args.models] if args.models else zoo_models.models()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    for tp in args.tp:
        rows = [zoo_models.check(m, tp, run_verify=not args.no_verify)
                for m in entries]  # fmt: skip
        print(zoo_models.table(rows), end="\n\n")


if __name__ == "__main__":
    main()
