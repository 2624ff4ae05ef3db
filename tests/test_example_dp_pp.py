"""Acceptance: the data x pipeline example's loss curve equals single-device training to 1e-4
relative.

Runs ``examples/train_dp_pp.py`` (HF Llama on Mesh(dp=2, pp=2), zero=1, 4 Gloo ranks, 20 AdamW
steps with 1F1B over 2 micro-batches per replica) as a subprocess; the example itself exits
non-zero when a step's relative difference exceeds 1e-4 or the ranks return different losses.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("transformers")


def test_train_dp_pp_example_matches_single_device() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_dp_pp.py")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "ZeRO stage 1" in out and "dp=2 over" in out and "pp=2 over" in out, out
    assert "every rank returned rank 0's losses: True" in out, out
    assert re.search(r"step\s+single-device\s+autopar dp=2 pp=2 zero=1\s+rel\. diff", out), out
    rows = re.findall(r"^\s*(\d+)\s+\d+\.\d+\s+\d+\.\d+\s+\S+e[-+]\d+$", run.stdout, re.M)
    assert [int(r) for r in rows] == list(range(1, 21)), out
    assert "within 0.0001" in out, out
