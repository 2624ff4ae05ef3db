"""Plan fingerprints of the test models on every mesh kind, to compare across a refactor.

    python benchmarks/plan_hashes.py > after.txt   # run at two commits and diff the outputs

Each row: model, case, the plan's hash (the tp strategies of every node; a data-parallel plan
adds its degree and ZeRO stage), the ZeRO stage and a digest of the printed plan (every
section: stages, collectives with bytes, memory, predicted cost, why-lines).  A row that changes names a plan that
changed; a refactor must leave every row alone unless it fixes a defect on purpose.
"""

from __future__ import annotations

import hashlib
import warnings
from typing import Any

from autopar import Mesh, autoparallelize
from autopar.tools.testing import Config, MoEConfig, build, build_moe, lm_loss, tokens

CASES: list[tuple[str, Mesh, dict[str, Any]]] = [
    ("tp2", Mesh(tp=2), {}),
    ("tp4", Mesh(tp=4), {}),
    ("dp2tp2", Mesh(dp=2, tp=2), {}),
    ("dp4", Mesh(dp=4), {}),
    ("dp2tp2-lim", Mesh(dp=2, tp=2), {"memory_limit": 3e6}),
    ("dp2-z3", Mesh(dp=2), {"zero": 3}),
    ("dp4-lim2", Mesh(dp=4), {"memory_limit": 2e6}),
    ("dp4-lim1", Mesh(dp=4), {"memory_limit": 1.2e6}),
    ("dp2pp2-lim", Mesh(dp=2, pp=2), {"n_microbatches": 2, "memory_limit": 1.5e6}),
    ("pp2tp2", Mesh(pp=2, tp=2), {"n_microbatches": 4}),
    ("dp2pp2", Mesh(dp=2, pp=2), {"n_microbatches": 2}),
    ("cp2tp2", Mesh(cp=2, tp=2), {}),
    ("dp2cp2", Mesh(dp=2, cp=2), {}),
    ("tp2-rec", Mesh(tp=2), {"recompute": "full"}),
    ("pp2cp2", Mesh(pp=2, cp=2), {"n_microbatches": 2}),
]
MOE_CASES: list[tuple[str, Mesh, dict[str, Any]]] = [
    ("ep2", Mesh(ep=2), {}),
    ("ep2tp2", Mesh(ep=2, tp=2), {}),
    ("ep2tp2-cap", Mesh(ep=2, tp=2), {"capacity_factor": 1.5, "recompute": "full"}),
    ("dp2ep2", Mesh(dp=2, ep=2), {}),
    ("ep2pp2", Mesh(ep=2, pp=2), {"n_microbatches": 2}),
]


def rows() -> list[str]:
    """One line per (model, case): hash, ZeRO stage and printed-plan digest, or the error."""
    c, moe = Config(batch=8, seq=32), MoEConfig(batch=8)
    models = [("llama", build("llama", c), tokens(c), CASES),
              ("gpt", build("gpt", c), tokens(c), CASES),
              ("moe", build_moe(moe), tokens(moe), MOE_CASES)]  # fmt: skip
    out = []
    for kind, model, inputs, cases in models:
        for name, mesh, options in cases:
            try:
                plan = autoparallelize(model, mesh, inputs, lm_loss, **options).plan
                text = hashlib.sha256(str(plan).encode()).hexdigest()[:10]
                zero = plan.dp.zero if plan.dp else "-"
                out.append(f"{kind:6} {name:12} {plan.label} zero={zero} "
                           f"printed={text}")  # fmt: skip
            except Exception as exc:  # a case that fails is a row too
                out.append(f"{kind:6} {name:12} ERR {type(exc).__name__}: {str(exc)[:80]}")
    return out


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    print("\n".join(rows()))
