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


def test_grand_teton_peak_is_fitted_on_its_fit_row_only(fidelity):
    """The 500 W H100's sustained peak reads the `peak_fit` row's published step time and
    nothing else: moving every other row's figures leaves it (and the held-out predictions on
    that GPU) alone; moving the fit row's figure moves it; the fitted row is then matched."""
    rows = fidelity.ROWS
    factor = fidelity.peak_factor(rows)
    assert 0.2 < factor < 1.0
    moved = tuple(r if r.peak_fit else replace(r, published=r.published * 3) for r in rows)
    assert fidelity.peak_factor(moved) == factor
    held = next(r for r in rows if r.cluster.gpu.name == fidelity.H100_GT.name and not r.fit)
    assert fidelity.predict(held, moved).tokens_per_s == fidelity.predict(held, rows).tokens_per_s
    refit = tuple(replace(r, published=r.published * 1.2) if r.peak_fit else r for r in rows)
    assert fidelity.peak_factor(refit) > factor
    (fit,) = (r for r in rows if r.peak_fit)
    assert fidelity.figure(fit, fidelity.predict(fit)) == pytest.approx(fit.published, rel=1e-4)


def test_every_held_out_miss_is_printed_with_its_component(fidelity, capsys):
    """Each held-out row outside ±10% prints a MISS with the component the model lacks, and
    the closing tally of components counts exactly those rows."""
    fidelity.main()
    out = capsys.readouterr().out
    held = out.split("HELD-OUT rows")[1].split("held-out step time:")[0]
    missed = sum("  MISS: " in line for line in held.splitlines())
    inside, total = (int(x) for x in out.split("held-out step time: ")[1].split(" within")[0]
                     .split(" of "))  # fmt: skip
    tally = out.split("misses by the component printed:\n")[1].split("held-out published")[0]
    counted = sum(int(line.split()[0]) for line in tally.splitlines() if line.strip())
    assert missed == counted == total - inside > 0
