"""Sites forked from a process that has imported what a site imports: how `gossipd mesh up`,
`gossipd demo` and the local benchmarks start their nodes.

A site's process spends about 4 s of CPU importing torch, then torch._dynamo (its first
optimizer imports that), before it does anything else: a 4-site demo on 2 cores took
8 s of its start-up doing that, twice. Here a :mod:`multiprocessing` fork server,
started once per launching process, imports them once and runs nothing (no torch op,
no gRPC channel or server); each node is forked from it and runs ``gossipd --log-level
INFO node --config ...`` through the command line's own ``main``, in a process of its
own, with its own signals, sockets, log and exit status, ready in about 0.3 s. A site
an operator runs (`gossipd node`, a container) is the executable itself, which
:func:`~gossipd.node.launch.processes.spawn_node` starts where a caller needs exactly
that.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
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
    """The node's process: output to its log, the launcher's environment, then the
    command line as ``python -m gossipd.node.cli ARGV`` runs it (its exit status too)."""
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
    sys.argv = ["gossipd", *argv]
    runpy.run_module("gossipd.node.cli", run_name="__main__", alter_sys=True)


class ForkedProcess:
    """The subset of :class:`subprocess.Popen` the launcher and ``stop_process`` use."""

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
