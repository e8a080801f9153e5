"""`gossipd node --ranks R`: a multi-rank site on one machine without torchrun.

It does what ``torchrun --standalone --nproc-per-node=R --no-python gossipd node``
does for us: R child processes with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, signals passed on, every child reaped. The launcher imports torch once
and forks the ranks from itself (:mod:`.forking`): each rank as an executable spent
about 4 s of CPU importing what the launcher had already imported. SIGTERM or Ctrl-C
goes to rank 0 only (it ends the site: it tells the other ranks to stop, leaves the mesh,
checkpoints). When a rank exits, the others end on their own (a failed collective,
or rank 0's stop); whatever is still running ``collective_timeout_s +
shutdown_timeout_s`` later is killed, so the launcher never hangs.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import signal
import socket
import time
from pathlib import Path
from types import FrameType

from gossipd.node.errors import ConfigError
from gossipd.node.shared.config import NodeConfig
from gossipd.node.site.forking import SITE_IMPORTS, ForkedProcess, fork_cli

log = logging.getLogger(__name__)

POLL_S = 0.1
MAX_RANKS = 64


def rendezvous(config: NodeConfig) -> tuple[str, int]:
    """``[ranks] master`` with port 0 replaced by a free port on that host."""
    host, _, port = config.ranks.master.rpartition(":")
    if int(port):
        return host, int(port)
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


def rank_argv(config_path: Path, threads: int, log_level: str | None) -> list[str]:
    """A rank's command line, after ``gossipd``."""
    argv = ["--log-level", log_level] if log_level else []
    return [*argv, "node", "--config", str(config_path), "--threads", str(threads)]


def launch(
    config_path: Path, config: NodeConfig, ranks: int, threads: int, log_level: str | None
) -> int:
    """Run the site's ranks to the end; rank 0's exit code, else the first failure's."""
    if not 2 <= ranks <= MAX_RANKS:
        raise ConfigError(f"--ranks {ranks}: give 2..{MAX_RANKS} (1 is a plain `gossipd node`)")
    host, port = rendezvous(config)
    base = {
        **os.environ,
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(ranks),
        "PYTHONUNBUFFERED": "1",
    }
    argv = rank_argv(config_path, threads, log_level)
    for module in SITE_IMPORTS:  # once here, not once in every rank
        importlib.import_module(module)
    context = multiprocessing.get_context("fork")  # nothing here runs a thread yet
    children = [
        fork_cli(context, argv, {**base, "RANK": str(r), "LOCAL_RANK": str(r)}, None)
        for r in range(ranks)
    ]
    log.info(
        "site %s: started %d ranks (pids %s), rendezvous %s:%d; rank 0 is the gossip member",
        config.node_id,
        ranks,
        ", ".join(str(c.pid) for c in children),
        host,
        port,
    )

    def forward(signum: int, frame: FrameType | None) -> None:
        if children[0].poll() is None:
            children[0].send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(children, config)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()


def _supervise(children: list[ForkedProcess], config: NodeConfig) -> int:
    grace_s = config.ranks.collective_timeout_s + config.shutdown_timeout_s + 5.0
    deadline: float | None = None
    while any(c.poll() is None for c in children):
        if deadline is None:
            ended = [(r, c.returncode) for r, c in enumerate(children) if c.returncode is not None]
            if ended:
                rank, code = ended[0]
                log.log(
                    logging.INFO if code == 0 else logging.ERROR,
                    "rank %d of site %s exited with %d; the other ranks end within %g s",
                    rank,
                    config.node_id,
                    code,
                    grace_s,
                )
                deadline = time.monotonic() + grace_s
        elif time.monotonic() > deadline:
            stuck = [r for r, c in enumerate(children) if c.poll() is None]
            log.error("ranks %s did not end within %g s; killing them", stuck, grace_s)
            for r in stuck:
                children[r].kill()
        time.sleep(POLL_S)
    codes = [c.returncode for c in children]
    if codes[0] != 0:
        return codes[0]
    return next((code for code in codes if code != 0), 0)
