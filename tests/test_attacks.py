"""Outsiders against a real daemon's values over real sockets: pushes from senders it never
verified, out-of-bounds and extreme values, de-duplication floods.

Every case was first seen on a live mesh (the observation numbers refer to that
report). One module-scoped target keeps daemon starts down: ``victim``, a lone daemon
that never pushes (its model and weight only move when a push is merged, so
"unchanged" can be checked bit for bit). Forged identities, poisoned peer lists and
spoofed Leaves against a gossiping mesh are ``tests/test_attacks_membership.py``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
from collections.abc import Iterator

import grpc
import pytest
import torch

from tests.conftest import (
    DaemonHandle,
    check_alive,
    start_daemon,
    status_of,
    stop_all,
    wait_until,
)
from tests.fakepeer import FakePeer
from tests.outsider import (
    dead_address,
    flood_pushes,
    handshake_as,
    leave_as,
    node_info,
    pull_unchecked,
    push_as,
    push_frames,
    synthetic_plan,
)

MAX_SUM_WEIGHT = 1e6  # limits.max_sum_weight's default
# The de-duplication window of the code these tests were written against held 4,096
# (sequence, segment) pairs per sender; one flood push more than that evicts everything.
DEDUP_FLOOD = 4_200
HUGE_SEQUENCE = 2**62
_MEMBER_IDS = itertools.count(1)


@functools.cache
def _numel() -> int:
    return synthetic_plan().segments[0].numel


def _filled(value: float) -> torch.Tensor:
    return torch.full((_numel(),), value, dtype=torch.float32)


# -- the target ---------------------------------------------------------------------------


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
