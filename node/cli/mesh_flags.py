"""The flags `gossipd mesh up` and `gossipd demo` share, as one table of data
(:data:`MESH_ARGS`, in ``--help`` order), and what each command sets apart: the defaults
of ``--nodes``, ``--duration-s`` and ``--job``, and whether ``--protocol`` offers the
baselines."""

from __future__ import annotations

import argparse
import math
from typing import Any

from gossipd.node.baselines import BASELINES
from gossipd.node.protocols import DEFAULT_PROTOCOL, PROTOCOLS


def cpu_share(text: str) -> float:
    """``--cpu-share``: a share of the cores' time, as ``gossip.cpu_share`` takes it."""
    try:
        share = float(text)
    except ValueError:
        share = math.nan
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(
            f"--cpu-share {text!r}: give a share of the cores' time over 0 and at most 1 "
            "(0.03 is gossip.cpu_share's default; 1 never holds a push)"
        )
    return share


def steps_per_s(text: str) -> float:
    """``--max-steps-per-s``: a pace, as ``job.max_steps_per_s`` takes it."""
    try:
        pace = float(text)
    except ValueError:
        pace = math.nan
    if not 0 <= pace < math.inf:
        raise argparse.ArgumentTypeError(
            f"--max-steps-per-s {text!r}: give a number of steps a second, 0 or more "
            "(0: as fast as each node goes)"
        )
    return pace


# The flags both commands share, as (flag, add_argument keywords), in --help order;
# :func:`add_mesh_args` adds what differs between them.
MESH_ARGS: tuple[tuple[str, dict[str, Any]], ...] = (
    (
        "--nodes",
        {"type": int, "help": "daemons to start, at least 2 (default: %(default)s)"},
    ),
    (
        "--ranks",
        {
            "type": int,
            "default": 1,
            "help": "processes per site: rank 0 gossips, all ranks all-reduce gradients (gloo) "
            "every step; the --json summary lists every rank's test accuracy "
            "(default: %(default)s)",
        },
    ),
    (
        "--device",
        {
            "default": "cpu",
            "help": "job.device of every site: cpu, cuda (one GPU per rank) or cuda:N "
            "(default: %(default)s)",
        },
    ),
    (
        "--node-based",
        {
            "type": int,
            "default": None,
            "metavar": "K",
            "help": "node-based mode (with --ranks): persyn between sites every K steps and at "
            "each epoch end of a rank's data (default: off)",
        },
    ),
    (
        "--job",
        {
            "help": "training job of every node: digits, mnist1d, shakespeare, synthetic or "
            "module:factory "
            "(default: %(default)s)",
        },
    ),
    ("--protocol", {"default": DEFAULT_PROTOCOL}),  # choices and help: _protocol_options
    (
        "--round-steps",
        {"type": int, "default": 1, "help": "local steps per round (default: %(default)s)"},
    ),
    (
        "--coordinator",
        {
            "choices": ("none", "local"),
            "default": "none",
            "help": "local: start a gossipd coordinator beside the nodes (it schedules the "
            "overlap protocol's pulls; a node that loses it schedules alone); none: "
            "decentralized (default: %(default)s)",
        },
    ),
    (
        "--overlap-mode",
        {
            "choices": ("scheduled", "naive", "none"),
            "default": None,
            "help": "overlap protocol: when a pull starts (scheduled: to land as the period "
            "ends; naive: at its start; none: after it) (default: the protocol's, scheduled)",
        },
    ),
    (
        "--period-steps",
        {
            "type": int,
            "default": None,
            "help": "overlap protocol: local steps between averages, T (default: the "
            "protocol's, 16)",
        },
    ),
    (
        "--duration-s",
        {
            "type": float,
            "help": "seconds each node trains once all are in touch; 0: until --max-steps "
            "(default: %(default)s)",
        },
    ),
    (
        "--max-steps",
        {
            "type": int,
            "default": 0,
            "help": "stop each node after this many steps; 0: no limit (default: %(default)s)",
        },
    ),
    (
        "--max-steps-per-s",
        {
            "type": steps_per_s,
            "default": 0.0,
            "help": "pace each node to at most this many steps a second (job.max_steps_per_s), "
            "as on a slower machine: with --max-steps, the same number of pushes per step on "
            "a fast machine as on a slow one; 0: as fast as it goes (default: %(default)s)",
        },
    ),
    (
        "--push-probability",
        {
            "type": float,
            "default": None,
            "help": "sumweight: chance of a push per step (default: the config's, 0.5)",
        },
    ),
    (
        "--cpu-share",
        {
            "type": cpu_share,
            "default": None,
            "help": "gossip.cpu_share of every node: most of its cores' time gossip may take "
            "while it trains, over 0 and at most 1 (default: the config's, 0.03; for demo 0.1)",
        },
    ),
    (
        "--codec",
        {
            "default": "raw",
            "choices": ["raw", "fp16", "bf16", "int8", "int4"],
            "help": "how segments travel: raw float32, halved to fp16 or bf16, or a quarter "
            "and an eighth in int8 and int4 (default: %(default)s)",
        },
    ),
    (
        "--error-feedback",
        {
            "action": argparse.BooleanOptionalAction,
            "default": False,
            "help": "with a lossy --codec: send differences from copies both ends hold and "
            "keep what the codec dropped (gossip.error_feedback; default: off)",
        },
    ),
    (
        "--learning-rate",
        {
            "type": float,
            "default": None,
            "help": "SGD learning rate of every node (default: the job's own)",
        },
    ),
    (
        "--job-option",
        {
            "action": "append",
            "default": [],
            "metavar": "KEY=VALUE",
            "help": "an option of the job, as in a node's [job.options] table, repeatable, "
            "e.g. --job-option model=cnn; the value is a TOML scalar, a bare word a string "
            "(default: none for mesh up, partition=by_label for demo with job digits)",
        },
    ),
    (
        "--workdir",
        {
            "default": None,
            "help": "keep configs, node state, logs and certificates here; one that holds an "
            "earlier run's nodes is refused (default: a temporary directory, removed at the "
            "end)",
        },
    ),
    (
        "--plot",
        {
            "default": None,
            "help": "write a PNG of loss, test accuracy and consensus distance over time "
            "(default: none for mesh up, gossipd-demo.png for demo)",
        },
    ),
    (
        "--seed",
        {
            "type": int,
            "default": 0,
            "help": "seed of node 0's job; node i uses seed + i (default: %(default)s)",
        },
    ),
    (
        "--insecure",
        {
            "action": "store_true",
            "help": "plaintext gRPC (default: a throwaway CA in the work dir and mutual TLS)",
        },
    ),
    (
        "--json",
        {
            "action": "store_true",
            "help": "print one JSON object as the last stdout line; progress and table go to "
            "stderr (default: progress and table on stdout)",
        },
    ),
)


def add_mesh_args(
    p: argparse.ArgumentParser, *, nodes: int, duration_s: float, job: str, baseline: bool = False
) -> None:
    """Every flag of :data:`MESH_ARGS` on ``p``, with this command's defaults; ``baseline``:
    --protocol also offers the baselines (:data:`gossipd.node.baselines.BASELINES`)."""
    own: dict[str, dict[str, Any]] = {
        "--nodes": {"default": nodes},
        "--duration-s": {"default": duration_s},
        "--job": {"default": job},
        "--protocol": _protocol_options(baseline),
    }
    for flag, options in MESH_ARGS:
        p.add_argument(flag, **options, **own.get(flag, {}))
    if baseline:
        p.add_argument(
            "--inner-steps",
            type=int,
            default=None,
            metavar="H",
            help="diloco: local steps between outer steps (default: the config's, 100)",
        )


def _protocol_options(baseline: bool) -> dict[str, Any]:
    baselines = list(BASELINES.values()) if baseline else []
    return {
        "choices": sorted(PROTOCOLS) + [b.name for b in baselines],
        "help": "gossip protocol of every node"
        + "".join(f"; {b.name}: {b.description}" for b in baselines)
        + " (default: %(default)s)",
    }
