"""The command line of `gossipd bench transport`: its flags, its two modes, what each runs.

The default mode measures the transport: goodput of one large push next to raw
TCP, gloo, bare grpc.aio and hivemind (:mod:`gossipd.bench.transport`), then the
fixed cost of one small push in CPU-milliseconds on each side and its latency
(:mod:`gossipd.bench.push_cost`). ``--trainer`` measures instead what gossip
costs a trainer in steps (:mod:`gossipd.bench.trainer_overhead`). A flag of one
mode given to the other is refused rather than ignored.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

from gossipd.bench import push_cost, trainer_overhead
from gossipd.bench import transport_report as report
from gossipd.bench.baselines import bench_gloo, bench_grpc_bare, bench_hivemind, bench_raw_tcp
from gossipd.bench.transport import MiB, Setting, bench_gossipd
from gossipd.node.cli.mesh_flags import cpu_share
from gossipd.node.errors import GossipdError

DEFAULT_SETTINGS = ("4:1024:1", "4:1024:4", "16:1024:4", "16:4096:4", "64:4096:4")
QUICK_SETTINGS = ("16:1024:1", "16:1024:4")
PUSH_COST_BYTES = 4096  # small enough that only what every push pays is measured
PUSH_COST_PUSHES, PUSH_COST_PUSHES_QUICK = 1000, 200
MIN_PUSH_COST_PUSHES = 10
TRAINER_DURATION_S = 40.0
# Flags of one mode only (argparse dests); given with the other mode they are an error.
GOODPUT_ONLY = (
    "size_mb", "tensor_mb", "reps", "setting", "quick", "no_pull", "skip_gloo",
    "skip_hivemind", "hivemind_floats", "plot", "push_cost_pushes", "no_push_cost",
)  # fmt: skip
TRAINER_ONLY = ("trainer_jobs", "duration_s", "cpu_share", "shared_cores")


# What `--help` says: the module docstrings in plain words, without their markup.
DESCRIPTION = (
    "Goodput of one model push between two gossipd daemons on loopback. A real receiver "
    "daemon is sent the whole model by a real sender node, exactly as nodes push to each "
    "other: handshake, segments split over client streams, validation, checksum, assembly, "
    "merge on the receiver's trainer thread, acks. Goodput is model bytes over the wall time "
    "of the push, the ack included. The same run times a raw TCP socket and torch.distributed "
    "gloo send/recv between two processes, and hivemind's DecentralizedAverager where it is "
    "installed, and prints each as a ratio of raw TCP (timed first and again last; the "
    "ratios are to its best time of both). Plaintext and mutual TLS pushes alternate within "
    "each repetition. The model is a stack of equal float32 "
    "tensors (--tensor-mb). A second table gives the fixed cost of one small push, plaintext "
    "and mutual TLS: CPU-milliseconds on the sender and on the receiver daemon, and its "
    "latency. With --trainer, instead: two daemons train a job for the same time without "
    "pushes and with push probability 0.5, and the table compares the steps they did."
)


def _setting(text: str) -> Setting:
    try:
        segment_mb, chunk_kb, streams = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--setting {text!r} is not SEGMENT_MB:CHUNK_KB:STREAMS (for example 16:1024:4)"
        ) from None
    if min(segment_mb, chunk_kb, streams) < 1 or chunk_kb > 4096:
        raise argparse.ArgumentTypeError(
            f"--setting {text!r}: all parts must be positive and chunks at most 4096 KiB "
            "(the receiver's limits.max_chunk_bytes)"
        )
    return Setting(segment_mb, chunk_kb, streams)


def _push_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < MIN_PUSH_COST_PUSHES:
        raise argparse.ArgumentTypeError(
            f"--push-cost-pushes {text!r}: give a whole number of at least "
            f"{MIN_PUSH_COST_PUSHES} (a latency percentile needs several pushes)"
        )
    return count


def _jobs(text: str) -> list[str]:
    jobs = [j.strip() for j in text.split(",") if j.strip()]
    if not jobs:
        raise argparse.ArgumentTypeError(
            f"--trainer-jobs {text!r} names no job; give e.g. digits,wide_digits"
        )
    return jobs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gossipd bench transport", description=DESCRIPTION)
    _add_goodput_flags(p)
    _add_trainer_flags(p)
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object as the last stdout line, the table on stderr",
    )
    return p


def _add_goodput_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the default mode (:data:`GOODPUT_ONLY`)."""
    p.add_argument(
        "--size-mb", type=int, default=256, help="model size in MiB (default: %(default)s)"
    )
    p.add_argument(
        "--tensor-mb", type=int, default=4, help="MiB per model tensor (default: %(default)s)"
    )
    p.add_argument(
        "--reps", type=int, default=None, help="timed repetitions (default: 5, with --quick 2)"
    )
    p.add_argument(
        "--setting",
        type=_setting,
        action="append",
        help="gossipd push setting SEGMENT_MB:CHUNK_KB:STREAMS, repeatable "
        f"(default: {' '.join(DEFAULT_SETTINGS)})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="two gossipd settings, 2 reps, fewer pushes for the per-push cost "
        "(default: all, 5 reps)",
    )
    p.add_argument("--no-pull", action="store_true", help="do not time PullModel")
    p.add_argument("--skip-gloo", action="store_true", help="do not time torch.distributed gloo")
    p.add_argument(
        "--skip-hivemind", action="store_true", help="do not time hivemind, even if installed"
    )
    p.add_argument(
        "--hivemind-floats", type=int, default=None, help="floats averaged (default: the model's)"
    )
    p.add_argument(
        "--push-cost-pushes",
        type=_push_count,
        default=None,
        help=f"timed {PUSH_COST_BYTES // 1024} KiB pushes per TLS mode for the per-push cost "
        f"table (default: {PUSH_COST_PUSHES}, with --quick {PUSH_COST_PUSHES_QUICK})",
    )
    p.add_argument(
        "--no-push-cost", action="store_true", help="do not measure the per-push fixed cost"
    )
    p.add_argument(
        "--plot",
        default="bench-transport.png",
        help="PNG path, '' for none (default: %(default)s)",
    )


def _add_trainer_flags(p: argparse.ArgumentParser) -> None:
    """``--trainer`` and the flags only it takes (:data:`TRAINER_ONLY`)."""
    p.add_argument(
        "--trainer",
        action="store_true",
        help="instead of goodput: steps two training daemons do without pushes and with "
        "push probability 0.5, for each of --trainer-jobs",
    )
    p.add_argument(
        "--trainer-jobs",
        type=_jobs,
        default=None,
        help="with --trainer: comma-separated jobs, digits, wide_digits (4.35M parameters) or "
        f"any module:factory (default: {','.join(trainer_overhead.DEFAULT_JOBS)})",
    )
    p.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help=f"with --trainer: seconds each node trains per run (default: {TRAINER_DURATION_S:g})",
    )
    p.add_argument(
        "--cpu-share",
        type=cpu_share,
        default=None,
        help="with --trainer: gossip.cpu_share of both daemons, to compare shares "
        "(default: the config's, 0.03)",
    )
    p.add_argument(
        "--shared-cores",
        action="store_true",
        help="with --trainer: let both daemons run on any core (default: each on a core of "
        "its own, as two sites on two machines; shared, each counts the other's core as "
        "its own and their gossip takes CPU from both trainers)",
    )


def _check_mode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A flag the chosen mode does not use is an error, not silently ignored."""
    wrong = GOODPUT_ONLY if args.trainer else TRAINER_ONLY
    given = [d for d in wrong if getattr(args, d) != parser.get_default(d)]
    if given:
        flags = ", ".join("--" + d.replace("_", "-") for d in given)
        parser.error(
            f"{flags}: only for the goodput mode; drop them or --trainer"
            if args.trainer
            else f"{flags}: only with --trainer; add --trainer or drop them"
        )
    if args.duration_s is not None and not args.duration_s > 0:
        parser.error(f"--duration-s {args.duration_s}: give a positive number of seconds")


def main(argv: list[str] | None = None) -> int:
    """`gossipd bench transport [flags]`: run the chosen mode, print its tables (and JSON)."""
    if argv and argv[0] == "--":  # `gossipd bench transport -- --json ...`
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_mode(parser, args)
    torch.set_num_threads(1)
    out = sys.stderr if args.json else sys.stdout
    try:
        summary = _trainer(args, out) if args.trainer else _goodput(args, out)
    except GossipdError as err:
        print(f"gossipd bench transport: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary))
    return 0


def _trainer(args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    jobs = args.trainer_jobs or list(trainer_overhead.DEFAULT_JOBS)
    duration_s = args.duration_s or TRAINER_DURATION_S
    pinned = not args.shared_cores and len(os.sched_getaffinity(0)) >= trainer_overhead.NODES
    rows = trainer_overhead.bench_trainer_overhead(
        jobs, duration_s, out, args.cpu_share, pin_cores=pinned
    )
    share = "default" if args.cpu_share is None else f"{args.cpu_share:g}"
    cores = "each daemon on a core of its own" if pinned else "daemons share the cores"
    print(
        f"gossipd bench transport --trainer: {os.cpu_count()} CPUs ({cores}), "
        f"gossip.cpu_share {share}",
        file=out,
    )
    trainer_overhead.print_overhead(rows, out)
    return {"trainer_overhead": rows, **report.machine()}


def _optional(
    rows: list[dict[str, Any]], notes: list[str], name: str, run: Callable[[], Any]
) -> None:
    """Run an optional baseline; a failure becomes a note instead of ending the benchmark."""
    try:
        rows.append(run())
    except Exception as err:
        notes.append(f"{name}: failed, left out: {err}")


def _hivemind_row(numel: int, reps: int) -> dict[str, Any]:
    result = bench_hivemind(numel, reps)
    mm = statistics.median(result["matchmaking"])
    label = f"2-peer all-reduce of {numel / 1e6:.1f}M floats, after {mm:.2f} s matchmaking"
    return report.row("hivemind", label, result["allreduce"], numel * 4)


def _goodput(args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    reps = max(1, args.reps or (2 if args.quick else 5))
    settings = args.setting or [
        _setting(t) for t in (QUICK_SETTINGS if args.quick else DEFAULT_SETTINGS)
    ]
    numel = args.size_mb * MiB // 4
    nbytes = numel * 4
    tensor_numel = min(numel, max(1, args.tensor_mb * MiB // 4))
    notes: list[str] = []
    rows = _goodput_rows(args, numel, tensor_numel, settings, reps, notes)
    report.finish(rows, nbytes)
    costs = [] if args.no_push_cost else _push_costs(args)
    title = f"gossipd bench transport: {args.size_mb} MiB model, loopback, {os.cpu_count()} CPUs"
    _print_goodput(rows, costs, notes, title, args.plot, out)
    return report.summary(rows, costs, nbytes, tensor_numel * 4, reps, notes)


def _goodput_rows(
    args: argparse.Namespace,
    numel: int,
    tensor_numel: int,
    settings: list[Setting],
    reps: int,
    notes: list[str],
) -> list[dict[str, Any]]:
    """One row per transport timed: raw TCP, gloo, bare grpc.aio, each gossipd setting,
    hivemind; a baseline that fails or is skipped becomes a note instead."""
    nbytes = numel * 4
    row = report.row

    # Raw TCP is timed first and again after the gossipd rows, and every ratio is to its
    # best time of both: a quiet moment at either end of the run raises the bar for all.
    def raw_tcp() -> list[float]:
        return bench_raw_tcp(_bytes_of(torch.ones(numel)), reps)

    raw = row("raw TCP", "1 MiB sendall, 1-byte ack, before and after", raw_tcp())
    rows = [raw]
    if not args.skip_gloo:
        _optional(
            rows,
            notes,
            "gloo",
            lambda: row("gloo", "send/recv, 1-float ack", bench_gloo(numel, reps)),
        )
    _optional(
        rows,
        notes,
        "grpc.aio",
        lambda: row(
            "grpc.aio bare",
            "1 MiB messages, 4 channels, no-op servicer",
            bench_grpc_bare(nbytes, reps),
        ),
    )
    rows += bench_gossipd(numel, tensor_numel, settings, reps, pull=not args.no_pull)
    raw["times_s"] += raw_tcp()
    if args.skip_hivemind:
        notes.append("hivemind: skipped (--skip-hivemind)")
    elif importlib.util.find_spec("hivemind") is None:
        notes.append("hivemind: not installed (pip install 'gossipd[bench]'), skipped")
    else:
        hm_numel = args.hivemind_floats or numel
        _optional(rows, notes, "hivemind", lambda: _hivemind_row(hm_numel, reps))
    return rows


def _print_goodput(
    rows: list[dict[str, Any]],
    costs: list[dict[str, Any]],
    notes: list[str],
    title: str,
    plot: str,
    out: TextIO,
) -> None:
    """The goodput table and verdicts, the per-push cost table, the notes, and the plot."""
    print(title, file=out)
    report.print_table(rows, file=out)
    report.print_verdicts(rows, file=out)
    if costs:
        print(file=out)
        push_cost.print_cost(costs, file=out)
    for note in notes:
        print(note, file=out)
    if plot:
        report.plot(rows, Path(plot), title)
        print(f"plot: {plot}", file=out)


def _push_costs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The per-push cost row over plaintext, then over mutual TLS."""
    pushes = args.push_cost_pushes or (PUSH_COST_PUSHES_QUICK if args.quick else PUSH_COST_PUSHES)
    return [
        push_cost.bench_push_cost(pushes, PUSH_COST_BYTES // 4, secure) for secure in (False, True)
    ]


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy()).cast("B")
