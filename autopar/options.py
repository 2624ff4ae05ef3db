"""The options of one ``autoparallelize`` call, validated once into a frozen record.

Algorithm (:func:`make_options`):
1. Check every option whose value alone can be wrong (recompute mode, attention choice,
   capacity factor, micro-batch and stage counts, split points, compile backend, fp8
   recipe, tp overlap mode), naming the option and what to give instead.
2. Freeze them into :class:`Options`; the driver and every axis read this record (the sub-mesh
   programs get ``dataclasses.replace`` copies, e.g. with the plan's own section removed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autopar.errors import InputError
from cost.hardware import Cluster

ATTENTION = ("ring", "all_to_all")
OVERLAP = ("auto", "all", "none")  # autopar.planner.overlap.MODES
MIXED_PRECISION = ("cast", "autocast")


@dataclass(frozen=True, kw_only=True)
class Options:
    """Everything ``autoparallelize`` was told besides the model, mesh and example inputs."""

    memory_limit: float | None = None
    memory_weight: float | None = None
    strict: bool = False
    verbose: bool = False
    n_microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    split_points: tuple[str, ...] = ()
    plan: Any = None  # autopar.plan.Plan (a reloaded plan), or None
    cluster: Cluster | None = None
    zero: int | None = None
    param_dtype: torch.dtype = torch.float32
    mixed_precision: str = "cast"  # how a 16-bit param_dtype runs: MIXED_PRECISION
    global_batch: int | None = None
    reduce_dtype: torch.dtype = torch.float32
    cp_attention: str | None = None
    capacity_factor: float | None = None
    recompute: str | None = None
    compile: bool | str = False  # True: inductor; or a torch.compile backend name
    fp8: str | None = None  # a torchao float8 recipe: "tensorwise" | "rowwise"
    plan_cache: Any = None  # Mesh.auto: a folder of world-independent prices (planner/cache.py)
    tp_overlap: str = "auto"  # decompose tp gathers / scatters under their matmuls: OVERLAP

    @property
    def overlap_mode(self) -> str:
        """``tp_overlap`` as the program can run it: "none" under ``fp8`` (its linears are
        torchao's), autocast (the decomposed matmuls run in the traced dtype) and where
        ``compile`` leaves the pairs to inductor's micro-pipelined TP (:attr:`micro_pipeline_tp`);
        otherwise compiled programs decompose as eager ones (their ring steps trace as
        functional collectives)."""
        plain = self.fp8 is None and self.autocast_dtype == torch.float32
        return self.tp_overlap if plain and not self.micro_pipeline_tp else "none"

    @property
    def backend(self) -> str | None:
        """The torch.compile backend of ``compile``, or None (eager)."""
        return "inductor" if self.compile is True else (self.compile or None)

    @property
    def micro_pipeline_tp(self) -> bool:
        """Whether ``compile`` runs inductor's micro-pipelined TP on the tp pairs here
        (autopar.ops.compiled.micro_pipeline_tp: inductor on CUDA with NCCL)."""
        from autopar.ops.compiled import micro_pipeline_tp

        return self.backend is not None and micro_pipeline_tp(self.backend)[0]

    def replace(self, **changes: Any) -> Options:
        return dataclasses.replace(self, **changes)

    @property
    def cast_dtype(self) -> torch.dtype | None:
        """The dtype the weights and inputs are cast to and the graph is traced in ("cast":
        FSDP2's MixedPrecisionPolicy), or None (fp32, or "autocast")."""
        low = self.param_dtype != torch.float32 and self.mixed_precision == "cast"
        return self.param_dtype if low else None

    @property
    def autocast_dtype(self) -> torch.dtype:
        """The dtype an fp32-traced graph runs under autocast to ("autocast"), else fp32 (the
        graph's own dtypes are what runs: autopar.frontend.precision has nothing to add)."""
        return self.param_dtype if self.mixed_precision == "autocast" else torch.float32


def make_options(*, split_points: Sequence[str] = (), **given: Any) -> Options:
    """Steps 1-2."""
    from autopar.axes.recompute import check_mode

    if given.get("recompute") is not None:
        check_mode(given["recompute"])
    attention = given.get("cp_attention")
    if attention not in (None, *ATTENTION):
        raise InputError(f"cp_attention={attention!r}: use 'ring', 'all_to_all' or None")
    factor = given.get("capacity_factor")
    if factor is not None and not factor > 0:
        raise InputError(f"capacity_factor={factor!r}: the capacity factor must be > 0 "
                         "(tokens an expert takes, as a multiple of an even share); "
                         "None is dropless")  # fmt: skip
    for name in ("n_microbatches", "virtual_stages", "global_batch"):
        value = given.get(name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise InputError(f"{name}={value!r}: give a positive integer (or None to choose)")
    if given.get("compile") not in (None, False, True) and not isinstance(given["compile"], str):
        raise InputError(f"compile={given['compile']!r}: give True (inductor), False, or a "
                         "torch.compile backend name such as 'aot_eager'")  # fmt: skip
    _check_fp8(given.get("fp8"))
    if given.get("tp_overlap", "auto") not in OVERLAP:
        raise InputError(f"tp_overlap={given['tp_overlap']!r}: give 'auto' (the cost model "
                         "decides per collective), 'all' or 'none'")  # fmt: skip
    check_precision(given.get("param_dtype", torch.float32),
                    given.get("mixed_precision", "cast"))  # fmt: skip
    if isinstance(split_points, str):
        raise InputError(f"split_points={split_points!r}: give a list of module paths, "
                         f"e.g. [{split_points!r}]")  # fmt: skip
    return Options(split_points=tuple(split_points), **given)


def _check_fp8(recipe: Any) -> None:
    """``fp8=``: a torchao recipe name, and torchao importable."""
    from autopar.ops.fp8 import RECIPES

    if recipe is None:
        return
    if recipe not in RECIPES:
        raise InputError(f"fp8={recipe!r}: give one of torchao's float8 training recipes "
                         f"{', '.join(map(repr, RECIPES))}, or None for no FP8")  # fmt: skip
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise InputError(f"fp8={recipe!r} runs torchao's float8 recipes, but torchao does not "
                         f"import ({exc}): pip install --no-deps torchao==0.18.0") from exc


def check_precision(param_dtype: Any, mixed_precision: Any) -> None:
    """``param_dtype`` a floating dtype of 16 or 32 bits; ``mixed_precision`` one of
    :data:`MIXED_PRECISION` (what each does: README, "Mixed precision")."""
    if mixed_precision not in MIXED_PRECISION:
        raise InputError(f"mixed_precision={mixed_precision!r}: use 'cast' (weights and inputs "
                         "cast to param_dtype once per step, the whole forward in it, as FSDP2's "
                         "MixedPrecisionPolicy) or 'autocast' (fp32 weights, torch.autocast "
                         "around the forward)")  # fmt: skip
    if param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise InputError(f"param_dtype={param_dtype!r}: use torch.float32, torch.bfloat16 or "
                         "torch.float16")  # fmt: skip
