"""The fidelity benchmark keeps its fit honest: a held-out row's published figure cannot move
any prediction, and the table meets the issue's size (>= 20 rows, >= 5 sources)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from dataclasses import replace

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "fidelity.py"


@pytest.fixture(scope="module")
def fidelity():
    spec = importlib.util.spec_from_file_location("fidelity", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fidelity"] = module
    spec.loader.exec_module(module)
    return module


def test_table_size(fidelity):
    rows = fidelity.ROWS
    assert len(rows) >= 20
    assert len({fidelity.source_name(r) for r in rows}) >= 5
    assert 1 <= sum(r.fit or r.memory_fit for r in rows) <= 5


def test_held_out_figures_do_not_move_predictions(fidelity):
    """Changing every held-out row's published figures leaves every prediction unchanged."""
    rows = [r for r in fidelity.ROWS if not r.fit and r.model.layers <= 40][:3]
    before = [fidelity.figure(r, fidelity.predict(r)) for r in rows]
    moved = [replace(r, published=r.published * 3, memory_gib=1.0) for r in rows]
    after = [fidelity.figure(r, fidelity.predict(r)) for r in moved]
    assert before == after


def test_reserve_ratio_is_fitted_on_the_memory_fit_rows_only(fidelity):
    """The allocator's ratio reads the memory-fit rows' published memory and nothing else:
    moving every other row's figures leaves it (and the held-out memory predictions) alone,
    moving a fit row's memory moves it."""
    rows = fidelity.ROWS
    ratio = fidelity.reserve_ratio(rows)
    moved = tuple(r if r.memory_fit else replace(r, published=r.published * 3, memory_gib=1.0)
                  for r in rows)  # fmt: skip
    assert fidelity.reserve_ratio(moved) == ratio
    refit = tuple(replace(r, memory_gib=r.memory_gib * 2) if r.memory_fit else r for r in rows)
    assert fidelity.reserve_ratio(refit) == pytest.approx(2 * ratio)
