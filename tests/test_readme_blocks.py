"""Every code block the README or a docs page marks ``<!-- runs as written ... -->`` runs as a
user pastes it.

A snippet that fails as written (a missing ``[tls]``, no ``listen``, a flag that was
renamed) costs a new user their first hour; the marker says which blocks are meant to
run, and this test runs each one in a fresh process in an empty directory: a ``python``
block with this interpreter, a ``bash`` block with ``bash -euo pipefail`` and this
environment's ``gossipd`` first on ``PATH``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKED = re.compile(r"<!-- runs as written[^>]*-->\n```(python|bash)\n(.*?)```", re.DOTALL)
TIMEOUT_S = 300


def _blocks() -> list[tuple[str, str, str]]:
    """(page, language, code) of every marked block, pages in a fixed order."""
    return [
        (str(page.relative_to(ROOT)), language, code)
        for page in PAGES
        for language, code in MARKED.findall(page.read_text())
    ]


BLOCKS = _blocks()


def test_the_docs_mark_the_library_snippet_and_a_command_block_to_run() -> None:
    assert any(lang == "python" and "GossipNode(" in code for _, lang, code in BLOCKS)
    assert any(lang == "bash" and "gossipd certs" in code for _, lang, code in BLOCKS)


def test_a_marker_is_always_followed_by_a_block_it_can_run() -> None:
    """A marker above a ```toml block, or one blank line away, would be silently skipped."""
    for page in PAGES:
        markers = len(re.findall(r"^<!-- runs as written", page.read_text(), re.M))
        found = len(MARKED.findall(page.read_text()))
        assert markers == found, f"{page.relative_to(ROOT)}: {markers} markers, {found} blocks"


@pytest.mark.parametrize(
    ("page", "language", "code"),
    BLOCKS,
    ids=[f"{page}-{i}" for i, (page, _, _) in enumerate(BLOCKS)],
)
def test_a_marked_block_runs_as_written(
    page: str, language: str, code: str, tmp_path: Path
) -> None:
    if language == "python":
        argv = [sys.executable, "-c", code]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", code]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        argv, cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )
    assert done.returncode == 0, f"{page}: this block failed:\n{code}\n{done.stderr[-3000:]}"
    if "GossipNode(" in code:
        assert "sum-weights: [1.0" in done.stdout, done.stdout  # alone: its weight stays
