"""gossipd: run a site daemon, a local mesh, the demo, status queries and benchmarks."""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading
from pathlib import Path

from gossipd.node.cli.certs import add_certs_commands
from gossipd.node.cli.control import add_control_command
from gossipd.node.cli.mesh import add_mesh_commands
from gossipd.node.cli.node import run_node
from gossipd.node.cli.queries import add_query_commands
from gossipd.node.errors import GossipdError
from gossipd.node.sim.command import add_arguments as add_sim_arguments

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# `gossipd bench NAME ...`: each is gossipd.bench.NAME's main, which parses the rest.
BENCHES = {
    "transport": "gossipd vs raw TCP vs gloo goodput; see gossipd bench transport --help",
    "overlap": "scheduled overlap's wait and accuracy, simulator and real processes; see "
    "gossipd bench overlap --help",
    "wan": "time to accuracy of every protocol against DDP on a shaped wide-area network; "
    "see gossipd bench wan --help",
}


def _bench(args: argparse.Namespace) -> int:
    return importlib.import_module(f"gossipd.bench.{args.bench_command}").main(args.extra)


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
    _add_node_command(sub)
    add_mesh_commands(sub)
    add_query_commands(sub)
    p = sub.add_parser("sim", help="simulate N nodes of a protocol on a virtual clock")
    add_sim_arguments(p)
    p.set_defaults(func=_sim)
    _add_bench_commands(sub)
    p = sub.add_parser(
        "coordinator",
        help="run the mesh coordinator (membership view, overlap scheduling)",
        description="Serve the Coordinator gRPC service for one mesh until SIGTERM or Ctrl-C.",
    )
    p.add_argument("--config", required=True, type=Path, help="its TOML config file (required)")
    p.set_defaults(func=_run_coordinator)
    add_certs_commands(sub)
    add_control_command(sub)
    return parser


def _add_node_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    p.set_defaults(func=run_node)


def _add_bench_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="benchmarks (print a table, write a plot)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, help_text in BENCHES.items():
        p = bench_sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(func=_bench, takes_extra=True)


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
