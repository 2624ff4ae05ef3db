"""Symbolic form of the cost model: the closed formulas as sympy expressions.

Symbols follow REFERENCE.md: b micro-batch, s sequence, h hidden, a heads, L layers, V vocab,
t tensor-, p pipeline-, d data-parallel degree, m micro-batches, v virtual stages, N model
parameters (without the input embedding), N_r parameters held by one rank, N_k of them kept
gathered from forward into backward under per-block ZeRO-3 (the root group and the last block),
n group size, M message bytes, B link bandwidth (B/s), alpha link latency (s), B_g global batch.

Algorithm:
1. Each formula is a `Formula`: a name, a sympy expression, a unit and one line of meaning;
   `str()` prints "name = expression  [unit]" so a user can read why a number is what it is.
2. `Formula.evaluate(**values)` substitutes numbers through a lambdified function built once
   per formula and cached, so a planner evaluating thousands of points pays no sympy cost.
3. The numeric model (`cost.comm`, `cost.workload`, `cost.memory`) implements the same
   formulas; tests check that both agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

import sympy as sp

b, s, h, a, L, V = sp.symbols("b s h a L V", positive=True)
t, p, d, m, v, n = sp.symbols("t p d m v n", positive=True, integer=True)
N, N_r, N_k, M, B, alpha, B_g = sp.symbols("N N_r N_k M B alpha B_g", positive=True)


@dataclass(frozen=True, kw_only=True)
class Formula:
    """A named closed form; `evaluate` is lambdified once and cached."""

    name: str
    expr: sp.Expr
    unit: str
    meaning: str
    symbols: tuple[sp.Symbol, ...] = field(init=False)

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.expr.free_symbols, key=lambda x: x.name))
        object.__setattr__(self, "symbols", ordered)

    def evaluate(self, **values: float) -> float:
        """The formula at `values` (one keyword per free symbol, by name)."""
        missing = [x.name for x in self.symbols if x.name not in values]
        if missing:
            raise ValueError(f"{self.name} needs values for {', '.join(missing)}")
        return float(_compiled(self)(*(values[x.name] for x in self.symbols)))

    def __str__(self) -> str:
        return f"{self.name} = {sp.sstr(self.expr)}  [{self.unit}]  ({self.meaning})"


@cache
def _compiled(formula: Formula):
    return sp.lambdify(formula.symbols, formula.expr, modules="math")


def _f(name: str, expr: sp.Expr, unit: str, meaning: str) -> Formula:
    return Formula(name=name, expr=expr, unit=unit, meaning=meaning)


@cache
def formulas() -> dict[str, Formula]:
    """Every closed form of the model, by name."""
    items = [
        _f("ring_all_reduce_time", 2 * (n - 1) * alpha + 2 * (n - 1) / n * M / B, "s",
           "ring all-reduce of M bytes over n ranks"),
        _f("all_gather_time", (n - 1) * alpha + (n - 1) / n * M / B, "s",
           "ring all-gather producing M bytes (reduce-scatter of M bytes alike)"),
        _f("tree_all_reduce_time", 2 * sp.ceiling(sp.log(n, 2)) * alpha + 2 * M / B, "s",
           "double binary tree all-reduce"),
        _f("tp_traffic_per_layer", 8 * b * s * h * (t - 1) / t, "elements per GPU",
           "4 all-reduces of [b,s,h] per layer, forward + backward (×2 bytes in bf16)"),
        _f("pp_boundary_bytes", 2 * b * s * h / t, "bytes",
           "activation sent between stages per micro-batch (÷t: scatter-gather / SP)"),
        _f("activations_per_layer", s * b * h * (34 + 5 * a * s / h), "bytes",
           "Korthikanti: no parallelism, 16-bit, unfused attention with dropout"),
        _f("activations_per_layer_tp", s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
           "bytes", "Korthikanti: tensor parallel"),
        _f("activations_per_layer_tp_sp", s * b * h / t * (34 + 5 * a * s / h), "bytes",
           "Korthikanti: tensor + sequence parallel"),
        _f("activations_per_layer_selective", 34 * s * b * h / t, "bytes",
           "Korthikanti: TP + SP + selective recompute"),
        _f("activations_per_layer_full", 2 * s * b * h, "bytes", "full recompute: layer input"),
        _f("activations_per_layer_full_sp", 2 * s * b * h / t, "bytes",
           "full recompute with sequence parallelism: the layer input's [s/t] shard"),
        _f("model_state_ddp", 18 * N_r, "bytes", "bf16 weights + fp32 grads + Adam fp32 state"),
        _f("model_state_zero1", (6 + 12 / d) * N_r, "bytes", "optimizer state sharded over d"),
        _f("model_state_zero2", (2 + 16 / d) * N_r, "bytes", "+ gradients sharded"),
        _f("model_state_zero3", 18 * N_r / d + 2 * N_k * (d - 1) / d, "bytes",
           "+ weights sharded (FSDP; the root group and last block held whole into backward)"),
        _f("bubble_gpipe", (p - 1) / (m + p - 1), "fraction of step", "GPipe bubble"),
        _f("bubble_1f1b", (p - 1) / m, "fraction of ideal", "1F1B bubble"),
        _f("bubble_interleaved", (p - 1) / (v * m), "fraction of ideal", "interleaved 1F1B"),
        _f("gpt_params", 12 * L * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * L * h)), "params",
           "GPT parameters (tied embeddings, learned positions)"),
        _f("megatron_flops", 96 * B_g * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h)),
           "FLOPs per iteration", "Megatron-2021 count, includes the recompute forward"),
        _f("palm_flops_per_token", 6 * N + 12 * L * h * s, "FLOPs per token",
           "PaLM model FLOPs (a·d = h), no recompute"),
    ]  # fmt: skip
    return {f.name: f for f in items}
