"""``gossipd sim`` as a user runs it: a process of its own, its exit code, stderr and JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any


def sim_cli(*argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``gossipd sim ARGV`` to the end (a fresh interpreter: its memory is its own)."""
    return subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", "sim", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def json_line(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The ``--json`` object, the last line of a run that succeeded."""
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return data
