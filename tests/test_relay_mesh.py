"""Sites that cannot be dialled take part through relays: real daemons, real gRPC, mutual
TLS, loopback (no root, no NAT; docs/nat.md).

An outbound-only site (``reach.reachable = false``, or found so by a peer's dial-back
when left at ``auto``) attaches to reachable peers and advertises
``relay://SITE@RELAYS``; every connection to it is joined by a relay and carries the two
end sites' own TLS. Here on loopback nothing stops a peer from dialling it, except that
its address names no port of its own: every push to or from such a site, and every push
between two of them, crosses a relay.

What these tests hold the relays to:

* a mesh with outbound-only sites is a full mesh, and the sum of weights stays exact;
* a relay that is lost (``kill -9``: reset; ``SIGSTOP``: only silence) is replaced by
  another reachable peer within ``REPLACED_WITHIN_S`` (10 s, a requirement of the issue,
  not a performance figure), and gossip goes on through the new one;
* what a lost relay costs the sum of weights is what the relay itself held, nothing
  of what it only forwarded: the TLS inside is end to end, so a push cut in a relay is
  an unacknowledged push, retried with the same sequence or folded back;
* a site that cannot be dialled and was told nothing finds that out at start;
* the last relay between two outbound-only sites leaving first keeps the sum exact
  (it does not yet: the last test fails, see its docstring).

Seeds are fixed (``job.seed`` and ``gossip.seed`` per site), ports are picked at run
time, every wait is bounded, and every daemon is reaped.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gossipd.node.launch.localmesh import free_ports
from tests.conftest import (
    DaemonHandle,
    check_alive,
    kill_hard,
    scrape_metrics,
    sigstopped,
    start_daemon,
    status_of,
    stop_all,
    stop_in_turn,
    wait_counters_grow,
    wait_gone,
    wait_mesh_live,
    wait_until,
)
from tests.tls_mesh import CLIENT, Pki

# The issue's requirement: "a relay that is lost is replaced by another reachable peer
# within 10 s" (with the default reach.keepalive_s = 2 s: 3 silent periods and a dial).
REPLACED_WITHIN_S = 10.0
TOLERANCE = 1e-9
# Every site pushes every step it may (the relayed links are exercised at once), and a
# push to a hung relay is abandoned after 2 s, so the sites attached elsewhere go on.
GOSSIP: dict[str, Any] = {"push_probability": 1.0, "progress_timeout_s": 2.0}
# Stated, not left to the default: the faults below last well under drop_after_s, so a
# frozen relay is suspected, never declared dead (its pushes are never folded back).
MEMBERSHIP: dict[str, Any] = {"suspect_after_failures": 2, "drop_after_s": 60.0}
# Two outbound-only sites took 10-40 s to become live to each other on a loaded 2-core
# box: a connection through a relay takes longer to set up than gRPC waits for at first
# (grpc.min_reconnect_backoff_ms = 100 in CHANNEL_OPTIONS is also its connect timeout),
# so it succeeds only once the backoff has grown past the setup time.
LIVE_TIMEOUT_S = 90.0


# -- starting and reading a mesh with outbound-only sites ------------------------------


@pytest.fixture
def sites() -> Iterator[list[DaemonHandle]]:
    """The daemons a test starts (appended as each answers); all reaped at the end, also
    when a start or an assertion fails half-way."""
    handles: list[DaemonHandle] = []
    try:
        yield handles
    finally:
        stop_all(handles)


def start_sites(
    tmp_path: Path,
    handles: list[DaemonHandle],
    direct: list[str],
    relayed: list[str],
    *,
    relayed_seeds: list[str] | None = None,
    relayed_reach: dict[str, Any] | None = None,
    relayed_config: dict[str, Any] | None = None,
) -> dict[str, DaemonHandle]:
    """``direct`` sites (``reach.reachable = true``: no dial-back at start, so which sites
    relay does not depend on start-up order), then ``relayed`` ones
    (``reach.reachable = false`` updated with ``relayed_reach``, and ``relayed_config``),
    each with its own certificate; the test presents a client certificate of its own.

    Direct sites seed each other; relayed ones seed the direct sites ``relayed_seeds``
    names (default: all). Site i has ``job.seed = gossip.seed = i``. Handles go into
    ``handles`` as each daemon answers, so the caller's teardown reaps a half-started
    mesh too.
    """
    ids = direct + relayed
    pki = Pki.create(tmp_path / "pki", [*ids, CLIENT])
    client = pki.creds(CLIENT)
    ports = dict(zip(ids, free_ports(len(ids)), strict=True))
    address = {n: f"127.0.0.1:{ports[n]}" for n in ids}
    for index, node_id in enumerate(ids):
        extra: dict[str, Any] = {}
        if node_id in direct:
            seeds = [address[n] for n in direct if n != node_id]
            reach: dict[str, Any] = {"reachable": True}
        else:
            seeds = [address[n] for n in (direct if relayed_seeds is None else relayed_seeds)]
            reach = {"reachable": False, **(relayed_reach or {})}
            extra = relayed_config or {}
        handles.append(
            start_daemon(
                tmp_path,
                node_id,
                ports[node_id],
                client_tls=client,
                seeds=seeds,
                tls=pki.tls_config(node_id),
                job={"seed": index},
                gossip={**GOSSIP, "seed": index},
                membership=MEMBERSHIP,
                reach=reach,
                **extra,
            )
        )
    return {h.node_id: h for h in handles}


def relays_of(handle: DaemonHandle) -> list[str]:
    """The relay addresses ``handle`` reports it is reached by ([] if none or direct)."""
    reach = status_of(handle)["reach"]
    prefix = "relayed by "
    return [r.strip() for r in reach[len(prefix) :].split(",")] if reach.startswith(prefix) else []


def wait_reach(handles: list[DaemonHandle], what: str, timeout_s: float = LIVE_TIMEOUT_S) -> None:
    """Until every one of ``handles`` reports ``relayed by`` at least one relay."""
    wait_until(
        lambda: all(relays_of(h) for h in handles), what, timeout_s, lambda: check_alive(handles)
    )


def exchanged_both_ways(one: DaemonHandle, other: DaemonHandle) -> bool:
    """``one``'s accounts show weight committed to ``other`` and merged from it."""
    mass = status_of(one)["exchanged"].get(other.node_id, {})
    return mass.get("sent", 0.0) > 0.0 and mass.get("received", 0.0) > 0.0


def time_until_replaced(
    handles: list[DaemonHandle], lost: str, since: float, timeout_s: float
) -> dict[str, float]:
    """Seconds from ``since`` (time.monotonic) until each of ``handles`` reports a relay
    again and none of them is ``lost``: the time to replace a lost relay. Polled while it
    runs; a timeout says where each site got to."""
    replaced: dict[str, float] = {}
    seen: dict[str, list[str]] = {}

    def done() -> bool:
        for h in handles:
            if h.node_id in replaced:
                continue
            relays = seen[h.node_id] = relays_of(h)
            if relays and lost not in relays:
                replaced[h.node_id] = time.monotonic() - since
        return len(replaced) == len(handles)

    try:
        wait_until(done, f"{[h.node_id for h in handles]} to replace relay {lost}", timeout_s)
    except AssertionError as err:
        raise AssertionError(f"{err}; relays seen last: {seen}; replaced: {replaced}") from None
    return replaced


def relayed_first(handles: list[DaemonHandle]) -> list[DaemonHandle]:
    """``handles`` in the order they leave: outbound-only sites first, while relays are
    still there to carry their hand-offs and Leaves, then the direct ones.

    The other order (relays first) is the case of
    :func:`test_the_last_relay_leaving_first_keeps_the_sum_of_weights_exact`: when the last
    relay between two outbound-only sites leaves, a push between them whose
    acknowledgement was crossing it can never be settled.
    """
    relayed = [h for h in handles if status_of(h)["reach"] != "direct"]
    return relayed + [h for h in handles if h not in relayed]


def segment_totals(weights: list[list[float]]) -> list[float]:
    return [sum(w[s] for w in weights) for s in range(len(weights[0]))]


def held_by(lost: str, survivors: list[dict[str, Any]], segments: int) -> float:
    """What a site that is gone for good held, summed over segments, by its peers' own
    accounts of it: its starting weight (1 per segment), plus what they committed to it
    (acknowledged), less what they merged from it.

    The survivors' weights change only by what they merge and what they commit, and
    among themselves the two cancel (retries are de-duplicated), so their total is
    N - 1 per segment plus what they merged from the lost site less what they committed
    to it: Σw falls by exactly this. A push the loss cut stays with its sender until it
    is acknowledged (never, here) and a relay's own connections are only such pushes,
    so nothing the lost site forwarded as a relay counts.
    """
    sent = sum(s["exchanged"].get(lost, {}).get("sent", 0.0) for s in survivors)
    received = sum(s["exchanged"].get(lost, {}).get("received", 0.0) for s in survivors)
    return segments + sent - received


# -- the tests ---------------------------------------------------------------------------


def test_outbound_only_sites_are_live_to_all_and_gossip_with_each_other_through_relays(
    tmp_path: Path, sites: list[DaemonHandle]
) -> None:
    """Two direct sites and two that cannot be dialled: all four live to all, the two
    outbound-only ones say by whom they are relayed and exchange weight both ways with
    each other (every such push crosses a relay: neither has a port to dial), the relays
    count what they forwarded, and after every site leaves in turn (outbound-only ones
    first: :func:`relayed_first`) Σw is exactly 4 per segment (a relayed push is an
    ordinary push: acknowledged or folded back, once)."""
    by_id = start_sites(tmp_path, sites, ["a", "b"], ["c", "d"])
    a, b, c, d = (by_id[n] for n in "abcd")
    wait_mesh_live(sites, LIVE_TIMEOUT_S)
    wait_reach([c, d], "c and d to report their relays")

    assert status_of(a)["reach"] == status_of(b)["reach"] == "direct"
    relay_addresses = {a.address, b.address}
    for h in (c, d):
        relays = relays_of(h)
        assert relays and set(relays) <= relay_addresses, (h.node_id, relays)
        # Peers know it by its relayed address, never by its own port.
        for peer in (a, b):
            known = {p["node_id"]: p["address"] for p in status_of(peer)["peers"]}
            assert known[h.node_id].startswith(f"relay://{h.node_id}@"), (peer.node_id, known)

    wait_until(
        lambda: exchanged_both_ways(c, d) and exchanged_both_ways(d, c),
        "c and d to commit and merge weight from each other (through relays only)",
        30.0,
        lambda: check_alive(sites),
    )
    wait_counters_grow(sites, ("pushes_acked", "pushes_merged"), 5, "gossip everywhere", 45.0)

    forwarded = {h.node_id: status_of(h)["relay_bytes"] for h in sites}
    assert forwarded["a"] + forwarded["b"] > 0, forwarded
    assert forwarded["c"] == forwarded["d"] == 0, f"outbound-only sites relay nothing: {forwarded}"

    metrics = {h.node_id: scrape_metrics(h.node_json()["metrics_port"]) for h in sites}
    assert [metrics[n]["gossipd_reach_relayed"] for n in "abcd"] == [0.0, 0.0, 1.0, 1.0]
    assert metrics["a"]["gossipd_relays_attached"] == metrics["b"]["gossipd_relays_attached"] == 0
    attached = {n: int(metrics[n]["gossipd_relays_attached"]) for n in "cd"}
    assert attached == {n: len(relays_of(by_id[n])) for n in "cd"}, attached
    assert sum(metrics[n]["gossipd_relay_attached_sites"] for n in "ab") == sum(attached.values())
    relay_bytes = sum(
        v for n in "ab" for k, v in metrics[n].items() if k.startswith("gossipd_relay_bytes_total{")
    )
    assert relay_bytes > 0, {n: metrics[n] for n in "ab"}

    inconsistencies = {h.node_id: status_of(h)["mass_inconsistencies"] for h in sites}
    weights = stop_in_turn(relayed_first(sites))
    totals = segment_totals(weights)
    assert inconsistencies == dict.fromkeys("abcd", 0), inconsistencies
    assert all(abs(t - len(sites)) <= TOLERANCE for t in totals), (totals, weights)


def one_relay_mesh(tmp_path: Path, sites: list[DaemonHandle]) -> dict[str, DaemonHandle]:
    """Three direct sites a, b, e and two outbound-only ones c, d that keep one relay
    each (``reach.relays = 1``) and are seeded with a alone, so both depend on a: a
    replacement exists (b or e), and c and d know of it only by gossip. Returned once
    all five are live to all, c and d are attached to a, and they have exchanged weight
    with each other through it."""
    by_id = start_sites(
        tmp_path,
        sites,
        ["a", "b", "e"],
        ["c", "d"],
        relayed_seeds=["a"],
        relayed_reach={"relays": 1},
    )
    a, c, d = by_id["a"], by_id["c"], by_id["d"]
    wait_mesh_live(sites, LIVE_TIMEOUT_S)
    wait_until(
        lambda: relays_of(c) == relays_of(d) == [a.address],
        f"c and d to be relayed by a ({a.address}) alone",
        LIVE_TIMEOUT_S,
        lambda: check_alive(sites),
    )
    wait_until(
        lambda: exchanged_both_ways(c, d) and exchanged_both_ways(d, c),
        "c and d to exchange weight through a",
        30.0,
        lambda: check_alive(sites),
    )
    return by_id


def wait_exchange_grows(
    one: DaemonHandle, other: DaemonHandle, timeout_s: float, *, both_ways: bool = True
) -> None:
    """Until ``one`` committed more weight to ``other`` and merged more from it than now
    (``both_ways``), or did either: pushes between two outbound-only sites, which only
    their relays can carry."""
    before = status_of(one)["exchanged"][other.node_id]

    def grew() -> bool:
        now = status_of(one)["exchanged"][other.node_id]
        sent, received = now["sent"] > before["sent"], now["received"] > before["received"]
        return sent and received if both_ways else sent or received

    way = "both ways" if both_ways else "either way"
    wait_until(grew, f"{one.node_id} and {other.node_id} to exchange weight {way}", timeout_s)


def test_a_relay_killed_is_replaced_within_10_s_and_costs_only_what_it_held(
    tmp_path: Path, sites: list[DaemonHandle]
) -> None:
    """The one relay of both outbound-only sites is killed with ``kill -9`` (its
    connections reset). Each attaches to another reachable peer, one it learned of by
    gossip, within 10 s of the kill; both keep pushing and merging, with each other too,
    through the new relays. After the survivors leave in turn, Σw is 5 per segment less
    exactly what the killed site held by its peers' accounts (:func:`held_by`): nothing
    of what it only forwarded as a relay is lost or counted twice."""
    by_id = one_relay_mesh(tmp_path, sites)
    a, b, e, c, d = (by_id[n] for n in "abecd")
    survivors = [b, e, c, d]

    since = time.monotonic()
    kill_hard(a)
    took = time_until_replaced([c, d], a.address, since, 3 * REPLACED_WITHIN_S)
    assert all(t <= REPLACED_WITHIN_S for t in took.values()), (
        f"a lost relay must be replaced within {REPLACED_WITHIN_S:g} s: took {took}"
    )
    for h in (c, d):
        assert set(relays_of(h)) <= {b.address, e.address}, (h.node_id, relays_of(h))

    wait_mesh_live(survivors, LIVE_TIMEOUT_S)
    wait_exchange_grows(c, d, 30.0)
    wait_counters_grow(
        [c, d], ("pushes_acked", "pushes_merged"), 5, "c and d to gossip after the kill", 45.0
    )
    wait_gone("a", survivors, LIVE_TIMEOUT_S)

    accounts = [status_of(h) for h in survivors]
    inconsistencies = {s["node_id"]: s["mass_inconsistencies"] for s in accounts}
    weights = stop_in_turn(relayed_first(survivors))
    segments = len(weights[0])
    held = held_by("a", accounts, segments)
    lost = 5 * segments - sum(segment_totals(weights))
    assert inconsistencies == dict.fromkeys("becd", 0), inconsistencies
    # The crash bound: the killed site can have taken at most what it held.
    assert -TOLERANCE <= lost <= held + TOLERANCE, (
        f"Σw fell by {lost} when a, which held {held} by its peers' accounts, was killed: "
        f"{weights}, accounts of a: {[s['exchanged'].get('a') for s in accounts]}"
    )
    assert abs(lost - held) <= TOLERANCE, (
        f"Σw fell by {lost}, but a held {held}: a relay's loss cost more (or less) than the "
        f"relay's own weight; accounts of a: {[s['exchanged'].get('a') for s in accounts]}"
    )


def test_a_frozen_relay_is_replaced_within_10_s_and_nothing_is_lost(
    tmp_path: Path, sites: list[DaemonHandle]
) -> None:
    """The one relay of both outbound-only sites is frozen (``SIGSTOP``: its sockets stay
    open, nothing resets; it only goes silent). Each site gives it up after 3 silent
    keepalive periods and attaches to another reachable peer, within 10 s of the freeze,
    and both keep gossiping, with each other too. The freeze lasts far less than
    ``membership.drop_after_s``, so the relay is only suspected, never declared dead:
    once resumed it is live to the others again, its pushes settle, and after every
    site leaves in turn Σw is exactly 5 per segment: nothing is lost."""
    by_id = one_relay_mesh(tmp_path, sites)
    a, b, e, c, d = (by_id[n] for n in "abecd")

    with sigstopped(a):
        since = time.monotonic()
        took = time_until_replaced([c, d], a.address, since, 3 * REPLACED_WITHIN_S)
        assert all(t <= REPLACED_WITHIN_S for t in took.values()), (
            f"a frozen relay must be replaced within {REPLACED_WITHIN_S:g} s: took {took}"
        )
        for h in (c, d):
            assert set(relays_of(h)) <= {b.address, e.address}, (h.node_id, relays_of(h))
        # Only silence, yet noticed: the others' pushes to a make no progress.
        wait_gone("a", [b, e, c, d], LIVE_TIMEOUT_S)
        # Either way: weight that went one way while a was frozen and none came back
        # makes a site hold the other as a suspected sink for a while (no pushes to it),
        # which is the protocol's business, not the relays'.
        wait_exchange_grows(c, d, 30.0, both_ways=False)
        wait_counters_grow(
            [c, d], ("pushes_acked", "pushes_merged"), 5, "c and d to gossip, a frozen", 45.0
        )
        frozen_for = time.monotonic() - since
        assert frozen_for < MEMBERSHIP["drop_after_s"], frozen_for
        assert a.proc.poll() is None, "a exited while stopped"

    # Back: live again to every other site (it is dialled directly). Whether it reaches
    # c and d at their new relays yet does not matter to the sum: they leave first, and
    # their Leaves reach a directly and settle whatever a still had in flight to them.
    others = [b, e, c, d]
    wait_until(
        lambda: all("a" in status_of(h)["live_peers"] for h in others),
        "a to be live again to the others once resumed",
        LIVE_TIMEOUT_S,
        lambda: check_alive(sites),
    )
    # Suspected, never declared dead (which forgets a peer and folds its pushes back).
    known = {h.node_id: {p["node_id"] for p in status_of(h)["peers"]} for h in others}
    assert all("a" in peers for peers in known.values()), known
    inconsistencies = {h.node_id: status_of(h)["mass_inconsistencies"] for h in sites}
    weights = stop_in_turn(relayed_first(sites))
    totals = segment_totals(weights)
    assert inconsistencies == dict.fromkeys("abecd", 0), inconsistencies
    assert all(abs(t - len(sites)) <= TOLERANCE for t in totals), (totals, weights)


def test_a_site_that_cannot_be_dialled_back_finds_it_by_itself_and_goes_through_relays(
    tmp_path: Path, sites: list[DaemonHandle]
) -> None:
    """A site with no ``[reach]`` setting (``reachable = auto``) that advertises an address
    where nothing listens: the seed it asks cannot dial it back there, so it runs
    outbound-only on its own, says so in one INFO line (where it was checked, by whom,
    and by which relays it is reached now), reports ``relayed by ...`` and is live to the
    others, who know it by its relayed address."""
    (nowhere_port,) = free_ports(1)
    nowhere = f"127.0.0.1:{nowhere_port}"  # picked free, and nothing is started there
    by_id = start_sites(
        tmp_path,
        sites,
        ["a", "b"],
        ["x"],
        relayed_reach={"reachable": "auto"},
        relayed_config={"advertise": nowhere},
    )
    a, b, x = by_id["a"], by_id["b"], by_id["x"]
    wait_reach([x], "x to find it cannot be dialled and attach to relays")
    wait_mesh_live(sites, LIVE_TIMEOUT_S)

    assert set(relays_of(x)) <= {a.address, b.address}, relays_of(x)
    for peer in (a, b):
        known = {p["node_id"]: p["address"] for p in status_of(peer)["peers"]}
        assert known["x"].startswith("relay://x@"), (peer.node_id, known)

    said = [
        line.split(" INFO ", 1)[1]
        for line in x.log().splitlines()
        if " INFO reach: not reachable at" in line
    ]
    assert len(said) == 1, x.log()[-3000:]
    assert said[0].startswith(f"reach: not reachable at {nowhere} from "), said
    assert "outbound-only" in said[0] and "relayed by" in said[0], said
    assert not re.search(r"WARNING .*reach:", x.log()), x.log()[-3000:]
    assert scrape_metrics(x.node_json()["metrics_port"])["gossipd_reach_relayed"] == 1.0
