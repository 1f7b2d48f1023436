"""The documentation: its Python examples run as written, its site builds, its performance page
is what the saved benchmark records render to, and the README keeps its promises."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks(page: Path) -> tuple[dict[str, str], list[str]]:
    """A page's Python blocks: those starting `# file: NAME` are files its other blocks (and
    pytest, for `test_*.py`) use; the rest are programs."""
    files, programs = {}, []
    for code in FENCE.findall(page.read_text()):
        first, _, rest = code.partition("\n")
        if first.startswith("# file: "):
            files[first.removeprefix("# file: ").strip()] = rest
        else:
            programs.append(code)
    return files, programs


def examples() -> list[tuple[str, Path, str]]:
    found = []
    for page in PAGES:
        files, programs = blocks(page)
        name = str(page.relative_to(REPO))
        found += [(f"{name}#{n + 1}", page, code) for n, code in enumerate(programs)]
        found += [(f"{name}:{test}", page, "") for test in files if test.startswith("test_")]
    return found


def test_every_page_is_searched() -> None:
    # The examples below come from these pages; a page moved out of reach would be skipped silently.
    assert (REPO / "docs" / "getting-started.md") in PAGES
    assert len(EXAMPLES) >= 8


EXAMPLES = examples()


@pytest.mark.parametrize(("where", "page", "code"), EXAMPLES, ids=[where for where, _, _ in EXAMPLES])
def test_example_runs(where: str, page: Path, code: str, tmp_path: Path) -> None:
    files, _ = blocks(page)
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    if code:
        command = [sys.executable, "-c", code]
    else:  # a page's test file, run by pytest as its reader would
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", where.split(":")[-1]]
    # Temporary files an example makes (`tempfile.mkdtemp`, as a reader's would) go under this
    # test's own directory, which pytest removes, rather than piling up in /tmp.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, f"{where} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def test_readme_first_lines_give_the_two_commands() -> None:
    lines = (REPO / "README.md").read_text().splitlines()[:8]
    assert any("kvtier demo" in line for line in lines)
    assert any("pytest" in line for line in lines)


def test_readme_is_short() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link, a missing page or a bad API reference fails."""
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("mkdocs is not installed: install the dev extra")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "site" / "performance" / "index.html").exists()
    assert (tmp_path / "site" / "reference" / "spec" / "index.html").exists()


def test_performance_page_is_rendered_from_the_records(tmp_path: Path) -> None:
    """docs/performance.md is generated: editing it by hand, or a record without rerendering, fails."""
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "render_docs.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "performance.md").read_text() == (REPO / "docs" / "performance.md").read_text()
    assert (tmp_path / "headline.md").read_text() in (REPO / "README.md").read_text()
    for plot in (tmp_path / "img").iterdir():
        assert (REPO / "docs" / "img" / plot.name).exists(), f"{plot.name} is not checked in"
