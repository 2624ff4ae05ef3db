"""Errors autopar raises.  Each says what was wrong, where in the user's model, and what to do."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class NodeProblem:
    """A graph node a recogniser could not handle: its name, why, and the user's source line
    (reported in a warning, or raised under ``strict=True``)."""

    node: str
    why: str
    source: str

    def __str__(self) -> str:
        return f"node '{self.node}' ({self.source}): {self.why}"


class AutoparError(ValueError):
    """Base class of every error autopar raises on bad input."""


class TraceError(AutoparError):
    """torch.export could not capture the model."""


class InputError(AutoparError):
    """The example inputs do not fit the model."""


class MeshError(AutoparError):
    """The mesh is malformed, names an unknown axis, or does not match the world."""


class PlanError(AutoparError):
    """No valid plan exists for the model on this mesh (or a requested plan is invalid)."""


class FitError(PlanError):
    """The plan is valid but needs more memory per rank than the limit (or the GPU) holds."""


class ShardingRuleError(AutoparError):
    """An op has no sharding rule and ``strict=True`` was given."""


class CheckpointError(AutoparError):
    """A checkpoint is missing, incomplete, tampered with, damaged, or does not fit the model."""
