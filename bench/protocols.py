"""`python -m gossipd.bench.protocols`: rounds and virtual time to consensus, every protocol.

For every registered protocol and every N of the grid (16, 64, 256, 1,024 by
default) the simulator (:mod:`gossipd.node.sim`) runs the homogeneous scenario
with training off: each node starts from its own random vector, and the run
stops once the consensus error max‖xᵢ − x̄‖/‖x̄‖ (x̄ the mean of the initial
vectors) and its spectral prediction error₀·σ₁(P_k − J) are both at most the
target (1e-3), or at ``--max-rounds``. In this scenario one round is one
synchronous step of 1 s and everything lands within it, so the table's virtual
time is the round count plus the half step at which a round is measured.

Columns: rounds to the target measured and predicted; the measured and
predicted per-round decay factors (geometric mean over the run); whether the
rigorous bound rms_k/rms_0 ≤ σ_k held every round; payload bytes sent per node
per round, also in model copies (the model is ``--dim`` float64s). ``--json``
puts one JSON object on the last stdout line; ``--quick`` runs N = 16, 64.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from gossipd.node.errors import ConfigError
from gossipd.node.launch.plot import save_figure
from gossipd.node.protocols import PROTOCOLS, keeps_weights
from gossipd.node.sim import SimSpec, run_sim
from gossipd.node.sim.command import checked_options, parse_setting
from gossipd.node.sim.spectral import MAX_TRACKED_N, decay_rate, rounds_to

DEFAULT_SIZES = (16, 64, 256, 1024)
QUICK_SIZES = (16, 64)


def measure(
    protocol: str,
    nodes: int,
    *,
    target: float,
    max_rounds: int,
    segments: int,
    dim: int,
    seed: int,
    predict: bool,
    options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One cell of the grid: run until the target is met and read the columns off.
    ``options``: the protocol's own settings, as in its ``[gossip.<protocol>]`` table."""
    spec = SimSpec(
        protocol=protocol,
        nodes=nodes,
        rounds=max_rounds,
        segments=segments,
        dim=dim,
        seed=seed,
        target_error=target,
        predict=predict and nodes <= MAX_TRACKED_N,
        options=dict(options or {}),
        # The protocols as their papers state them: the peer credit (a defence against a
        # dishonest member, docs/security.md) cuts their pushes and costs rounds.
        peer_credit=math.inf,
    )
    r = run_sim(spec)
    measured = rounds_to(r.errors, target)
    predicted = rounds_to(r.predicted_errors, target) if r.predicted_errors else None
    bound_held = None
    if r.sigmas:
        rms0 = r.rms_errors[0]
        bound_held = all(
            e / rms0 <= s * (1 + 1e-9) + 1e-14 for e, s in zip(r.rms_errors, r.sigmas, strict=True)
        )
    model_bytes = dim * 8
    return {
        "protocol": protocol,
        "nodes": nodes,
        "rounds_to_target": measured,
        "predicted_rounds_to_target": predicted,
        "virtual_s_to_target": r.times_s[measured] if measured is not None else None,
        "decay_measured": decay_rate(r.errors),
        "decay_predicted": decay_rate(r.predicted_errors) if r.predicted_errors else None,
        "bound_held": bound_held,
        "bytes_per_node_per_round": r.bytes_per_node_per_round,
        "models_per_node_per_round": r.bytes_per_node_per_round / model_bytes,
        "rounds_run": r.rounds,
        "error_start": r.consensus_error_start,
        "error_end": r.consensus_error_end,
        "wall_s": r.wall_s,
    }


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]], target: float, file: IO[str]) -> None:
    head = (
        f"{'protocol':<17} {'N':>5} {f'rounds→{target:g}':>13} {'predicted':>9} "
        f"{'virtual s':>9} {'decay':>6} {'pred.':>6} {'bound':>5} {'B/node/rnd':>10} "
        f"{'models':>6} {'wall s':>7}"
    )
    print(head, file=file)
    print("-" * len(head), file=file)
    for row in rows:
        bound = {True: "ok", False: "NO", None: "-"}[row["bound_held"]]
        print(
            f"{row['protocol']:<17} {row['nodes']:>5} {_fmt(row['rounds_to_target'], 'd'):>13} "
            f"{_fmt(row['predicted_rounds_to_target'], 'd'):>9} "
            f"{_fmt(row['virtual_s_to_target'], '.1f'):>9} {row['decay_measured']:>6.3f} "
            f"{_fmt(row['decay_predicted'], '.3f'):>6} {bound:>5} "
            f"{row['bytes_per_node_per_round']:>10.0f} {row['models_per_node_per_round']:>6.2f} "
            f"{row['wall_s']:>7.1f}",
            file=file,
        )


def plot(rows: list[dict[str, Any]], target: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rounds, ax_bytes) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, protocol in enumerate(sorted({r["protocol"] for r in rows})):
        mine = [r for r in rows if r["protocol"] == protocol]
        color, marker = f"C{i}", "osD^v<>"[i % 7]  # markers tell overlapping lines apart
        ns = [r["nodes"] for r in mine if r["rounds_to_target"] is not None]
        ax_rounds.plot(
            ns,
            [r["rounds_to_target"] for r in mine if r["rounds_to_target"] is not None],
            marker + "-",
            color=color,
            label=f"{protocol} measured",
        )
        pn = [r["nodes"] for r in mine if r["predicted_rounds_to_target"] is not None]
        if pn:
            ax_rounds.plot(
                pn,
                [r["predicted_rounds_to_target"] for r in mine if r["nodes"] in pn],
                "x--",
                color=color,
                alpha=0.7,
                label=f"{protocol} predicted",
            )
        ax_bytes.plot(
            [r["nodes"] for r in mine],
            [r["models_per_node_per_round"] for r in mine],
            marker + "-",
            color=color,
            label=protocol,
            markersize=9 - i,
        )
    ax_rounds.set(
        title=f"rounds (1 s each) to consensus error {target:g}",
        xlabel="nodes",
        xscale="log",
        ylabel="rounds",
    )
    ax_bytes.set(
        title="model copies sent per node per round", xlabel="nodes", xscale="log", yscale="log"
    )
    for ax in (ax_rounds, ax_bytes):
        ax.set_xticks(sorted({r["nodes"] for r in rows}))
        ax.set_xticklabels([str(n) for n in sorted({r["nodes"] for r in rows})])
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle("gossipd bench protocols (simulator, homogeneous scenario, training off)")
    return save_figure(fig, path, dpi=110)


# What `--help` says: the module docstring in plain words, without its markup.
DESCRIPTION = (
    "Rounds and virtual time to consensus, every protocol. For every registered protocol and "
    "every N of the grid, the simulator runs the homogeneous scenario with training off: each "
    "node starts from its own random vector, and the run stops once the consensus error "
    "max‖xᵢ − x̄‖/‖x̄‖ and its spectral prediction are both at most --target, or at "
    "--max-rounds. Columns: rounds to the target measured and predicted, per-round decay "
    "factors measured and predicted, whether the bound rms_k/rms_0 ≤ σ_k held every round, "
    "payload bytes sent per node per round and in model copies."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gossipd.bench.protocols", description=DESCRIPTION)
    p.add_argument(
        "--protocol",
        action="append",
        choices=sorted(PROTOCOLS),
        help="protocols to run, repeatable (default: every push protocol; overlap has its "
        "own benchmark, gossipd bench overlap)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        action="append",
        help=f"sizes N, repeatable (default: {' '.join(map(str, DEFAULT_SIZES))})",
    )
    p.add_argument(
        "--quick", action="store_true", help=f"N = {', '.join(map(str, QUICK_SIZES))} only"
    )
    p.add_argument(
        "--target", type=float, default=1e-3, help="consensus error to reach (default: %(default)s)"
    )
    p.add_argument(
        "--max-rounds",
        type=int,
        default=400,
        help="give up after this many rounds (default: %(default)s)",
    )
    p.add_argument("--segments", type=int, default=4, help="model segments (default: %(default)s)")
    p.add_argument("--dim", type=int, default=64, help="vector length (default: %(default)s)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the simulation (default: %(default)s)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PROTOCOL.KEY=VALUE",
        help="a setting of one protocol, as in a node's [gossip.<protocol>] table (a TOML "
        "value), repeatable, e.g. --set persyn.average_every_steps=8; unset: what "
        "gossipd sim uses (default: none)",
    )
    p.add_argument(
        "--no-predict", action="store_true", help="skip the mixing-matrix prediction (faster)"
    )
    p.add_argument(
        "--plot", default="bench-protocols.png", help="PNG path, '' for none (default: %(default)s)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object as the last stdout line")
    return p


def options_by_protocol(settings: list[str]) -> dict[str, dict[str, Any]]:
    """``--set PROTOCOL.KEY=VALUE`` grouped by protocol, each checked by its protocol's class."""
    options: dict[str, dict[str, Any]] = {}
    for text in settings:
        protocol, _, setting = text.partition(".")
        if protocol not in PROTOCOLS:
            raise ConfigError(
                f"--set {text!r}: {protocol!r} is not a protocol; write PROTOCOL.KEY=VALUE with "
                f"PROTOCOL one of {', '.join(sorted(PROTOCOLS))}"
            )
        key, value = parse_setting(setting)
        options.setdefault(protocol, {})[key] = value
    return {protocol: checked_options(protocol, o) for protocol, o in options.items()}


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    # The push protocols by default: their mixing matrices give the spectral bound this
    # table checks. `overlap` pulls on its own schedule; `gossipd bench overlap` is its.
    protocols = args.protocol or sorted(p for p in PROTOCOLS if keeps_weights(p))
    try:
        options = options_by_protocol(args.set)
    except ConfigError as err:
        parser.error(str(err))
    sizes = args.nodes or list(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    out = sys.stderr if args.json else sys.stdout
    rows = []
    for n in sizes:
        for protocol in protocols:
            row = measure(
                protocol,
                n,
                target=args.target,
                max_rounds=args.max_rounds,
                segments=args.segments,
                dim=args.dim,
                seed=args.seed,
                predict=not args.no_predict,
                options=options.get(protocol),
            )
            rows.append(row)
            if args.json:
                print(f"  {protocol} N={n}: {row['rounds_to_target']} rounds", file=out)
    rows.sort(key=lambda r: (r["protocol"], r["nodes"]))
    print(
        f"gossipd bench protocols: homogeneous scenario, {args.segments} segments, "
        f"{args.dim}-float vectors, seed {args.seed}, target {args.target:g}",
        file=out,
    )
    print_table(rows, args.target, out)
    result: dict[str, Any] = {
        "target": args.target,
        "rows": rows,
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
    if args.plot:
        result["plot"] = str(plot(rows, args.target, Path(args.plot)))
        print(f"plot: {result['plot']}", file=out)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
