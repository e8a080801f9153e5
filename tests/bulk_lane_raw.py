"""A member driving a bulk lane by hand, for the bulk-lane tests: raw connections (plain,
TLS or sealed), hellos, push frames that name a connection, and feeds that write the
payload on it whole, stalled or trickled, beside its own gRPC frames.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import torch

from gossipd.node.net.bulk.lane import MAGIC, MAGIC_SEALED, leave_tls
from gossipd.node.net.bulk.sealing import SEED_BYTES, Seal, new_seed
from gossipd.proto import gossip_pb2 as pb
from tests.bulk_lane_mesh import (
    INCARNATION,
    PLAN,
    PULL_MODEL,
    PUSH_SEGMENTS,
    PUSH_TIMEOUT_S,
    Lane,
    next_sequence,
    seeded_values,
)
from tests.outsider import MESH, PushOutcome, push_frames
from tests.outsider import push_sync as outsider_push_sync

_tokens = itertools.count()


def dial_lane(lane: Lane, context: ssl.SSLContext | None = None) -> socket.socket:
    """A raw connection to the lane (with TLS: ``context``, by default the member's)."""
    sock = socket.create_connection(("127.0.0.1", lane.port), timeout=10.0)
    context = context or lane.lane_tls
    return context.wrap_socket(sock) if context is not None else sock


def send_hello(sock: socket.socket, token: bytes | None = None) -> bytes:
    """Send the hello, with a fresh token (16 bytes, unique in the module) by default."""
    token = token or f"test-lane-{next(_tokens):06d}".encode()
    sock.sendall(MAGIC + token)
    return token


def sealed_dial(lane: Lane) -> tuple[socket.socket, bytes, Seal]:
    """A sealed connection by hand, as the node's client makes one: TLS, the GDB2 hello
    with a seed, the daemon's seed back, then sealed records on the bare socket."""
    sock = dial_lane(lane)
    token, seed = f"test-lane-{next(_tokens):06d}".encode(), new_seed()
    sock.sendall(MAGIC_SEALED + token + seed)
    answer = bytes(recv_exactly(sock, SEED_BYTES))
    return leave_tls(sock), token, Seal.derive(seed, answer, token, dialer=True)  # type: ignore[arg-type]


def closed_within(sock: socket.socket, timeout_s: float) -> float | None:
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


def bulk_frames(
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


async def write_lane(sock: socket.socket, data: bytes) -> bool:
    """Write ``data`` on a lane connection; False if the daemon had closed it."""
    try:
        await asyncio.to_thread(sock.sendall, data)
    except OSError:
        return False
    return True


def feed_bytes(sock: socket.socket, data: bytes) -> Feed:
    """A feed that writes ``data`` on the lane connection."""

    async def feed() -> None:
        await write_lane(sock, data)

    return feed


def feed_then_stall(sock: socket.socket, data: bytes) -> Feed:
    """A feed that writes ``data`` on the lane connection, then nothing ever again."""

    async def feed() -> None:
        await write_lane(sock, data)
        await asyncio.Event().wait()  # until the daemon ends the push (grpc then ends this)

    return feed


def feed_trickle(sock: socket.socket, data: bytes, piece: int, every_s: float) -> Feed:
    """A feed that writes ``data`` a ``piece`` every ``every_s`` (each well inside the
    idle timeout), until the daemon closes the connection."""

    async def feed() -> None:
        for start in range(0, len(data), piece):
            if not await write_lane(sock, data[start : start + piece]):
                break
            await asyncio.sleep(every_s)  # the trickle's pace, not a wait for the daemon
        await asyncio.Event().wait()

    return feed


async def push_by_hand(lane: Lane, frames: list[bytes], feed: Feed | None = None) -> PushOutcome:
    """``frames`` in one PushSegments call over the member's gRPC channel, then ``feed()``
    (what the member writes on its lane once the header is on the wire)."""
    async with lane.tls.channel(lane.handle.address, []) as channel:
        return await push_on(channel, frames, feed)


async def push_on(
    channel: grpc.aio.Channel, frames: list[bytes], feed: Feed | None = None
) -> PushOutcome:
    """:func:`push_by_hand` over a channel the caller opened (and made ready) first: a
    lane connection dialled after it waits only for the frames, never for gRPC's own
    handshake, however loaded the machine (its idle limit is a few seconds here)."""

    async def requests() -> AsyncIterator[bytes]:
        for frame in frames:
            yield frame
        if feed is not None:
            await feed()

    rpc = channel.stream_unary(
        PUSH_SEGMENTS, request_serializer=None, response_deserializer=pb.PushReply.FromString
    )
    try:
        reply = await rpc(requests(), timeout=PUSH_TIMEOUT_S)
    except grpc.aio.AioRpcError as err:
        return PushOutcome(err.code(), (), err.details() or "")
    return PushOutcome(grpc.StatusCode.OK, tuple(a.result for a in reply.acks))


def push_sync(lane: Lane, frames: list[bytes]) -> PushOutcome:
    """``frames`` in one plaintext PushSegments call by :func:`tests.outsider.push_sync`."""
    assert lane.tls.insecure, "the sync helper speaks plaintext only"
    return outsider_push_sync(lane.handle.address, frames, PUSH_TIMEOUT_S)


def timed_push(
    lane: Lane, frames: list[bytes], feed: Feed | None = None
) -> tuple[PushOutcome, float]:
    """:func:`push_by_hand` and the seconds it took."""
    started = time.monotonic()
    outcome = asyncio.run(push_by_hand(lane, frames, feed))
    return outcome, time.monotonic() - started


def lane_push(lane: Lane, sock: socket.socket, token: bytes, weight: float) -> PushOutcome:
    """A whole honest push by hand on the lane connection ``sock`` (named by ``token``)."""
    frames, payload = bulk_frames(lane, next_sequence(), weight, seeded_values(11), token=token)
    return asyncio.run(push_by_hand(lane, frames, feed_bytes(sock, payload)))


async def pull_by_hand(
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


def recv_exactly(sock: socket.socket, nbytes: int) -> bytearray:
    data = bytearray(nbytes)
    view, got = memoryview(data), 0
    sock.settimeout(10.0)
    while got < nbytes:
        n = sock.recv_into(view[got:])
        assert n, f"the lane closed after {got} of {nbytes} bytes"
        got += n
    return data
