"""The bulk lane (``node/net/bulk/lane.py``) on real daemons: large payloads as raw bytes beside
gRPC, honest ones.

What it protects. A push or a pull of a part of 1 MiB or more (``BULK_MIN_BYTES``)
travels on the receiver's lane, counted in ``gossipd_bulk_bytes_total``, and ends
exactly as it would in chunk frames: the same model, the same sum-weight, in
plaintext and over mutual TLS; a daemon with ``bulk = false`` answers
``bulk_port = 0`` and still takes such pushes in frames. Over TLS the lane carries
sealed records; a record altered on the way is refused, a dialer that does not seal
is still served, and one without a certificate of the mesh CA is turned away. After a
lane push that failed midway, the sender's client retries on a fresh connection and the
push is merged once.

The module's three daemons are :func:`tests.bulk_lane_mesh.started_daemons`'s; what a
member that drives the lane by hand cannot do is ``tests/test_bulk_lane_hostile.py``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from gossipd.node.errors import GossipdError
from gossipd.node.net.bulk.lane import MAGIC_SEALED, BulkDialer
from gossipd.node.net.bulk.sealing import LENGTH, new_seed
from gossipd.node.net.dial import client as transport
from gossipd.node.net.dial.client import OutcomeUnknown
from gossipd.node.net.wire.frames import Limits
from gossipd.node.net.wire.shaping import LinkShaper
from gossipd.node.trainer.messages import Ack, Pulled
from gossipd.proto import gossip_pb2 as pb
from tests.bulk_lane_mesh import (
    IDLE_S,
    MEMBER,
    MERGED,
    NUMEL,
    PAYLOAD_BYTES,
    PLAINTEXT,
    PLAN,
    PUSH_TIMEOUT_S,
    SENDER,
    TOLERANCE,
    Daemons,
    Lane,
    client_context,
    counted,
    lane_bytes,
    lane_connections,
    lane_port,
    next_sequence,
    no_lane_connections,
    outbound_push,
    pull_in_frames,
    pull_with_client,
    push_with_client,
    rejected,
    seeded_values,
    started_daemons,
    weight_of,
)
from tests.bulk_lane_raw import (
    bulk_frames,
    closed_within,
    dial_lane,
    feed_bytes,
    push_on,
    push_sync,
    sealed_dial,
    send_hello,
)
from tests.outsider import PushOutcome, pull_unchecked
from tests.outsider_tls import handshake_tls
from tests.test_sealing import sealed_bytes
from tests.tls_mesh import Pki


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    with started_daemons(tmp_path_factory.mktemp("bulk")) as started:
        yield started


@pytest.fixture(params=["plaintext", "mutual TLS"])
def lane(request: pytest.FixtureRequest, daemons: Daemons) -> Lane:
    return daemons.lane if request.param == "plaintext" else daemons.tls


# -- honest pushes and pulls --------------------------------------------------------------


def test_a_large_push_goes_over_the_lane_and_merges_as_one_in_chunk_frames(
    daemons: Daemons,
) -> None:
    """The same push from the node's client to ``lane`` (on the lane) and to ``framed``
    (bulk = false: in chunk frames) leaves the two models byte for byte alike, each at
    the weighted average of its model and the payload."""
    lane, framed = daemons.lane, daemons.framed
    before = {h.node_id: h.status(checksum=True) for h in (lane.handle, framed.handle)}
    assert before["lane"]["params_checksum"] == before["framed"]["params_checksum"], (
        "the two receivers must start with one model for the comparison to mean anything"
    )
    own = pull_unchecked(lane.handle.address, fingerprint=PLAN.fingerprint)[0]
    received = lane_bytes(lane.handle, "received")
    sequence, weight, values = next_sequence(), 0.25, seeded_values(1)

    acks = [push_with_client(to, sequence, weight, values) for to in (lane, framed)]

    total = before["lane"]["sum_weights"][0] + weight
    assert acks == [[Ack(0, False, total)]] * 2
    assert lane_bytes(lane.handle, "received") - received == PAYLOAD_BYTES
    assert lane_bytes(framed.handle, "received") == 0.0, "a daemon with bulk = false has no lane"
    after = {h.node_id: h.status(checksum=True) for h in (lane.handle, framed.handle)}
    assert after["lane"]["params_checksum"] == after["framed"]["params_checksum"]
    assert after["lane"]["params_checksum"] != before["lane"]["params_checksum"]
    assert after["lane"]["sum_weights"] == after["framed"]["sum_weights"] == [total]
    merged = pull_unchecked(lane.handle.address, fingerprint=PLAN.fingerprint)[0]
    mine = before["lane"]["sum_weights"][0]
    expected = (mine * own + weight * values) / total
    assert torch.allclose(merged, expected, atol=1e-6), (merged - expected).abs().max()


def test_a_large_push_over_mutual_tls_goes_over_the_lane_and_merges(daemons: Daemons) -> None:
    lane = daemons.tls
    own = pull_in_frames(lane, daemons)
    mine, received = weight_of(lane.handle), lane_bytes(lane.handle, "received")
    weight, values = 0.25, seeded_values(2)

    acks = push_with_client(lane, next_sequence(), weight, values)

    assert acks == [Ack(0, False, mine + weight)]
    assert lane_bytes(lane.handle, "received") - received == PAYLOAD_BYTES
    assert weight_of(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)
    expected = (mine * own + weight * values) / (mine + weight)
    merged = pull_in_frames(lane, daemons)
    assert torch.allclose(merged, expected, atol=1e-6), (merged - expected).abs().max()


def test_a_large_pull_brings_what_a_pull_in_frames_brings_on_the_lane(
    lane: Lane, daemons: Daemons
) -> None:
    """Over TLS the payload comes in sealed records (the server advertises them)."""
    sent = lane_bytes(lane.handle, "sent")

    pulled = pull_with_client(lane)

    assert lane_bytes(lane.handle, "sent") - sent == PAYLOAD_BYTES
    assert sorted(pulled.values) == [0] and pulled.nbytes == PAYLOAD_BYTES
    assert torch.equal(pulled.values[0], pull_in_frames(lane, daemons))
    assert pulled.weights[0] == weight_of(lane.handle)


def test_a_daemon_without_a_lane_answers_port_0_and_takes_large_pushes_in_frames(
    daemons: Daemons,
) -> None:
    framed = daemons.framed
    assert lane_port(framed.handle, PLAINTEXT, pb.NodeInfo(node_id=SENDER)) == 0
    assert daemons.lane.port not in (0, int(daemons.lane.handle.address.rpartition(":")[2]))
    mine, weight = weight_of(framed.handle), 0.125

    acks = push_with_client(framed, next_sequence(), weight, seeded_values(3))

    assert acks == [Ack(0, False, mine + weight)]
    assert lane_connections(framed.handle) == 0
    assert lane_bytes(framed.handle, "received") == 0.0
    # A push that names a lane connection anyway is refused, and merges nothing.
    frames, _ = bulk_frames(
        framed, next_sequence(), weight, seeded_values(3), token=b"no-lane-here-000"
    )
    outcome = push_sync(framed, frames)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert weight_of(framed.handle) == pytest.approx(mine + weight, abs=TOLERANCE)


@pytest.mark.parametrize("why", ["[link] shaping", "a part under BULK_MIN_BYTES"])
def test_a_push_the_client_may_not_put_on_the_lane_goes_in_chunk_frames(
    daemons: Daemons, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    lane, weight = daemons.lane, 0.125
    mine, received = weight_of(lane.handle), lane_bytes(lane.handle, "received")
    shaper = None
    if why == "[link] shaping":
        shaper = LinkShaper(latency_s=0.001)  # paces chunk frames; the lane would bypass it
    else:
        monkeypatch.setattr(transport, "BULK_MIN_BYTES", PAYLOAD_BYTES + 1)

    acks = push_with_client(lane, next_sequence(), weight, seeded_values(14), shaper)

    assert acks == [Ack(0, False, mine + weight)]
    assert lane_bytes(lane.handle, "received") == received
    assert weight_of(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)


# -- mutual TLS on the lane -------------------------------------------------------------


def test_over_tls_the_lane_advertises_sealed_records_and_the_client_uses_them(
    daemons: Daemons,
) -> None:
    """The TLS daemon's Handshake says ``bulk_sealed`` (the plaintext one's does not), and
    the node's client then dials sealed connections: the push merges as in frames."""
    lane, plain = daemons.tls, daemons.lane
    for each, tls, sender, sealed in (
        (lane, lane.tls, daemons.tls_member, True),
        (plain, PLAINTEXT, None, False),
    ):
        info = sender.info() if sender is not None else pb.NodeInfo(node_id=SENDER)
        code, reply, details = handshake_tls(
            tls, each.handle.address, info, fingerprint=PLAN.fingerprint
        )
        assert code == grpc.StatusCode.OK and reply is not None, (code, details)
        assert (reply.bulk_port, reply.bulk_sealed) == (each.port, sealed)
    no_lane_connections(lane.handle)  # earlier tests' connections count against the member
    mine, weight = weight_of(lane.handle), 0.125

    async def push() -> tuple[list[Ack], bool]:
        client = lane.client()
        try:
            # The gRPC channel first: its TLS handshake on a loaded machine could outlast
            # the lane connection's 2 s idle limit here, which a node's retry would cover.
            await asyncio.wait_for(client.channel.channel_ready(), PUSH_TIMEOUT_S)
            acks = await client.push(
                outbound_push(next_sequence(), weight, seeded_values(14)), PUSH_TIMEOUT_S
            )
            return acks, client._bulk is not None and client._bulk.sealed
        finally:
            await client.close()

    acks, sealed = asyncio.run(push())
    assert acks == [Ack(0, False, mine + weight)]
    assert sealed, "the client dialled the TLS lane without sealed records"


@pytest.mark.parametrize("fault", ["tampered record", "NaN"])
def test_a_sealed_connection_by_hand_carries_pushes_and_a_bad_one_is_refused_and_closes_it(
    daemons: Daemons, fault: str
) -> None:
    """An honest sealed push merges; then a record altered on the way fails its tag (or
    an honestly sealed NaN fails the finite check: sealing skips only the checksum), the
    push is refused, the connection closed, and nothing of it merged."""
    lane, weight = daemons.tls, 0.125
    reason = {"tampered record": "InvalidFrame", "NaN": "NonFinitePayload"}[fault]
    mine, refused = weight_of(lane.handle), rejected(lane.handle, reason)
    honest_values, values = seeded_values(12), seeded_values(13)
    no_lane_connections(lane.handle)  # earlier tests' connections count against the member
    if fault == "NaN":
        values[NUMEL // 3] = float("nan")

    async def dial_and_push() -> tuple[socket.socket, PushOutcome, PushOutcome]:
        async with lane.tls.channel(lane.handle.address, []) as channel:
            await asyncio.wait_for(channel.channel_ready(), PUSH_TIMEOUT_S)
            sock, token, seal = sealed_dial(lane)  # its idle limit starts now
            frames, payload = bulk_frames(lane, next_sequence(), weight, honest_values, token=token)
            honest = await push_on(channel, frames, feed_bytes(sock, sealed_bytes(seal, payload)))
            frames, payload = bulk_frames(lane, next_sequence(), weight, values, token=token)
            wire = bytearray(sealed_bytes(seal, payload))
            if fault == "tampered record":
                wire[LENGTH.size + 1000] ^= 0x01
            bad = await push_on(channel, frames, feed_bytes(sock, bytes(wire)))
            return sock, honest, bad

    sock, honest, bad = asyncio.run(dial_and_push())
    with sock:
        assert closed_within(sock, IDLE_S) is not None, "the connection is still open"
    assert (honest.code, honest.results) == (grpc.StatusCode.OK, MERGED), honest
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT, bad
    if fault == "tampered record":
        assert "failed authentication" in bad.details, bad
    counted(lane.handle, reason, refused)
    assert weight_of(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)


def test_a_client_that_does_not_seal_still_pushes_and_pulls_over_tls(daemons: Daemons) -> None:
    """A dialer of an older release (``GDB1``, TLS bytes through Python's ssl) is still
    served: its push merges and its pull brings the model, both on the lane."""
    lane, weight = daemons.tls, 0.125
    mine, received = weight_of(lane.handle), lane_bytes(lane.handle, "received")
    sent = lane_bytes(lane.handle, "sent")
    host = lane.handle.address.rpartition(":")[0]

    async def push_and_pull() -> tuple[list[Ack], Pulled, bool]:
        client = lane.client()
        client._bulk = BulkDialer(host, lane.port, lane.tls, lane.handle.node_id, 2)
        try:
            acks = await client.push(
                outbound_push(next_sequence(), weight, seeded_values(15)), PUSH_TIMEOUT_S
            )
            pulled = await client.pull(PLAN, Limits(), PUSH_TIMEOUT_S)
            return acks, pulled, client._bulk is not None and client._bulk.sealed
        finally:
            await client.close()

    acks, pulled, sealed = asyncio.run(push_and_pull())
    assert not sealed
    assert acks == [Ack(0, False, mine + weight)]
    assert lane_bytes(lane.handle, "received") - received == PAYLOAD_BYTES
    # Unsealed over TLS a pull goes in gRPC frames (one Python ssl connection is slower).
    assert lane_bytes(lane.handle, "sent") == sent
    assert torch.equal(pulled.values[0], pull_in_frames(lane, daemons))


def test_a_sealed_hello_with_more_tls_bytes_behind_it_is_refused(daemons: Daemons) -> None:
    """After its seed the dialer must leave TLS: bytes it still sends in TLS (here in the
    hello's own record) would be lost when the daemon leaves it, so they are refused."""
    lane = daemons.tls
    refused = rejected(lane.handle, "InvalidFrame")
    with dial_lane(lane) as sock:
        sock.sendall(MAGIC_SEALED + b"sealed-and-extra" + new_seed() + b"more in TLS")
        assert closed_within(sock, IDLE_S) is not None, "the connection is still open"
    counted(lane.handle, "InvalidFrame", refused)


def test_a_sealed_hello_on_a_plaintext_lane_is_refused(daemons: Daemons) -> None:
    """Sealing keys come from TLS: without it there is nothing to seal with."""
    lane = daemons.lane
    refused = rejected(lane.handle, "InvalidFrame")
    with dial_lane(lane) as sock:
        sock.sendall(MAGIC_SEALED + b"plaintext-sealed" + new_seed())
        assert closed_within(sock, IDLE_S) is not None, "the connection is still open"
    counted(lane.handle, "InvalidFrame", refused)


@pytest.mark.parametrize("certificate", ["none", "another CA's"])
def test_a_lane_client_without_a_certificate_of_the_mesh_ca_is_turned_away(
    daemons: Daemons, tmp_path: Path, certificate: str
) -> None:
    lane, pki = daemons.tls, daemons.pki
    refused = rejected(lane.handle, "BulkClosed")
    if certificate == "none":
        context = client_context(pki.ca)
    else:
        other = Pki.create(tmp_path / "other-ca", [MEMBER])
        context = client_context(pki.ca, other.pem(MEMBER), other.key(MEMBER))
    sock = socket.create_connection(("127.0.0.1", lane.port), timeout=10.0)
    try:
        sock = context.wrap_socket(sock)  # TLS 1.3: the client may finish before the refusal
        send_hello(sock)
        closed_s = closed_within(sock, IDLE_S)
    except OSError:  # the server's alert arrived during the handshake or the hello
        closed_s = 0.0
    finally:
        sock.close()
    assert closed_s is not None, "a connection without a mesh certificate is still open"
    counted(lane.handle, "BulkClosed", refused)
    no_lane_connections(lane.handle)  # the member's, from earlier tests: its cap is 2
    mine, weight = weight_of(lane.handle), 0.125
    assert push_with_client(lane, next_sequence(), weight, seeded_values(12)) == [
        Ack(0, False, mine + weight)
    ], "the daemon must go on serving its members' lane pushes"


# -- the node's client after a failure ----------------------------------------------------


def test_after_a_lane_push_stalled_midway_the_client_retries_on_a_fresh_connection(
    daemons: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's client: a push whose payload stalls halfway on the lane ends with an
    unknown outcome (nothing merged); its retry, with the same sequence, dials a fresh
    connection and is merged once."""
    lane, weight = daemons.lane, 0.125
    mine = weight_of(lane.handle)
    values = seeded_values(13)

    async def stalled_send(conn: Any, view: memoryview, progressed: Callable[[], None]) -> None:
        await asyncio.to_thread(conn.send_all, view[: len(view) // 2])
        await asyncio.Event().wait()

    async def pushes() -> tuple[Any, Any, bool, GossipdError, list[Ack]]:
        client = lane.client()
        try:
            await client.push(outbound_push(next_sequence(), weight, values), PUSH_TIMEOUT_S)
            assert client._bulk is not None
            [used] = client._bulk._idle  # the first push's connection, kept for the next
            monkeypatch.setattr(client._bulk, "send", stalled_send)
            sequence = next_sequence()
            with pytest.raises(GossipdError) as failed:
                await client.push(outbound_push(sequence, weight, values), PUSH_TIMEOUT_S)
            monkeypatch.undo()
            acks = await client.push(outbound_push(sequence, weight, values), PUSH_TIMEOUT_S)
            [fresh] = client._bulk._idle
            return used, fresh, fresh.closed, failed.value, acks
        finally:
            await client.close()

    used, fresh, fresh_closed, failure, acks = asyncio.run(pushes())
    assert isinstance(failure, OutcomeUnknown), failure
    assert used.closed and not fresh_closed and fresh.token != used.token
    assert acks == [Ack(0, False, mine + 2 * weight)], "the retry merges, once"
    assert weight_of(lane.handle) == pytest.approx(mine + 2 * weight, abs=TOLERANCE)
