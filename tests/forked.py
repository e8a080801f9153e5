"""Daemons for the tests, forked from a process that has imported what a daemon imports.

The suite starts about 300 daemons. Each ``python -m gossipd.node.cli node`` spent about
4 s of CPU importing torch, then torch._dynamo (its first optimizer imports that) before
it did anything else: on CI's 2 cores, about half of the suite's time. Here a
:mod:`multiprocessing` fork server, started once per test worker, imports them once and
runs nothing (no torch op, no gRPC channel or server); each daemon is forked from it and
runs ``gossipd --log-level INFO node --config ...`` through the CLI's own ``main``, in a
process of its own, with its own signals, sockets and exit status, as the launchers'
daemons do; it is ready in about 0.3 s instead of 3 to 8. Tests of the command line
itself and of how a process exits (tests/test_allreduce.py, `mesh up`, `demo`, the
benchmarks) still start the real executable.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

# Imported once in the fork server. torch._dynamo is not imported by ``import torch`` but
# by the first optimizer a job builds (and sympy by the first ``to_empty``): another 2 s of
# CPU per daemon. None of them starts a thread of its own at import but NumPy's BLAS pool,
# which re-creates itself in a forked child; gRPC starts its threads on
# first use, in the daemon.
PRELOAD = [
    "torch",
    "torch._dynamo",
    "gossipd.node.cli.main",
    "gossipd.node.site.site",
]

_CONTEXT_LOCK = threading.Lock()
_context: Any = None


def _fork_server() -> Any:
    global _context
    with _CONTEXT_LOCK:
        if _context is None:
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(PRELOAD)
        return _context


def _run(argv: list[str], log_path: str, env: dict[str, str], cwd: str) -> None:
    """The daemon's process: output to its log, the test's environment, then the CLI."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    signal.signal(signal.SIGINT, signal.default_int_handler)

    from gossipd.node.cli.main import main

    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


class ForkedProcess:
    """The subset of :class:`subprocess.Popen` the tests and ``stop_process`` use."""

    def __init__(self, process: Any, argv: list[str]) -> None:
        self._process = process
        self.args = argv
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_node(
    config: Path, log_path: Path, command: str = "node", extra: tuple[str, ...] = ()
) -> ForkedProcess:
    """``gossipd --log-level INFO COMMAND --config CONFIG EXTRA``, output appended to
    ``log_path``: what :func:`gossipd.node.launch.processes.spawn_node` starts, forked."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = ["--log-level", "INFO", command, "--config", str(config), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = _fork_server().Process(
        target=_run, args=(argv, str(log_path), env, os.getcwd()), daemon=False
    )
    process.start()
    return ForkedProcess(process, argv)
