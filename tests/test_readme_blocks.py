"""Every README code block marked ``<!-- runs as written ... -->`` runs as a user pastes it.

A snippet that fails as written (a missing ``[tls]``, no ``listen``) costs a new
user their first hour; the marker says which blocks are meant to run, and this
test runs each one in a fresh interpreter in an empty directory.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MARKED = re.compile(r"<!-- runs as written[^>]*-->\n```python\n(.*?)```", re.DOTALL)


def _blocks() -> list[str]:
    return MARKED.findall(README.read_text())


def test_the_readme_marks_its_library_snippet_to_run() -> None:
    assert any("GossipNode(" in block for block in _blocks())


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_a_marked_readme_block_runs_as_written(index: int, tmp_path: Path) -> None:
    block = _blocks()[index]
    done = subprocess.run(
        [sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"README block {index} failed:\n{block}\n{done.stderr[-3000:]}"
    if "GossipNode(" in block:
        assert "sum-weights: [1.0" in done.stdout, done.stdout  # alone: its weight stays
