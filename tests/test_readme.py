"""The README's usage example runs exactly as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_usage_example_runs() -> None:
    text = README.read_text()
    usage = text[text.index("## Usage") :]
    code = re.search(r"```python\n(.*?)```", usage, re.S)
    assert code is not None
    result = subprocess.run(
        [sys.executable, "-c", code.group(1)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "blocks came back from the memory tier" in result.stdout


def test_first_lines_give_the_two_commands() -> None:
    lines = README.read_text().splitlines()[:8]
    assert any("kvtier demo" in line for line in lines)
    assert any("pytest" in line for line in lines)
