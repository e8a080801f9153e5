"""docs/first-mesh.md, the operator's path, run as an operator pastes it: certificates,
configs with fixed ports, start, join, check the mesh, rotate, leave, in that order, in
one shell (its functions and files carry from block to block).

Only the fixed ports change: each is replaced by a free one picked now, so the page
can say 50051 and the test never collides with another run. Then the mesh the page
left running is checked: three sites answer, site-c is gone, the sum of weights is
still 3 (site-d joined at 0, site-c handed its weight on), and the rotated
certificate was read.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from gossipd.node.launch.processes import free_ports

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "first-mesh.md"
MARKED = re.compile(r"<!-- first mesh:[^>]*-->\n```bash\n(.*?)```", re.DOTALL)
FIXED_PORTS = (50051, 50052, 50053, 50054, 9101, 9102, 9103, 9104)
SITES = ("site-a", "site-b", "site-c", "site-d")
TIMEOUT_S = 600
TOLERANCE = 1e-9


def _script(ports: dict[int, int]) -> str:
    blocks = MARKED.findall(PAGE.read_text())
    assert len(blocks) == 7, f"{PAGE.name}: {len(blocks)} marked blocks, not the path's 7 steps"
    script = "\n".join(blocks)
    return re.sub(r"\b(\d{4,5})\b", lambda m: str(ports.get(int(m[1]), m[1])), script)


def _stop(workdir: Path) -> list[str]:
    """SIGTERM every site the page started that still runs, and wait (bounded) until each
    is gone: they are the page's shell's children, not ours, so their logs tell how they
    ended. Returns the sites that had to be killed."""
    pids = {
        s: int((workdir / f"{s}.pid").read_text()) for s in SITES if (workdir / f"{s}.pid").exists()
    }
    pids = {s: pid for s, pid in pids.items() if _runs_in(pid, workdir)}
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    killed = []
    for site, pid in pids.items():
        gone = subprocess.run(
            ["timeout", "90", "tail", f"--pid={pid}", "-f", "/dev/null"], check=False
        )
        if gone.returncode != 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.append(site)
    return killed


def _runs_in(pid: int, workdir: Path) -> bool:
    """Whether ``pid`` is still a process started in ``workdir`` (not a reused pid)."""
    try:
        return Path(f"/proc/{pid}/cwd").resolve() == workdir.resolve()
    except OSError:
        return False


def test_the_operators_path_runs_as_written_and_keeps_the_mesh_whole(tmp_path: Path) -> None:
    ports = dict(zip(FIXED_PORTS, free_ports(len(FIXED_PORTS)), strict=True))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    try:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", _script(ports)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
        )
        if done.returncode != 0:
            tails = {
                s: p.read_text()[-1500:] for s in SITES if (p := tmp_path / f"{s}.log").exists()
            }
            raise AssertionError(f"the page's blocks failed:\n{done.stderr[-3000:]}\n{tails}")
        query = ["status", "--mesh", "--json", "--address", f"127.0.0.1:{ports[50051]}"]
        mesh = json.loads(
            subprocess.run(
                [sys.executable, "-m", "gossipd.node.cli", *query, "--config", "site-a.toml"],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
        )
    finally:
        killed = _stop(tmp_path)
    logs = {s: (tmp_path / f"{s}.log").read_text() for s in SITES}
    assert "sum-weight (per segment)" in done.stdout and "site-d" in done.stdout, done.stdout
    names = sorted(r["node_id"] for r in mesh["sites"])
    assert names == ["site-a", "site-b", "site-d"] and not mesh["unreachable"], mesh
    assert mesh["sum_weight_low"] - TOLERANCE <= 3.0 <= mesh["sum_weight"] + TOLERANCE, mesh
    assert "bootstrapped the model from" in logs["site-d"], logs["site-d"][-3000:]
    assert "SIGHUP: reloaded the TLS files; certificate for site-b" in logs["site-b"]
    assert "handed weight to" in logs["site-c"], logs["site-c"][-3000:]
    assert not killed, f"{killed} did not stop within 90 s of SIGTERM"
    for site in SITES:
        assert "wrote the final checkpoint" in logs[site], (site, logs[site][-3000:])
