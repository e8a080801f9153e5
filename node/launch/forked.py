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
import threading
from pathlib import Path
from typing import Any

from gossipd.node.site.forking import SITE_IMPORTS, ForkedProcess, fork_cli

# Imported once in the fork server: what a site imports, and the command line.
PRELOAD = [*SITE_IMPORTS, "gossipd.node.cli.main"]

_CONTEXT_LOCK = threading.Lock()
_context: Any = None


def _fork_server() -> Any:
    global _context
    with _CONTEXT_LOCK:
        if _context is None:
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(PRELOAD)
        return _context


def fork_node(
    config: Path, log_path: Path, command: str = "node", extra: tuple[str, ...] = ()
) -> ForkedProcess:
    """``gossipd --log-level INFO COMMAND --config CONFIG EXTRA``, output appended to
    ``log_path``: what :func:`gossipd.node.launch.processes.spawn_node` starts, forked."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = ["--log-level", "INFO", command, "--config", str(config), *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return fork_cli(_fork_server(), argv, env, str(log_path))
