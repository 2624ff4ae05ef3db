"""Golden-text helper: compare printed IR with tests/golden/<name>.txt.

Set AUTOPAR_UPDATE_GOLDEN=1 to rewrite the files after an intended change (then review the
diff like code).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

GOLDEN = Path(__file__).resolve().parent.parent / "golden"


def assert_golden(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("AUTOPAR_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with AUTOPAR_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text(), f"printed IR differs from {path} (see diff above)"


def masked(text: str) -> str:
    """``text`` with each gradient bucket's key (unique per program: a uuid4) masked."""
    return re.sub(r"'[0-9a-f]{32}:", "'<key>:", text)
