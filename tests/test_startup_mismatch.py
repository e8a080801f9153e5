"""A data_dir's checkpoint is resumed only under the config keys it was written with
(issue 34): another node_id, mesh_id, gossip.protocol or job.name is refused in one line
that names the key, both values and the fix, with exit code 2, and the checkpoint files
stay byte for byte as they were.

``checkpoint.json``, written after each ``checkpoint.pt``, lets ``gossipd node`` refuse
before torch loads; a data_dir without it (written by an older release) is refused by the
restore itself, before anything is restored. One real daemon writes the checkpoint (the
module fixture); every refused start after it is a real ``gossipd node`` process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import free_ports, stop_process
from gossipd.node.shared.config import load_config
from gossipd.node.site.preflight import check_checkpoint_owner, check_site
from tests.daemons import start_daemon, wait_until, write_config

CHECKPOINT_FILES = ("checkpoint.pt", "checkpoint.json")


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The data_dir of node a (mesh test-mesh, sumweight, synthetic job) after it took
    some steps and stopped on SIGTERM, leaving its final checkpoint."""
    root = tmp_path_factory.mktemp("written")
    handle = start_daemon(root, "a", free_ports(1)[0])
    try:
        wait_until(lambda: handle.status()["step"] > 0, "a to take a step", 60.0)
    finally:
        code = handle.stop()
    assert code == 0, handle.log()
    return handle.data_dir


def _copy(written: Path, tmp_path: Path, files: tuple[str, ...] = CHECKPOINT_FILES) -> Path:
    """A data_dir of its own for one test, holding ``files`` of the written one."""
    data_dir = tmp_path / "site"
    data_dir.mkdir()
    for name in files:
        shutil.copy2(written / name, data_dir / name)
    return data_dir


def _config(tmp_path: Path, data_dir: Path, **config: Any) -> Path:
    """The written node's keys (as tests.daemons sets them, less the settings of a running
    daemon, whose deprecated keys would add a warning line), with ``config`` over them."""
    full: dict[str, Any] = {
        "mesh_id": "test-mesh",
        "node_id": "a",
        "listen": f"127.0.0.1:{free_ports(1)[0]}",
        "data_dir": str(data_dir),
        "job": {"name": "synthetic", "eval_every_steps": 0},
        "tls": {"insecure": True},
    }
    for key, value in config.items():
        full[key] = {**full.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "site.toml"
    write_config(path, full)
    return path


def _files(data_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(data_dir.iterdir())}


def _gossipd_node(config_path: Path) -> subprocess.CompletedProcess[str]:
    """`gossipd node` as an operator runs it (default log level), to its exit."""
    return subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", "node", "--config", str(config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _only_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused start prints: nothing else, not even the INFO line that
    announces loading torch."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("gossipd: error: "), proc.stderr
    return proc.stderr.rstrip("\n")


def _forked_node_error(config_path: Path, log_path: Path) -> str:
    """Run a forked `gossipd node` (torch already imported: the refusals that come after
    the job is built) to its exit; its one error line."""
    code = stop_process(fork_node(config_path, log_path), 60.0, signalled=True)
    output = log_path.read_text()
    assert code == 2, output
    assert not any(bad in output for bad in ("Traceback", "ValueError")), output
    errors = [line for line in output.splitlines() if line.startswith("gossipd: ")]
    assert len(errors) == 1 and errors[0].startswith("gossipd: error: "), output
    return errors[0]


def test_each_checkpoint_is_followed_by_its_record_of_node_mesh_protocol_job_and_model(
    written: Path,
) -> None:
    record = json.loads((written / "checkpoint.json").read_text())
    ckpt = torch.load(written / "checkpoint.pt", weights_only=True)
    assert record == {
        "node_id": "a",
        "mesh_id": "test-mesh",
        "protocol": "sumweight",
        "job": "synthetic",
        "fingerprint": ckpt["fingerprint"],
        "step": ckpt["step"],
    }
    assert ckpt["step"] > 0


@pytest.mark.parametrize(
    ("key", "then", "now", "config"),
    [
        ("node_id", "a", "b", {"node_id": "b"}),
        ("mesh_id", "test-mesh", "other-mesh", {"mesh_id": "other-mesh"}),
        ("gossip.protocol", "sumweight", "overlap", {"gossip": {"protocol": "overlap"}}),
        ("job.name", "synthetic", "digits", {"job": {"name": "digits"}}),
    ],
)
def test_a_checkpoint_of_another_key_is_refused_in_one_line_before_torch_loads(
    written: Path, tmp_path: Path, key: str, then: str, now: str, config: dict[str, Any]
) -> None:
    data_dir = _copy(written, tmp_path)
    before = _files(data_dir)
    line = _only_line(_gossipd_node(_config(tmp_path, data_dir, **config)))
    assert line == (
        f"gossipd: error: data_dir {data_dir} holds a checkpoint written with {key} = "
        f"{then!r}, but this config has {key} = {now!r}; set {key} = {then!r} to resume it, "
        "or point data_dir at a fresh directory (or move checkpoint.pt and checkpoint.json "
        "out of it) to start anew"
    )
    assert _files(data_dir) == before


def test_an_unreadable_checkpoint_json_is_refused_in_one_line_naming_the_file(
    written: Path, tmp_path: Path
) -> None:
    data_dir = _copy(written, tmp_path)
    (data_dir / "checkpoint.json").write_text('{"node_id": "a", "mesh')  # cut short
    before = _files(data_dir)
    line = _only_line(_gossipd_node(_config(tmp_path, data_dir)))
    assert f"{data_dir / 'checkpoint.json'}: cannot read it: not a record gossipd wrote" in line
    assert "move it out of data_dir" in line
    assert _files(data_dir) == before


@pytest.mark.parametrize(
    ("files", "config", "expected"),
    [
        # An older data_dir, without checkpoint.json: the restore compares checkpoint.pt.
        (
            ("checkpoint.pt",),
            {"gossip": {"protocol": "overlap"}},
            "gossip.protocol = 'sumweight', but this config has gossip.protocol = 'overlap'; "
            "set gossip.protocol = 'sumweight' to resume it",
        ),
        (
            ("checkpoint.pt",),
            {"node_id": "b"},
            "node_id = 'a', but this config has node_id = 'b'; set node_id = 'a' to resume it",
        ),
        # Another model shape under the same job name: only the built job can tell.
        (
            CHECKPOINT_FILES,
            {"job": {"options": {"dim": 16}}},
            "(job.name or job.options changed since it was written); set them back to resume "
            "it, or to start anew, point data_dir at a fresh directory",
        ),
    ],
    ids=["protocol-without-json", "node_id-without-json", "model-shape"],
)
def test_a_mismatch_found_after_the_job_is_built_is_one_line_and_restores_nothing(
    written: Path,
    tmp_path: Path,
    files: tuple[str, ...],
    config: dict[str, Any],
    expected: str,
) -> None:
    data_dir = _copy(written, tmp_path, files)
    before = _files(data_dir)
    line = _forked_node_error(_config(tmp_path, data_dir, **config), tmp_path / "node.log")
    assert expected in line and "fresh directory" in line, line
    assert _files(data_dir) == before


def test_a_matching_checkpoint_json_passes_the_start_up_checks(
    written: Path, tmp_path: Path
) -> None:
    data_dir = _copy(written, tmp_path)
    check_site(load_config(_config(tmp_path, data_dir)))


def test_a_checkpoint_json_without_its_checkpoint_is_stale_and_ignored(
    written: Path, tmp_path: Path
) -> None:
    """Moving checkpoint.pt away starts anew; the record left behind must not refuse that."""
    data_dir = _copy(written, tmp_path, ("checkpoint.json",))
    check_checkpoint_owner(load_config(_config(tmp_path, data_dir, mesh_id="other-mesh")))
