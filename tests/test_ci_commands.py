"""CI runs what the README tells a new user to run: its install and test commands.

A test command that only works after set-up CI does on the side fails on a fresh
machine; so the README's test command is a script that does that set-up, and
``.ci/run`` calls exactly it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _first_block(section: str) -> list[str]:
    """The command lines of the first ```bash block under the README heading ``section``."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", body, re.S)
    assert block, f"no bash block under '## {section}'"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]


def test_ci_runs_the_readmes_install_and_test_commands_exactly() -> None:
    ci = _ci_lines()
    install = _first_block("Install")
    assert install[-1] in ci, (install, ci)
    test = _first_block("Test")
    assert test == ["bash tests/run.sh"], test
    assert ci[-1] == test[0], "the test command must be the last thing .ci/run does"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "tests" / "run.sh"), "-n", "0", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={"PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin"},
    )


def test_the_test_command_passes_pytests_arguments_and_its_exit_code() -> None:
    proc = _run("-q", "tests/test_ci_commands.py", "-k", "exactly")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "passed" in proc.stdout


def test_the_test_command_fails_when_pytest_collects_nothing() -> None:
    proc = _run("-q", "tests/test_ci_commands.py", "-k", "no_test_has_this_name")
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "collected no tests" in proc.stderr
