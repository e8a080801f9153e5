"""Real kernel write errors for the storage tests, at a chosen moment, and a daemon whose
output no such error can touch.

As root (here and in CI) a data_dir is a small tmpfs that a filler file fills up, giving
ENOSPC, and a read-only tmpfs gives EROFS. Without root, the daemon's RLIMIT_FSIZE is
lowered below a checkpoint's size (Python ignores SIGXFSZ, so writes fail with EFBIG)
and a read-only directory stands in for the read-only mount. :class:`Daemon`'s output
goes through a pipe.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from gossipd.node.launch.localmesh import stop_process

ROOT = os.geteuid() == 0
TIMEOUT_S = 120.0
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


@contextlib.contextmanager
def small_disk_at(path: Path) -> Iterator[SmallDisk]:
    """``path`` (made here) as a :class:`SmallDisk`: a 256 KiB tmpfs as root; freed and
    unmounted after."""
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


@contextlib.contextmanager
def read_only_at(path: Path) -> Iterator[Path]:
    """``path`` (made here), read-only: a read-only tmpfs as root, mode 0555 otherwise."""
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
