"""A daemon that cannot start says so in one clear line, exits with code 2 and leaves
nothing running: a taken port, a taken metrics port, an unknown job or a misspelt key,
and a join that fails after the server started (which saves nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

BAD_OUTPUT = ("Traceback", "Event loop is closed", "was never awaited", "Task was destroyed")


def _node_cli(tmp_path: Path, node_id: str, **config: Any) -> subprocess.CompletedProcess[str]:
    """Run `gossipd node` to its exit (default log level: what an operator sees)."""
    from gossipd.node.launch.localmesh import free_ports
    from tests.conftest import write_config

    full: dict[str, Any] = {
        "mesh_id": "test-mesh",
        "node_id": node_id,
        "listen": f"127.0.0.1:{free_ports(1)[0]}",
        "data_dir": str(tmp_path / node_id),
        "job": {"name": "synthetic", "eval_every_steps": 0},
        "tls": {"insecure": True},
        **config,
    }
    path = tmp_path / f"{node_id}.toml"
    write_config(path, full)
    return subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", "node", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert not any(bad in output for bad in BAD_OUTPUT), output
    errors = [line for line in output.splitlines() if line.startswith("gossipd: ")]
    assert len(errors) == 1 and errors[0].startswith("gossipd: error: "), output
    return errors[0]


def test_taken_port_is_refused_in_one_line_and_the_holder_keeps_answering(
    daemons: Any, tmp_path: Path
) -> None:
    holder = daemons("holder")
    proc = _node_cli(tmp_path, "intruder", listen=holder.address)
    line = _one_error_line(proc)
    assert f"listen = '{holder.address}': cannot listen there: Address already in use" in line
    assert proc.stdout + proc.stderr == line + "\n"  # nothing else, not even gRPC's own log
    for _ in range(5):  # connections spread over two listeners would reach the intruder
        assert holder.status()["node_id"] == "holder"


def test_taken_metrics_port_is_refused_in_one_line_before_anything_starts(
    daemons: Any, tmp_path: Path
) -> None:
    holder = daemons("holder", metrics={"listen": "127.0.0.1:0"})
    taken = f"127.0.0.1:{holder.node_json()['metrics_port']}"
    line = _one_error_line(_node_cli(tmp_path, "intruder", metrics={"listen": taken}))
    assert f"metrics.listen = '{taken}': cannot listen there" in line
    assert holder.status()["node_id"] == "holder"


def test_unknown_job_and_misspelt_key_are_refused_in_one_line(tmp_path: Path) -> None:
    line = _one_error_line(_node_cli(tmp_path, "nojob", job={"name": "no-such-job"}))
    assert "unknown job 'no-such-job'" in line
    proc = _node_cli(tmp_path, "typo", gossip={"push_probabilty": 0.5})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("gossipd: error: invalid config")
    assert "did you mean 'push_probability'?" in proc.stderr


def test_join_failure_after_the_server_started_is_one_line_and_saves_nothing(
    tmp_path: Path,
) -> None:
    """Raised inside the event loop (bootstrap), it still reaches the CLI as exit code 2."""
    from gossipd.node.launch.localmesh import free_ports

    nobody = f"127.0.0.1:{free_ports(1)[0]}"
    proc = _node_cli(tmp_path, "joiner", join=True, seeds=[nobody], join_timeout_s=1.0)
    assert "join: no peer answered within 1.0 s" in _one_error_line(proc)
    # Not trained, weight unchanged: a checkpoint would make a restart skip the bootstrap.
    assert not (tmp_path / "joiner" / "checkpoint.pt").exists()
