"""`gossipd bench overlap`: how much scheduled overlap hides, simulated and on real processes.

The experiment of the scheduled-overlap paper (§5): 8 nodes, 0, 2 or 6 of them
on fast links, and four ways to pull: ``none`` (after the period's steps: the
trainer waits a whole transfer), ``naive`` (at the period's start: the average
is with a model a period old), and ``scheduled`` (to land as the period ends)
with a coordinator and decentralized. Two parts:

* the simulator (:mod:`gossipd.bench.overlap_sim`): real digits steps, virtual
  links sized like the paper's, every mode for the same virtual-time budget,
  averaged over seeds; a table and a plot (accuracy against virtual time, one
  panel per fast count, and the wait fractions);
* real processes (:mod:`gossipd.bench.overlap_mesh`): 4 `gossipd node` processes
  on loopback, shaped by ``[link]``, one mode after another for the same
  wall-clock budget; a table with each mode's wait and accuracy next to ``none``'s.

``--json`` puts one JSON object on the last stdout line (the tables go to stderr);
``--quick`` runs a small version (2 fast counts, 1 seed, 10 periods; 15 s a mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import IO, Any

from gossipd.bench.overlap_mesh import MeshSettings, run_mode
from gossipd.bench.overlap_sim import MODES, SimSettings, run_grid
from gossipd.node.launch.plot import save_figure

GOAL_WAIT = 0.03  # the goal for scheduled overlap: under 3% of wall time waited


def _pct(x: float) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}%"


def _none_row(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any]:
    return next(
        r for r in rows if r["mode"] == "none" and r.get("fast_nodes") == row.get("fast_nodes")
    )


def print_sim_table(rows: list[dict[str, Any]], file: IO[str]) -> None:
    head = (
        f"{'fast':>4} {'mode':<25} {'wait mean':>9} {'wait max':>8} {'acc@budget':>10} "
        f"{'vs none':>8} {'best acc':>8} {'steps/node':>10}"
    )
    print(head, file=file)
    print("-" * len(head), file=file)
    for row in rows:
        gain = row["accuracy_end"] - _none_row(rows, row)["accuracy_end"]
        print(
            f"{row['fast_nodes']:>4} {row['mode']:<25} {_pct(row['wait_mean']):>9} "
            f"{_pct(row['wait_max']):>8} {row['accuracy_end']:>10.4f} {gain:>+8.4f} "
            f"{row['accuracy_best']:>8.4f} {row['steps_per_node']:>10.0f}",
            file=file,
        )


def print_real_table(rows: list[dict[str, Any]], file: IO[str]) -> None:
    head = (
        f"{'mode':<25} {'wait mean':>9} {'wait max':>8} {'÷ none':>6} {'accuracy':>8} "
        f"{'vs none':>8} {'steps/node':>10} {'load':>5}"
    )
    print(head, file=file)
    print("-" * len(head), file=file)
    for row in rows:
        none = _none_row(rows, row)
        ratio = row["wait_mean"] / none["wait_mean"] if none["wait_mean"] > 0 else math.nan
        print(
            f"{row['mode']:<25} {_pct(row['wait_mean']):>9} {_pct(row['wait_max']):>8} "
            f"{ratio:>6.2f} {row['accuracy_mean']:>8.4f} "
            f"{row['accuracy_mean'] - none['accuracy_mean']:>+8.4f} {row['steps_mean']:>10.0f} "
            f"{row['load_average']:>5.1f}",
            file=file,
        )


def plot(rows: list[dict[str, Any]], settings: SimSettings, path: Path) -> Path:
    """Top: mean accuracy against virtual time, a panel per fast count, a line per mode.
    Bottom: each mode's mean wait fraction, with the 3% goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fasts = list(settings.fast_counts)
    labels = [label for label, _, _ in MODES]
    fig, axes = plt.subplots(2, len(fasts), figsize=(5 * len(fasts), 7.5), squeeze=False)
    top_wait = 105 * max(max(r["wait_mean"] for r in rows), GOAL_WAIT)  # one scale for all
    for col, fast in enumerate(fasts):
        mine = {r["mode"]: r for r in rows if r["fast_nodes"] == fast}
        ax = axes[0][col]
        late = []
        for i, label in enumerate(labels):
            row = mine[label]
            ax.plot(row["times_s"], row["accuracy"], "-", color=f"C{i}", label=label)
            late += row["accuracy"][len(row["accuracy"]) // 4 :]
        ax.set_ylim(max(0.0, min(late) - 0.02), min(1.0, max(late) + 0.01))
        ax.set(title=f"{fast} of {settings.nodes} nodes on fast links", xlabel="virtual s")
        ax.set_ylabel("mean test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
        bars = axes[1][col]
        waits = [100 * mine[label]["wait_mean"] for label in labels]
        bars.bar(range(len(labels)), waits, color=[f"C{i}" for i in range(len(labels))])
        bars.axhline(100 * GOAL_WAIT, color="k", ls="--", lw=1, label="3% goal")
        bars.set_xticks(range(len(labels)))
        bars.set_xticklabels([label.replace(", ", "\n").replace("+", "\n+") for label in labels])
        bars.set_ylabel("trainer wait, % of time")
        bars.set_ylim(0, top_wait)
        bars.grid(alpha=0.3, axis="y")
        bars.legend(fontsize=8)
    fig.suptitle(
        f"gossipd bench overlap (simulator): T = {settings.period_steps}, slow pull "
        f"{settings.pull_s(False):.2f} s of a {settings.period_steps * settings.step_s:g} s "
        f"period, mean of {len(settings.seeds)} seed(s)"
    )
    return save_figure(fig, path)


DESCRIPTION = (
    "How much scheduled overlap hides: the paper's experiment (8 nodes, 0/2/6 on fast links, "
    "modes none, naive, scheduled with a coordinator and decentralized) on the simulator with "
    "real digits steps, then 4 real gossipd processes on shaped loopback links, one mode after "
    "another. Prints the trainer's wait fraction and the accuracy reached in a fixed budget."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gossipd bench overlap", description=DESCRIPTION)
    p.add_argument(
        "--quick",
        action="store_true",
        help="small version: fast counts 0 and 6, one seed, 10 periods; 15 s per real mode",
    )
    part = p.add_mutually_exclusive_group()
    part.add_argument("--sim-only", action="store_true", help="skip the real processes")
    part.add_argument("--real-only", action="store_true", help="skip the simulator")
    p.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="simulator seeds averaged per cell (default: %(default)s; 1 with --quick)",
    )
    p.add_argument(
        "--periods",
        type=int,
        default=25,
        help="simulator budget in periods of T steps (default: %(default)s; 10 with --quick)",
    )
    p.add_argument(
        "--real-budget-s",
        type=float,
        default=40.0,
        help="seconds of training per real mode (default: %(default)s; 15 with --quick)",
    )
    p.add_argument(
        "--plot", default="bench-overlap.png", help="PNG path, '' for none (default: %(default)s)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object as the last stdout line")
    return p


def run_sim_part(args: argparse.Namespace, out: IO[str]) -> tuple[SimSettings, list[dict]]:
    settings = SimSettings(
        fast_counts=(0, 6) if args.quick else (0, 2, 6),
        periods=10 if args.quick else args.periods,
        seeds=tuple(range(1 if args.quick else args.seeds)),
    )
    print(f"simulator: {settings.describe()}", file=out, flush=True)
    rows = run_grid(settings)
    print_sim_table(rows, out)
    return settings, rows


def run_real_part(args: argparse.Namespace, out: IO[str]) -> tuple[MeshSettings, list[dict]]:
    settings = MeshSettings(budget_s=15.0 if args.quick else args.real_budget_s)
    print(f"real processes: {settings.describe()}", file=out, flush=True)
    rows = []
    for label, mode, coordinator in MODES:
        load = os.getloadavg()[0]
        row = {"mode": label, "load_average": load, **run_mode(settings, mode, coordinator)}
        print(
            f"  {label}: wait {_pct(row['wait_mean'])}, accuracy {row['accuracy_mean']:.4f}, "
            f"{row['wall_s']:.0f} s",
            file=out,
            flush=True,
        )
        rows.append(row)
    print_real_table(rows, out)
    return settings, rows


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average_start": os.getloadavg()[0],
    }
    if not args.real_only:
        settings, rows = run_sim_part(args, out)
        result["sim"] = {"settings": dataclasses.asdict(settings), "rows": rows}
        if args.plot:
            result["plot"] = str(plot(rows, settings, Path(args.plot)))
            print(f"plot: {result['plot']}", file=out)
    if not args.sim_only:
        mesh_settings, real_rows = run_real_part(args, out)
        result["real"] = {"settings": dataclasses.asdict(mesh_settings), "rows": real_rows}
    result["load_average_end"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
