"""gossipd: run a site daemon, a local mesh, the demo, status queries and benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from gossipd.node.cli.mesh import add_mesh_commands
from gossipd.node.errors import GossipdError
from gossipd.node.net.corelog import CoreLog
from gossipd.node.sim.command import add_arguments as add_sim_arguments
from gossipd.node.trainer.memory import keep_freed_buffers

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def _reload_tls(path: Path, site: object) -> None:
    from gossipd.node.shared.config import load_config

    try:
        tls = load_config(path).tls
    except GossipdError as err:
        logging.getLogger("gossipd.node.net.network").warning(
            "SIGHUP: kept the current certificate: %s", err
        )
        return
    site.network.reload_tls(tls)  # type: ignore[attr-defined]


def _run_node(args: argparse.Namespace) -> int:
    # Before gRPC starts: its C core's lines (a failed TLS handshake per bad client) are
    # read from fd 2 and become counted, rate-limited refusals.
    core_log = CoreLog()
    try:
        return _run_site(args, core_log)
    finally:
        core_log.close()
        # Everything the daemon writes is written and closed: what is left is interpreter
        # exit, whose garbage collection walks every object torch, gRPC and the job made
        # (some 300,000) and took 1 to 2 s of each stop on a 2-core VM, about four fifths of
        # the time from SIGTERM to exit. Frozen, they are left to the end of the process;
        # objects made after this point are still collected.
        gc.freeze()


def _run_site(args: argparse.Namespace, core_log: CoreLog) -> int:
    from gossipd.node.shared.config import load_config
    from gossipd.node.site.preflight import check_site

    # Every mistake in the site's files fails here, in seconds, before torch loads.
    config = load_config(args.config)
    check_site(config)
    log = logging.getLogger("gossipd.node.site.site")
    if config.gossip.protocol == "allreduce" and (args.ranks > 1 or "WORLD_SIZE" in os.environ):
        raise GossipdError(
            "the allreduce baseline runs one process per site (its sites are the ranks of one "
            "DDP group): drop --ranks / torchrun, or pick a gossip protocol"
        )
    if args.ranks > 1:
        from gossipd.node.site.rank_launcher import launch

        return launch(args.config, config, args.ranks, args.threads, args.log_level)
    log.info("config %s checked; loading torch and building job %s", args.config, config.job.name)
    import torch

    from gossipd.node.site.site import Site
    from gossipd.node.trainer import ranks
    from gossipd.node.trainer.jobs import build_job
    from gossipd.node.trainer.torchthreads import use_for_default_executor

    torch.set_num_threads(args.threads)
    keep_freed_buffers()
    if config.gossip.protocol == "allreduce":  # the synchronous DDP baseline, no gossip
        from gossipd.node.baselines.allreduce import run_allreduce

        return run_allreduce(config)
    rank_env = ranks.RankEnv.from_environ()
    if rank_env is not None and rank_env.rank != 0:
        return ranks.follow(config, rank_env, build_job)
    site = Site(config, rank_env=rank_env)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        use_for_default_executor(loop)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # A renewed certificate or a new allow-list needs no restart: `kill -HUP` reads
        # the config's [tls] section and its files again.
        loop.add_signal_handler(signal.SIGHUP, lambda: _reload_tls(args.config, site))
        core_log.attach(loop, site.network.rejections, site.metrics)
        await site.run(stop)

    # A start-up failure raised inside the loop (port taken, join timeout) leaves
    # asyncio.run as itself and reaches main's `except GossipdError`: exit 2.
    asyncio.run(main())
    if site.ranks is not None:
        ranks.end_leader(site.ranks, site.replica.steps, site.loop_thread.is_alive())
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


def _add_client_tls_args(p: argparse.ArgumentParser) -> None:
    """The certificate a client command presents (status, health)."""
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help="present this site config's [tls] certificate (default: --ca/--cert/--key, "
        "or plaintext when none is given)",
    )
    p.add_argument("--ca", type=Path, default=None, help="the mesh CA certificate (default: none)")
    p.add_argument(
        "--cert", type=Path, default=None, help="a certificate of that mesh (default: none)"
    )
    p.add_argument("--key", type=Path, default=None, help="its private key (default: none)")


def _client_tls(args: argparse.Namespace) -> object:
    """The certificate a command presents: a site config's [tls], or --ca/--cert/--key."""
    from gossipd.node.shared.tls import Credentials

    if args.config is not None:
        from gossipd.node.shared.config import load_config

        return Credentials.from_config(load_config(args.config).tls)
    given = [args.ca, args.cert, args.key]
    if any(given) and not all(given):
        raise GossipdError("--ca, --cert and --key go together; give all three or none")
    if all(given):
        return Credentials(ca=args.ca, cert=args.cert, key=args.key)
    return Credentials(insecure=True)


def _status(args: argparse.Namespace) -> int:
    from gossipd.node.net.status import query_status, render_status

    # One call by a person or a script: worth the model copy a fresh checksum costs.
    reply = asyncio.run(
        query_status(args.address, args.timeout_s, checksum=True, tls=_client_tls(args))
    )
    print(json.dumps(reply) if args.json else render_status(reply))
    return 0


def _health(args: argparse.Namespace) -> int:
    from gossipd.node.net.status import check_health

    status = asyncio.run(check_health(args.address, args.timeout_s, tls=_client_tls(args)))
    print(status)
    return 0 if status == "SERVING" else 1


def _bench(args: argparse.Namespace) -> int:
    return importlib.import_module(f"gossipd.bench.{args.bench_command}").main(args.extra)


def _certs_init(args: argparse.Namespace) -> int:
    from gossipd.node.shared.certs import init_ca

    cert, key = init_ca(args.dir, mesh_id=args.mesh_id, days=args.days)
    print(f"wrote {cert} (mesh CA certificate: copy it to every site)")
    print(f"wrote {key} (CA private key, mode 0600: keep it here, never on a site)")
    print(f"next: issue a certificate per site with: gossipd certs issue NODE_ID --dir {args.dir}")
    return 0


def _certs_issue(args: argparse.Namespace) -> int:
    from gossipd.node.shared.certs import CA_CERT_FILE, issue

    cert, key = issue(args.node_id, args.dir, days=args.days, coordinator=args.coordinator)
    what = "the mesh coordinator" if args.coordinator else "site"
    print(f"wrote {cert} (certificate of {what} {args.node_id})")
    print(f"wrote {key} (its private key, mode 0600)")
    print(f"next: copy {cert.name}, {key.name} and {CA_CERT_FILE} to {what} {args.node_id}")
    return 0


def _certs_show(args: argparse.Namespace) -> int:
    from gossipd.node.shared.certs import describe

    info = describe(args.file)
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key:>11}: {value}")
    return 0


def _add_certs_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from gossipd.node.shared.certs import CA_DAYS, SITE_DAYS

    certs = sub.add_parser("certs", help="mesh CA and site certificates for mutual TLS")
    certs_sub = certs.add_subparsers(dest="certs_command", required=True)
    p = certs_sub.add_parser("init", help="create the mesh CA: ca.pem (share) and ca.key (keep)")
    p.add_argument(
        "--dir", required=True, type=Path, help="where to write the CA (required; made 0700)"
    )
    p.add_argument("--mesh-id", required=True, help="mesh id named in the CA (required)")
    p.add_argument(
        "--days", type=int, default=CA_DAYS, help="CA validity in days (default: %(default)s)"
    )
    p.set_defaults(func=_certs_init)

    p = certs_sub.add_parser("issue", help="write NODE_ID.pem and NODE_ID.key signed by the CA")
    p.add_argument("node_id", metavar="NODE_ID", help="the site's node_id, as in its config")
    p.add_argument("--dir", required=True, type=Path, help="directory of the CA (required)")
    p.add_argument(
        "--coordinator",
        action="store_true",
        help="a certificate for the mesh coordinator named NODE_ID, not for a site",
    )
    p.add_argument(
        "--days", type=int, default=SITE_DAYS, help="validity in days (default: %(default)s)"
    )
    p.set_defaults(func=_certs_issue)

    p = certs_sub.add_parser("show", help="subject, node id, validity of a certificate")
    p.add_argument("file", metavar="FILE", type=Path, help="a PEM certificate")
    p.add_argument("--json", action="store_true", help="print one JSON object (default: table)")
    p.set_defaults(func=_certs_show)


def _run_coordinator(args: argparse.Namespace) -> int:
    from gossipd.coordinator.server import run

    return run(args)


def _sim(args: argparse.Namespace) -> int:
    from gossipd.node.sim.command import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gossipd", description=__doc__)
    parser.add_argument(
        "--log-level",
        default=None,
        type=str.upper,
        choices=LOG_LEVELS,
        help="log level of this process: DEBUG, INFO, WARNING or ERROR (default: INFO for "
        "node, WARNING for the other commands)",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "node",
        help="run one site daemon",
        description="Run one site daemon: train, gossip with the seeds in the config, "
        "stop gracefully on SIGTERM or Ctrl-C.",
    )
    p.add_argument(
        "--config", required=True, type=Path, help="the site's TOML config file (required)"
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default: %(default)s)"
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="processes in this site: rank 0 gossips, all all-reduce gradients each step "
        "(same as torchrun --standalone --nproc-per-node=R --no-python gossipd node; "
        "default: %(default)s)",
    )
    p.set_defaults(func=_run_node)

    add_mesh_commands(sub)

    p = sub.add_parser(
        "status",
        help="ask a running node what it is doing",
        description="Ask a running node for its step, loss, weights, peers and push counters.",
    )
    p.add_argument(
        "--address", required=True, help="HOST:PORT of the node's gRPC server (required)"
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=5.0,
        help="seconds to wait for the reply (default: %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    _add_client_tls_args(p)
    p.set_defaults(func=_status)

    p = sub.add_parser(
        "health",
        help="the node's gRPC health check: prints SERVING and exits 0, or exits non-zero",
        description="The standard gRPC health check (what a container HEALTHCHECK runs); "
        "copies nothing, unlike status.",
    )
    p.add_argument(
        "--address", required=True, help="HOST:PORT of the node's gRPC server (required)"
    )
    p.add_argument(
        "--timeout-s", type=float, default=3.0, help="seconds to wait (default: %(default)s)"
    )
    _add_client_tls_args(p)
    p.set_defaults(func=_health)

    p = sub.add_parser("sim", help="simulate N nodes of a protocol on a virtual clock")
    add_sim_arguments(p)
    p.set_defaults(func=_sim)

    bench = sub.add_parser("bench", help="benchmarks (print a table, write a plot)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser(
        "transport",
        help="gossipd vs raw TCP vs gloo goodput; see gossipd bench transport --help",
        add_help=False,
    )
    p.set_defaults(func=_bench, takes_extra=True)
    p = bench_sub.add_parser(
        "overlap",
        help="scheduled overlap's wait and accuracy, simulator and real processes; see gossipd "
        "bench overlap --help",
        add_help=False,
    )
    p.set_defaults(func=_bench, takes_extra=True)
    p = bench_sub.add_parser(
        "wan",
        help="time to accuracy of every protocol against DDP on a shaped wide-area network; "
        "see gossipd bench wan --help",
        add_help=False,
    )
    p.set_defaults(func=_bench, takes_extra=True)

    p = sub.add_parser(
        "coordinator",
        help="run the mesh coordinator (membership view, overlap scheduling)",
        description="Serve the Coordinator gRPC service for one mesh until SIGTERM or Ctrl-C.",
    )
    p.add_argument("--config", required=True, type=Path, help="its TOML config file (required)")
    p.set_defaults(func=_run_coordinator)

    _add_certs_commands(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM to a command other than a daemon, unwound as Ctrl-C is: `mesh up`, `demo`
    and the benchmarks stop the processes they started on the way out. Without it a
    SIGTERM (``timeout``, a cancelled CI job) killed the launcher alone and left its
    daemons training."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    # A daemon's operator reads its INFO lines (start-up, progress, peers); a command run
    # by hand prints its own answer and only warnings besides.
    level = args.log_level or ("INFO" if args.command in ("node", "coordinator") else "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if getattr(args, "plot_default", None) and args.plot is None:
        args.plot = args.plot_default
    # Daemons stop on SIGTERM in their own loop; in the main thread only (a test may call
    # main from another), and restored after (a test may call it in-process).
    catch = args.command not in ("node", "coordinator") and (
        threading.current_thread() is threading.main_thread()
    )
    previous = signal.signal(signal.SIGTERM, _terminated) if catch else None
    try:
        return int(args.func(args))
    except GossipdError as err:
        print(f"gossipd: error: {err}", file=sys.stderr)
        return 2
    except Terminated:
        print("gossipd: stopped by SIGTERM", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        return 130
    finally:
        if catch:
            signal.signal(signal.SIGTERM, previous)
