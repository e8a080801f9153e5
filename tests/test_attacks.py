"""Outsiders against real daemons over real sockets: forged identities, poisoned peer lists,
spoofed Leaves, de-duplication floods and extreme values.

Every case was first seen on a live mesh (the observation numbers refer to that
report). Two module-scoped targets keep daemon starts down: ``victim``, a lone
daemon that never pushes (its model and weight only move when a push is merged,
so "unchanged" can be checked bit for bit), and ``mesh``, three daemons gossiping
at push probability 0.5 that must keep gossiping whatever the outsider does.
Each mesh test checks its invariant at every poll of a window that ends once
the mesh has made a stated amount of progress (acknowledged pushes), never
after a fixed time.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from tests.conftest import (
    DaemonHandle,
    check_alive,
    open_fds,
    start_daemon,
    start_mesh,
    status_of,
    stop_all,
    thread_count,
    wait_counters_grow,
    wait_mesh_live,
    wait_until,
)
from tests.fakepeer import (
    FakePeer,
    dead_address,
    flood_handshakes,
    flood_pushes,
    handshake_as,
    leave_as,
    node_info,
    peers_as,
    pull_unchecked,
    push_as,
    push_frames,
    synthetic_plan,
    true_identity,
)

MESH_IDS = ["a", "b", "c"]
MESH_CONFIG: dict[str, Any] = {
    "gossip": {"push_probability": 0.5, "progress_timeout_s": 2.0},
    "membership": {"suspect_after_failures": 2, "anti_entropy_interval_s": 0.5},
}
MAX_SUM_WEIGHT = 1e6  # limits.max_sum_weight's default
# The de-duplication window of the code these tests were written against held 4,096
# (sequence, segment) pairs per sender; one flood push more than that evicts everything.
DEDUP_FLOOD = 4_200
HUGE_SEQUENCE = 2**62
# Bounds for the poisoning test: what a daemon may add over its own baseline while an
# outsider's 5,000 fake peers are around (membership.max_candidates is 64 and dials
# run membership.dial_concurrency = 8 at a time, on throwaway channels).
FD_SLACK = 96
THREAD_SLACK = 16
_MEMBER_IDS = itertools.count(1)


@functools.cache
def _numel() -> int:
    return synthetic_plan().segments[0].numel


def _filled(value: float) -> torch.Tensor:
    return torch.full((_numel(),), value, dtype=torch.float32)


# -- targets ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonHandle]:
    """A lone daemon (push probability 0): only merged pushes change its model or weight."""
    from gossipd.node.launch.localmesh import free_ports

    # One step, then it idles: it still merges every push, without spinning a core.
    handle = start_daemon(
        tmp_path_factory.mktemp("victim"), "victim", free_ports(1)[0], job={"max_steps": 1}
    )
    try:
        yield handle
    finally:
        stop_all([handle])


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


@pytest.fixture
def member(victim: DaemonHandle) -> Iterator[FakePeer]:
    """A fake site the victim has verified (its own Handshake to the fake's address)."""
    fake = FakePeer(f"member-{next(_MEMBER_IDS)}", serve_peers=True)
    try:
        fake.introduce_to(victim.address)
        wait_until(
            lambda: fake.node_id in status_of(victim)["live_peers"],
            f"the victim to verify {fake.node_id}",
            60.0,
            lambda: check_alive([victim]),
        )
        yield fake
    finally:
        # Leave for real (refuse Handshakes, as a leaving node does, then say Leave) so
        # the victim forgets the fake instead of trying to hand its weight to it at exit.
        fake.refuse_handshakes = grpc.StatusCode.FAILED_PRECONDITION
        leave_as(victim.address, fake.node_id, fake.incarnation)
        with contextlib.suppress(AssertionError):
            wait_until(
                lambda: fake.node_id not in status_of(victim)["live_peers"],
                f"the victim to let {fake.node_id} go",
                20.0,
            )
        fake.close()


def _model_state(handle: DaemonHandle) -> tuple[str, list[float]]:
    status = status_of(handle, checksum=True)
    assert status["params_checksum"], "Status(checksum=True) returned no checksum"
    return status["params_checksum"], status["sum_weights"]


# -- observation 10: values are checked, not trusted -----------------------------------------


def test_push_from_unverified_handshaker_is_refused_and_model_unchanged(
    victim: DaemonHandle,
) -> None:
    """Observation 10: a made-up sender's push of 1e30 was merged and spread to every node.

    The outsider completes an inbound Handshake (claiming an address nobody listens
    on, and in a second try the address of a server that answers as someone else),
    then pushes: refused UNAUTHENTICATED, model and weights bit-for-bit unchanged.
    """
    with FakePeer("someone-else") as other:
        claims = [
            node_info("made-up-1", dead_address(1, 79), 3),
            node_info("made-up-2", other.address, 3),
        ]
        for info in claims:
            before = _model_state(victim)
            code, _ = handshake_as(victim.address, info)
            assert code == grpc.StatusCode.OK, code
            outcome = push_as(
                victim.address,
                sender=info.node_id,
                incarnation=info.incarnation,
                sequence=1,
                weight=1.0,
                values=_filled(1e30),
            )
            assert outcome.code == grpc.StatusCode.UNAUTHENTICATED, (info.node_id, outcome)
            assert _model_state(victim) == before, info.node_id
            assert info.node_id not in status_of(victim)["live_peers"]


@pytest.mark.parametrize(
    "weight",
    [1e300, math.inf, 2 * MAX_SUM_WEIGHT],
    ids=["1e300", "inf", "twice-max_sum_weight"],
)
def test_verified_sender_sum_weight_out_of_bounds_is_refused_and_model_unchanged(
    victim: DaemonHandle, member: FakePeer, weight: float
) -> None:
    """Observation 10: sum-weights of 1e300 and inf were accepted from a peer.

    A verified sender's push whose header weight is not finite or is above
    limits.max_sum_weight is refused with INVALID_ARGUMENT and changes nothing.
    """
    before = _model_state(victim)
    outcome = member.push(victim.address, sequence=1, weight=weight, values=_filled(0.5))
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert _model_state(victim) == before
    check_alive([victim])


def test_opposite_extreme_pushes_leave_every_parameter_finite(
    victim: DaemonHandle, member: FakePeer
) -> None:
    """Observation 10: +3e38 then -3e38 from a peer overflowed a float32 model to ±inf.

    Both payloads are finite and both weights are in bounds; the merge must either
    be computed without overflow or be refused leaving the model as it was. Either
    way every parameter the victim serves is finite, and so are its weights.
    """
    weight = min(max(status_of(victim)["sum_weights"][0], 1.0), MAX_SUM_WEIGHT)
    first = member.push(victim.address, sequence=1, weight=weight, values=_filled(3e38))
    after_first = _model_state(victim)
    second = member.push(victim.address, sequence=2, weight=weight, values=_filled(-3e38))
    after_second = _model_state(victim)

    model = pull_unchecked(victim.address)
    bad = sum(int((~torch.isfinite(seg)).sum()) for seg in model)
    assert bad == 0, (f"{bad} non-finite parameters", first, second)
    assert all(math.isfinite(w) for w in after_second[1]), after_second
    if not second.merged:
        assert after_second == after_first, "a refused push changed the model"


# -- observation 7: the de-duplication window cannot be flushed from outside --------------------


@pytest.mark.parametrize("history", ["fresh-sender", "after-one-push"])
def test_sequence_flood_is_not_merged_and_later_real_pushes_still_merge(
    victim: DaemonHandle, member: FakePeer, history: str
) -> None:
    """Observation 7: 8,193 tiny pushes with sequences 2^62+i flushed the window.

    Afterwards every real push from that sender was answered DUPLICATE: the sender
    committed (dropped) its weight and the receiver never added it. Whatever the
    receiver does with such a flood, none of it is acknowledged as merged, the
    sender's next real pushes are merged with their exact weight, and only a true
    retry is answered DUPLICATE. Sequences start at 1 on each edge, so the flood is
    far beyond the window whether the sender has pushed before ("after-one-push")
    or not ("fresh-sender").
    """
    first = 1
    if history == "after-one-push":
        assert member.push(victim.address, sequence=1, weight=0.25, values=_filled(0.5)).merged
        first = 2
    flood = [
        push_frames(
            sender=member.node_id,
            incarnation=member.incarnation,
            sequence=HUGE_SEQUENCE + i,
            weight=1e-12,
            values=_filled(0.0),
        )
        for i in range(DEDUP_FLOOD)
    ]
    outcomes = flood_pushes(victim.address, flood, concurrency=16)
    merged_floods = sum(o.merged for o in outcomes)

    weight_before = status_of(victim)["sum_weights"][0]
    real = [
        member.push(victim.address, sequence=s, weight=0.25, values=_filled(0.125))
        for s in (first, first + 1)
    ]
    retry = member.push(victim.address, sequence=first + 1, weight=0.25, values=_filled(0.125))
    weight_after = status_of(victim)["sum_weights"][0]

    assert (merged_floods, [o.merged for o in real]) == (0, [True, True]), (
        f"{merged_floods} of {DEDUP_FLOOD} flood pushes merged; real pushes: {real}"
    )
    assert retry.duplicate and not retry.merged, retry
    assert weight_after == pytest.approx(weight_before + 0.5, abs=1e-12)


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
        problems = []
        for h in healthy_mesh:
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
