"""The bulk lane (``node/net/bulk.py``) on real daemons: large payloads as raw bytes beside gRPC.

What it protects. A push or a pull of a part of 1 MiB or more (``BULK_MIN_BYTES``)
travels on the receiver's lane, counted in ``gossipd_bulk_bytes_total``, and ends
exactly as it would in chunk frames: the same model, the same sum-weight, in
plaintext and over mutual TLS; a daemon with ``bulk = false`` answers
``bulk_port = 0`` and still takes such pushes in frames. A member that drives the
lane by hand (a raw socket beside its own gRPC frames) cannot get a payload merged
that did not arrive whole and intact, hold a connection past
``limits.stream_idle_timeout_s`` or below ``limits.min_push_rate_bytes_s``, use a
connection that is not its own (or one that is busy), name one that does not exist,
or open more than ``limits.max_inbound_pushes[_per_peer]`` allow: each is refused with
its status, counted, the connection is closed, and the receiver's sum of weights
moves by exactly what was merged. After a lane push that failed midway, the sender's
client retries on a fresh connection and the push is merged once.

Three daemons start once for the module, at the same time: ``lane`` (plaintext, bulk
lane on), ``framed`` (plaintext, ``bulk = false``, the same model) and ``tls-lane``
(mutual TLS, lane on). Their model is one segment of 1.2 MB. The plaintext senders
are ``FakePeer`` members the daemons verified; the TLS one is a member with a
certificate of the mesh CA (``tests/insider_streams.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from gossipd.node.errors import GossipdError
from gossipd.node.launch.localmesh import free_ports
from gossipd.node.net import transport
from gossipd.node.net.bulk import MAGIC, MAGIC_SEALED, TOKEN_BYTES, BulkDialer, leave_tls
from gossipd.node.net.sealing import LENGTH, SEED_BYTES, Seal, new_seed
from gossipd.node.net.shaping import LinkShaper
from gossipd.node.net.transport import BULK_MIN_BYTES, Identity, OutcomeUnknown, PeerClient
from gossipd.node.net.wire import Limits
from gossipd.node.protocols.base import Push
from gossipd.node.shared.tls import Credentials
from gossipd.node.trainer.messages import Ack, OutboundPush, Pulled
from gossipd.proto import gossip_pb2 as pb
from tests.conftest import DaemonHandle, scrape_metrics, start_daemon, wait_until
from tests.fakepeer import (
    MESH,
    FakePeer,
    PushOutcome,
    handshake_tls,
    pull_unchecked,
    push_frames,
    synthetic_plan,
)
from tests.insider_streams import Insider
from tests.test_sealing import sealed_bytes
from tests.test_tls import CLIENT, Pki

NUMEL = 300_000  # float32 parameters: one segment of 1.2 MB
PLAN = synthetic_plan(numel=NUMEL)
PAYLOAD_BYTES = PLAN.segments[0].nbytes
SENDER, OTHER, MEMBER = "lane-sender", "lane-other", "lane-member"
INCARNATION = 5
IDLE_S = 2.0  # limits.stream_idle_timeout_s of every daemon here
MIN_RATE = 1 << 20  # bytes/s: a whole payload may take IDLE_S + 1.1 s of waiting
TOTAL_CAP = 4  # limits.max_inbound_pushes of the plaintext lane daemon
PER_PEER_CAP = 2  # limits.max_inbound_pushes_per_peer of the TLS daemon
PUSH_TIMEOUT_S = 30.0
TOLERANCE = 1e-12
LIMITS = {
    "stream_idle_timeout_s": IDLE_S,
    "min_push_rate_bytes_s": MIN_RATE,
    "max_sum_weight": 100.0,  # the pushes here add up to more than the founding view of 2
}
JOB = {"options": {"numel": NUMEL}, "max_steps": 1}  # then idle: merges only
PLAINTEXT = Credentials(insecure=True)
PUSH_SEGMENTS = "/gossipd.v1.Gossip/PushSegments"
PULL_MODEL = "/gossipd.v1.Gossip/PullModel"
MERGED = (pb.SEGMENT_RESULT_MERGED,)  # PushOutcome.results of a push merged

assert PAYLOAD_BYTES >= BULK_MIN_BYTES, "the model must be large enough for the lane"


class _Member(Insider):
    """A member of the TLS mesh that runs this file's model; it takes no pushes."""

    def __init__(self, node_id: str, tls: Credentials) -> None:
        super().__init__(node_id, tls, incarnation=INCARNATION)
        self.fingerprint = PLAN.fingerprint  # what its Handshake answers


@dataclass
class Lane:
    """A daemon with a bulk lane, and the verified member that pushes to it."""

    handle: DaemonHandle
    port: int  # the lane's port, from the daemon's Handshake reply
    sender: str
    sender_address: str
    tls: Credentials  # what the member presents on gRPC
    lane_tls: ssl.SSLContext | None  # and on the lane (None: plaintext)

    def client(self, shaper: LinkShaper | None = None) -> PeerClient:
        """The node's own client, as the member (one stream, so one lane connection)."""
        identity = Identity(
            MESH, self.sender, self.sender_address, INCARNATION, PLAN.fingerprint, "sumweight"
        )
        expected = None if self.tls.insecure else self.handle.node_id
        return PeerClient(
            self.handle.address, identity, tls=self.tls, expected=expected, streams=1, shaper=shaper
        )


@dataclass
class Daemons:
    lane: Lane
    framed: Lane  # bulk = false (port 0), the same model and history as lane's
    tls: Lane
    tls_member: _Member
    pki: Pki


# -- the module's daemons -----------------------------------------------------------------


def _client_context(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """A TLS client context for raw lane connections (the server checked against ``ca``)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # the lane names nodes by certificate, not host name
    context.load_verify_locations(ca)
    if cert is not None and key is not None:
        context.load_cert_chain(cert, key)
    return context


def _admitted(handle: DaemonHandle, node_id: str) -> None:
    wait_until(
        lambda: node_id in handle.status()["live_peers"],
        f"{handle.node_id} to verify {node_id}",
        60,
    )


def _lane_port(handle: DaemonHandle, tls: Credentials, info: pb.NodeInfo) -> int:
    code, reply, details = handshake_tls(tls, handle.address, info, fingerprint=PLAN.fingerprint)
    assert code == grpc.StatusCode.OK and reply is not None, (code, details)
    return reply.bulk_port


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemons]:
    root = tmp_path_factory.mktemp("bulk")
    pki = Pki.create(root / "ca", ["tls-lane", MEMBER, CLIENT])
    ports = free_ports(3)
    plaintext = {"job": JOB, "limits": {**LIMITS, "max_inbound_pushes": TOTAL_CAP}}
    starts: list[Callable[[], DaemonHandle]] = [
        lambda: start_daemon(root, "lane", ports[0], **plaintext),
        lambda: start_daemon(root, "framed", ports[1], bulk=False, **plaintext),
        lambda: start_daemon(
            root,
            "tls-lane",
            ports[2],
            client_tls=pki.creds(CLIENT),
            tls=pki.tls_config("tls-lane"),
            job=JOB,
            limits={**LIMITS, "max_inbound_pushes_per_peer": PER_PEER_CAP},
        ),
    ]
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    handles = [f.result() for f in futures if f.exception() is None]
    try:
        assert len(handles) == len(starts), [f.exception() for f in futures]
        lane, framed, tls = handles
        with (
            FakePeer(SENDER, fingerprint=PLAN.fingerprint, incarnation=INCARNATION) as sender,
            FakePeer(OTHER, fingerprint=PLAN.fingerprint, incarnation=INCARNATION) as other,
            _Member(MEMBER, pki.creds(MEMBER)) as member,
        ):
            for fake in (sender, other):
                for handle in (lane, framed):
                    fake.introduce_to(handle.address)
                    _admitted(handle, fake.node_id)
            member.introduce_to(tls.address)
            _admitted(tls, MEMBER)
            yield Daemons(
                lane=Lane(
                    lane,
                    _lane_port(lane, PLAINTEXT, sender.info()),
                    SENDER,
                    sender.address,
                    PLAINTEXT,
                    None,
                ),
                framed=Lane(framed, 0, SENDER, sender.address, PLAINTEXT, None),
                tls=Lane(
                    tls,
                    _lane_port(tls, pki.creds(MEMBER), member.info()),
                    MEMBER,
                    member.address,
                    pki.creds(MEMBER),
                    _client_context(pki.ca, pki.pem(MEMBER), pki.key(MEMBER)),
                ),
                tls_member=member,
                pki=pki,
            )
    finally:
        with ThreadPoolExecutor(len(starts)) as pool:  # their shutdowns overlap
            stopped = pool.map(DaemonHandle.stop, handles)
            codes = {h.node_id: code for h, code in zip(handles, stopped, strict=True)}
        assert all(code == 0 for code in codes.values()), codes


@pytest.fixture(params=["plaintext", "mutual TLS"])
def lane(request: pytest.FixtureRequest, daemons: Daemons) -> Lane:
    return daemons.lane if request.param == "plaintext" else daemons.tls


# -- reading a daemon -----------------------------------------------------------------------


def _metrics(handle: DaemonHandle) -> dict[str, float]:
    return scrape_metrics(handle.node_json()["metrics_port"])


def _lane_bytes(handle: DaemonHandle, direction: str) -> float:
    return _metrics(handle).get(f'gossipd_bulk_bytes_total{{direction="{direction}"}}', 0.0)


def _lane_connections(handle: DaemonHandle) -> float:
    return _metrics(handle)["gossipd_bulk_connections"]


def _no_lane_connections(handle: DaemonHandle) -> None:
    """Until the connections earlier tests left are gone (closed ones are swept in ~1 s)."""
    wait_until(lambda: _lane_connections(handle) == 0, "no bulk-lane connections", IDLE_S + 10)


def _weight(handle: DaemonHandle) -> float:
    return handle.status()["sum_weights"][0]


def _rejected(handle: DaemonHandle, reason: str) -> int:
    return handle.status()["rejected"].get(reason, 0)


def _counted(handle: DaemonHandle, reason: str, before: int) -> None:
    wait_until(
        lambda: _rejected(handle, reason) == before + 1, f"one more {reason} refusal counted", 10
    )


def _pull_in_frames(lane: Lane, daemons: Daemons) -> torch.Tensor:
    """The daemon's one segment, pulled in chunk frames (no lane)."""
    if lane.tls.insecure:
        [values] = pull_unchecked(lane.handle.address, fingerprint=PLAN.fingerprint)
    else:
        [values] = daemons.tls_member.pull(lane.handle.address)
    return values


# -- the node's own client ------------------------------------------------------------------

_sequence = itertools.count(2)  # every sender's pushes, numbered once for the module


def _values(seed: int) -> torch.Tensor:
    return 0.1 * torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def _outbound(sequence: int, weight: float, values: torch.Tensor) -> OutboundPush:
    return OutboundPush(Push("receiver", sequence, {0: weight}), {0: values})


def _push_with_client(
    lane: Lane,
    sequence: int,
    weight: float,
    values: torch.Tensor,
    shaper: LinkShaper | None = None,
) -> list[Ack]:
    async def push() -> list[Ack]:
        client = lane.client(shaper)
        try:
            return await client.push(_outbound(sequence, weight, values), PUSH_TIMEOUT_S)
        finally:
            await client.close()

    return asyncio.run(push())


def _pull_with_client(lane: Lane) -> Pulled:
    async def pull() -> Pulled:
        client = lane.client()
        try:
            return await client.pull(PLAN, Limits(), PUSH_TIMEOUT_S)
        finally:
            await client.close()

    return asyncio.run(pull())


# -- a member driving the lane by hand ------------------------------------------------------

_tokens = itertools.count()


def _dial(lane: Lane, context: ssl.SSLContext | None = None) -> socket.socket:
    """A raw connection to the lane (with TLS: ``context``, by default the member's)."""
    sock = socket.create_connection(("127.0.0.1", lane.port), timeout=10.0)
    context = context or lane.lane_tls
    return context.wrap_socket(sock) if context is not None else sock


def _hello(sock: socket.socket, token: bytes | None = None) -> bytes:
    """Send the hello, with a fresh token (16 bytes, unique in the module) by default."""
    token = token or f"test-lane-{next(_tokens):06d}".encode()
    sock.sendall(MAGIC + token)
    return token


def _sealed_dial(lane: Lane) -> tuple[socket.socket, bytes, Seal]:
    """A sealed connection by hand, as the node's client makes one: TLS, the GDB2 hello
    with a seed, the daemon's seed back, then sealed records on the bare socket."""
    sock = _dial(lane)
    token, seed = f"test-lane-{next(_tokens):06d}".encode(), new_seed()
    sock.sendall(MAGIC_SEALED + token + seed)
    answer = bytes(_recv_exactly(sock, SEED_BYTES))
    return leave_tls(sock), token, Seal.derive(seed, answer, token, dialer=True)  # type: ignore[arg-type]


def _closed_within(sock: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the daemon closed ``sock`` (EOF, reset or a TLS alert), or None if it
    was still open after ``timeout_s``. A daemon never writes on a connection pushed to."""
    started = time.monotonic()
    sock.settimeout(timeout_s)
    try:
        data = sock.recv(1)
    except TimeoutError:
        return None
    except OSError:  # reset, or TLS's alert for a refused certificate
        data = b""
    assert data == b"", f"the daemon sent {data!r} on a lane connection"
    return time.monotonic() - started


def _frames(
    lane: Lane,
    sequence: int,
    weight: float,
    values: torch.Tensor,
    *,
    token: bytes,
    sender: str | None = None,
) -> tuple[list[bytes], bytes]:
    """A one-segment push by hand: its open (naming ``token``) and header (marked bulk)
    frames, and the payload that the lane is to carry."""
    opened, header, chunk = (
        pb.PushFrame.FromString(frame)
        for frame in push_frames(
            sender=sender or lane.sender,
            incarnation=INCARNATION,
            sequence=sequence,
            weight=weight,
            values=values,
            fingerprint=PLAN.fingerprint,
        )
    )
    opened.open.bulk_token = token
    header.header.bulk = True
    return [opened.SerializeToString(), header.SerializeToString()], chunk.chunk


Feed = Callable[[], Awaitable[None]]


async def _write(sock: socket.socket, data: bytes) -> bool:
    """Write ``data`` on a lane connection; False if the daemon had closed it."""
    try:
        await asyncio.to_thread(sock.sendall, data)
    except OSError:
        return False
    return True


def _send(sock: socket.socket, data: bytes) -> Feed:
    """A feed that writes ``data`` on the lane connection."""

    async def feed() -> None:
        await _write(sock, data)

    return feed


def _stall(sock: socket.socket, data: bytes) -> Feed:
    """A feed that writes ``data`` on the lane connection, then nothing ever again."""

    async def feed() -> None:
        await _write(sock, data)
        await asyncio.Event().wait()  # until the daemon ends the push (grpc then ends this)

    return feed


def _trickle(sock: socket.socket, data: bytes, piece: int, every_s: float) -> Feed:
    """A feed that writes ``data`` a ``piece`` every ``every_s`` (each well inside the
    idle timeout), until the daemon closes the connection."""

    async def feed() -> None:
        for start in range(0, len(data), piece):
            if not await _write(sock, data[start : start + piece]):
                break
            await asyncio.sleep(every_s)  # the trickle's pace, not a wait for the daemon
        await asyncio.Event().wait()

    return feed


async def _push_by_hand(lane: Lane, frames: list[bytes], feed: Feed | None = None) -> PushOutcome:
    """``frames`` in one PushSegments call over the member's gRPC channel, then ``feed()``
    (what the member writes on its lane once the header is on the wire)."""

    async def requests() -> AsyncIterator[bytes]:
        for frame in frames:
            yield frame
        if feed is not None:
            await feed()

    async with lane.tls.channel(lane.handle.address, []) as channel:
        rpc = channel.stream_unary(
            PUSH_SEGMENTS, request_serializer=None, response_deserializer=pb.PushReply.FromString
        )
        try:
            reply = await rpc(requests(), timeout=PUSH_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            return PushOutcome(err.code(), (), err.details() or "")
    return PushOutcome(grpc.StatusCode.OK, tuple(a.result for a in reply.acks))


def _push_sync(lane: Lane, frames: list[bytes]) -> PushOutcome:
    """``frames`` in one PushSegments call with grpc's sync API, for a push refused
    before its last frame is written: grpc.aio's client reports such a refusal as
    ``INTERNAL: Internal error from Core`` when a write loses the race with the
    server's end of the stream (grpc/grpc#36066)."""
    assert lane.tls.insecure, "the sync helper speaks plaintext only"
    with grpc.insecure_channel(lane.handle.address) as channel:
        rpc = channel.stream_unary(
            PUSH_SEGMENTS, request_serializer=None, response_deserializer=pb.PushReply.FromString
        )
        try:
            reply = rpc(iter(frames), timeout=PUSH_TIMEOUT_S)
        except grpc.RpcError as err:
            return PushOutcome(err.code(), (), err.details() or "")
    return PushOutcome(grpc.StatusCode.OK, tuple(a.result for a in reply.acks))


def _timed_push(
    lane: Lane, frames: list[bytes], feed: Feed | None = None
) -> tuple[PushOutcome, float]:
    """:func:`_push_by_hand` and the seconds it took."""
    started = time.monotonic()
    outcome = asyncio.run(_push_by_hand(lane, frames, feed))
    return outcome, time.monotonic() - started


def _lane_push(lane: Lane, sock: socket.socket, token: bytes, weight: float) -> PushOutcome:
    """A whole honest push by hand on the lane connection ``sock`` (named by ``token``)."""
    frames, payload = _frames(lane, next(_sequence), weight, _values(11), token=token)
    return asyncio.run(_push_by_hand(lane, frames, _send(sock, payload)))


async def _pull_by_hand(
    lane: Lane, token: bytes, requester: str
) -> tuple[grpc.StatusCode, list[pb.SegmentHeader]]:
    """A PullModel call as ``requester`` that names the lane connection ``token``: its
    status and the headers it brought (payloads marked bulk come on that connection)."""
    request = pb.PullRequest(
        mesh_id=MESH,
        requester=requester,
        fingerprint=PLAN.fingerprint,
        codec=pb.CODEC_RAW,
        bulk_token=token,
    )
    headers: list[pb.SegmentHeader] = []
    async with lane.tls.channel(lane.handle.address, []) as channel:
        rpc = channel.unary_stream(
            PULL_MODEL,
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=pb.PullFrame.FromString,
        )
        try:
            async for frame in rpc(request, timeout=PUSH_TIMEOUT_S):
                assert frame.WhichOneof("kind") == "header", "a chunk frame in a lane pull"
                headers.append(frame.header)
        except grpc.aio.AioRpcError as err:
            return err.code(), headers
    return grpc.StatusCode.OK, headers


def _recv_exactly(sock: socket.socket, nbytes: int) -> bytearray:
    data = bytearray(nbytes)
    view, got = memoryview(data), 0
    sock.settimeout(10.0)
    while got < nbytes:
        n = sock.recv_into(view[got:])
        assert n, f"the lane closed after {got} of {nbytes} bytes"
        got += n
    return data


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
    received = _lane_bytes(lane.handle, "received")
    sequence, weight, values = next(_sequence), 0.25, _values(1)

    acks = [_push_with_client(to, sequence, weight, values) for to in (lane, framed)]

    total = before["lane"]["sum_weights"][0] + weight
    assert acks == [[Ack(0, False, total)]] * 2
    assert _lane_bytes(lane.handle, "received") - received == PAYLOAD_BYTES
    assert _lane_bytes(framed.handle, "received") == 0.0, "a daemon with bulk = false has no lane"
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
    own = _pull_in_frames(lane, daemons)
    mine, received = _weight(lane.handle), _lane_bytes(lane.handle, "received")
    weight, values = 0.25, _values(2)

    acks = _push_with_client(lane, next(_sequence), weight, values)

    assert acks == [Ack(0, False, mine + weight)]
    assert _lane_bytes(lane.handle, "received") - received == PAYLOAD_BYTES
    assert _weight(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)
    expected = (mine * own + weight * values) / (mine + weight)
    merged = _pull_in_frames(lane, daemons)
    assert torch.allclose(merged, expected, atol=1e-6), (merged - expected).abs().max()


def test_a_large_pull_brings_what_a_pull_in_frames_brings_on_the_lane(
    lane: Lane, daemons: Daemons
) -> None:
    """Over TLS the payload comes in sealed records (the server advertises them)."""
    sent = _lane_bytes(lane.handle, "sent")

    pulled = _pull_with_client(lane)

    assert _lane_bytes(lane.handle, "sent") - sent == PAYLOAD_BYTES
    assert sorted(pulled.values) == [0] and pulled.nbytes == PAYLOAD_BYTES
    assert torch.equal(pulled.values[0], _pull_in_frames(lane, daemons))
    assert pulled.weights[0] == _weight(lane.handle)


def test_a_daemon_without_a_lane_answers_port_0_and_takes_large_pushes_in_frames(
    daemons: Daemons,
) -> None:
    framed = daemons.framed
    assert _lane_port(framed.handle, PLAINTEXT, pb.NodeInfo(node_id=SENDER)) == 0
    assert daemons.lane.port not in (0, int(daemons.lane.handle.address.rpartition(":")[2]))
    mine, weight = _weight(framed.handle), 0.125

    acks = _push_with_client(framed, next(_sequence), weight, _values(3))

    assert acks == [Ack(0, False, mine + weight)]
    assert _lane_connections(framed.handle) == 0
    assert _lane_bytes(framed.handle, "received") == 0.0
    # A push that names a lane connection anyway is refused, and merges nothing.
    frames, _ = _frames(framed, next(_sequence), weight, _values(3), token=b"no-lane-here-000")
    outcome = _push_sync(framed, frames)
    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert _weight(framed.handle) == pytest.approx(mine + weight, abs=TOLERANCE)


@pytest.mark.parametrize("why", ["[link] shaping", "a part under BULK_MIN_BYTES"])
def test_a_push_the_client_may_not_put_on_the_lane_goes_in_chunk_frames(
    daemons: Daemons, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    lane, weight = daemons.lane, 0.125
    mine, received = _weight(lane.handle), _lane_bytes(lane.handle, "received")
    shaper = None
    if why == "[link] shaping":
        shaper = LinkShaper(latency_s=0.001)  # paces chunk frames; the lane would bypass it
    else:
        monkeypatch.setattr(transport, "BULK_MIN_BYTES", PAYLOAD_BYTES + 1)

    acks = _push_with_client(lane, next(_sequence), weight, _values(14), shaper)

    assert acks == [Ack(0, False, mine + weight)]
    assert _lane_bytes(lane.handle, "received") == received
    assert _weight(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)


# -- a member driving the lane by hand --------------------------------------------------------


def test_a_push_naming_a_connection_nobody_opened_is_refused_after_the_idle_timeout(
    daemons: Daemons,
) -> None:
    lane = daemons.lane
    mine, refused = _weight(lane.handle), _rejected(lane.handle, "BulkClosed")
    frames, _ = _frames(lane, next(_sequence), 0.25, _values(4), token=b"nobody-opened-it")

    outcome, took_s = _timed_push(lane, frames)

    assert outcome.code == grpc.StatusCode.UNAVAILABLE, outcome
    assert IDLE_S * 0.9 <= took_s < IDLE_S + 10, f"refused after {took_s:.1f} s"
    _counted(lane.handle, "BulkClosed", refused)
    assert _weight(lane.handle) == pytest.approx(mine, abs=TOLERANCE)


def test_a_header_marked_bulk_in_a_push_that_names_no_connection_is_refused(
    daemons: Daemons,
) -> None:
    lane = daemons.lane
    mine, refused = _weight(lane.handle), _rejected(lane.handle, "InvalidFrame")
    frames, _ = _frames(lane, next(_sequence), 0.25, _values(5), token=b"")

    outcome = asyncio.run(_push_by_hand(lane, frames))

    assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
    assert "names no bulk-lane connection" in outcome.details, outcome
    _counted(lane.handle, "InvalidFrame", refused)
    assert _weight(lane.handle) == pytest.approx(mine, abs=TOLERANCE)


def test_a_payload_stalled_on_the_lane_ends_the_push_and_closes_the_connection(
    lane: Lane,
) -> None:
    handle = lane.handle
    mine, received = _weight(handle), _lane_bytes(handle, "received")
    idled = _rejected(handle, "StreamIdle")
    sock = _dial(lane)
    with sock:
        frames, payload = _frames(lane, next(_sequence), 0.25, _values(6), token=_hello(sock))

        outcome, took_s = _timed_push(lane, frames, _stall(sock, payload[: len(payload) // 2]))

        assert outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED, outcome
        assert IDLE_S * 0.9 <= took_s < IDLE_S + 10, f"ended after {took_s:.1f} s"
        assert _closed_within(sock, IDLE_S) is not None, "the stalled connection is still open"
    _counted(handle, "StreamIdle", idled)
    assert _lane_bytes(handle, "received") == received
    assert _weight(handle) == pytest.approx(mine, abs=TOLERANCE)


def test_a_payload_trickled_below_the_minimum_rate_ends_the_push(daemons: Daemons) -> None:
    """Every piece comes well inside the idle timeout; the whole payload may take
    IDLE_S + PAYLOAD_BYTES / MIN_RATE of waiting all the same (limits.min_push_rate_bytes_s)."""
    lane = daemons.lane
    mine, slow = _weight(lane.handle), _rejected(lane.handle, "PushTooSlow")
    allowed_s = IDLE_S + PAYLOAD_BYTES / MIN_RATE
    sock = _dial(lane)
    with sock:
        frames, payload = _frames(lane, next(_sequence), 0.25, _values(7), token=_hello(sock))
        trickle = _trickle(sock, payload, piece=32 << 10, every_s=IDLE_S / 10)  # 160 KiB/s

        outcome, took_s = _timed_push(lane, frames, trickle)

        assert outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED, outcome
        assert allowed_s * 0.9 <= took_s < allowed_s + 10, f"ended after {took_s:.1f} s"
        assert _closed_within(sock, IDLE_S) is not None, "the trickling connection is still open"
    _counted(lane.handle, "PushTooSlow", slow)
    assert _weight(lane.handle) == pytest.approx(mine, abs=TOLERANCE)


@pytest.mark.parametrize("fault", ["checksum", "NaN"])
def test_a_payload_that_fails_its_checks_on_the_lane_is_refused_and_closes_the_connection(
    daemons: Daemons, fault: str
) -> None:
    lane = daemons.lane
    reason = {"checksum": "InvalidFrame", "NaN": "NonFinitePayload"}[fault]
    mine, refused = _weight(lane.handle), _rejected(lane.handle, reason)
    values = _values(8)
    if fault == "NaN":
        values[NUMEL // 2] = float("nan")  # the header's checksum is the payload's own
    sock = _dial(lane)
    with sock:
        frames, payload = _frames(lane, next(_sequence), 0.25, values, token=_hello(sock))
        if fault == "checksum":
            payload = bytes([payload[0] ^ 1]) + payload[1:]

        outcome = asyncio.run(_push_by_hand(lane, frames, _send(sock, payload)))

        assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
        assert _closed_within(sock, IDLE_S) is not None, "the connection is still open"
    _counted(lane.handle, reason, refused)
    assert _weight(lane.handle) == pytest.approx(mine, abs=TOLERANCE)


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
    mine, weight = _weight(lane.handle), 0.125

    async def push() -> tuple[list[Ack], bool]:
        client = lane.client()
        try:
            acks = await client.push(
                _outbound(next(_sequence), weight, _values(14)), PUSH_TIMEOUT_S
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
    mine, refused = _weight(lane.handle), _rejected(lane.handle, reason)
    sock, token, seal = _sealed_dial(lane)
    with sock:
        frames, payload = _frames(lane, next(_sequence), weight, _values(12), token=token)
        honest = asyncio.run(_push_by_hand(lane, frames, _send(sock, sealed_bytes(seal, payload))))
        values = _values(13)
        if fault == "NaN":
            values[NUMEL // 3] = float("nan")
        frames, payload = _frames(lane, next(_sequence), weight, values, token=token)
        wire = bytearray(sealed_bytes(seal, payload))
        if fault == "tampered record":
            wire[LENGTH.size + 1000] ^= 0x01
        bad = asyncio.run(_push_by_hand(lane, frames, _send(sock, bytes(wire))))
        assert _closed_within(sock, IDLE_S) is not None, "the connection is still open"
    assert (honest.code, honest.results) == (grpc.StatusCode.OK, MERGED), honest
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT, bad
    if fault == "tampered record":
        assert "failed authentication" in bad.details, bad
    _counted(lane.handle, reason, refused)
    assert _weight(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)


def test_a_client_that_does_not_seal_still_pushes_and_pulls_over_tls(daemons: Daemons) -> None:
    """A dialer of an older release (``GDB1``, TLS bytes through Python's ssl) is still
    served: its push merges and its pull brings the model, both on the lane."""
    lane, weight = daemons.tls, 0.125
    mine, received = _weight(lane.handle), _lane_bytes(lane.handle, "received")
    sent = _lane_bytes(lane.handle, "sent")
    host = lane.handle.address.rpartition(":")[0]

    async def push_and_pull() -> tuple[list[Ack], Pulled, bool]:
        client = lane.client()
        client._bulk = BulkDialer(host, lane.port, lane.tls, lane.handle.node_id, 2)
        try:
            acks = await client.push(
                _outbound(next(_sequence), weight, _values(15)), PUSH_TIMEOUT_S
            )
            pulled = await client.pull(PLAN, Limits(), PUSH_TIMEOUT_S)
            return acks, pulled, client._bulk is not None and client._bulk.sealed
        finally:
            await client.close()

    acks, pulled, sealed = asyncio.run(push_and_pull())
    assert not sealed
    assert acks == [Ack(0, False, mine + weight)]
    assert _lane_bytes(lane.handle, "received") - received == PAYLOAD_BYTES
    # Unsealed over TLS a pull goes in gRPC frames (one Python ssl connection is slower).
    assert _lane_bytes(lane.handle, "sent") == sent
    assert torch.equal(pulled.values[0], _pull_in_frames(lane, daemons))


def test_a_sealed_hello_with_more_tls_bytes_behind_it_is_refused(daemons: Daemons) -> None:
    """After its seed the dialer must leave TLS: bytes it still sends in TLS (here in the
    hello's own record) would be lost when the daemon leaves it, so they are refused."""
    lane = daemons.tls
    refused = _rejected(lane.handle, "InvalidFrame")
    with _dial(lane) as sock:
        sock.sendall(MAGIC_SEALED + b"sealed-and-extra" + new_seed() + b"more in TLS")
        assert _closed_within(sock, IDLE_S) is not None, "the connection is still open"
    _counted(lane.handle, "InvalidFrame", refused)


def test_a_sealed_hello_on_a_plaintext_lane_is_refused(daemons: Daemons) -> None:
    """Sealing keys come from TLS: without it there is nothing to seal with."""
    lane = daemons.lane
    refused = _rejected(lane.handle, "InvalidFrame")
    with _dial(lane) as sock:
        sock.sendall(MAGIC_SEALED + b"plaintext-sealed" + new_seed())
        assert _closed_within(sock, IDLE_S) is not None, "the connection is still open"
    _counted(lane.handle, "InvalidFrame", refused)


@pytest.mark.parametrize("hello", ["garbage", "nothing"])
def test_a_connection_without_its_hello_is_closed_and_counted(lane: Lane, hello: str) -> None:
    """Garbage is refused at once (InvalidFrame); silence after the idle timeout
    (StreamIdle). With TLS, both come after a completed handshake."""
    reason = {"garbage": "InvalidFrame", "nothing": "StreamIdle"}[hello]
    refused = _rejected(lane.handle, reason)
    sock = _dial(lane)
    with sock:
        if hello == "garbage":
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n\0\0")  # 20 bytes, the size of a hello
        closed_s = _closed_within(sock, IDLE_S + 10)
    assert closed_s is not None, "the connection is still open"
    if hello == "garbage":
        assert closed_s < IDLE_S * 0.9, f"garbage closed only after {closed_s:.1f} s"
    else:
        assert closed_s >= IDLE_S * 0.9, f"a silent connection closed after {closed_s:.1f} s"
    _counted(lane.handle, reason, refused)


def test_a_connection_belongs_to_the_first_sender_that_uses_it(
    daemons: Daemons,
) -> None:
    """Plaintext: the connection is bound to the sender of its first push; another
    verified member that names it, in a push or a pull, is refused, and the owner's
    connection still carries its pushes and pulls."""
    lane, weight = daemons.lane, 0.125
    mine, refused = _weight(lane.handle), _rejected(lane.handle, "IdentityMismatch")
    with _dial(lane) as sock:
        token = _hello(sock)
        first = _lane_push(lane, sock, token, weight)
        frames, _ = _frames(lane, next(_sequence), weight, _values(9), token=token, sender=OTHER)
        stolen_push = asyncio.run(_push_by_hand(lane, frames))
        stolen_pull, _ = asyncio.run(_pull_by_hand(lane, token, OTHER))
        again = _lane_push(lane, sock, token, weight)
        pulled, headers = asyncio.run(_pull_by_hand(lane, token, SENDER))
        payload = _recv_exactly(sock, PAYLOAD_BYTES)
    assert (first.code, first.results) == (grpc.StatusCode.OK, MERGED), first
    assert stolen_push.code == grpc.StatusCode.PERMISSION_DENIED, stolen_push
    assert stolen_pull == grpc.StatusCode.PERMISSION_DENIED
    assert (again.code, again.results) == (grpc.StatusCode.OK, MERGED), again
    assert pulled == grpc.StatusCode.OK and [h.bulk for h in headers] == [True]
    values = torch.frombuffer(payload, dtype=torch.float32)
    assert torch.equal(values, _pull_in_frames(lane, daemons))
    assert _rejected(lane.handle, "IdentityMismatch") == refused + 2
    assert _weight(lane.handle) == pytest.approx(mine + 2 * weight, abs=TOLERANCE)


def test_a_connection_carries_one_push_at_a_time(daemons: Daemons) -> None:
    """Two pushes name one connection at once: whichever claims it second is refused
    (without closing it), and the first, its payload written only then, is merged."""
    lane, weight = daemons.lane, 0.125
    mine = _weight(lane.handle)
    sock = _dial(lane)
    with sock:
        token = _hello(sock)
        pushes = [_frames(lane, next(_sequence), weight, _values(10), token=token) for _ in "ab"]
        outcomes: dict[int, PushOutcome] = {}

        async def both() -> None:
            one_answered = asyncio.Event()

            def feed(i: int) -> Feed:
                async def write_if_holding() -> None:
                    await one_answered.wait()
                    if i not in outcomes:  # the other was refused: this one holds it
                        await _write(sock, pushes[i][1])
                    else:
                        await asyncio.Event().wait()

                return write_if_holding

            async def push(i: int) -> None:
                outcomes[i] = await _push_by_hand(lane, pushes[i][0], feed(i))
                one_answered.set()

            async with asyncio.timeout(PUSH_TIMEOUT_S):
                await asyncio.gather(push(0), push(1))

        asyncio.run(both())
    by_code = {o.code: o for o in outcomes.values()}
    assert set(by_code) == {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}, outcomes
    assert by_code[grpc.StatusCode.OK].results == MERGED
    assert "already in use" in by_code[grpc.StatusCode.INVALID_ARGUMENT].details
    assert _weight(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)


def test_a_hello_dribbled_a_byte_at_a_time_is_cut_off_at_the_idle_timeout(lane: Lane) -> None:
    """The handshake and the hello together must finish within stream_idle_timeout_s, not
    each byte of them: a byte every IDLE_S / 2 would hold a connection (and, with TLS, a
    worker and a slot that no per-peer cap counts yet) for 20 times that."""
    give_up_s = IDLE_S + 3
    closed = False
    with _dial(lane) as sock:
        started = time.monotonic()
        for byte in MAGIC + bytes(TOKEN_BYTES):
            if time.monotonic() - started > give_up_s:
                break
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            if _closed_within(sock, IDLE_S / 2) is not None:
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
    _no_lane_connections(lane.handle)
    mine, busy = _weight(lane.handle), _rejected(lane.handle, "Busy")
    held = [_dial(lane) for _ in range(TOTAL_CAP)]
    try:
        tokens = [_hello(sock) for sock in held]
        wait_until(
            lambda: _lane_connections(lane.handle) == TOTAL_CAP, "every allowed connection", 10
        )
        with _dial(lane) as extra:
            assert _closed_within(extra, IDLE_S / 2) is not None, "one over the cap is open"
        _counted(lane.handle, "Busy", busy)
        outcome = _lane_push(lane, held[-1], tokens[-1], weight)
        assert (outcome.code, outcome.results) == (grpc.StatusCode.OK, MERGED), outcome
    finally:
        for sock in held:
            sock.close()
    assert _weight(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)


def test_lane_connections_over_the_per_peer_cap_are_closed_and_the_others_still_work(
    daemons: Daemons,
) -> None:
    """TLS names the member at connect time: one more connection than
    limits.max_inbound_pushes_per_peer is refused and closed; the member's others still
    push, and another site still gets a connection of its own."""
    lane, weight = daemons.tls, 0.125
    _no_lane_connections(lane.handle)
    mine, over = _weight(lane.handle), _rejected(lane.handle, "TooManyStreams")
    held: list[socket.socket] = []
    try:
        for count in range(1, PER_PEER_CAP + 1):
            held.append(_dial(lane))
            token = _hello(held[-1])
            wait_until(lambda n=count: _lane_connections(lane.handle) == n, f"{count} held", 10)
        held.append(extra := _dial(lane))
        _hello(extra)
        _counted(lane.handle, "TooManyStreams", over)
        outcome = _lane_push(lane, held[PER_PEER_CAP - 1], token, weight)
        assert (outcome.code, outcome.results) == (grpc.StatusCode.OK, MERGED), outcome
        pki = daemons.pki
        held.append(_dial(lane, _client_context(pki.ca, pki.pem(CLIENT), pki.key(CLIENT))))
        _hello(held[-1])
        wait_until(lambda: _lane_connections(lane.handle) == PER_PEER_CAP + 1, "another site's", 10)
        extra_closed_s = _closed_within(extra, IDLE_S)
    finally:
        for sock in held:
            sock.close()
    assert _weight(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)
    assert extra_closed_s is not None, (
        "the connection over limits.max_inbound_pushes_per_peer was refused (TooManyStreams "
        f"counted) but left open for {IDLE_S:g} s"
    )


def test_a_hello_that_reuses_a_token_in_use_is_refused_and_closed(lane: Lane) -> None:
    """The connection that holds the token keeps it and still pushes."""
    weight = 0.125
    _no_lane_connections(lane.handle)
    mine, refused = _weight(lane.handle), _rejected(lane.handle, "InvalidFrame")
    first, second = _dial(lane), _dial(lane)
    with first, second:
        token = _hello(first)
        wait_until(lambda: _lane_connections(lane.handle) == 1, "the first connection", 10)
        _hello(second, token)
        _counted(lane.handle, "InvalidFrame", refused)
        outcome = _lane_push(lane, first, token, weight)
        assert (outcome.code, outcome.results) == (grpc.StatusCode.OK, MERGED), outcome
        second_closed_s = _closed_within(second, IDLE_S)
    assert _weight(lane.handle) == pytest.approx(mine + weight, abs=TOLERANCE)
    assert second_closed_s is not None, (
        f"the hello that reused a token in use was refused (InvalidFrame counted) but its "
        f"connection left open for {IDLE_S:g} s"
    )


@pytest.mark.parametrize("certificate", ["none", "another CA's"])
def test_a_lane_client_without_a_certificate_of_the_mesh_ca_is_turned_away(
    daemons: Daemons, tmp_path: Path, certificate: str
) -> None:
    lane, pki = daemons.tls, daemons.pki
    refused = _rejected(lane.handle, "BulkClosed")
    if certificate == "none":
        context = _client_context(pki.ca)
    else:
        other = Pki.create(tmp_path / "other-ca", [MEMBER])
        context = _client_context(pki.ca, other.pem(MEMBER), other.key(MEMBER))
    sock = socket.create_connection(("127.0.0.1", lane.port), timeout=10.0)
    try:
        sock = context.wrap_socket(sock)  # TLS 1.3: the client may finish before the refusal
        _hello(sock)
        closed_s = _closed_within(sock, IDLE_S)
    except OSError:  # the server's alert arrived during the handshake or the hello
        closed_s = 0.0
    finally:
        sock.close()
    assert closed_s is not None, "a connection without a mesh certificate is still open"
    _counted(lane.handle, "BulkClosed", refused)
    _no_lane_connections(lane.handle)  # the member's, from earlier tests: its cap is 2
    mine, weight = _weight(lane.handle), 0.125
    assert _push_with_client(lane, next(_sequence), weight, _values(12)) == [
        Ack(0, False, mine + weight)
    ], "the daemon must go on serving its members' lane pushes"


def test_after_a_lane_push_stalled_midway_the_client_retries_on_a_fresh_connection(
    daemons: Daemons, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node's client: a push whose payload stalls halfway on the lane ends with an
    unknown outcome (nothing merged); its retry, with the same sequence, dials a fresh
    connection and is merged once."""
    lane, weight = daemons.lane, 0.125
    mine = _weight(lane.handle)
    values = _values(13)

    async def stalled_send(conn: Any, view: memoryview, progressed: Callable[[], None]) -> None:
        await asyncio.to_thread(conn.send_all, view[: len(view) // 2])
        await asyncio.Event().wait()

    async def pushes() -> tuple[Any, Any, bool, GossipdError, list[Ack]]:
        client = lane.client()
        try:
            await client.push(_outbound(next(_sequence), weight, values), PUSH_TIMEOUT_S)
            assert client._bulk is not None
            [used] = client._bulk._idle  # the first push's connection, kept for the next
            monkeypatch.setattr(client._bulk, "send", stalled_send)
            sequence = next(_sequence)
            with pytest.raises(GossipdError) as failed:
                await client.push(_outbound(sequence, weight, values), PUSH_TIMEOUT_S)
            monkeypatch.undo()
            acks = await client.push(_outbound(sequence, weight, values), PUSH_TIMEOUT_S)
            [fresh] = client._bulk._idle
            return used, fresh, fresh.closed, failed.value, acks
        finally:
            await client.close()

    used, fresh, fresh_closed, failure, acks = asyncio.run(pushes())
    assert isinstance(failure, OutcomeUnknown), failure
    assert used.closed and not fresh_closed and fresh.token != used.token
    assert acks == [Ack(0, False, mine + 2 * weight)], "the retry merges, once"
    assert _weight(lane.handle) == pytest.approx(mine + 2 * weight, abs=TOLERANCE)
