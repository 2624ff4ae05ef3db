"""Sharding rules: for each ATen op, the ways it can run split along one mesh axis.

``autopar.rules.core`` holds the strategy type, the registry and :func:`strategies`; one module
per op family registers its rules on import: ``pointwise`` (broadcasting, partial sums through
linear ops), ``views`` (views, permutes, slices, split/cat), ``reductions`` (sums, softmax,
norms), ``matmul`` (linear and matmuls, attention, embedding, cross-entropy), ``moe`` (grouped
matmuls and routing), ``replicated_only`` (ops that only run whole).
"""

from autopar.rules import matmul, moe, pointwise, reductions, replicated_only, views  # noqa: F401
from autopar.rules.core import (
    RULES,
    Rule,
    RuleContext,
    Strategy,
    has_rule,
    replicated,
    rule,
    strategies,
)
from autopar.rules.matmul import shared_kv_reps
from autopar.rules.views import map_view, view_block_counts

__all__ = ["RULES", "Rule", "RuleContext", "Strategy", "has_rule", "map_view",
           "replicated", "rule", "shared_kv_reps", "strategies", "view_block_counts"]  # fmt: skip
