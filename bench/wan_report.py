"""What `gossipd bench wan` shows of its result: the table (with the throughput pair and
each protocol's consensus under it) and the plot of the sites' mean metric over time.

Kept apart from :mod:`gossipd.bench.wan`, which runs the sites: both read only the
result object that ``--json`` prints, so a saved result can be shown again.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

from gossipd.bench import wan_results as results
from gossipd.bench.wan_sites import SitesRun
from gossipd.node.launch.plot import save_figure

# The share of the trainer's steps gossip on must keep: 0.97 where a step is a fraction
# of a millisecond (digits, synthetic), 0.9 on the real tasks, whose steps are longer but
# whose sites share this box's 2 cores with their daemons.
GOAL_THROUGHPUT = {"mnist1d": 0.9, "shakespeare": 0.9}
GOAL_THROUGHPUT_DEFAULT = 0.97


def num(value: float | None, fmt: str) -> str:
    """``value`` in ``fmt``, or '-' where there is none (never reached, no baseline)."""
    return "-" if value is None else format(value, fmt)


def print_table(result: dict[str, Any], file: IO[str]) -> None:
    target = result["target"]
    print(
        f"gossipd bench wan · {result['date']} · {result['machine']} · scenario "
        f"{result['scenario']} · {result['sites']} sites · job {result['job']} · target "
        f"{target['describe']}{_reach_words(result)}\ntestbed: {result['testbed']}",
        file=file,
    )
    metric = "final loss" if target["lower_is_better"] else "final acc"
    natted = bool(result.get("natted"))
    head = (
        f"{'protocol':<17} {'to target':>9} {'vs DDP':>8} {'vs DiLoCo':>9} {metric:>10} "
        f"{'MB/site':>8} {'MB to tgt':>9} {'wait':>6} {'steps/site':>10} {'shares':>11} "
        f"{'load':>5}" + (f" {'MB/relay':>8}" if natted else "")
    )
    print(head, file=file)
    print("-" * len(head), file=file)
    for name, row in result["protocols"].items():
        print(_row_line(name, row) + (f" {_relayed_mean(row):>8}" if natted else ""), file=file)
    _print_throughput(result, file)
    _print_relays(result, file)
    _print_consensus(result, file)
    print(
        "'-': never reached (or no baseline run to compare with); shares: each site's share "
        "of the weight times the number of sites, lowest-highest (1.00: its fair share)",
        file=file,
    )


def _row_line(name: str, row: dict[str, Any]) -> str:
    """One protocol's row of the table."""
    mb = None if row["bytes_per_site"] is None else row["bytes_per_site"] / 1e6
    to_target = row.get("bytes_per_site_to_target")
    mb_target = None if to_target is None else to_target / 1e6
    wait = None if row["wait_fraction"] is None else 100 * row["wait_fraction"]
    shares = row.get("weight_shares")
    spread = "-" if not shares else f"{min(shares):.2f}-{max(shares):.2f}"
    return (
        f"{name:<17} {num(row['time_to_target_s'], '8.1f') + 's':>9} "
        f"{num(row['speedup_vs_allreduce'], '7.2f') + '×':>8} "
        f"{num(row.get('speedup_vs_diloco'), '8.2f') + '×':>9} "
        f"{num(row['final_accuracy'], '10.4f'):>10} {num(mb, '8.1f'):>8} "
        f"{num(mb_target, '9.1f'):>9} "
        f"{num(wait, '5.1f') + '%':>6} {num(row['steps_per_site'], '10.0f'):>10} "
        f"{spread:>11} {row['load_average']:>5.1f}"
    )


def _reach_words(result: dict[str, Any]) -> str:
    """The header's word on NAT and TLS (nothing for a plain run, as before)."""
    natted, sites = result.get("natted") or 0, result["sites"]
    if natted:
        first = sites - natted
        which = f"site {first}" if natted == 1 else f"sites {first}-{sites - 1}"
        return f" · {which} natted (reached through relays) · mutual TLS"
    return " · mutual TLS" if result.get("tls") else ""


def _relayed_mean(row: dict[str, Any]) -> str:
    """MB relayed per public site (the mean over those that answered)."""
    counts = [b for b in (row.get("relay_bytes") or {}).values() if b is not None]
    return num(sum(counts) / len(counts) / 1e6 if counts else None, ".1f")


def _print_relays(result: dict[str, Any], file: IO[str]) -> None:
    """Per protocol, the bytes each public site relayed for the natted ones."""
    for name, row in result["protocols"].items():
        relayed = row.get("relay_bytes")
        if relayed:
            each = ", ".join(
                f"{site} {num(None if b is None else b / 1e6, '.1f')} MB"
                for site, b in relayed.items()
            )
            print(f"{name}: relayed (both directions) by {each}", file=file)


def _print_throughput(result: dict[str, Any], file: IO[str]) -> None:
    """The throughput pair's two lines, when it ran."""
    tp = result.get("throughput")
    if not tp:
        return
    print(
        f"trainer throughput, {tp['protocol']} gossip on / off (each site alone): "
        f"{num(tp['on_steps_per_s'], '.1f')} / {num(tp['off_steps_per_s'], '.1f')} "
        f"steps/s per site = {num(tp['ratio'], '.3f')} (goal >= "
        f"{GOAL_THROUGHPUT.get(result['job'], GOAL_THROUGHPUT_DEFAULT)})",
        file=file,
    )
    print(
        f"each site alone (no gossip): to target "
        f"{num(tp['alone_time_to_target_s'], '.1f')} s, final "
        f"{num(tp['alone_final_accuracy'], '.4f')}",
        file=file,
    )


def _print_consensus(result: dict[str, Any], file: IO[str]) -> None:
    """A line per protocol whose consensus was scored on each site's classes."""
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
