"""Running the command line in a forked child: the part of starting a process that both
`gossipd mesh up` (sites forked from a fork server that imported torch once, see
:mod:`gossipd.node.launch.forked`) and `gossipd node --ranks R` (ranks forked from the
site's launcher, :mod:`.rank_launcher`) share.

A child runs ``python -m gossipd.node.cli ARGV`` as the executable would, in a process
of its own (its own signals, sockets and exit status), without paying again for what the
parent imported: about 4 s of CPU for torch and torch._dynamo per process.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
from typing import Any

# What a site imports before it does anything, where a parent imports it once for the
# children it forks. torch._dynamo is not imported by ``import torch`` but by the first
# optimizer a job builds: another 2 s of CPU per process. None of them starts a thread of
# its own at import but NumPy's BLAS pool, which re-creates itself in a forked child.
SITE_IMPORTS = ["torch", "torch._dynamo", "gossipd.node.site.site"]


def run_cli(argv: list[str], env: dict[str, str], cwd: str, log_path: str | None) -> None:
    """The child's body: the given environment and directory, output to ``log_path`` (None:
    the parent's), then the command line as ``python -m gossipd.node.cli ARGV`` runs it;
    its exit status is the child's."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if log_path is not None:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = ["gossipd", *argv]
    runpy.run_module("gossipd.node.cli", run_name="__main__", alter_sys=True)


class ForkedProcess:
    """The subset of :class:`subprocess.Popen` the launchers and ``stop_process`` use, over
    a :class:`multiprocessing.Process`."""

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


def fork_cli(
    context: Any, argv: list[str], env: dict[str, str], log_path: str | None
) -> ForkedProcess:
    """Start ``gossipd ARGV`` in a child of ``context`` (a multiprocessing context)."""
    process = context.Process(target=run_cli, args=(argv, env, os.getcwd(), log_path), daemon=False)
    process.start()
    return ForkedProcess(process, argv)
