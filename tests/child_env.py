"""The environment of a Python process a test starts: the caller's, with test directories first on the path.

The caller's own PYTHONPATH stays after them, so a checkout tested from outside the
installed one (`PYTHONPATH=/path/to/checkout pytest`) is what the child imports too.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["child_env"]


def child_env(*paths: str | Path) -> dict[str, str]:
    kept = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, paths), *([kept] if kept else [])])}
