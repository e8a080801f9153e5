"""Sizes: no module over 400 lines and no function over 60 in node/, coordinator/, bench/
and dashboards/ (docs/contributing.md, "Sizes").

A module that grows past a screenful of screens does several jobs, and a function past
one screen does several steps: each is split by what its parts are for, with names, before
a newcomer has to read all of it to change one line. The generated protobuf stubs are
written by a tool, not by us, and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("node", "coordinator", "bench", "dashboards")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def _sources() -> list[Path]:
    found = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]
    return [p for p in found if "_pb2" not in p.name]


def _long_functions(source: str) -> list[tuple[str, int]]:
    """(name, lines) of every function longer than the limit, from its ``def`` line to its
    last line (decorators aside), nested functions and methods included."""
    long = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append((node.name, lines))
    return long


def test_the_size_check_reads_every_folder_it_names() -> None:
    seen = {p.relative_to(ROOT).parts[0] for p in _sources()}
    assert seen == set(FOLDERS)
    assert not any(p.name.endswith("_pb2.py") for p in _sources())


@pytest.mark.parametrize("path", _sources(), ids=[str(p.relative_to(ROOT)) for p in _sources()])
def test_no_module_over_400_lines_nor_function_over_60(path: Path) -> None:
    source = path.read_text()
    lines = len(source.splitlines())
    assert lines <= MAX_MODULE_LINES, (
        f"{path.relative_to(ROOT)} has {lines} lines, over {MAX_MODULE_LINES}: split it by "
        "responsibility into modules named for what they hold"
    )
    long = _long_functions(source)
    assert long == [], (
        f"{path.relative_to(ROOT)}: {long} over {MAX_FUNCTION_LINES} lines: split each into "
        "named steps"
    )


def test_the_function_check_sees_a_long_function() -> None:
    # Without this, a check that never measured a function would pass every test above.
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert _long_functions(f"def short():\n    pass\n\nasync def long():\n{body}") == [
        ("long", MAX_FUNCTION_LINES + 1)
    ]
