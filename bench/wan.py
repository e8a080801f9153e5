"""`gossipd bench wan`: time to target of every protocol against the DDP and DiLoCo
baselines on a shaped wide-area network.

For each protocol, one after another (side by side they would share the cores and
time each other), N `gossipd node` sites run on a fresh wide-area testbed
(:mod:`gossipd.bench.wan_sites`: a network namespace per site, bandwidth shaped by
``tc tbf`` both ways, latency injected by each site's ``[link] latency_ms``; without
root, every site on loopback shaped by ``[link]`` alone, labelled so). Each row: the
time from the moment every site had started until every site had evaluated at or
past the target, the final metric, the bytes each site sent in all and until the
target (the interfaces' counters, sampled through the run), the trainer's wait, the
spread of the sites' weight shares (gossip protocols) and the speedup over
``allreduce`` (plain torch DDP across all sites) and ``diloco`` (H local steps, then
an averaged outer step). A last pair of
runs measures what gossip costs the trainer: the same N sites with ``sumweight`` on,
then with no seeds (each trains alone, the same CPU contention).

``--json`` puts one JSON object on the last stdout line (the table then goes to stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from gossipd.bench import consensus
from gossipd.bench import wan_results as results
from gossipd.bench.wan_scenarios import DEFAULT_PATH, scenario
from gossipd.bench.wan_sites import SitesRun, WanSpec, run_sites
from gossipd.node.errors import ConfigError
from gossipd.node.launch.plot import save_figure
from gossipd.node.protocols import PROTOCOLS
from gossipd.node.shared.config_gossip import GossipConfig
from gossipd.node.shared.config_ranks import ALLREDUCE, BASELINE_SECTIONS, DILOCO
from gossipd.node.trainer import checkpoint

log = logging.getLogger("gossipd.bench.wan")

SYNTHETIC_NUMEL = 10_000_000  # --job synthetic: a 40 MB model, where bandwidth dominates
THROUGHPUT_PROTOCOL = "sumweight"
# The share of the trainer's steps gossip on must keep: 0.97 where a step is a fraction
# of a millisecond (digits, synthetic), 0.9 on the real tasks, whose steps are longer but
# whose sites share this box's 2 cores with their daemons.
GOAL_THROUGHPUT = {"mnist1d": 0.9, "shakespeare": 0.9}
GOAL_THROUGHPUT_DEFAULT = 0.97


def protocol_row(run: SitesRun, target: results.Target, budget_s: float) -> dict[str, Any]:
    """One protocol's numbers (speedup filled in once allreduce's time is known)."""
    t0 = run.t0_unix_s
    steps = [s.get("steps") for s in run.summaries]
    to_target = None if t0 is None else results.time_to_target_s(run.histories, target, t0)
    return {
        "time_to_target_s": to_target,
        "final_accuracy": results.final_metric(run.histories, target.metric),
        "bytes_per_site": results.mean(run.tx_bytes) if run.tx_bytes is not None else None,
        "bytes_per_site_to_target": None
        if t0 is None or to_target is None
        else results.bytes_at(run.tx_samples, t0 + to_target),
        # Sampled during the run: MB per site to any other bar, from the sites' histories.
        "bytes_per_site_over_time": None
        if t0 is None or run.tx_bytes is None
        else [[round(t - t0, 2), b] for t, b in run.tx_samples],
        "weight_shares": results.weight_shares(run.summaries),
        "wait_fraction": results.mean([s.get("wait_fraction") for s in run.summaries]),
        "speedup_vs_allreduce": None,
        "speedup_vs_diloco": None,
        "steps_per_site": results.mean(steps),
        # DiLoCo's and DiLoCo over gossip's (a burst whose pushes did not all merge takes
        # none); 0 for the other gossip protocols, None for DDP
        "outer_steps_per_site": results.mean([s.get("outer_steps") for s in run.summaries]),
        # Of the segments the sites merged, the share the clip pulled in (honest ones all)
        "clipped_share": results.clipped_share(run.summaries),
        "steps_per_s": None if results.mean(steps) is None else results.mean(steps) / budget_s,
        "load_average": run.load_average,
        "finished": run.finished,
        "workdir": str(run.workdir),
    }


def add_speedups(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's speedup over each baseline's time to target (None without that run)."""
    for baseline in (ALLREDUCE, DILOCO):
        base = rows.get(baseline, {}).get("time_to_target_s")
        for row in rows.values():
            row[f"speedup_vs_{baseline}"] = results.speedup(base, row["time_to_target_s"])


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_table(result: dict[str, Any], file: IO[str]) -> None:
    target = result["target"]
    print(
        f"gossipd bench wan · {result['date']} · {result['machine']} · scenario "
        f"{result['scenario']} · {result['sites']} sites · job {result['job']} · target "
        f"{target['describe']}\ntestbed: {result['testbed']}",
        file=file,
    )
    metric = "final loss" if target["lower_is_better"] else "final acc"
    head = (
        f"{'protocol':<17} {'to target':>9} {'vs DDP':>8} {'vs DiLoCo':>9} {metric:>10} "
        f"{'MB/site':>8} {'MB to tgt':>9} {'wait':>6} {'steps/site':>10} {'shares':>11} "
        f"{'load':>5}"
    )
    print(head, file=file)
    print("-" * len(head), file=file)
    for name, row in result["protocols"].items():
        mb = None if row["bytes_per_site"] is None else row["bytes_per_site"] / 1e6
        to_target = row.get("bytes_per_site_to_target")
        mb_target = None if to_target is None else to_target / 1e6
        wait = None if row["wait_fraction"] is None else 100 * row["wait_fraction"]
        shares = row.get("weight_shares")
        spread = "-" if not shares else f"{min(shares):.2f}-{max(shares):.2f}"
        print(
            f"{name:<17} {_num(row['time_to_target_s'], '8.1f') + 's':>9} "
            f"{_num(row['speedup_vs_allreduce'], '7.2f') + '×':>8} "
            f"{_num(row.get('speedup_vs_diloco'), '8.2f') + '×':>9} "
            f"{_num(row['final_accuracy'], '10.4f'):>10} {_num(mb, '8.1f'):>8} "
            f"{_num(mb_target, '9.1f'):>9} "
            f"{_num(wait, '5.1f') + '%':>6} {_num(row['steps_per_site'], '10.0f'):>10} "
            f"{spread:>11} {row['load_average']:>5.1f}",
            file=file,
        )
    tp = result.get("throughput")
    if tp:
        print(
            f"trainer throughput, {tp['protocol']} gossip on / off (each site alone): "
            f"{_num(tp['on_steps_per_s'], '.1f')} / {_num(tp['off_steps_per_s'], '.1f')} "
            f"steps/s per site = {_num(tp['ratio'], '.3f')} (goal >= "
            f"{GOAL_THROUGHPUT.get(result['job'], GOAL_THROUGHPUT_DEFAULT)})",
            file=file,
        )
        print(
            f"each site alone (no gossip): to target "
            f"{_num(tp['alone_time_to_target_s'], '.1f')} s, final "
            f"{_num(tp['alone_final_accuracy'], '.4f')}",
            file=file,
        )
    for name, row in result["protocols"].items():
        agreed = row.get("consensus") or {}
        if agreed.get("consensus_on_site_classes"):
            on = agreed["consensus_on_site_classes"]
            own = agreed["own_model_on_site_classes"]
            print(
                f"{name}: the consensus (Σ w·x / Σ w of the final models) on each site's "
                f"classes {min(on):.3f}-{max(on):.3f}; each site's own model on them "
                f"{min(own):.3f}-{max(own):.3f}",
                file=file,
            )
    print(
        "'-': never reached (or no baseline run to compare with); shares: each site's share "
        "of the weight times the number of sites, lowest-highest (1.00: its fair share)",
        file=file,
    )


def plot(runs: list[SitesRun], target: results.Target, title: str, path: Path) -> Path:
    """Mean test metric over sites against seconds since every site started, a line per
    protocol, with the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for i, run in enumerate(runs):
        if run.t0_unix_s is None:
            continue
        times, values = results.mean_curve(run.histories, target.metric, run.t0_unix_s)
        ax.plot(times, values, "-", color=f"C{i}", label=run.name)
    ax.axhline(target.value, color="k", ls="--", lw=1, label=f"target {target.describe()}")
    if target.lower_is_better:
        ax.set_yscale("log")
    else:
        # From where a lone mnist1d site sits (0.2-0.3) for a 0.80 bar; 0.3 for digits.
        ax.set_ylim(max(0.0, target.value - 0.6), 1.0)
    # Gossip reaches the bar in seconds, DDP at 50 ms in a minute: linear up to 1 s, then log.
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(left=0.0)
    ax.set(xlabel="seconds since every site started", ylabel=f"mean {target.metric} over sites")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return save_figure(fig, path)


DESCRIPTION = (
    "Time to target of every gossip protocol against plain DDP (allreduce) and DiLoCo on a "
    "shaped wide-area network: a network namespace per site with tc tbf (root), else loopback with "
    "gossipd's own [link] shaping. One protocol after another, then the trainer's throughput "
    "with gossip on and off."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gossipd bench wan", description=DESCRIPTION)
    p.add_argument("--scenario", required=True, help=f"a scenario of {DEFAULT_PATH}")
    p.add_argument("--sites", type=int, default=8, help="number of sites (default: %(default)s)")
    p.add_argument(
        "--job",
        choices=sorted(results.DEFAULT_TARGETS),
        default="digits",
        help=f"the job every site trains (synthetic: padded to {SYNTHETIC_NUMEL:,} "
        "parameters) (default: %(default)s)",
    )
    p.add_argument(
        "--protocols",
        default=",".join([*PROTOCOLS, *BASELINE_SECTIONS]),
        help="comma-separated protocols to run, in order (default: %(default)s)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=90.0,
        help="seconds of training per protocol, each site (default: %(default)s)",
    )
    p.add_argument(
        "--target",
        type=float,
        default=None,
        help="the bar every site must reach: "
        + "; ".join(f"{job}: {t.describe()}" for job, t in results.DEFAULT_TARGETS.items()),
    )
    p.add_argument(
        "--cpu-share",
        type=float,
        default=None,
        help="gossip.cpu_share of every gossip site, over 0 and at most 1 (default: the "
        "config's, 0.03)",
    )
    p.add_argument(
        "--weight-balance",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gossip.weight_balance of every gossip site: a fast site's pushes shrink until "
        "it holds about its share (default: on, as in the config)",
    )
    p.add_argument(
        "--clip-factor",
        type=float,
        default=None,
        help="limits.clip_factor of every gossip site, over 0; inf turns the clip off "
        "(default: the config's, 10)",
    )
    p.add_argument(
        "--peer-credit",
        type=float,
        default=None,
        help="limits.peer_credit of every gossip site, over 0; inf turns the credit off "
        "(default: the protocol's, 1/3, or 1/2 for pushsum-expgraph and persyn)",
    )
    p.add_argument(
        "--codecs",
        default="raw",
        help="comma-separated gossip.codec values each gossip protocol runs with, in order; "
        "a lossy one with gossip.error_feedback on (rows named PROTOCOL+CODEC); the "
        "baselines run once, uncompressed (default: %(default)s)",
    )
    p.add_argument(
        "--persyn-outer",
        action="store_true",
        help="persyn runs as DiLoCo over gossip: a burst every H (--inner-steps) steps and "
        "DiLoCo's outer Nesterov step after it (rows named persyn+outer)",
    )
    p.add_argument(
        "--inner-steps",
        type=int,
        default=100,
        metavar="H",
        help="diloco: local steps between outer steps (default: %(default)s)",
    )
    p.add_argument(
        "--site-ranks",
        default="",
        metavar="R,R,...",
        help="ranks of each gossip site (gossipd node --ranks), one per site: sites of "
        "different speed, as a 2-rank site beside 1-rank ones (default: 1 each; the "
        "baselines always run 1)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="site i seeds its job (initial model, batch order) with 1000·SEED + i: repeat "
        "a comparison with other seeds to see its noise (default: %(default)s)",
    )
    p.add_argument(
        "--no-throughput",
        action="store_true",
        help=f"skip the last pair of runs ({THROUGHPUT_PROTOCOL} gossip on, then off)",
    )
    p.add_argument("--loopback", action="store_true", help="loopback even as root")
    p.add_argument(
        "--workdir", default=None, help="where the sites' files go (default: a temp dir)"
    )
    p.add_argument("--plot", default="bench-wan.png", help="PNG path, '' for none")
    p.add_argument("--json", action="store_true", help="one JSON object as the last stdout line")
    return p


def _protocols(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = [*PROTOCOLS, *BASELINE_SECTIONS]
    unknown = [n for n in names if n not in known]
    if not names or unknown or len(set(names)) != len(names):
        raise ConfigError(
            f"--protocols {text!r}: give distinct names from {', '.join(known)}, comma-separated"
        )
    return names


CODECS = ("raw", "fp16", "bf16", "int8", "int4")


def _codecs(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in CODECS for n in names) or len(set(names)) != len(names):
        raise ConfigError(
            f"--codecs {text!r}: give distinct names from {', '.join(CODECS)}, comma-separated"
        )
    return names


def _site_ranks(text: str, sites: int) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        ranks = tuple(int(r) for r in text.split(","))
    except ValueError:
        ranks = ()
    if len(ranks) != sites or any(r < 1 for r in ranks):
        raise ConfigError(
            f"--site-ranks {text!r}: give {sites} whole numbers of at least 1, one per site, "
            "comma-separated"
        )
    return ranks


def consensus_of(run: SitesRun, spec: WanSpec) -> dict[str, Any] | None:
    """The run's consensus scored on each site's classes (:mod:`.consensus`); None where a
    site wrote no final checkpoint (it is named in the log)."""
    paths = [run.workdir / f"site-{i}" / checkpoint.FILENAME for i in range(spec.sites)]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        log.warning("%s: no consensus scored, no final checkpoint at %s", run.name, missing)
        return None
    segment_bytes = GossipConfig.model_fields["segment_bytes"].default
    try:
        return consensus.score(spec.job, spec.job_options, paths, segment_bytes).as_json()
    except Exception:  # a figure beside the run's: never the reason a bench loses its rows
        log.warning("%s: the consensus could not be scored", run.name, exc_info=True)
        return None


def runs_of(
    protocols: list[str], codecs: list[str], persyn_outer: bool = False
) -> list[tuple[str, str, str]]:
    """(row name, protocol, codec) of every run: each gossip protocol once per codec, a
    baseline once (it sends no gossip)."""
    out = []
    for protocol in protocols:
        label = "persyn+outer" if protocol == "persyn" and persyn_outer else protocol
        for codec in ["raw"] if protocol in BASELINE_SECTIONS else codecs:
            out.append((label if codec == "raw" else f"{label}+{codec}", protocol, codec))
    return out


def run(args: argparse.Namespace, out: IO[str]) -> dict[str, Any]:
    """Every protocol, then the throughput pair; the result object of ``--json``."""
    names = _protocols(args.protocols)
    codecs = _codecs(args.codecs)
    target = results.target_for(args.job, args.target)
    if args.sites < 2 or args.budget_s <= 0:
        raise ConfigError(
            f"--sites {args.sites} --budget-s {args.budget_s:g}: a wide-area run needs at "
            "least 2 sites and a budget above 0 s"
        )
    if args.cpu_share is not None and not 0 < args.cpu_share <= 1:
        raise ConfigError(f"--cpu-share {args.cpu_share:g}: give a share over 0 and at most 1")
    if args.clip_factor is not None and not args.clip_factor > 0:
        raise ConfigError(
            f"--clip-factor {args.clip_factor:g}: give a factor over 0, or inf for no clip"
        )
    if args.peer_credit is not None and not args.peer_credit > 0:
        raise ConfigError(
            f"--peer-credit {args.peer_credit:g}: give a credit over 0, or inf for no credit"
        )
    if args.inner_steps < 1:
        raise ConfigError(f"--inner-steps {args.inner_steps}: DiLoCo needs H >= 1 local steps")
    site_ranks = _site_ranks(args.site_ranks, args.sites)
    chosen = scenario(args.scenario)  # an unknown name stops here, before any directory
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gossipd-bench-wan-"))
    spec = WanSpec(
        scenario=chosen,
        sites=args.sites,
        job=args.job,
        budget_s=args.budget_s,
        workdir=workdir,
        loopback=args.loopback,
        job_options={"numel": SYNTHETIC_NUMEL} if args.job == "synthetic" else {},
        inner_steps=args.inner_steps,
        cpu_share=args.cpu_share,
        weight_balance=args.weight_balance,
        clip_factor=args.clip_factor,
        peer_credit=args.peer_credit,
        persyn_outer=args.persyn_outer,
        site_ranks=site_ranks,
        seed=args.seed,
    )
    log.info("bench wan: protocols %s, files in %s", ", ".join(names), workdir)
    runs, rows = [], {}
    for name, protocol, codec in runs_of(names, codecs, args.persyn_outer):
        run_ = run_sites(dataclasses.replace(spec, codec=codec), protocol, name=name)
        runs.append(run_)
        rows[name] = protocol_row(run_, target, args.budget_s)
        rows[name]["codec"] = codec
        if protocol not in BASELINE_SECTIONS:
            rows[name]["consensus"] = consensus_of(run_, spec)
        row = rows[name]
        outer, clipped = row["outer_steps_per_site"], row["clipped_share"]
        print(
            f"  {name}: to target {_num(row['time_to_target_s'], '.1f')} s, final "
            f"{_num(row['final_accuracy'], '.4f')}, {_num(row['steps_per_site'], '.0f')} steps"
            + (f", {outer:.0f} outer steps" if outer else "")
            + ("" if clipped is None else f", {100 * clipped:.2f}% of merges clipped"),
            file=out,
            flush=True,
        )
    add_speedups(rows)
    result: dict[str, Any] = {
        "scenario": args.scenario,
        "sites": args.sites,
        "job": args.job,
        "target": {
            "metric": target.metric,
            "value": target.value,
            "lower_is_better": target.lower_is_better,
            "describe": target.describe(),
        },
        "testbed": runs[0].testbed,
        "budget_s": args.budget_s,
        "inner_steps": args.inner_steps,
        "cpu_share": args.cpu_share,
        "weight_balance": args.weight_balance,
        "clip_factor": args.clip_factor,
        "peer_credit": args.peer_credit,
        "codecs": codecs,
        "persyn_outer": args.persyn_outer,
        "site_ranks": list(site_ranks),
        "seed": args.seed,
        "protocols": rows,
        "throughput": None if args.no_throughput else throughput(spec, target, out),
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "workdir": str(workdir),
    }
    if args.plot:
        title = (
            f"gossipd bench wan · {args.scenario} · {args.sites} sites · job {args.job} · "
            f"{result['testbed'][:60]}"
        )
        result["plot"] = str(plot(runs, target, title, Path(args.plot)))
    return result


def throughput(spec: WanSpec, target: results.Target, out: IO[str]) -> dict[str, Any]:
    """Mean steps/s per site with gossip on and with no seeds (each site alone), and how
    soon the sites alone reach the target: what gossip adds over local training."""
    rows = {}
    for on in (True, False):
        name = f"{THROUGHPUT_PROTOCOL}-{'on' if on else 'off'}"
        rows[on] = protocol_row(
            run_sites(spec, THROUGHPUT_PROTOCOL, gossip=on, name=name), target, spec.budget_s
        )
        print(f"  throughput {name}: {_num(rows[on]['steps_per_s'], '.1f')} steps/s", file=out)
    on_rate, off_rate = rows[True]["steps_per_s"], rows[False]["steps_per_s"]
    return {
        "protocol": THROUGHPUT_PROTOCOL,
        "on_steps_per_s": on_rate,
        "off_steps_per_s": off_rate,
        "ratio": on_rate / off_rate if on_rate is not None and off_rate else None,
        "alone_time_to_target_s": rows[False]["time_to_target_s"],
        "alone_final_accuracy": rows[False]["final_accuracy"],
    }


def main(argv: list[str] | None = None) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    # Which protocol runs and where its files are: said at INFO, whatever the CLI's level.
    logging.getLogger("gossipd.bench").setLevel(logging.INFO)
    try:
        result = run(args, out)
    except ConfigError as err:
        print(f"gossipd bench wan: {err}", file=sys.stderr)
        return 2
    print_table(result, out)
    if result.get("plot"):
        print(f"plot: {result['plot']}", file=out)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
