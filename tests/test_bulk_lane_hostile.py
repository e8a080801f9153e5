"""The bulk lane (``node/net/bulk/lane.py``) on real daemons against a member that drives it by
hand (a raw socket beside its own gRPC frames).

What it protects. Such a member cannot get a payload merged that did not arrive whole
and intact, hold a connection past ``limits.stream_idle_timeout_s`` or below
``limits.min_push_rate_bytes_s``, use a connection that is not its own (or one that is
busy), name one that does not exist, or open more than
``limits.max_inbound_pushes[_per_peer]`` allow: each is refused with its status,
counted, the connection is closed, and the receiver's sum of weights moves by exactly
what was merged.

The module's three daemons are :func:`tests.bulk_lane_mesh.started_daemons`'s; the
honest pushes and pulls are ``tests/test_bulk_lane.py``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from gossipd.node.net.bulk.lane import MAGIC, TOKEN_BYTES
from tests.bulk_lane_mesh import (
    IDLE_S,
    MERGED,
    MIN_RATE,
    NUMEL,
    OTHER,
    PAYLOAD_BYTES,
    PER_PEER_CAP,
    PUSH_TIMEOUT_S,
    SENDER,
    TOLERANCE,
    TOTAL_CAP,
    Daemons,
    Lane,
    client_context,
    counted,
    lane_bytes,
    lane_connections,
    next_sequence,
    no_lane_connections,
    pull_in_frames,
    rejected,
    seeded_values,
    started_daemons,
    weight_of,
)
from tests.bulk_lane_raw import (
    Feed,
    bulk_frames,
    closed_within,
    dial_lane,
    feed_bytes,
    feed_then_stall,
    feed_trickle,
    lane_push,
    pull_by_hand,
    push_by_hand,
    recv_exactly,
    send_hello,
    timed_push,
    write_lane,
)
from tests.conftest import wait_until
from tests.outsider import PushOutcome
from tests.tls_mesh import CLIENT


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    with started_daemons(tmp_path_factory.mktemp("bulk")) as started:
        yield started


@pytest.fixture(params=["plaintext", "mutual TLS"])
def lane(request: pytest.FixtureRequest, daemons: Daemons) -> Lane:
    return daemons.lane if request.param == "plaintext" else daemons.tls


def test_a_push_naming_a_connection_nobody_opened_is_refused_after_the_idle_timeout(
    daemons: Daemons,
) -> None:
    lane = daemons.lane
    mine, refused = weight_of(lane.handle), rejected(lane.handle, "BulkClosed")
    frames, _ = bulk_frames(
        lane, next_sequence(), 0.25, seeded_values(4), token=b"nobody-opened-it"
    )

    outcome, took_s = timed_push(lane, frames)

    assert outcome.code == grpc.StatusCode.UNAVAILABLE, outcome
    assert IDLE_S * 0.9 <= took_s < IDLE_S + 10, f"refused after {took_s:.1f} s"
    counted(lane.handle, "BulkClosed", refused)
    assert weight_of(lane.handle) == pytest.approx(mine, abs=TOLERANCE)


def test_a_header_marked_bulk_in_a_push_that_names_no_connection_is_refused(
    daemons: Daemons,
) -> None:
    lane = daemons.lane
    mine, refused = weight_of(lane.handle), rejected(lane.handle, "InvalidFrame")
    frames, _ = bulk_frames(lane, next_sequence(), 0.25, seeded_values(5), token=b"")

    outcome = asyncio.run(push_by_hand(lane, frames))

    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert "names no bulk-lane connection" in outcome.details, outcome
    counted(lane.handle, "InvalidFrame", refused)
    assert weight_of(lane.handle) == pytest.approx(mine, abs=TOLERANCE)


def test_a_payload_stalled_on_the_lane_ends_the_push_and_closes_the_connection(
    lane: Lane,
) -> None:
    handle = lane.handle
    mine, received = weight_of(handle), lane_bytes(handle, "received")
    idled = rejected(handle, "StreamIdle")
    sock = dial_lane(lane)
    with sock:
        frames, payload = bulk_frames(
            lane, next_sequence(), 0.25, seeded_values(6), token=send_hello(sock)
        )

        outcome, took_s = timed_push(
            lane, frames, feed_then_stall(sock, payload[: len(payload) // 2])
        )

        assert outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED, outcome
        assert IDLE_S * 0.9 <= took_s < IDLE_S + 10, f"ended after {took_s:.1f} s"
        assert closed_within(sock, IDLE_S) is not None, "the stalled connection is still open"
    counted(handle, "StreamIdle", idled)
    assert lane_bytes(handle, "received") == received
    assert weight_of(handle) == pytest.approx(mine, abs=TOLERANCE)


def test_a_payload_trickled_below_the_minimum_rate_ends_the_push(daemons: Daemons) -> None:
    """Every piece comes well inside the idle timeout; the whole payload may take
    IDLE_S + PAYLOAD_BYTES / MIN_RATE of waiting all the same (limits.min_push_rate_bytes_s)."""
    lane = daemons.lane
    mine, slow = weight_of(lane.handle), rejected(lane.handle, "PushTooSlow")
    allowed_s = IDLE_S + PAYLOAD_BYTES / MIN_RATE
    sock = dial_lane(lane)
    with sock:
        frames, payload = bulk_frames(
            lane, next_sequence(), 0.25, seeded_values(7), token=send_hello(sock)
        )
        trickle = feed_trickle(sock, payload, piece=32 << 10, every_s=IDLE_S / 10)  # 160 KiB/s

        outcome, took_s = timed_push(lane, frames, trickle)

        assert outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED, outcome
        assert allowed_s * 0.9 <= took_s < allowed_s + 10, f"ended after {took_s:.1f} s"
        assert closed_within(sock, IDLE_S) is not None, "the trickling connection is still open"
    counted(lane.handle, "PushTooSlow", slow)
    assert weight_of(lane.handle) == pytest.approx(mine, abs=TOLERANCE)


@pytest.mark.parametrize("fault", ["checksum", "NaN"])
def test_a_payload_that_fails_its_checks_on_the_lane_is_refused_and_closes_the_connection(
    daemons: Daemons, fault: str
) -> None:
    lane = daemons.lane
    reason = {"checksum": "InvalidFrame", "NaN": "NonFinitePayload"}[fault]
    mine, refused = weight_of(lane.handle), rejected(lane.handle, reason)
    values = seeded_values(8)
    if fault == "NaN":
        values[NUMEL // 2] = float("nan")  # the header's checksum is the payload's own
    sock = dial_lane(lane)
    with sock:
        frames, payload = bulk_frames(lane, next_sequence(), 0.25, values, token=send_hello(sock))
        if fault == "checksum":
            payload = bytes([payload[0] ^ 1]) + payload[1:]

        outcome = asyncio.run(push_by_hand(lane, frames, feed_bytes(sock, payload)))

        assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
        assert closed_within(sock, IDLE_S) is not None, "the connection is still open"
    counted(lane.handle, reason, refused)
    assert weight_of(lane.handle) == pytest.approx(mine, abs=TOLERANCE)


@pytest.mark.parametrize("hello", ["garbage", "nothing"])
def test_a_connection_without_its_hello_is_closed_and_counted(lane: Lane, hello: str) -> None:
    """Garbage is refused at once (InvalidFrame); silence after the idle timeout
    (StreamIdle). With TLS, both come after a completed handshake."""
    reason = {"garbage": "InvalidFrame", "nothing": "StreamIdle"}[hello]
    refused = rejected(lane.handle, reason)
    sock = dial_lane(lane)
    with sock:
        if hello == "garbage":
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n\0\0")  # 20 bytes, the size of a hello
        closed_s = closed_within(sock, IDLE_S + 10)
    assert closed_s is not None, "the connection is still open"
    if hello == "garbage":
        assert closed_s < IDLE_S * 0.9, f"garbage closed only after {closed_s:.1f} s"
    else:
        assert closed_s >= IDLE_S * 0.9, f"a silent connection closed after {closed_s:.1f} s"
    counted(lane.handle, reason, refused)


def test_a_connection_belongs_to_the_first_sender_that_uses_it(
    daemons: Daemons,
) -> None:
    """Plaintext: the connection is bound to the sender of its first push; another
    verified member that names it, in a push or a pull, is refused, and the owner's
    connection still carries its pushes and pulls."""
    lane, weight = daemons.lane, 0.125
    mine, refused = weight_of(lane.handle), rejected(lane.handle, "IdentityMismatch")
    with dial_lane(lane) as sock:
        token = send_hello(sock)
        first = lane_push(lane, sock, token, weight)
        frames, _ = bulk_frames(
            lane, next_sequence(), weight, seeded_values(9), token=token, sender=OTHER
        )
        stolen_push = asyncio.run(push_by_hand(lane, frames))
        stolen_pull, _ = asyncio.run(pull_by_hand(lane, token, OTHER))
        again = lane_push(lane, sock, token, weight)
        pulled, headers = asyncio.run(pull_by_hand(lane, token, SENDER))
        payload = recv_exactly(sock, PAYLOAD_BYTES)
    assert (first.code, first.results) == (grpc.StatusCode.OK, MERGED), first
    assert stolen_push.code == grpc.StatusCode.PERMISSION_DENIED, stolen_push
    assert stolen_pull == grpc.StatusCode.PERMISSION_DENIED
    assert (again.code, again.results) == (grpc.StatusCode.OK, MERGED), again
    assert pulled == grpc.StatusCode.OK and [h.bulk for h in headers] == [True]
    values = torch.frombuffer(payload, dtype=torch.float32)
    assert torch.equal(values, pull_in_frames(lane, daemons))
    assert rejected(lane.handle, "IdentityMismatch") == refused + 2
    assert weight_of(lane.handle) == pytest.approx(mine + 2 * weight, abs=TOLERANCE)


def test_a_connection_carries_one_push_at_a_time(daemons: Daemons) -> None:
    """Two pushes name one connection at once: whichever claims it second is refused
    (without closing it), and the first, its payload written only then, is merged."""
    lane, weight = daemons.lane, 0.125
    mine = weight_of(lane.handle)
    sock = dial_lane(lane)
    with sock:
        token = send_hello(sock)
        pushes = [
            bulk_frames(lane, next_sequence(), weight, seeded_values(10), token=token) for _ in "ab"
        ]
        outcomes: dict[int, PushOutcome] = {}

        async def both() -> None:
            one_answered = asyncio.Event()

            def feed(i: int) -> Feed:
                async def write_if_holding() -> None:
                    await one_answered.wait()
                    if i not in outcomes:  # the other was refused: this one holds it
                        await write_lane(sock, pushes[i][1])
                    else:
                        await asyncio.Event().wait()

                return write_if_holding

            async def push(i: int) -> None:
                outcomes[i] = await push_by_hand(lane, pushes[i][0], feed(i))
                one_answered.set()

            async with asyncio.timeout(PUSH_TIMEOUT_S):
                await asyncio.gather(push(0), push(1))

        asyncio.run(both())
    by_code = {o.code: o for o in outcomes.values()}
    assert set(by_code) == {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, outcomes
    assert by_code[grpc.StatusCode.OK].results == MERGED
    assert "already in use" in by_code[grpc.StatusCode.INVALID_ARGUMENT].details
    assert weight_of(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)


def test_a_hello_dribbled_a_byte_at_a_time_is_cut_off_at_the_idle_timeout(lane: Lane) -> None:
    """The handshake and the hello together must finish within stream_idle_timeout_s, not
    each byte of them: a byte every IDLE_S / 2 would hold a connection (and, with TLS, a
    worker and a slot that no per-peer cap counts yet) for 20 times that."""
    give_up_s = IDLE_S + 3
    closed = False
    with dial_lane(lane) as sock:
        started = time.monotonic()
        for byte in MAGIC + bytes(TOKEN_BYTES):
            if time.monotonic() - started > give_up_s:
                break
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            if closed_within(sock, IDLE_S / 2) is not None:
                closed = True
                break
        held_s = time.monotonic() - started
    assert closed and held_s <= give_up_s, (
        f"a hello sent a byte every {IDLE_S / 2:g} s was still being read after {held_s:.1f} s; "
        f"the handshake and hello must finish within stream_idle_timeout_s = {IDLE_S:g} s"
    )


def test_lane_connections_over_max_inbound_pushes_are_closed_and_the_others_still_work(
    daemons: Daemons,
) -> None:
    """Plaintext names nobody at connect time: only the total cap applies there."""
    lane, weight = daemons.lane, 0.125
    no_lane_connections(lane.handle)
    mine, busy = weight_of(lane.handle), rejected(lane.handle, "Busy")
    held = [dial_lane(lane) for _ in range(TOTAL_CAP)]
    try:
        tokens = [send_hello(sock) for sock in held]
        wait_until(
            lambda: lane_connections(lane.handle) == TOTAL_CAP, "every allowed connection", 10
        )
        with dial_lane(lane) as extra:
            assert closed_within(extra, IDLE_S / 2) is not None, "one over the cap is open"
        counted(lane.handle, "Busy", busy)
        outcome = lane_push(lane, held[-1], tokens[-1], weight)
        assert (outcome.code, outcome.results) == (grpc.StatusCode.OK, MERGED), outcome
    finally:
        for sock in held:
            sock.close()
    assert weight_of(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)


def test_lane_connections_over_the_per_peer_cap_are_closed_and_the_others_still_work(
    daemons: Daemons,
) -> None:
    """TLS names the member at connect time: one more connection than
    limits.max_inbound_pushes_per_peer is refused and closed; the member's others still
    push, and another site still gets a connection of its own."""
    lane, weight = daemons.tls, 0.125
    no_lane_connections(lane.handle)
    mine, over = weight_of(lane.handle), rejected(lane.handle, "TooManyStreams")
    held: list[socket.socket] = []
    try:
        for count in range(1, PER_PEER_CAP + 1):
            held.append(dial_lane(lane))
            token = send_hello(held[-1])
            wait_until(lambda n=count: lane_connections(lane.handle) == n, f"{count} held", 10)
        held.append(extra := dial_lane(lane))
        send_hello(extra)
        counted(lane.handle, "TooManyStreams", over)
        outcome = lane_push(lane, held[PER_PEER_CAP - 1], token, weight)
        assert (outcome.code, outcome.results) == (grpc.StatusCode.OK, MERGED), outcome
        pki = daemons.pki
        held.append(dial_lane(lane, client_context(pki.ca, pki.pem(CLIENT), pki.key(CLIENT))))
        send_hello(held[-1])
        wait_until(lambda: lane_connections(lane.handle) == PER_PEER_CAP + 1, "another site's", 10)
        extra_closed_s = closed_within(extra, IDLE_S)
    finally:
        for sock in held:
            sock.close()
    assert weight_of(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)
    assert extra_closed_s is not None, (
        "the connection over limits.max_inbound_pushes_per_peer was refused (TooManyStreams "
        f"counted) but left open for {IDLE_S:g} s"
    )


def test_a_hello_that_reuses_a_token_in_use_is_refused_and_closed(lane: Lane) -> None:
    """The connection that holds the token keeps it and still pushes."""
    weight = 0.125
    no_lane_connections(lane.handle)
    mine, refused = weight_of(lane.handle), rejected(lane.handle, "InvalidFrame")
    first, second = dial_lane(lane), dial_lane(lane)
    with first, second:
        token = send_hello(first)
        wait_until(lambda: lane_connections(lane.handle) == 1, "the first connection", 10)
        send_hello(second, token)
        counted(lane.handle, "InvalidFrame", refused)
        outcome = lane_push(lane, first, token, weight)
        assert (outcome.code, outcome.results) == (grpc.StatusCode.OK, MERGED), outcome
        second_closed_s = closed_within(second, IDLE_S)
    assert weight_of(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)
    assert second_closed_s is not None, (
        f"the hello that reused a token in use was refused (InvalidFrame counted) but its "
        f"connection left open for {IDLE_S:g} s"
    )
