"""The one error type of the cost model: bad user input, reported with what to do about it."""

from __future__ import annotations


class CostInputError(ValueError):
    """Invalid hardware, model shape or parallel configuration given to the cost model."""
