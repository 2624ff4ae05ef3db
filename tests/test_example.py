"""Acceptance: the training example's loss curve equals single-device training to 1e-4 relative.

Runs ``examples/train_tp.py`` (4 Gloo ranks, 20 AdamW steps) as a subprocess; the example
itself exits non-zero when a step's relative difference exceeds 1e-4.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_tp_example_matches_single_device() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_tp.py")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert re.search(r"step\s+single-device\s+autopar tp=4\s+rel\. diff", out), out
    rows = re.findall(r"^\s*(\d+)\s+\d+\.\d+\s+\d+\.\d+\s+\S+e[-+]\d+$", run.stdout, re.M)
    assert [int(r) for r in rows] == list(range(1, 21)), out
    assert "within 0.0001" in out, out
