"""A data_dir that cannot be written: training goes on, the old checkpoint stays, one clear line.

Faults are real kernel write errors at a chosen moment. As root (here and in CI)
data_dir is a small tmpfs that a filler file fills up, giving ENOSPC; a
read-only tmpfs gives EROFS. Without root, the daemon's RLIMIT_FSIZE is lowered
below a checkpoint's size (Python ignores SIGXFSZ, so writes fail with EFBIG)
and a read-only directory stands in for the read-only mount: the tests never
skip. Daemon output goes through a pipe, which neither fault can touch.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import os
import resource
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipd.node.errors import CheckpointError, GossipdError
from gossipd.node.launch.localmesh import free_ports, stop_process
from gossipd.node.net.status import query_status
from gossipd.node.trainer import checkpoint
from tests.conftest import scrape_metrics, wait_until, write_node_config

ROOT = os.geteuid() == 0
TIMEOUT_S = 120.0
EVERY_STEPS = 200
BAD_OUTPUT = ("Traceback", "Event loop is closed", "was never awaited", "Task was destroyed")
# Below the size of any checkpoint of the synthetic job (about 2 KB), above node.json's.
RLIMIT_BYTES = 1024
CLI = [sys.executable, "-m", "gossipd.node.cli"]


class SmallDisk:
    """A directory whose writes can be made to fail with a real kernel error, and recover."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._filler: Any = None
        self._limited: dict[int, tuple[int, int]] = {}

    def fill(self, pid: int) -> None:
        """Make writes by process ``pid`` fail: root fills the tmpfs, others lower its limit.

        Idempotent; as root, a second call also takes what a write in progress freed.
        """
        if not ROOT:
            if pid not in self._limited:
                self._limited[pid] = resource.prlimit(pid, resource.RLIMIT_FSIZE)
                hard = self._limited[pid][1]
                resource.prlimit(pid, resource.RLIMIT_FSIZE, (RLIMIT_BYTES, hard))
            return
        if self._filler is None:
            self._filler = open(self.path / "filler", "ab", buffering=0)  # noqa: SIM115
        try:
            while True:
                self._filler.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC, err

    def full_at_start(self) -> Callable[[], None] | None:
        """Fill now (root) or return a preexec_fn that limits the child before it runs."""
        if ROOT:
            self.fill(0)
            return None
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (RLIMIT_BYTES, hard))

    def free(self) -> None:
        if self._filler is not None:
            self._filler.close()
            (self.path / "filler").unlink()
            self._filler = None
        for pid, limits in self._limited.items():
            with contextlib.suppress(ProcessLookupError):
                resource.prlimit(pid, resource.RLIMIT_FSIZE, limits)
        self._limited.clear()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[SmallDisk]:
    path = tmp_path / "disk"
    path.mkdir()
    if ROOT:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(path)], check=True)
    disk = SmallDisk(path)
    try:
        yield disk
    finally:
        disk.free()
        if ROOT:  # lazy: a daemon still being reaped may hold a file open there
            subprocess.run(["umount", "--lazy", str(path)], check=True)


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "ro"
    path.mkdir()
    if ROOT:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], check=True
        )
    else:
        path.chmod(0o555)
    try:
        yield path
    finally:
        if ROOT:
            subprocess.run(["umount", "--lazy", str(path)], check=True)
        else:
            path.chmod(0o755)


class Daemon:
    """`gossipd node` with its output read through a pipe into memory."""

    def __init__(self, config: Path, preexec: Callable[[], None] | None = None) -> None:
        self.proc = subprocess.Popen(
            [*CLI, "--log-level", "INFO", "node", "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=preexec,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._lock:
                self._lines.append(line.rstrip("\n"))

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._lines)

    def output(self) -> str:
        return "\n".join(self.lines())

    def alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.output()}")

    def stop(self, timeout_s: float = 60.0) -> int:
        code = stop_process(self.proc, timeout_s)
        self._reader.join(30)
        return code

    def wait(self, timeout_s: float = TIMEOUT_S) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        finally:
            stop_process(self.proc)
        self._reader.join(30)
        return code


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
    from gossipd.node.trainer.jobs import JobSpec, build_job
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


def test_full_disk_during_training_warns_once_keeps_training_and_gossip_then_recovers(
    tmp_path: Path, small_disk: SmallDisk, spawn: Callable[..., Daemon]
) -> None:
    """The fault: the disk fills after the first periodic checkpoint; later, space is freed."""
    ports = free_ports(2)
    peer_dir, full_dir = tmp_path / "peer", small_disk.path
    gossip = {"push_probability": 0.5}
    peer = spawn(
        _config(
            tmp_path, "peer", ports[0], peer_dir, seeds=[f"127.0.0.1:{ports[1]}"], gossip=gossip
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
    sent_ok = 'gossipd_gossip_messages_total{direction="sent",kind="push",result="ok"}'
    wait_until(
        lambda: scrape_metrics(metrics_port).get(sent_ok, 0) > 0,
        "a first push",
        TIMEOUT_S,
        full.alive,
    )

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
            and scrape_metrics(metrics_port)[sent_ok] > at_failure[sent_ok]
        ),
        "three failed intervals while training and gossip go on",
        TIMEOUT_S,
        full.alive,
    )
    warnings = [line for line in full.lines() if "WARNING" in line and "checkpoint" in line]
    assert len(warnings) == 1, full.output()
    assert str(target) in warnings[0] and "free" in warnings[0]
    assert checkpoint.load(target, fingerprint=_fingerprint()).step == kept.step

    small_disk.free()
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
