"""One protocol's run of `gossipd bench wan`: N `gossipd node` sites on the wide-area testbed.

:func:`run_sites` builds the testbed for the scenario (a network namespace per site,
``tc tbf`` both ways; or the loopback fallback), writes each site's config (listen
on its testbed address, the other sites as seeds, ``[link] latency_ms`` from the
scenario, job shard i of N, ``duration_s`` = the budget), starts ``gossipd node`` in
each site, waits (bounded) until every site has written ``summary.json`` with
``training_done`` or has exited, stops them (SIGTERM, then SIGKILL; all reaped), reads
the interfaces' byte counters and tears the testbed down, also on failure or Ctrl-C.

The sites run plaintext gRPC (``[tls] insecure = true``): the bench times protocols,
and the all-reduce baseline it compares with has no TLS either. With ``natted`` sites
(behind the testbed's NAT router, reached through relays) or ``tls``, every site runs
mutual TLS instead, as relays need (:mod:`gossipd.bench.wan_reach`). Checkpoints are
written only at shutdown, so no site spends its budget on the disk.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gossipd.bench import wan_cleanup, wan_reach
from gossipd.bench.wan_net import LoopbackTestbed, Testbed, open_testbed
from gossipd.bench.wan_results import History, eval_every_steps
from gossipd.bench.wan_scenarios import Scenario
from gossipd.node.launch.localmesh import free_ports
from gossipd.node.launch.plot import read_history
from gossipd.node.shared.config_ranks import BASELINE_SECTIONS

log = logging.getLogger(__name__)

STARTUP_S = 120.0  # every site listening and in touch (or at the rendezvous), generously
FINISH_S = 60.0  # after the budget: the last evaluation, summary.json, a slow stop
POLL_S = 0.5


OUTER_LEARNING_RATE, OUTER_MOMENTUM = 0.7, 0.9  # DiLoCo's, as the diloco baseline's
SEED_STRIDE = 1000  # site i of --seed S seeds its job and gossip with 1000·S + i


@dataclass(frozen=True)
class WanSpec:
    """What every protocol's run shares."""

    scenario: Scenario
    sites: int
    job: str
    budget_s: float
    workdir: Path
    loopback: bool = False
    job_options: dict[str, Any] = field(default_factory=dict)
    inner_steps: int = 100  # the diloco baseline's H
    cpu_share: float | None = None  # [gossip] cpu_share of the gossip sites; None: default
    weight_balance: bool = True  # [gossip] weight_balance of the gossip sites
    clip_factor: float | None = None  # [limits] clip_factor of the gossip sites; None: default
    peer_credit: float | None = None  # [limits] peer_credit of the gossip sites; None: default
    codec: str = "raw"  # [gossip] codec of the gossip sites; a lossy one with error feedback
    # persyn sites take DiLoCo's outer step (0.7, Nesterov 0.9) every inner_steps steps
    persyn_outer: bool = False
    # Ranks of each gossip site (`gossipd node --ranks R`; empty: one each): sites of
    # different speed. The baselines run one rank per site.
    site_ranks: tuple[int, ...] = ()
    seed: int = 0  # a repeat with other initial models and batches (SEED_STRIDE)
    # The last `natted` sites sit behind the testbed's NAT router and are reached through
    # relays; with any, or with `tls`, every site runs mutual TLS (wan_reach.py).
    natted: int = 0
    tls: bool = False

    @property
    def ca_dir(self) -> Path | None:
        """Where the run's certificates are, or None for plaintext."""
        return self.workdir / wan_reach.CA_DIR if self.tls or self.natted else None

    def is_natted(self, index: int) -> bool:
        return index >= self.sites - self.natted


@dataclass
class SitesRun:
    """What one run left: each site's history and summary, the common start, the bytes."""

    name: str
    protocol: str
    testbed: str
    workdir: Path
    histories: list[History]
    summaries: list[dict[str, Any]]
    t0_unix_s: float | None  # the last site's node.json: every site had started
    tx_bytes: list[int] | None  # per site, from the testbed's counters; None on loopback
    tx_samples: list[tuple[float, float]]  # (unix_s, mean bytes sent per site) in the run
    exit_codes: list[int | None]
    load_average: float
    finished: bool  # every site wrote training_done (or exited) before the deadline
    # Bytes each public site forwarded as a relay (Status relay_bytes) at the end, by
    # node id; None without natted sites
    relay_bytes: dict[str, int | None] | None = None


def site_toml(
    spec: WanSpec,
    protocol: str,
    index: int,
    addresses: list[str],
    latency_ms: float,
    rate_mbit: float | None,
    data_dir: Path,
    *,
    gossip: bool = True,
    master: str | None = None,
    unreachable: bool = False,
) -> str:
    """Site ``index``'s config: ``rate_mbit`` only where gossipd must shape the rate itself
    (the loopback fallback; the baselines model latency only); ``gossip`` False: no
    seeds, the site trains alone; ``master``: a baseline's rendezvous; ``unreachable``:
    ``reach.reachable = false`` (a natted site on loopback, where no NAT stops a dial)."""
    baseline = protocol in BASELINE_SECTIONS
    n = len(addresses)
    top = {
        "mesh_id": f"wan-{protocol}",
        "node_id": f"site-{index}",
        "listen": addresses[index],
        "seeds": _seeds(spec, index, addresses) if gossip else [],
        "data_dir": str(data_dir),
        "progress_interval_s": 10,
    }
    link: dict[str, Any] = {"latency_ms": latency_ms}
    if rate_mbit is not None and not baseline:
        link["rate_mbit"] = rate_mbit
    tables: dict[str, dict[str, Any]] = {
        "job": _site_job(spec, protocol, index, n, latency_ms),
        "job.options": spec.job_options,
        "gossip": _gossip(spec, protocol, index, baseline),
        "limits": {} if baseline else _limits(spec),
        "membership": {"start_after_peers": n - 1 if gossip and not baseline else 0},
        "checkpoint": {"every_steps": 0},
        "link": link,
        "tls": wan_reach.tls_table(spec.ca_dir, f"site-{index}"),
    }
    if unreachable:
        tables["reach"] = {"reachable": False}
    if protocol == "persyn" and spec.persyn_outer:
        tables["gossip.persyn"] = {
            "average_every_steps": spec.inner_steps,
            "outer_learning_rate": OUTER_LEARNING_RATE,
            "outer_momentum": OUTER_MOMENTUM,
        }
    if baseline:
        if master is None:
            raise ValueError(f"site_toml for baseline {protocol!r} needs its rendezvous")
        tables[protocol] = {"master": master}
        if protocol == "diloco":
            tables[protocol]["inner_steps"] = spec.inner_steps
    lines = _toml_keys(top)
    for name, values in tables.items():
        lines += ["", f"[{name}]", *_toml_keys(values)]
    return "\n".join(lines) + "\n"


def _seeds(spec: WanSpec, index: int, addresses: list[str]) -> list[str]:
    """The other sites, or with natted sites the public ones only: nobody can dial a natted
    site, and a natted neighbour would dial one back and call it reachable."""
    public = len(addresses) - spec.natted
    return [a for i, a in enumerate(addresses) if i != index and (i < public or not spec.natted)]


def _gossip(spec: WanSpec, protocol: str, index: int, baseline: bool) -> dict[str, Any]:
    """Site ``index``'s ``[gossip]``: a baseline takes only its protocol and seed, sending
    no gossip to shape, share or compress."""
    return {
        "protocol": protocol,
        "seed": SEED_STRIDE * spec.seed + index,
        **({"cpu_share": spec.cpu_share} if spec.cpu_share and not baseline else {}),
        **({"weight_balance": False} if not spec.weight_balance and not baseline else {}),
        **(
            {"codec": spec.codec, "error_feedback": True}
            if spec.codec != "raw" and not baseline
            else {}
        ),
    }


def _limits(spec: WanSpec) -> dict[str, float]:
    """The [limits] a gossip site runs with: what the bench was told, the rest default."""
    given = {"clip_factor": spec.clip_factor, "peer_credit": spec.peer_credit}
    return {key: value for key, value in given.items() if value is not None}


def _site_job(
    spec: WanSpec, protocol: str, index: int, n: int, latency_ms: float
) -> dict[str, Any]:
    """Site ``index``'s ``[job]``: shard ``index`` of ``n``, seeded by it, for the budget."""
    return {
        "name": spec.job,
        "seed": SEED_STRIDE * spec.seed + index,
        "shard_index": index,
        "num_shards": n,
        "duration_s": spec.budget_s,
        "eval_every_steps": eval_every_steps(protocol, n, latency_ms, spec.inner_steps),
    }


def _toml_keys(values: dict[str, Any]) -> list[str]:
    """``key = value`` lines (JSON's strings, numbers, lists and booleans are TOML's too;
    an infinite float is not JSON's, and is TOML's ``inf``)."""
    return [f"{k} = {_toml_value(v)}" for k, v in values.items()]


def _toml_value(value: Any) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return json.dumps(value)


def run_sites(spec: WanSpec, protocol: str, *, gossip: bool = True, name: str = "") -> SitesRun:
    """One run of ``protocol`` on a fresh testbed (see the module docstring)."""
    name = name or protocol
    root = spec.workdir / name
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    load = os.getloadavg()[0]
    if spec.ca_dir is not None:
        wan_reach.ensure_certificates(spec.workdir, spec.sites)
    links, natted = spec.scenario.links(spec.sites), wan_reach.natted_sites(spec.sites, spec.natted)
    with open_testbed(links, force_loopback=spec.loopback, natted=natted) as bed:
        label = testbed_label(bed)
        log.info(
            "running %s: %d sites, job %s, %g s of training each, files in %s (%s)",
            name,
            spec.sites,
            spec.job,
            spec.budget_s,
            root,
            label,
        )
        dirs = [root / f"site-{i}" for i in range(spec.sites)]
        procs, addresses = _start(spec, bed, protocol, gossip, root, dirs)
        samples: list[tuple[float, float]] = []
        finished = _wait(spec, procs, dirs, lambda: _sample(bed, spec.sites, samples))
        relayed = _relay_bytes(spec, addresses) if spec.natted else None
        wan_cleanup.stop_processes(procs)
        counters = [bed.counters(i) for i in range(spec.sites)]
    codes = [p.returncode for p in procs]
    for i, code in enumerate(codes):
        if code not in (0, None) and not _done(dirs[i]):
            log.warning("%s site %d exited with %s; see %s", name, i, code, dirs[i] / "node.log")
    starts = [dirs[i] / "node.json" for i in range(spec.sites)]
    return SitesRun(
        name=name,
        protocol=protocol,
        testbed=label,
        workdir=root,
        histories=[read_history(d) for d in dirs],
        summaries=[_summary(d) for d in dirs],
        t0_unix_s=max(p.stat().st_mtime for p in starts)
        if all(p.exists() for p in starts)
        else None,
        tx_bytes=None if any(c is None for c in counters) else [c[0] for c in counters if c],
        tx_samples=samples,
        exit_codes=codes,
        load_average=load,
        finished=finished,
        relay_bytes=relayed,
    )


def _relay_bytes(spec: WanSpec, addresses: list[str]) -> dict[str, int | None]:
    """What each public site forwarded as a relay, read before the sites stop."""
    public = {f"site-{i}": a for i, a in enumerate(addresses) if not spec.is_natted(i)}
    return wan_reach.relay_bytes(public, wan_reach.harness_tls(spec.ca_dir))


def testbed_label(bed: Testbed | LoopbackTestbed) -> str:
    """How the network was made, for the table and the JSON."""
    return bed.label if bed.kernel_shaping else f"loopback: {bed.label}"


def _start(
    spec: WanSpec,
    bed: Testbed | LoopbackTestbed,
    protocol: str,
    gossip: bool,
    root: Path,
    dirs: list[Path],
) -> tuple[list[Any], list[str]]:
    """Every site's process, and the addresses they listen at. Natted sites start once the
    public ones listen: a natted site's reach check needs a seed to answer
    (:mod:`gossipd.bench.wan_reach`)."""
    ports = free_ports(spec.sites + 1)
    addresses = [f"{bed.address(i)}:{ports[i]}" for i in range(spec.sites)]
    master = f"{bed.address(0)}:{ports[-1]}" if protocol in BASELINE_SECTIONS else None
    procs = []
    for i, data_dir in enumerate(dirs):
        if spec.natted and i == spec.sites - spec.natted:
            wan_reach.wait_listening(addresses[:i], STARTUP_S)
        data_dir.mkdir(parents=True)
        config = root / f"site-{i}.toml"
        rate = None if bed.kernel_shaping else bed.rate_mbit(i)
        config.write_text(
            site_toml(
                spec,
                protocol,
                i,
                addresses,
                bed.latency_ms(i),
                rate,
                data_dir,
                gossip=gossip,
                master=master,
                unreachable=spec.is_natted(i) and not bed.kernel_shaping,
            )
        )
        procs.append(_popen(spec, bed, protocol, i, config, data_dir))
    return procs, addresses


def _popen(
    spec: WanSpec,
    bed: Testbed | LoopbackTestbed,
    protocol: str,
    i: int,
    config: Path,
    data_dir: Path,
) -> Any:
    """``gossipd node`` as site ``i``, its output to its ``node.log``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if isinstance(bed, Testbed):
        # gloo would pick the interface of the machine's hostname, absent in a namespace.
        env["GLOO_SOCKET_IFNAME"] = bed.interface(i)
    argv = [sys.executable, "-m", "gossipd.node.cli", "--log-level", "INFO", "node"]
    ranks = spec.site_ranks[i] if spec.site_ranks else 1
    if ranks > 1 and protocol not in BASELINE_SECTIONS:
        argv += ["--ranks", str(ranks)]
    with open(data_dir / "node.log", "ab") as out:
        return bed.popen(i, [*argv, "--config", str(config)], stdout=out, stderr=out, env=env)


def _sample(bed: Testbed | LoopbackTestbed, sites: int, samples: list[tuple[float, float]]) -> None:
    """Append (now, mean bytes sent per site) where the testbed counts bytes per site."""
    counts = [bed.counters(i) for i in range(sites)]
    if all(c is not None for c in counts):
        samples.append((time.time(), sum(c[0] for c in counts if c) / sites))


def _wait(spec: WanSpec, procs: list[Any], dirs: list[Path], sample: Callable[[], None]) -> bool:
    """Until every site is done or exited, sampling the byte counters each poll; False
    if the deadline came first."""
    deadline = time.monotonic() + STARTUP_S + spec.budget_s + FINISH_S
    while time.monotonic() < deadline:
        sample()
        if all(p.poll() is not None or _done(d) for p, d in zip(procs, dirs, strict=True)):
            return True
        time.sleep(POLL_S)
    late = [i for i, d in enumerate(dirs) if not _done(d) and procs[i].poll() is None]
    log.warning(
        "sites %s had not finished %g s after the start; stopping them (their logs are in %s)",
        late,
        STARTUP_S + spec.budget_s + FINISH_S,
        dirs[0].parent,
    )
    return False


def _summary(data_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((data_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def _done(data_dir: Path) -> bool:
    return bool(_summary(data_dir).get("training_done"))
