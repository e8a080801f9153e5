"""Meshes of real daemons behind the testbed's real NAT for tests/test_nat_mesh.py: public
and natted sites in network namespaces with mutual TLS, read from the root namespace
(public sites directly, natted ones through their relays), stopped in turn for the sum
of weights."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gossipd.bench import wan_nat, wan_net
from gossipd.bench.wan_scenarios import SiteLink
from gossipd.node.errors import GossipdError
from gossipd.node.launch.localmesh import free_ports, stop_process
from gossipd.node.net.relay.routes import Routes
from gossipd.node.net.status.query import query_status
from gossipd.node.protocols import keeps_weights
from gossipd.node.shared.tls import Credentials
from tests.daemons import TEST_STEPS_PER_S, wait_until, write_config
from tests.tls_mesh import CLIENT, Pki

ROOT, WHY_NOT = wan_net.have_root()
NFT_MISSING = wan_nat.nft_missing()
LINK = SiteLink(rate_mbit=100.0, latency_ms=5.0)
START_S = 120.0  # a daemon answering, on 2 busy cores (torch imports)
MESH_S = 90.0  # every site live to every other, the natted ones through relays
GOSSIP_S = 120.0  # each site's counters grow by the margin
STOP_S = 60.0  # one daemon's SIGTERM, hand-off and exit; the rest seeing it gone
# A natted site attached to a new relay after losing its only one: about 6-10 s on an idle
# box (3 silent keepalive periods, then the attach), printed by the test; the bound is a
# timeout for a loaded one (CI, two workers: over 10 s once), not the claim.
REATTACH_S = 60.0
ASK_S = 10.0  # one Status call (2 cores shared with other tests: a generous bound)
TOLERANCE = 1e-9
# Each protocol's own settings that make it exchange often, so every site, natted or not,
# sends and merges within seconds (overlap pulls every few steps as it is).
FAST: dict[str, dict[str, Any]] = {
    "sumweight": {"push_probability": 0.5},
    "crossover": {"round_steps": 1},
    "pushsum-expgraph": {"round_steps": 1},
    "shuffle-exchange": {"round_steps": 1},
    "persyn": {"average_every_steps": 5},
}


def gossip_of(protocol: str) -> dict[str, Any]:
    """``[gossip]`` for ``protocol``: no CPU budget (tests count exchanges against their
    own timeouts on 2 busy cores, as tests/daemons.py's defaults) and its FAST table."""
    own = FAST.get(protocol)
    return {"protocol": protocol, "cpu_share": 1.0, **({protocol: own} if own else {})}


@dataclass
class Site:
    """One daemon in its namespace."""

    index: int
    node_id: str
    listen: str  # HOST:PORT it binds: the harness may dial it only if it is public
    natted: bool
    data_dir: Path
    proc: subprocess.Popen[bytes]

    def log(self) -> str:
        path = self.data_dir / "node.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def summary(self) -> dict[str, Any]:
        return json.loads((self.data_dir / "summary.json").read_text())


@dataclass
class NatMesh:
    """The testbed, its daemons, and the certificate the harness presents."""

    bed: wan_net.Testbed
    pki: Pki
    tls: Credentials  # the harness's: CLIENT's certificate
    sites: list[Site] = field(default_factory=list)

    def running(self, *, natted: bool | None = None) -> list[Site]:
        return [
            s
            for s in self.sites
            if s.proc.poll() is None and (natted is None or s.natted == natted)
        ]

    def check_alive(self) -> None:
        """Raise, with its log's tail, if a daemon of the mesh has exited (a test removes
        one it killed on purpose)."""
        for s in self.sites:
            if s.proc.poll() is not None:
                raise AssertionError(
                    f"{s.node_id} exited with {s.proc.returncode}:\n{s.log()[-3000:]}"
                )

    def statuses(self) -> dict[str, dict[str, Any]]:
        """Status of every site the running public sites know, by node id: public ones
        asked directly, natted ones at the relayed address a public site lists for them."""
        entries = [s.listen for s in self.running(natted=False)]
        return asyncio.run(_read_statuses(entries, self.tls))


async def _read_statuses(entries: list[str], tls: Credentials) -> dict[str, dict[str, Any]]:
    routes = Routes(tls)  # the harness's own loopback ports to relayed sites
    try:
        found: dict[str, dict[str, Any]] = {}
        where: dict[str, str] = {}
        for entry in entries:
            with contextlib.suppress(GossipdError):
                status = await query_status(entry, ASK_S, tls=tls, routes=routes)
                found[status["node_id"]] = status
                for peer in status["peers"]:
                    where.setdefault(peer["node_id"], peer["address"])

        async def ask(address: str) -> dict[str, Any] | None:
            try:
                return await query_status(address, ASK_S, tls=tls, routes=routes)
            except GossipdError:
                return None  # not there (yet, or any more): the caller polls

        missing = [a for n, a in where.items() if n not in found]
        for status in await asyncio.gather(*(ask(a) for a in missing)):
            if status is not None:
                found[status["node_id"]] = status
        return found
    finally:
        await routes.close()


def _start_site(
    bed: wan_net.Testbed,
    pki: Pki,
    root: Path,
    i: int,
    addresses: list[str],
    seeds: list[str],
    config: dict[str, Any],
) -> Site:
    """Site ``i``'s daemon in its namespace, listening at ``addresses[i]``, with no
    ``[reach]`` setting (auto) beyond what ``config`` adds: a synthetic job paced to
    TEST_STEPS_PER_S (these tests wait on exchanges, not steps), its own certificate,
    ``[link] latency_ms`` from the testbed, tc the rate."""
    node_id = f"site-{i}"
    data_dir = root / node_id
    data_dir.mkdir(parents=True)
    job = {"name": "synthetic", "seed": i, "eval_every_steps": 0}
    full: dict[str, Any] = {
        "mesh_id": "nat-mesh",
        "node_id": node_id,
        "listen": addresses[i],
        "seeds": seeds,
        "data_dir": str(data_dir),
        "job": {**job, "learning_rate": 0.01, "max_steps_per_s": TEST_STEPS_PER_S},
        "checkpoint": {"every_steps": 0},
        "link": {"latency_ms": bed.latency_ms(i)},
        "tls": pki.tls_config(node_id),
        **config,
    }
    full["gossip"] = {"seed": i, **full.get("gossip", {})}
    path = root / f"{node_id}.toml"
    write_config(path, full)
    argv = [sys.executable, "-m", "gossipd.node.cli", "--log-level", "INFO", "node"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(data_dir / "node.log", "ab") as out:
        proc = bed.popen(i, [*argv, "--config", str(path)], stdout=out, stderr=out, env=env)
    return Site(i, node_id, addresses[i], bed.is_natted(i), data_dir, proc)


@contextlib.contextmanager
def nat_mesh(tmp_path: Path, public: int, natted: int, **config: Any) -> Iterator[NatMesh]:
    """``public`` sites, then ``natted`` ones behind the router, every one with
    ``config``'s sections (:func:`_start_site` has the rest). Public sites are seeded
    with each other, natted ones with the public ones, and the natted ones start once
    every public one answers: a site whose reach check finds no seed answering takes
    itself as direct and asks again only every 10 s (RECHECK_S in
    node/net/peers/reachability.py), unreachable meanwhile. Ports are picked free now
    (each namespace has its own, so any free one will do)."""
    n = public + natted
    root = tmp_path / "sites"
    root.mkdir()
    pki = Pki.create(tmp_path / "ca", [f"site-{i}" for i in range(n)] + [CLIENT])
    with wan_net.Testbed([LINK] * n, natted=set(range(public, n))) as bed:
        addresses = [f"{bed.address(i)}:{port}" for i, port in enumerate(free_ports(n))]
        mesh = NatMesh(bed, pki, pki.creds(CLIENT))
        try:
            for i in range(public):
                seeds = [a for k, a in enumerate(addresses[:public]) if k != i]
                mesh.sites.append(_start_site(bed, pki, root, i, addresses, seeds, config))
            wait_until(
                lambda: set(mesh.statuses()) >= {s.node_id for s in mesh.sites},
                "the public sites to answer",
                START_S,
                mesh.check_alive,
            )
            for i in range(public, n):
                site = _start_site(bed, pki, root, i, addresses, addresses[:public], config)
                mesh.sites.append(site)
            yield mesh
        finally:
            for s in mesh.sites:
                if s.proc.poll() is None:
                    s.proc.send_signal(signal.SIGTERM)
            for s in mesh.sites:
                stop_process(s.proc, STOP_S, signalled=True)
    assert wan_net.leftovers(bed.tag) == []


def wait_mesh_live(mesh: NatMesh, timeout_s: float = MESH_S) -> dict[str, dict[str, Any]]:
    """Until every running site answers and lists every other as live, each natted one
    relayed; the statuses read last."""
    ids = {s.node_id for s in mesh.running()}
    natted = {s.node_id for s in mesh.running(natted=True)}
    latest: dict[str, dict[str, Any]] = {}

    def full() -> bool:
        latest.clear()
        latest.update(mesh.statuses())
        return (
            set(latest) >= ids
            and all(set(latest[n]["live_peers"]) >= ids - {n} for n in ids)
            and all(latest[n]["reach"].startswith("relayed by ") for n in natted)
        )

    try:
        wait_until(full, f"{sorted(ids)} live to each other", timeout_s, mesh.check_alive)
    except AssertionError as err:
        seen = {n: (s["reach"], s["live_peers"]) for n, s in latest.items()}
        raise AssertionError(f"{err}; (reach, live peers) per site answering: {seen}") from None
    return dict(latest)


def read_all(mesh: NatMesh, sites: list[Site]) -> dict[str, dict[str, Any]]:
    """The statuses of ``sites``, once every one of them answered in the same read."""
    ids = {s.node_id for s in sites}
    latest: dict[str, dict[str, Any]] = {}

    def answered() -> bool:
        latest.clear()
        latest.update(mesh.statuses())
        return set(latest) >= ids

    wait_until(answered, f"{sorted(ids)} to answer", MESH_S, mesh.check_alive)
    return {n: latest[n] for n in ids}


def progress(status: dict[str, Any], protocol: str) -> tuple[int, ...]:
    """What a site has exchanged: pushes sent and merged, or (overlap, which pulls)
    pulls merged."""
    if keeps_weights(protocol):
        return status["pushes_acked"], status["pushes_merged"]
    return (status["pulls"].get("merged", 0),)


def wait_gossip(mesh: NatMesh, protocol: str, margin: int, timeout_s: float = GOSSIP_S) -> None:
    """Until every running site's :func:`progress` grew by ``margin`` in each count."""
    ids = {s.node_id for s in mesh.running()}
    start = {n: progress(s, protocol) for n, s in wait_mesh_live(mesh).items()}
    latest: dict[str, tuple[int, ...]] = {}

    def grown() -> bool:
        latest.update({n: progress(s, protocol) for n, s in mesh.statuses().items()})
        return all(
            n in latest and all(b - a >= margin for a, b in zip(start[n], latest[n], strict=True))
            for n in ids
        )

    try:
        wait_until(grown, f"{protocol} gossip on every site", timeout_s, mesh.check_alive)
    except AssertionError as err:
        raise AssertionError(f"{err}; (start, latest) per site: {start}, {latest}") from None


def stop_in_turn(mesh: NatMesh, order: list[int]) -> list[list[float]]:
    """SIGTERM one site at a time (each hands its weight to a live peer as it leaves,
    natted ones through a relay); before the next, wait until the rest no longer list it
    live. Each site's final per-segment sum-weights, from its ``summary.json``."""
    weights = []
    for k, i in enumerate(order):
        site = mesh.sites[i]
        code = stop_process(site.proc, STOP_S)
        assert code == 0, f"{site.node_id} exited with {code}:\n{site.log()[-3000:]}"
        weights.append(site.summary()["sum_weights"])
        rest = {mesh.sites[j].node_id for j in order[k + 1 :]}
        if rest:

            def gone(node_id: str = site.node_id, rest: set[str] = rest) -> bool:
                seen = mesh.statuses()
                return set(seen) >= rest and all(node_id not in seen[n]["live_peers"] for n in rest)

            wait_until(gone, f"{sorted(rest)} to see {site.node_id} gone", STOP_S)
    return weights


def mesh_cli(mesh: NatMesh, entry: Site) -> dict[str, str]:
    """Each site's reach as `gossipd status --mesh --json` against a public site shows it,
    run as an operator outside the NAT runs it (a certificate of the mesh), again until
    every site has had a row in one run, within MESH_S.

    Not all in one run because one run often misses a site: ``grpc.min_reconnect_
    backoff_ms = 100`` in node/net/wire/grpc_options.py is also gRPC's minimum connect
    timeout, so TCP, TLS and HTTP/2's settings must complete within about 100 ms. Through
    a relay (an order to the natted site, its Take, two hops each way) on 2 busy cores
    they often do not ("Handshake read failed (Endpoint closing)", "connection attempt
    timed out before receiving SETTINGS frame"): 1 run in 4 to 10 at load 4-8; at load
    14-17 most runs, and direct dials too ("tcp handshaker shutdown")."""
    pki = mesh.pki
    command = [sys.executable, "-m", "gossipd.node.cli", "status", "--mesh", "--json"]
    command += ["--address", entry.listen, "--timeout-s", str(ASK_S)]
    command += ["--ca", str(pki.ca), "--cert", str(pki.pem(CLIENT)), "--key", str(pki.key(CLIENT))]
    ids = {s.node_id for s in mesh.running()}
    reach: dict[str, str] = {}
    last: list[str] = [""]

    def every_site_seen() -> bool:
        out = subprocess.run(command, capture_output=True, text=True, timeout=60)
        last[0] = out.stdout + out.stderr
        if out.stdout.strip():
            reach.update({r["node_id"]: r["reach"] for r in json.loads(out.stdout)["sites"]})
        return set(reach) >= ids

    try:
        wait_until(every_site_seen, "status --mesh to show every site", MESH_S, mesh.check_alive)
    except AssertionError as err:
        raise AssertionError(f"{err}; seen {reach}, the last run:\n{last[0]}") from None
    return reach


def parse_reach(reach: str) -> str:
    """The one relay of a site with ``reach.relays = 1`` ("relayed by HOST:PORT")."""
    relays = reach.removeprefix("relayed by ").split(", ")
    assert reach.startswith("relayed by ") and len(relays) == 1, reach
    return relays[0]
