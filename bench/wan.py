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

With ``--natted K`` the last K sites sit behind the testbed's NAT router and are reached
through relays (:mod:`gossipd.bench.wan_reach`); each row then says how many bytes each
public site relayed.

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
from gossipd.bench.wan_options import (
    SYNTHETIC_NUMEL,
    THROUGHPUT_PROTOCOL,
    Checked,
    build_parser,
    check,
)
from gossipd.bench.wan_report import num, plot, print_table
from gossipd.bench.wan_scenarios import scenario
from gossipd.bench.wan_sites import SitesRun, WanSpec, run_sites
from gossipd.node.errors import ConfigError
from gossipd.node.shared.config_gossip import GossipConfig
from gossipd.node.shared.config_ranks import ALLREDUCE, BASELINE_SECTIONS, DILOCO
from gossipd.node.trainer import checkpoint

log = logging.getLogger("gossipd.bench.wan")


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
        # What each public site forwarded as a relay for the natted ones (None: none natted)
        "relay_bytes": run.relay_bytes,
        "workdir": str(run.workdir),
    }


def add_speedups(rows: dict[str, dict[str, Any]]) -> None:
    """Each row's speedup over each baseline's time to target (None without that run)."""
    for baseline in (ALLREDUCE, DILOCO):
        base = rows.get(baseline, {}).get("time_to_target_s")
        for row in rows.values():
            row[f"speedup_vs_{baseline}"] = results.speedup(base, row["time_to_target_s"])


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
    checked = check(args)
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
        site_ranks=checked.site_ranks,
        seed=args.seed,
        natted=args.natted,
        tls=args.tls,
    )
    log.info("bench wan: protocols %s, files in %s", ", ".join(checked.protocols), workdir)
    runs, rows = run_protocols(spec, checked, args.persyn_outer, out)
    result = _result(args, checked, runs[0].testbed, rows)
    result["throughput"] = None if args.no_throughput else throughput(spec, checked.target, out)
    result["date"] = datetime.date.today().isoformat()
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    result["workdir"] = str(workdir)
    if args.plot:
        title = (
            f"gossipd bench wan · {args.scenario} · {args.sites} sites · job {args.job} · "
            f"{result['testbed'][:60]}"
        )
        result["plot"] = str(plot(runs, checked.target, title, Path(args.plot)))
    return result


def run_protocols(
    spec: WanSpec, checked: Checked, persyn_outer: bool, out: IO[str]
) -> tuple[list[SitesRun], dict[str, dict[str, Any]]]:
    """Each run of :func:`runs_of`, one after another, a line on ``out`` as each ends; the
    runs and their rows, speedups filled in."""
    runs, rows = [], {}
    for name, protocol, codec in runs_of(checked.protocols, checked.codecs, persyn_outer):
        run_ = run_sites(dataclasses.replace(spec, codec=codec), protocol, name=name)
        runs.append(run_)
        rows[name] = protocol_row(run_, checked.target, spec.budget_s)
        rows[name]["codec"] = codec
        if protocol not in BASELINE_SECTIONS:
            rows[name]["consensus"] = consensus_of(run_, spec)
        row = rows[name]
        outer, clipped = row["outer_steps_per_site"], row["clipped_share"]
        print(
            f"  {name}: to target {num(row['time_to_target_s'], '.1f')} s, final "
            f"{num(row['final_accuracy'], '.4f')}, {num(row['steps_per_site'], '.0f')} steps"
            + (f", {outer:.0f} outer steps" if outer else "")
            + ("" if clipped is None else f", {100 * clipped:.2f}% of merges clipped"),
            file=out,
            flush=True,
        )
    add_speedups(rows)
    return runs, rows


def _result(
    args: argparse.Namespace, checked: Checked, testbed: str, rows: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The result object's head: what was run, on which testbed, and its rows (the
    throughput, date, machine and workdir follow, in that order)."""
    target = checked.target
    return {
        "scenario": args.scenario,
        "sites": args.sites,
        "job": args.job,
        "target": {
            "metric": target.metric,
            "value": target.value,
            "lower_is_better": target.lower_is_better,
            "describe": target.describe(),
        },
        "testbed": testbed,
        "budget_s": args.budget_s,
        "inner_steps": args.inner_steps,
        "cpu_share": args.cpu_share,
        "weight_balance": args.weight_balance,
        "clip_factor": args.clip_factor,
        "peer_credit": args.peer_credit,
        "codecs": checked.codecs,
        "persyn_outer": args.persyn_outer,
        "site_ranks": list(checked.site_ranks),
        "seed": args.seed,
        "natted": args.natted,  # the last sites, behind the NAT router
        "tls": bool(args.tls or args.natted),
        "protocols": rows,
    }


def throughput(spec: WanSpec, target: results.Target, out: IO[str]) -> dict[str, Any]:
    """Mean steps/s per site with gossip on and with no seeds (each site alone), and how
    soon the sites alone reach the target: what gossip adds over local training."""
    rows = {}
    for on in (True, False):
        name = f"{THROUGHPUT_PROTOCOL}-{'on' if on else 'off'}"
        rows[on] = protocol_row(
            run_sites(spec, THROUGHPUT_PROTOCOL, gossip=on, name=name), target, spec.budget_s
        )
        print(f"  throughput {name}: {num(rows[on]['steps_per_s'], '.1f')} steps/s", file=out)
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
