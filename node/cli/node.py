"""`gossipd node`: one site in this process, a gossip daemon or a baseline's site.

The config is checked before torch loads, so every mistake in a site's files fails in
seconds. A baseline (:data:`gossipd.node.baselines.BASELINES`) runs through its own entry
point and starts no gRPC; a gossip site runs its event loop until SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from gossipd.node.baselines import BASELINES, Baseline
from gossipd.node.errors import GossipdError
from gossipd.node.net.telemetry.corelog import CoreLog
from gossipd.node.trainer.memory import keep_freed_buffers

if TYPE_CHECKING:
    from gossipd.node.shared.config import NodeConfig
    from gossipd.node.site.site import Site

log = logging.getLogger("gossipd.node.site.site")


def run_node(args: argparse.Namespace) -> int:
    from gossipd.node.shared.config import load_config
    from gossipd.node.site.preflight import check_site

    # Every mistake in the site's files fails here, in seconds, before torch loads.
    config = load_config(args.config)
    check_site(config)
    baseline = BASELINES.get(config.gossip.protocol)
    if baseline is not None:
        return _run_baseline(args, config, baseline)
    # Before gRPC starts: its C core's lines (a failed TLS handshake per bad client) are
    # read from fd 2 and become counted, rate-limited refusals.
    core_log = CoreLog()
    try:
        return _run_site(args, config, core_log)
    finally:
        core_log.close()
        _freeze()


def _freeze() -> None:
    """Everything the site writes is written and closed: what is left is interpreter exit,
    whose garbage collection walks every object torch, gRPC and the job made (some 300,000)
    and took 1 to 2 s of each stop on a 2-core VM, about four fifths of the time from
    SIGTERM to exit. Frozen, they are left to the end of the process; objects made after
    this point are still collected."""
    gc.freeze()


def _run_baseline(args: argparse.Namespace, config: NodeConfig, baseline: Baseline) -> int:
    """A baseline's site: one process, one rank of the baseline's group."""
    if args.ranks > 1 or "WORLD_SIZE" in os.environ:
        raise GossipdError(
            f"the {baseline.name} baseline runs one process per site (its sites are the ranks "
            "of one process group): drop --ranks / torchrun, or pick a gossip protocol"
        )
    _load_torch(args, config)
    try:
        return baseline.run_site(config)
    finally:
        _freeze()


def _load_torch(args: argparse.Namespace, config: NodeConfig) -> None:
    log.info("config %s checked; loading torch and building job %s", args.config, config.job.name)
    import torch

    torch.set_num_threads(args.threads)
    keep_freed_buffers()


def _run_site(args: argparse.Namespace, config: NodeConfig, core_log: CoreLog) -> int:
    if args.ranks > 1:
        from gossipd.node.site.rank_launcher import launch

        return launch(args.config, config, args.ranks, args.threads, args.log_level)
    _load_torch(args, config)
    from gossipd.node.jobs.registry import build_job
    from gossipd.node.site.site import Site
    from gossipd.node.trainer import ranks

    rank_env = ranks.RankEnv.from_environ()
    if rank_env is not None and rank_env.rank != 0:
        return ranks.follow(config, rank_env, build_job)
    site = Site(config, rank_env=rank_env)
    # A start-up failure raised inside the loop (port taken, join timeout) leaves
    # asyncio.run as itself and reaches main's `except GossipdError`: exit 2.
    asyncio.run(_serve(site, args.config, core_log))
    if site.ranks is not None:
        ranks.end_leader(site.ranks, site.replica.steps, site.loop_thread.is_alive())
    return _exit_code(site)


async def _serve(site: Site, config_path: Path, core_log: CoreLog) -> None:
    """The site's event loop until SIGTERM or SIGINT; SIGHUP reloads its certificate."""
    from gossipd.node.model.torchthreads import use_for_default_executor

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    use_for_default_executor(loop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # A renewed certificate, a new allow-list or a revoked operator needs no restart:
    # `kill -HUP` reads the config's [tls] section, its files and
    # mqtt.revoked_operators again.
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(config_path, site))
    core_log.attach(loop, site.network.rejections, site.metrics)
    await site.run(stop)


def _reload(path: Path, site: Site) -> None:
    from gossipd.node.shared.config import load_config

    try:
        config = load_config(path)
    except GossipdError as err:
        logging.getLogger("gossipd.node.net.network").warning(
            "SIGHUP: kept the current certificate and revocations: %s", err
        )
        return
    site.network.reload_tls(config.tls)
    if site.mqtt is not None and config.mqtt is not None:
        site.mqtt.revoke(config.mqtt.revoked_operators)


def _exit_code(site: Site) -> int:
    """1 when training failed or the final checkpoint could not be written, else 0."""
    code = 0
    if site.loop_thread.error is not None:
        print(f"gossipd: training failed: {site.loop_thread.error!r}", file=sys.stderr)
        code = 1
    if site.final_checkpoint_error is not None:
        # Exit 1, not 0: the node stopped cleanly, but the state on disk is older than
        # what it did (a restart resumes from the last good checkpoint, and weight
        # handed off on the way out is counted again), which a supervisor must flag.
        # Not 2: that means "did not start, fix the config".
        resume = (
            f"a restart resumes from step {site.saved_step}"
            if site.saved_step is not None
            else "there is no checkpoint.pt, so a restart starts from scratch"
        )
        print(
            f"gossipd: final checkpoint failed: {site.final_checkpoint_error}; {resume}; "
            "free space under data_dir before restarting",
            file=sys.stderr,
        )
        code = 1
    return code
