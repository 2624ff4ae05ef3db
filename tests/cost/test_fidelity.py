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
    assert 1 <= sum(r.fit for r in rows) <= 5


def test_held_out_figures_do_not_move_predictions(fidelity):
    """Changing every held-out row's published figures leaves every prediction unchanged."""
    rows = [r for r in fidelity.ROWS if not r.fit and r.model.layers <= 40][:3]
    before = [fidelity.figure(r, fidelity.predict(r)) for r in rows]
    moved = [replace(r, published=r.published * 3, memory_gib=1.0) for r in rows]
    after = [fidelity.figure(r, fidelity.predict(r)) for r in moved]
    assert before == after
