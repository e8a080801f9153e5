"""The client side of the wire: one gRPC channel per peer, pushes and pulls in chunks.

A push splits its segments over up to ``streams`` concurrent streams so several
segments are on the wire at once; each part repeats the push's sequence number,
and the receiver de-duplicates per (sequence, segment), so a retry of any part is
safe. The streams are long-lived ``Exchange`` calls kept per peer and reused push
after push (:mod:`gossipd.node.net.pushstreams`): a call per push cost as much CPU as the rest of a
small push, on both sides.

One call is one attempt. Its outcome is either known (acknowledged, or refused
by the receiver before it merged anything) or unknown (the connection broke, a
deadline passed, or nothing moved for ``progress_timeout_s``): an unknown
outcome raises :class:`OutcomeUnknown`, and the caller retries with the same
sequence instead of guessing.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from gossipd.node.errors import (
    Busy,
    GossipdError,
    InvalidFrame,
    MeshMismatch,
    PeerUnreachable,
    UnknownPeer,
)
from gossipd.node.net.bulk import BulkConn, BulkDialer, InOrder
from gossipd.node.net.pushstreams import COALESCE_BYTES, END_FRAME, StreamPool, batched
from gossipd.node.net.shaping import LinkShaper
from gossipd.node.net.wire import (
    DEFAULT_CHUNK_BYTES,
    Limits,
    SegmentAssembler,
    chunks,
    encoded_segment,
    pull_frame,
    push_chunk_frame,
)
from gossipd.node.shared.tls import Credentials, NotAllowed
from gossipd.node.trainer.codec import Codec
from gossipd.node.trainer.messages import Ack, OutboundPush, Pulled, ReceivedSegment
from gossipd.node.trainer.payload_bound import Gauge
from gossipd.node.trainer.segments import SegmentPlan
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb
from gossipd.proto import gossip_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 16 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.http2.bdp_probe", 1),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # A peer that was down at first contact must be reachable soon after it starts:
    # grpc's default reconnect backoff (1 s, growing to 120 s) fails RPCs fast meanwhile.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# A push part of at least this many model bytes goes on the bulk lane where the peer has
# one: below it, grpc's frames cost less than a lane round trip does.
BULK_MIN_BYTES = 1 << 20
BULK_RECHECK_S = 60.0  # a peer without a lane (or unreachable there) is asked again after this
BULK_READ_PIECE = 4 << 20  # a pulled payload read from the lane counts as progress per piece
BULK_DIAL_S = 5.0  # the most a lane's Handshake or connection set-up may take
# Statuses after which the receiver may or may not have merged the push. Every
# other status is an answer from the receiver's servicer, which refuses before it
# merges anything.
_UNKNOWN_OUTCOME = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
}
# What grpc says of a call it failed before any connection to the peer existed (the
# channel was in TRANSIENT_FAILURE: connection refused, no route): the push was never
# sent, so its outcome is known. A call cut on a live connection says otherwise.
_NEVER_CONNECTED = "failed to connect to all addresses"
_ERRORS: dict[grpc.StatusCode, type[GossipdError]] = {
    grpc.StatusCode.FAILED_PRECONDITION: MeshMismatch,
    grpc.StatusCode.UNAUTHENTICATED: UnknownPeer,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidFrame,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Busy,
    grpc.StatusCode.UNAVAILABLE: PeerUnreachable,
    grpc.StatusCode.DEADLINE_EXCEEDED: PeerUnreachable,
    grpc.StatusCode.CANCELLED: PeerUnreachable,
    grpc.StatusCode.PERMISSION_DENIED: NotAllowed,
}


class OutcomeUnknown(PeerUnreachable):
    """The push may or may not have been merged: retry it with the same sequence."""


class PartialPush(GossipdError):
    """Some streams of a push were acknowledged, others failed."""

    def __init__(self, acks: list[Ack], errors: list[GossipdError]) -> None:
        super().__init__(
            f"{len(acks)} segments acknowledged, {len(errors)} streams failed: "
            + "; ".join(str(e) for e in errors)
        )
        self.acks = acks
        self.errors = errors


@dataclass(frozen=True)
class Identity:
    """Who we are on the wire."""

    mesh_id: str
    node_id: str
    address: str
    incarnation: int
    fingerprint: str
    protocol: str

    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(node_id=self.node_id, address=self.address, incarnation=self.incarnation)


def remote_error(err: grpc.aio.AioRpcError, peer: str) -> GossipdError:
    """The peer's status as one of our errors, keeping its text."""
    cls = _ERRORS.get(err.code(), GossipdError)
    return cls(f"{peer}: {err.code().name}: {err.details()}")


class PeerClient:
    def __init__(
        self,
        address: str,
        identity: Identity,
        *,
        codec: Codec = Codec.RAW,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        streams: int = 4,
        tls: Credentials,
        expected: str | None = None,
        shaper: LinkShaper | None = None,
        bulk: bool = True,
    ) -> None:
        """``expected``: the node id the server's certificate must name (with TLS);
        None accepts any site of the mesh, whose claimed id the caller then proves.
        ``shaper``: the node's ``[link]`` shaping of pushes and pull requests (None: off).
        ``bulk``: use the peer's bulk lane for large payloads (the node's ``bulk``)."""
        self.address = address
        self.identity = identity
        self.codec = codec
        self.shaper = shaper
        self.chunk_bytes = shaper.chunk_bytes(chunk_bytes) if shaper else chunk_bytes
        self.streams = max(1, streams)
        self.expected = expected
        self.channel = tls.channel(address, CHANNEL_OPTIONS, expected)
        self.stub = pb_grpc.GossipStub(self.channel)
        # Push frames go out as the bytes _frames made, pulled chunks arrive as views of
        # what grpc received: chunks never take a protobuf round trip.
        service = pb.DESCRIPTOR.services_by_name["Gossip"].full_name
        self._streams = StreamPool(
            self.channel.stream_stream(
                f"/{service}/Exchange",
                request_serializer=None,
                response_deserializer=pb.PushReply.FromString,
            )
        )
        self._pull_model = self.channel.unary_stream(
            f"/{service}/PullModel",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=pull_frame,
        )
        self.tls = tls
        self.use_bulk = bulk
        self._bulk: BulkDialer | None = None
        self._bulk_asked_s = -BULK_RECHECK_S

    async def close(self) -> None:
        self._streams.close()
        if self._bulk is not None:
            self._bulk.close()
        await self.channel.close(grace=None)

    async def _bulk_conn(self, nbytes: int, timeout_s: float) -> BulkConn | None:
        """A connection to the peer's bulk lane for ``nbytes`` of payload, or None: the
        payload then goes in chunk frames (small, shaped, no lane, or the lane failed).

        The lane's port comes from the peer's Handshake, asked once (again after
        ``BULK_RECHECK_S`` when it had none or could not be reached).
        """
        if not self.use_bulk or self.shaper is not None or nbytes < BULK_MIN_BYTES:
            return None  # shaping paces chunk frames
        loop = asyncio.get_running_loop()
        if self._bulk is None:
            if loop.time() - self._bulk_asked_s < BULK_RECHECK_S:
                return None
            self._bulk_asked_s = loop.time()
            try:
                reply = await self.handshake(min(timeout_s, BULK_DIAL_S))
            except GossipdError:
                return None
            if not reply.bulk_port:
                return None
            host = self.address.rpartition(":")[0]
            self._bulk = BulkDialer(
                host,
                reply.bulk_port,
                self.tls,
                self.expected,
                2 * self.streams,
                sealed=reply.bulk_sealed,
            )
        try:
            return await self._bulk.take(min(timeout_s, BULK_DIAL_S))
        except GossipdError as err:
            log.info(
                "bulk lane of %s: %s; this push goes in gRPC frames, the lane is tried "
                "again in %.0f s",
                self.address,
                err,
                BULK_RECHECK_S,
            )
            self._bulk.close()
            self._bulk = None
            return None

    async def handshake(self, timeout_s: float) -> pb.HandshakeReply:
        request = pb.HandshakeRequest(
            schema_version=SCHEMA_VERSION,
            mesh_id=self.identity.mesh_id,
            node=self.identity.info(),
            fingerprint=self.identity.fingerprint,
            protocol=self.identity.protocol,
        )
        try:
            reply = await self.stub.Handshake(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise remote_error(err, self.address) from None
        return reply

    async def push(
        self,
        out: OutboundPush,
        timeout_s: float,
        progress_timeout_s: float | None = None,
        segments: list[int] | None = None,
    ) -> list[Ack]:
        """One attempt: stream the snapshot (or ``segments`` of it), return the acks.

        Raises :class:`OutcomeUnknown` when the receiver may have merged without us
        hearing of it, another :class:`GossipdError` when it refused. A hung peer
        with an open connection takes no chunk and sends no reply: after
        ``progress_timeout_s`` without either, the attempt ends.
        """
        progress_s = progress_timeout_s or timeout_s
        try:
            async with asyncio.timeout(progress_s) as watchdog:

                def progressed() -> None:
                    watchdog.reschedule(asyncio.get_running_loop().time() + progress_s)

                results = await self._push_once(
                    out,
                    sorted(out.push.weights) if segments is None else segments,
                    timeout_s,
                    progressed,
                )
        except TimeoutError:
            raise OutcomeUnknown(
                f"{self.address}: push #{out.push.sequence} made no progress for "
                f"{progress_s:.1f} s (gossip.progress_timeout_s)"
            ) from None
        acks = [
            Ack(a.segment, a.result == pb.SEGMENT_RESULT_DUPLICATE, a.receiver_weight)
            for r in results
            if isinstance(r, pb.PushReply)
            for a in r.acks
            if a.result in (pb.SEGMENT_RESULT_MERGED, pb.SEGMENT_RESULT_DUPLICATE)
        ]
        errors = [self._outcome(r) for r in results if not isinstance(r, pb.PushReply)]
        if not errors:
            return acks
        if acks:
            raise PartialPush(acks, errors)
        raise next((e for e in errors if isinstance(e, OutcomeUnknown)), errors[0])

    def _outcome(self, err: BaseException) -> GossipdError:
        """One stream's failure as what it tells us: unknown, or refused."""
        if isinstance(err, grpc.aio.AioRpcError):
            details = err.details() or ""
            if err.code() == grpc.StatusCode.UNAVAILABLE and _NEVER_CONNECTED in details:
                # grpc started the call on no connection: not a byte of it left here.
                return PeerUnreachable(f"{self.address}: nothing was sent: {details}")
            if err.code() in _UNKNOWN_OUTCOME:
                return OutcomeUnknown(f"{self.address}: {err.code().name}: {details}")
            return remote_error(err, self.address)
        if isinstance(err, GossipdError):
            return err
        if isinstance(err, asyncio.CancelledError):
            # grpc.aio ends a call whose channel was closed under it (a certificate
            # reload, a forgotten peer) this way: the receiver may have merged it.
            return OutcomeUnknown(f"{self.address}: the channel was closed mid-push")
        raise err

    async def _push_once(
        self,
        out: OutboundPush,
        segments: list[int],
        timeout_s: float,
        progressed: Callable[[], None],
    ) -> list[pb.PushReply | BaseException]:
        """Every stream's reply or failure: one stream failing must not hide what the
        others merged, nor leave them running unobserved."""
        groups = [segments[i :: self.streams] for i in range(min(self.streams, len(segments)))]

        async def one(group: list[int]) -> pb.PushReply:
            async with asyncio.timeout(timeout_s):
                return await self._on_stream(out, group, timeout_s, progressed)

        results = await asyncio.gather(*(one(g) for g in groups), return_exceptions=True)
        return [
            OutcomeUnknown(
                f"{self.address}: no reply within {timeout_s:g} s (gossip.push_timeout_s)"
            )
            if isinstance(r, TimeoutError)
            else r
            for r in results
        ]

    async def _on_stream(
        self,
        out: OutboundPush,
        group: list[int],
        timeout_s: float,
        progressed: Callable[[], None],
    ) -> pb.PushReply:
        """``group`` of the push on one of this peer's long-lived streams, and its reply.

        The frames are fed while the reply is awaited, so a receiver that refuses
        mid-push is heard at once (the read fails with its status). A stream goes
        back to the idle ones once answered; any failure drops it. A reused stream
        the receiver had ended OK had been idle there, so nothing of this push
        reached it: the attempt moves to a new stream at once.
        """
        small = self._small(out, group)
        for fresh in (False, True):
            lane = None
            if not small:
                nbytes = sum(out.snapshot[i].nbytes for i in group)
                lane = await self._bulk_conn(nbytes, timeout_s)
            stream = self._streams.take(fresh)
            frames = self._frames(out, group, timeout_s, lane, progressed)
            if small:
                frames = batched(frames)
            feeding = asyncio.ensure_future(self._feed(stream.queue, frames, progressed))
            reading = asyncio.ensure_future(stream.call.read())
            answered = False
            try:
                await asyncio.wait({feeding, reading}, return_when=asyncio.FIRST_COMPLETED)
                if not reading.done() and feeding.exception() is not None:
                    # Our side failed (the bulk lane broke): the receiver may be waiting
                    # for bytes that will never come.
                    raise OutcomeUnknown(
                        f"{self.address}: push #{out.push.sequence} failed while sending: "
                        f"{feeding.exception()}"
                    )
                reply = await reading
                if reply is grpc.aio.EOF:  # ended OK: idle at the receiver
                    if stream.reused and not fresh:
                        continue
                    raise OutcomeUnknown(
                        f"{self.address}: the receiver ended the stream without answering "
                        f"push #{out.push.sequence}"
                    )
                if not feeding.done():
                    raise InvalidFrame(
                        f"{self.address} answered push #{out.push.sequence} before all of "
                        "it was sent"
                    )
                progressed()
                answered = True
                return reply
            finally:
                feeding.cancel()
                reading.cancel()
                with contextlib.suppress(BaseException):
                    await feeding
                if answered:
                    self._streams.put_back(stream)
                else:
                    stream.drop()
                if lane is not None:
                    # A lane may hold bytes of a push that was not answered: never reused.
                    if answered and not lane.closed and self._bulk is not None:
                        self._bulk.put_back(lane)
                    else:
                        lane.abort()
        raise AssertionError("unreachable: the second pass takes a fresh stream")

    @staticmethod
    async def _feed(
        queue: asyncio.Queue[bytes | None],
        frames: AsyncIterator[bytes],
        progressed: Callable[[], None],
    ) -> None:
        """Hand ``frames`` to grpc one at a time; each taken frame is progress."""
        async for frame in frames:
            await queue.put(frame)  # returns once grpc took the one before
            progressed()

    def _small(self, out: OutboundPush, group: list[int]) -> bool:
        """Whether ``group`` of the push goes as one message (under ``COALESCE_BYTES``)."""
        if self.shaper is not None:
            return False  # shaping paces chunk by chunk
        return sum(out.snapshot[i].nbytes for i in group) <= COALESCE_BYTES

    async def _frames(
        self,
        out: OutboundPush,
        segments: list[int],
        timeout_s: float,
        lane: BulkConn | None = None,
        progressed: Callable[[], None] = lambda: None,
    ) -> AsyncIterator[bytes]:
        """Serialized PushFrames: open, then per segment a header and its chunks.

        With a bulk ``lane`` each header is marked ``bulk`` and its payload, instead
        of chunk frames, is written whole on the lane once the header is handed to
        grpc (each piece written counts as ``progressed``), in a worker while the next
        segment's checksum is computed; payloads go in header order.

        A chunk frame is encoded by hand, byte for byte what protobuf writes for
        ``PushFrame(chunk=data)`` (field tag, varint length, payload), straight from
        a view of the tensor: one copy instead of three (bytes, message, encoding).
        With ``[link]`` shaping the stream waits its latency once, before the open
        frame, and each chunk waits for its turn at the node's rate.
        """
        if self.shaper:
            await self.shaper.delay()
        yield pb.PushFrame(
            open=pb.PushOpen(
                mesh_id=self.identity.mesh_id,
                sender=self.identity.node_id,
                fingerprint=self.identity.fingerprint,
                sequence=out.push.sequence,
                segment_count=len(segments),
                incarnation=self.identity.incarnation,
                round=out.push.round,
                sequence_base=out.push.sequence_base,
                deadline_s=timeout_s,
                bulk_token=lane.token if lane is not None else b"",
            )
        ).SerializeToString()
        async with InOrder() as lane_writes:
            for index in segments:
                header, data = encoded_segment(
                    sender=self.identity.node_id,
                    sequence=out.push.sequence,
                    segment=index,
                    sum_weight=out.push.weights[index],
                    flat=out.snapshot[index],
                    codec=self.codec,
                    checksum=lane is None or lane.seal is None,  # sealed: the tags prove it
                )
                header.bulk = lane is not None
                yield pb.PushFrame(header=header).SerializeToString()
                if lane is not None and self._bulk is not None:
                    # A push not answered (this block left early) closes its lane: never reused.
                    send = functools.partial(self._bulk.send, lane, data, progressed)
                    await lane_writes.write(send)
                    continue
                for piece in chunks(data, self.chunk_bytes):
                    if self.shaper:
                        await self.shaper.pace(piece.nbytes)
                    yield push_chunk_frame(piece)
        yield END_FRAME

    async def pull(
        self,
        plan: SegmentPlan,
        limits: Limits,
        timeout_s: float,
        *,
        segments: list[int] | None = None,
        round: int = 0,
        progress_timeout_s: float | None = None,
        gauge: Callable[..., Gauge | None] | None = None,
    ) -> Pulled:
        """``segments`` of the peer's model (all by default), verified segment by segment
        (and gauged against ours with ``gauge``, see :class:`SegmentAssembler`).

        Like a push, a pull ends when nothing arrives for ``progress_timeout_s`` (a
        hung peer), and within ``timeout_s`` in all; segments that were not asked
        for, or missing ones, refuse the whole pull.
        """
        wanted = list(range(len(plan))) if segments is None else list(segments)
        request = pb.PullRequest(
            mesh_id=self.identity.mesh_id,
            requester=self.identity.node_id,
            fingerprint=self.identity.fingerprint,
            codec=int(self.codec),
            segments=[] if segments is None else wanted,
            round=round,
        )
        assembler = SegmentAssembler(plan, limits, gauge=gauge)
        pulled = Pulled()
        progress_s = progress_timeout_s or timeout_s
        if self.shaper:
            await self.shaper.delay()  # the request's one-way latency; the reply is the server's
        # The server refuses segments it does not have; the lane is sized for those it has.
        nbytes = sum(plan.segments[i].nbytes for i in wanted if 0 <= i < len(plan))
        lane = await self._bulk_conn(nbytes, timeout_s)
        if lane is not None and not self.tls.insecure and lane.seal is None:
            # A peer without sealed records: TLS bytes on one connection of Python's ssl
            # (a 16 KB record per read) moved 0.4 to 0.5 of what grpc's C core does for a
            # pull, which is one stream; pushes, split over several connections, still gain.
            assert self._bulk is not None
            self._bulk.put_back(lane)
            lane = None
        if lane is not None:
            request.bulk_token = lane.token
        done = False
        checks: list[asyncio.Future[ReceivedSegment]] = []  # bulk segments' checks, running

        def take(seg: ReceivedSegment) -> None:
            if seg.segment not in wanted:
                raise InvalidFrame(
                    f"{self.address} sent segment {seg.segment}, which was not asked for"
                )
            pulled.values[seg.segment] = seg.values
            pulled.weights[seg.segment] = seg.sum_weight
            if seg.gauge is not None:
                pulled.gauges[seg.segment] = seg.gauge
            pulled.nbytes += seg.values.numel() * seg.values.element_size()

        try:
            async with asyncio.timeout(progress_s) as watchdog:

                def progressed() -> None:
                    watchdog.reschedule(asyncio.get_running_loop().time() + progress_s)

                async for frame in self._pull_model(request, timeout=timeout_s):
                    progressed()
                    if isinstance(frame, memoryview):
                        seg = assembler.chunk(frame)
                    elif (kind := frame.WhichOneof("kind")) == "header":
                        seg = assembler.header(frame.header)
                        if frame.header.bulk and (
                            check := await self._pulled_payload(assembler, lane, progressed)
                        ):
                            checks.append(check)
                    elif kind == "chunk":  # a chunk framed unlike ours (extra fields)
                        seg = assembler.chunk(frame.chunk)
                    else:
                        raise InvalidFrame(f"{self.address} sent an empty PullFrame")
                    if seg is not None:
                        take(seg)
                for seg in await asyncio.gather(*checks):
                    take(seg)
            done = True
        except TimeoutError:
            raise GossipdError(
                f"{self.address}: pull made no progress for {progress_s:.1f} s "
                "(gossip.progress_timeout_s)"
            ) from None
        except grpc.aio.AioRpcError as err:
            raise remote_error(err, self.address) from None
        finally:
            for check in checks:
                check.cancel()  # a failed pull's checks: their results are not wanted
            if lane is not None:
                if done and not lane.closed and self._bulk is not None:
                    self._bulk.put_back(lane)
                else:
                    lane.abort()
        assembler.close()
        if sorted(pulled.values) != sorted(wanted):
            raise InvalidFrame(
                f"{self.address} sent {len(pulled.values)} of {len(wanted)} segments in PullModel"
            )
        return pulled

    async def _pulled_payload(
        self,
        assembler: SegmentAssembler,
        lane: BulkConn | None,
        progressed: Callable[[], None],
    ) -> asyncio.Future[ReceivedSegment] | None:
        """The payload of a pulled header marked bulk, read from our lane connection
        straight into the segment's buffer, a piece at a time (each piece is progress);
        its checks then run in a worker thread while the pull reads on (None: no payload)."""
        if lane is None or self._bulk is None:
            raise InvalidFrame(f"{self.address} marked a pulled segment bulk; we named no lane")
        view = assembler.unfilled()
        if not len(view):
            return None
        for start in range(0, len(view), BULK_READ_PIECE):
            await self._bulk.read(lane, view[start : start + BULK_READ_PIECE])
            progressed()
        check = assembler.filled(len(view), sealed=lane.seal is not None)
        assert check is not None, "a filled segment is complete"
        return self._bulk.verify(check)

    async def leave(self, timeout_s: float) -> None:
        request = pb.LeaveRequest(
            mesh_id=self.identity.mesh_id,
            node_id=self.identity.node_id,
            incarnation=self.identity.incarnation,
        )
        try:
            await self.stub.Leave(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise remote_error(err, self.address) from None

    async def peers(self, known: list[pb.NodeInfo], timeout_s: float) -> list[pb.NodeInfo]:
        request = pb.PeersRequest(
            mesh_id=self.identity.mesh_id, sender=self.identity.info(), known=known
        )
        try:
            reply = await self.stub.Peers(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise remote_error(err, self.address) from None
        return list(reply.peers)
