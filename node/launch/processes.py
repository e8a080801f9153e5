"""The launcher's child processes on loopback: ports free for them to listen on,
`gossipd node` (or `gossipd coordinator`) started with its log in a file, and stopped
so that every child is always reaped.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from gossipd.node.errors import GossipdError

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that are free now, below the ephemeral range.

    A port the kernel hands out for ``bind(0)`` comes from the range it also uses for
    every outgoing connection: between picking it and the node binding it, any gRPC
    client on the machine may take it ("address already in use", seen in the suite).
    Ports below that range are only ever taken by a process that asks for them.
    """
    low, high = _listen_range()
    picker = random.SystemRandom()
    sockets: list[socket.socket] = []
    try:
        for _ in range(64 * count):
            if len(sockets) == count:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", picker.randrange(low, high) if high > low else 0))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        if len(sockets) < count:
            raise GossipdError(f"found only {len(sockets)} of {count} free loopback ports")
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _listen_range() -> tuple[int, int]:
    """[low, high) for listening ports: from 10000 up to the kernel's ephemeral range."""
    try:
        ephemeral_low = int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return (0, 0)  # unknown: let the kernel pick
    return (10_000, ephemeral_low) if ephemeral_low > 11_000 else (0, 0)


class NodeProcess(Protocol):
    """What the launcher does with a site's process (a :class:`subprocess.Popen` is one)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


#: Starts ``gossipd COMMAND --config CONFIG EXTRA`` with its output appended to a log:
#: (config, log_path, command, extra) -> the process. :func:`spawn_node` runs the
#: executable; the launcher forks its nodes from a process that imported torch once
#: (:func:`gossipd.node.launch.forked.fork_node`).
Spawner = Callable[[Path, Path, str, tuple[str, ...]], NodeProcess]


def spawn_node(
    config: Path, log_path: Path, command: str = "node", extra: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    """`gossipd node --config CONFIG` (or another ``command``: `coordinator`) as a child
    process, output appended to ``log_path``; ``extra``: more arguments (``--ranks R``)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gossipd.node.cli",
                "--log-level",
                "INFO",
                command,
                "--config",
                str(config),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def stop_process(proc: NodeProcess, timeout_s: float = 30.0, *, signalled: bool = False) -> int:
    """SIGTERM (unless ``signalled``: sent already), wait up to ``timeout_s``, then
    SIGKILL: a child is always reaped. SIGTERM goes once: a second one that lands after
    the node's event loop has ended (its handler gone) kills it mid-exit with -15."""
    if not signalled and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        return -9


def stop_processes(procs: list[NodeProcess], timeout_s: float = 30.0) -> list[int]:
    """SIGTERM every one at once, then reap each (:func:`stop_process`): their shutdowns
    overlap instead of queueing. Exit codes in the order given."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    return [stop_process(proc, timeout_s, signalled=True) for proc in procs]
