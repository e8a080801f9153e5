"""`gossipd bench wan`'s command line: its flags and help, and the checks a run's flags
pass before any site starts.

Kept apart from :mod:`gossipd.bench.wan` (which runs the sites and collects the rows):
what an operator may ask for, and the one line that says what was wrong with it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gossipd.bench import wan_results as results
from gossipd.bench.wan_scenarios import DEFAULT_PATH
from gossipd.node.errors import ConfigError
from gossipd.node.protocols import PROTOCOLS
from gossipd.node.shared.config_ranks import BASELINE_SECTIONS

SYNTHETIC_NUMEL = 10_000_000  # --job synthetic: a 40 MB model, where bandwidth dominates
THROUGHPUT_PROTOCOL = "sumweight"
CODECS = ("raw", "fp16", "bf16", "int8", "int4")

DESCRIPTION = (
    "Time to target of every gossip protocol against plain DDP (allreduce) and DiLoCo on a "
    "shaped wide-area network: a network namespace per site with tc tbf (root), else loopback with "
    "gossipd's own [link] shaping. One protocol after another, then the trainer's throughput "
    "with gossip on and off."
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gossipd bench wan", description=DESCRIPTION)
    _add_run_flags(p)
    _add_gossip_flags(p)
    _add_site_flags(p)
    _add_output_flags(p)
    return p


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """What is run: the scenario, how many sites, the job, the protocols, for how long, to
    which bar."""
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


def _add_gossip_flags(p: argparse.ArgumentParser) -> None:
    """The gossip sites' settings a comparison varies."""
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


def _add_site_flags(p: argparse.ArgumentParser) -> None:
    """How each site trains: DiLoCo's period, ranks per site, the seed."""
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
        "--natted",
        type=int,
        default=0,
        metavar="K",
        help="the last K sites sit behind the testbed's NAT router (masqueraded, nobody "
        "dials in): each finds out at start, attaches to public sites as relays and is "
        "reached through them; every site then runs mutual TLS, as relays need. Gossip "
        "protocols only (the baselines' rendezvous needs every site reachable); on "
        "loopback they are told reach.reachable = false (default: %(default)s)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="every site runs mutual TLS with a certificate of its own, as --natted does: "
        "an all-direct run to compare a natted one with (default: plaintext)",
    )


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """The throughput pair, the testbed, and where the results go."""
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


@dataclass(frozen=True)
class Checked:
    """A run's flags once they passed: the protocols and codecs in order, the bar, and each
    gossip site's ranks (empty: 1 each)."""

    protocols: list[str]
    codecs: list[str]
    target: results.Target
    site_ranks: tuple[int, ...]


def check(args: argparse.Namespace) -> Checked:
    """The flags of a run, checked in the order an operator reads them; the first that is
    wrong raises ConfigError, before any directory or site exists."""
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
    _check_natted(args.natted, args.sites, names)
    return Checked(names, codecs, target, _site_ranks(args.site_ranks, args.sites))


def _check_natted(natted: int, sites: int, protocols: list[str]) -> None:
    """Natted sites need a public one to relay for them, and no baseline: a rendezvous
    (DDP's, DiLoCo's) is dialled by every site, and nobody can dial a natted one."""
    if not 0 <= natted < sites:
        raise ConfigError(
            f"--natted {natted} with --sites {sites}: give 0 to {sites - 1}; at least one site "
            "must be public to relay for the natted ones"
        )
    baselines = [p for p in protocols if p in BASELINE_SECTIONS]
    if natted and baselines:
        raise ConfigError(
            f"--natted {natted} with {', '.join(baselines)}: the baselines' rendezvous needs "
            "every site reachable; give --protocols with gossip protocols only"
        )


def _protocols(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    known = [*PROTOCOLS, *BASELINE_SECTIONS]
    unknown = [n for n in names if n not in known]
    if not names or unknown or len(set(names)) != len(names):
        raise ConfigError(
            f"--protocols {text!r}: give distinct names from {', '.join(known)}, comma-separated"
        )
    return names


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
