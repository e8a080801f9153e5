"""A data_dir that cannot be written: training goes on, the old checkpoint stays, one clear line.

Faults are real kernel write errors at a chosen moment. As root (here and in CI)
data_dir is a small tmpfs that a filler file fills up, giving ENOSPC; a
read-only tmpfs gives EROFS. Without root, the daemon's RLIMIT_FSIZE is lowered
below a checkpoint's size (Python ignores SIGXFSZ, so writes fail with EFBIG)
and a read-only directory stands in for the read-only mount: the tests never
skip. Daemon output goes through a pipe, which neither fault can touch. The faults and
the piped daemon are ``tests/disk_faults.py``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipd.node.errors import CheckpointError, GossipdError
from gossipd.node.launch.localmesh import free_ports
from gossipd.node.net.status.query import query_status
from gossipd.node.trainer import checkpoint
from tests.conftest import scrape_metrics, wait_until, write_node_config
from tests.disk_faults import ROOT, TIMEOUT_S, Daemon, SmallDisk, read_only_at, small_disk_at

EVERY_STEPS = 200
BAD_OUTPUT = ("Traceback", "Event loop is closed", "was never awaited", "Task was destroyed")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_disk_at(tmp_path / "disk") as disk:
        yield disk


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    with read_only_at(tmp_path / "ro") as path:
        yield path


@pytest.fixture
def spawn() -> Iterator[Callable[..., Daemon]]:
    """Factory: ``spawn(config, preexec=None)`` starts a daemon; all are reaped at teardown."""
    started: list[Daemon] = []

    def start(config: Path, preexec: Callable[[], None] | None = None) -> Daemon:
        started.append(Daemon(config, preexec))
        return started[-1]

    yield start
    for daemon in started:
        daemon.stop()


def _status(address: str) -> dict[str, Any]:
    return asyncio.run(query_status(address, 10.0))


def _answers(address: str) -> bool:
    try:
        _status(address)
    except GossipdError:
        return False
    return True


def _config(tmp_path: Path, name: str, port: int, data_dir: Path, **extra: Any) -> Path:
    """The conftest defaults, but training (lr 0.01) and with a metrics endpoint."""
    return write_node_config(
        tmp_path,
        name,
        port,
        data_dir,
        mesh_id="disk-mesh",
        job={"learning_rate": 0.01},
        metrics={"listen": "127.0.0.1:0"},
        **extra,
    )


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("gossipd: ")]


@functools.cache
def _fingerprint() -> str:
    from gossipd.node.jobs.registry import JobSpec, build_job
    from gossipd.node.trainer.replica import Replica

    job = build_job(JobSpec("synthetic", seed=0, learning_rate=0.01))
    return Replica("x", job.model, segment_bytes=4 << 20).fingerprint


def _temp_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_checkpoint_save_on_a_full_disk_raises_keeps_the_old_file_and_leaves_no_temp(
    small_disk: SmallDisk,
) -> None:
    ckpt = checkpoint.Checkpoint("n", "fp", 1, {}, [torch.zeros(1000)], weights=[1.0])
    checkpoint.save(small_disk.path, ckpt)
    small_disk.fill(os.getpid())
    try:
        with pytest.raises(CheckpointError) as caught:
            checkpoint.save(
                small_disk.path,
                checkpoint.Checkpoint("n", "fp", 2, {}, [torch.ones(1000)], weights=[0.5]),
            )
    finally:
        small_disk.free()
    message = str(caught.value)
    assert str(small_disk.path / checkpoint.FILENAME) in message
    assert ("No space left on device" if ROOT else "File too large") in message
    assert "free" in message
    assert _temp_files(small_disk.path) == []
    kept = checkpoint.load(small_disk.path / checkpoint.FILENAME, fingerprint="fp")
    assert kept.step == 1 and torch.equal(kept.segments[0], torch.zeros(1000))
    assert kept.weights == [1.0]


SENT_OK = 'gossipd_gossip_messages_total{direction="sent",kind="push",result="ok"}'


def _start_full_and_peer(
    tmp_path: Path, full_dir: Path, spawn: Callable[..., Daemon]
) -> tuple[Daemon, Daemon, str, int]:
    """``full`` (data_dir on the small disk, a checkpoint every EVERY_STEPS) and ``peer``
    gossiping at push probability 0.5, once ``full`` has checkpointed and pushed: both,
    ``full``'s address and its metrics port."""
    ports = free_ports(2)
    gossip = {"push_probability": 0.5}
    peer = spawn(
        _config(
            tmp_path,
            "peer",
            ports[0],
            tmp_path / "peer",
            seeds=[f"127.0.0.1:{ports[1]}"],
            gossip=gossip,
        )
    )
    full = spawn(
        _config(
            tmp_path,
            "full",
            ports[1],
            full_dir,
            seeds=[f"127.0.0.1:{ports[0]}"],
            gossip=gossip,
            checkpoint={"every_steps": EVERY_STEPS},
        )
    )
    address, target = f"127.0.0.1:{ports[1]}", full_dir / checkpoint.FILENAME
    wait_until(lambda: _answers(address), "the daemon to answer", TIMEOUT_S, full.alive)
    wait_until(target.exists, "the first periodic checkpoint", TIMEOUT_S, full.alive)
    # Written before training starts, so present once a periodic checkpoint is.
    metrics_port = json.loads((full_dir / "node.json").read_text())["metrics_port"]
    wait_until(
        lambda: scrape_metrics(metrics_port).get(SENT_OK, 0) > 0,
        "a first push",
        TIMEOUT_S,
        full.alive,
    )
    return full, peer, address, metrics_port


def _fill_until_three_checkpoints_failed(
    small_disk: SmallDisk, full: Daemon, address: str, metrics_port: int
) -> checkpoint.Checkpoint:
    """Fill the disk until a checkpoint fails, then until three have while training and
    gossip go on; returns the last good checkpoint, which still loads."""
    target = small_disk.path / checkpoint.FILENAME

    def failing() -> bool:
        small_disk.fill(full.proc.pid)  # also takes what a write in progress held
        return scrape_metrics(metrics_port).get("gossipd_checkpoint_failures_total", 0) >= 1

    wait_until(failing, "a failed checkpoint", TIMEOUT_S, full.alive)
    kept = checkpoint.load(target, fingerprint=_fingerprint())  # the last good one loads
    at_failure = scrape_metrics(metrics_port)
    step_at_failure = _status(address)["step"]
    wait_until(
        lambda: (
            scrape_metrics(metrics_port)["gossipd_checkpoint_failures_total"] >= 3
            and _status(address)["step"] > step_at_failure + 2 * EVERY_STEPS
            and scrape_metrics(metrics_port)[SENT_OK] > at_failure[SENT_OK]
        ),
        "three failed intervals while training and gossip go on",
        TIMEOUT_S,
        full.alive,
    )
    return kept


def _wait_recovered(full: Daemon, target: Path, kept: checkpoint.Checkpoint) -> None:
    """Until a checkpoint newer than ``kept`` is written and the recovery is logged."""
    wait_until(
        lambda: checkpoint.load(target, fingerprint=_fingerprint()).step > kept.step,
        "a checkpoint after space was freed",
        TIMEOUT_S,
        full.alive,
    )
    wait_until(
        lambda: any(
            "INFO" in line and "checkpoint" in line and "again" in line for line in full.lines()
        ),
        "the recovery to be logged",
        TIMEOUT_S,
        full.alive,
    )


def test_full_disk_during_training_warns_once_keeps_training_and_gossip_then_recovers(
    tmp_path: Path, small_disk: SmallDisk, spawn: Callable[..., Daemon]
) -> None:
    """The fault: the disk fills after the first periodic checkpoint; later, space is freed."""
    full_dir = small_disk.path
    target = full_dir / checkpoint.FILENAME
    full, peer, address, metrics_port = _start_full_and_peer(tmp_path, full_dir, spawn)

    kept = _fill_until_three_checkpoints_failed(small_disk, full, address, metrics_port)
    warnings = [line for line in full.lines() if "WARNING" in line and "checkpoint" in line]
    assert len(warnings) == 1, full.output()
    assert str(target) in warnings[0] and "free" in warnings[0]
    assert checkpoint.load(target, fingerprint=_fingerprint()).step == kept.step

    small_disk.free()
    _wait_recovered(full, target, kept)
    after = scrape_metrics(metrics_port)
    assert after["gossipd_checkpoint_last_success_timestamp_seconds"] > 0
    assert after["gossipd_checkpoint_write_seconds_count"] > 0
    assert full.stop() == 0
    assert peer.stop() == 0
    assert _temp_files(full_dir) == []
    assert not any(bad in full.output() for bad in BAD_OUTPUT), full.output()


def test_full_disk_at_start_is_one_line_naming_data_dir_and_exit_code_2(
    tmp_path: Path, small_disk: SmallDisk, spawn: Callable[..., Daemon]
) -> None:
    preexec = small_disk.full_at_start()
    data_dir = small_disk.path
    daemon = spawn(_config(tmp_path, "n", free_ports(1)[0], data_dir), preexec)
    assert daemon.wait() == 2
    out = daemon.output()
    errors = _error_lines(out)
    assert len(errors) == 1, out
    assert "data_dir" in errors[0] and str(data_dir) in errors[0], out
    assert ("No space left on device" if ROOT else "File too large") in errors[0]
    assert not any(bad in out for bad in BAD_OUTPUT), out
    assert _temp_files(data_dir) == []


@pytest.mark.parametrize("case", ["read-only", "not creatable"])
def test_unwritable_data_dir_is_one_line_naming_data_dir_and_exit_code_2(
    tmp_path: Path, request: pytest.FixtureRequest, spawn: Callable[..., Daemon], case: str
) -> None:
    if case == "read-only":
        data_dir = request.getfixturevalue("read_only_dir")
    else:
        (tmp_path / "a-file").write_text("not a directory")
        data_dir = tmp_path / "a-file" / "state"
    daemon = spawn(_config(tmp_path, "n", free_ports(1)[0], data_dir))
    assert daemon.wait() == 2
    out = daemon.output()
    errors = _error_lines(out)
    assert len(errors) == 1, out
    assert "data_dir" in errors[0] and str(data_dir) in errors[0], out
    assert not any(bad in out for bad in BAD_OUTPUT), out


def test_final_checkpoint_on_a_full_disk_is_one_line_and_exit_code_1(
    tmp_path: Path, small_disk: SmallDisk, spawn: Callable[..., Daemon]
) -> None:
    """The fault: the disk fills while the daemon trains; then SIGTERM asks for a checkpoint."""
    port = free_ports(1)[0]
    daemon = spawn(_config(tmp_path, "n", port, small_disk.path))
    address = f"127.0.0.1:{port}"
    wait_until(lambda: _answers(address), "the daemon to answer", TIMEOUT_S, daemon.alive)
    wait_until(lambda: _status(address)["step"] > 0, "a first step", TIMEOUT_S, daemon.alive)
    small_disk.fill(daemon.proc.pid)
    code = daemon.stop()
    out = daemon.output()
    assert code == 1, out
    errors = _error_lines(out)
    assert len(errors) == 1 and "final checkpoint" in errors[0], out
    assert str(small_disk.path / checkpoint.FILENAME) in errors[0]
    assert not any(bad in out for bad in BAD_OUTPUT), out
    assert _temp_files(small_disk.path) == []
    initial = checkpoint.load(small_disk.path / "initial.pt", fingerprint=_fingerprint())
    assert initial.step == 0
