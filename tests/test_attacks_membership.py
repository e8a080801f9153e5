"""Outsiders against a real mesh's membership over real sockets: forged identities,
poisoned peer lists, spoofed Leaves.

Every case was first seen on a live mesh (the observation numbers refer to that
report). One module-scoped target keeps daemon starts down: ``mesh``, three daemons
gossiping at push probability 0.5 that must keep gossiping whatever the outsider does.
Each test checks its invariant at every poll of a window that ends once the mesh has
made a stated amount of progress (acknowledged pushes), never after a fixed time.
Attacks on a daemon's values are ``tests/test_attacks.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from gossipd.proto import gossip_pb2 as pb
from tests.conftest import (
    DaemonHandle,
    check_alive,
    open_fds,
    start_mesh,
    status_of,
    stop_all,
    thread_count,
    wait_counters_grow,
    wait_mesh_live,
    wait_until,
)
from tests.outsider import (
    dead_address,
    flood_handshakes,
    handshake_as,
    leave_as,
    node_info,
    peers_as,
    true_identity,
)

MESH_IDS = ["a", "b", "c"]
MESH_CONFIG: dict[str, Any] = {
    "gossip": {"push_probability": 0.5, "progress_timeout_s": 2.0},
    "membership": {"suspect_after_failures": 2, "anti_entropy_interval_s": 0.5},
}
# Bounds for the poisoning test: what a daemon may add over its own baseline while an
# outsider's 5,000 fake peers are around (membership.max_candidates is 64 and dials
# run membership.dial_concurrency = 8 at a time, on throwaway channels).
FD_SLACK = 96
THREAD_SLACK = 16


# -- the target ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonHandle]]:
    handles = start_mesh(tmp_path_factory.mktemp("mesh"), MESH_IDS, **MESH_CONFIG)
    try:
        yield handles
    finally:
        stop_all(handles)


@pytest.fixture
def healthy_mesh(mesh: list[DaemonHandle]) -> list[DaemonHandle]:
    """The module mesh, checked whole before each test (a test must not inherit a broken one)."""
    check_alive(mesh)
    wait_mesh_live(mesh, 60.0)
    return mesh


# -- observation 12: a Leave is believed only from the node itself ------------------------------


def test_forged_leaves_never_remove_a_live_peer_and_are_counted(
    healthy_mesh: list[DaemonHandle],
) -> None:
    """Observation 12: four forged Leaves a second kept b out of its peers' view 44% of the time.

    Forty forged Leaves for b (with b's true incarnation) to each of a and c: b is
    live at both in every sample taken between them, and both count ForgedLeave.
    """
    a, b, c = healthy_mesh
    incarnation = true_identity(b.address).incarnation
    forged_before = {h.node_id: status_of(h)["rejected"].get("ForgedLeave", 0) for h in (a, c)}
    missing: list[tuple[int, str]] = []
    for i in range(40):
        for target in (a, c):
            leave_as(target.address, "b", incarnation)
        for target in (a, c):
            if "b" not in status_of(target)["live_peers"]:
                missing.append((i, target.node_id))
    assert missing == [], f"b missing from the live view in {len(missing)} of 80 samples"

    def counted() -> bool:
        return all(
            status_of(h)["rejected"].get("ForgedLeave", 0) > forged_before[h.node_id]
            for h in (a, c)
        )

    wait_until(counted, "a and c to count the forged Leaves", 30.0, lambda: check_alive([a, c]))
    assert all("b" in status_of(h)["live_peers"] for h in (a, c))


# -- observation 9: an inbound Handshake names a candidate, never a member -----------------------


def test_handshakes_from_made_up_ids_make_none_live_and_pushes_keep_flowing(
    healthy_mesh: list[DaemonHandle],
) -> None:
    """Observation 9: Handshakes from 1,000 made-up ids made all of them live at a.

    a then pushed only to them. Here 900 claim addresses nobody listens on and 100
    claim c's real address: none becomes live anywhere, and a's pushes to its real
    peers keep being acknowledged.
    """
    a, _, c = healthy_mesh
    claims = [
        node_info(f"made-up-{i}", dead_address(i, 78) if i < 900 else c.address, 1)
        for i in range(1_000)
    ]
    flood_handshakes(a.address, claims, concurrency=32)
    members = set(MESH_IDS)

    def only_members() -> None:
        for h in healthy_mesh:
            live = set(status_of(h)["live_peers"])
            assert live <= members - {h.node_id}, (h.node_id, sorted(live - members)[:5])

    wait_counters_grow(
        [a], ("pushes_acked",), 20, "a's pushes to be acknowledged", 60.0, only_members
    )
    only_members()
    assert set(status_of(a)["live_peers"]) == {"b", "c"}


# -- observation 8: relayed peer lists are bounded candidates, never members ---------------------


def _no_fake_and_within_budget(
    mesh: list[DaemonHandle],
    baseline: dict[str, tuple[int, int]],
    worst: dict[str, tuple[int, int]],
    observer: pb.NodeInfo,
) -> None:
    """No fake live, in any node's status peers or in its Peers reply to ``observer``, and
    each node's open fds and threads within FD_SLACK and THREAD_SLACK of ``baseline``
    (the most seen so far goes to ``worst``)."""
    members = set(MESH_IDS)
    problems = []
    for h in mesh:
        fds, threads = open_fds(h), thread_count(h)
        worst[h.node_id] = (max(worst[h.node_id][0], fds), max(worst[h.node_id][1], threads))
        fd0, threads0 = baseline[h.node_id]
        if fds > fd0 + FD_SLACK:
            problems.append((h.node_id, "open fds", fd0, fds))
        if threads > threads0 + THREAD_SLACK:
            problems.append((h.node_id, "threads", threads0, threads))
        status = status_of(h)
        live = set(status["live_peers"]) - members
        listed = {p["node_id"] for p in status["peers"]} - members
        _, relayed = peers_as(h.address, observer, [])
        named = {p.node_id for p in relayed} - members
        for where, fake_ids in (("live", live), ("status peers", listed), ("Peers", named)):
            if fake_ids:
                problems.append((h.node_id, where, len(fake_ids), sorted(fake_ids)[:3]))
    assert problems == [], problems


def test_poisoned_peer_lists_make_no_fake_live_or_relayed_and_cost_bounded_fds_threads(
    healthy_mesh: list[DaemonHandle],
) -> None:
    """Observation 8: one Peers request listing 5,000 fakes at closed ports.

    Every node dialled every fake every second and kept the channels (4,002 per
    node, 5,499 fds, 150+ threads). Here a gets the 5,000 in one request and b gets
    them as 50 requests of 100: no fake becomes live or appears in any node's peers
    or in a Peers or Handshake reply, each daemon's open fds and threads stay within
    FD_SLACK and THREAD_SLACK of its baseline, and pushes keep being acknowledged.
    """
    a, b, _ = healthy_mesh
    members = set(MESH_IDS)
    baseline = {h.node_id: (open_fds(h), thread_count(h)) for h in healthy_mesh}
    fakes = [node_info(f"poison-{i}", dead_address(i, 77), 1) for i in range(5_000)]
    poisoner = node_info("poisoner", dead_address(0, 76), 1)
    peers_as(a.address, poisoner, fakes)
    for start in range(0, len(fakes), 100):
        peers_as(b.address, poisoner, fakes[start : start + 100])
    observer = node_info("observer", dead_address(1, 76), 1)
    worst = {h.node_id: (0, 0) for h in healthy_mesh}

    def invariants() -> None:
        _no_fake_and_within_budget(healthy_mesh, baseline, worst, observer)

    # The observation window: plenty of gossip and at least ten anti-entropy rounds
    # (each a chance to dial or relay the fakes); the invariants hold at every poll.
    window_end = time.monotonic() + 10 * MESH_CONFIG["membership"]["anti_entropy_interval_s"]

    def window_over() -> bool:
        invariants()
        return time.monotonic() >= window_end

    wait_counters_grow(healthy_mesh, ("pushes_acked",), 50, "acknowledged pushes", 90.0, invariants)
    wait_until(window_over, "the end of the observation window", 60.0)
    for h in healthy_mesh:
        code, reply = handshake_as(h.address, observer)
        assert code == grpc.StatusCode.OK and reply is not None, code
        named = {p.node_id for p in reply.peers}
        assert named <= members, (h.node_id, "Handshake reply", sorted(named - members)[:5])
    print("baseline (fds, threads):", baseline, "worst:", worst)


# -- observation 6: only the peer itself moves its identity -------------------------------------


def test_forged_handshakes_and_relays_never_replace_a_peers_identity(
    healthy_mesh: list[DaemonHandle],
) -> None:
    """Observation 6: a Handshake claiming to be b with incarnation 2^63-1 took over b.

    With a dead address (and again with b's real address), then relayed through
    Peers: a and c replaced b's entry, relayed it on, and refused b's real pushes.
    Here a and c keep b's true address and incarnation (in their status and in what
    they relay), keep b live, and b's pushes keep being acknowledged.
    """
    a, b, c = healthy_mesh
    truth = true_identity(b.address)
    forged = [
        node_info("b", dead_address(2, 76), 2**63 - 1),
        node_info("b", b.address, 2**63 - 1),
    ]
    for info in forged:
        for target in (a, c):
            handshake_as(target.address, info)
    for target in (a, c):
        peers_as(target.address, node_info("relay", dead_address(3, 76), 1), forged)
    observer = node_info("observer-6", dead_address(4, 76), 1)
    expected = ("b", truth.address, truth.incarnation)

    def b_is_b() -> None:
        problems = []
        for h in (a, c):
            _, relayed = peers_as(h.address, observer, [])
            claims = {(p.node_id, p.address, p.incarnation) for p in relayed if p.node_id == "b"}
            if claims != {expected}:
                problems.append((h.node_id, "Peers reply", claims))
            status = status_of(h)
            entries = {
                (p["node_id"], p["address"], p["incarnation"])
                for p in status["peers"]
                if p["node_id"] == "b"
            }
            if entries != {expected}:
                problems.append((h.node_id, "status peers", entries))
            if "b" not in status["live_peers"]:
                problems.append((h.node_id, "live_peers", status["live_peers"]))
        assert problems == [], (f"b is {expected}", problems)

    wait_counters_grow([b], ("pushes_acked",), 20, "b's pushes to be acknowledged", 60.0, b_is_b)
    b_is_b()
