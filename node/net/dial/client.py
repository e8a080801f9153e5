"""The client side of the wire: one gRPC channel per peer, pushes and pulls in chunks.

A push splits its segments over up to ``streams`` concurrent streams so several
segments are on the wire at once; each part repeats the push's sequence number,
and the receiver de-duplicates per (sequence, segment), so a retry of any part is
safe. The streams are long-lived ``Exchange`` calls kept per peer and reused push
after push (:mod:`gossipd.node.net.dial.streams`): a call per push cost as much CPU as the rest of a
small push, on both sides.

One call is one attempt. Its outcome is either known (acknowledged, or refused
by the receiver before it merged anything) or unknown (the connection broke, a
deadline passed, or nothing moved for ``progress_timeout_s``): an unknown
outcome raises :class:`OutcomeUnknown`, and the caller retries with the same
sequence instead of guessing.

The parts: :mod:`~gossipd.node.net.dial.push` (a push's parts on the peer's streams),
:mod:`~gossipd.node.net.dial.pull` (a pull, verified as it arrives),
:class:`~gossipd.node.net.bulk.dialer.PeerLane` (the peer's bulk lane, which both share)
and :mod:`~gossipd.node.net.wire.outcomes` (what a failed call tells us).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

import grpc

from gossipd.node.compression.codecs import Codec
from gossipd.node.compression.feedback import FeedbackSender
from gossipd.node.model.payload_bound import Gauge
from gossipd.node.model.segments import SegmentPlan
from gossipd.node.net.bulk.connection import BulkConn
from gossipd.node.net.bulk.dialer import BulkDialer, PeerLane
from gossipd.node.net.dial.pull import PullReader
from gossipd.node.net.dial.push import PushSender
from gossipd.node.net.dial.streams import StreamPool
from gossipd.node.net.wire.assembly import Limits
from gossipd.node.net.wire.calls import gossip_calls
from gossipd.node.net.wire.frames import DEFAULT_CHUNK_BYTES, pull_frame
from gossipd.node.net.wire.grpc_options import CHANNEL_OPTIONS, RELAYED_CHANNEL_OPTIONS
from gossipd.node.net.wire.identity import Identity
from gossipd.node.net.wire.lastwords import to_messages
from gossipd.node.net.wire.outcomes import OutcomeUnknown, PartialPush, remote_error, stream_failure
from gossipd.node.net.wire.shaping import LinkShaper
from gossipd.node.protocols.base import Receipts
from gossipd.node.shared.relay_address import is_relayed
from gossipd.node.shared.tls import Credentials
from gossipd.node.trainer.messages import Ack, OutboundPush, Pulled
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb

__all__ = [
    "BULK_MIN_BYTES",
    "CHANNEL_OPTIONS",
    "Identity",
    "OutcomeUnknown",
    "PartialPush",
    "PeerClient",
    "remote_error",
]

# A push part of at least this many model bytes goes on the bulk lane where the peer has
# one: below it, grpc's frames cost less than a lane round trip does.
BULK_MIN_BYTES = 1 << 20


def _model_calls(
    channel: grpc.aio.Channel,
) -> tuple[
    grpc.aio.StreamStreamMultiCallable[bytes, pb.PushReply],
    grpc.aio.UnaryStreamMultiCallable[pb.PullRequest, pb.PullFrame | memoryview],
]:
    """The channel's ``Exchange`` and ``PullModel`` calls. Push frames go out as the bytes
    :meth:`PushSender.frames` made, pulled chunks arrive as views of what grpc received:
    chunks never take a protobuf round trip."""
    service = pb.DESCRIPTOR.services_by_name["Gossip"].full_name
    exchange: grpc.aio.StreamStreamMultiCallable[bytes, pb.PushReply] = channel.stream_stream(
        f"/{service}/Exchange",
        request_serializer=None,
        response_deserializer=pb.PushReply.FromString,
    )
    pull_model: grpc.aio.UnaryStreamMultiCallable[pb.PullRequest, pb.PullFrame | memoryview] = (
        channel.unary_stream(
            f"/{service}/PullModel",
            request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=pull_frame,
        )
    )
    return exchange, pull_model


class PeerClient:
    def __init__(
        self,
        address: str,
        identity: Identity,
        *,
        codec: Codec = Codec.RAW,
        feedback: FeedbackSender | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        streams: int = 4,
        tls: Credentials,
        expected: str | None = None,
        shaper: LinkShaper | None = None,
        bulk: bool = True,
        target: str | None = None,
    ) -> None:
        """``expected``: the node id the server's certificate must name (with TLS); None
        accepts any site of the mesh, whose claimed id the caller then proves. ``shaper``:
        the ``[link]`` shaping (None: off); ``bulk``: use the peer's bulk lane for large
        payloads; ``target``: what the channel dials if not ``address`` (a relay route)."""
        self.address, self.identity = address, identity
        self.codec, self.shaper = codec, shaper
        self.chunk_bytes = shaper.chunk_bytes(chunk_bytes) if shaper else chunk_bytes
        self.streams = max(1, streams)
        self.expected = expected
        options = RELAYED_CHANNEL_OPTIONS if is_relayed(address) else CHANNEL_OPTIONS
        self.channel = tls.channel(target or address, options, expected)
        self.stub, self.tls = gossip_calls(self.channel), tls
        self.use_bulk = bulk
        exchange, pull_model = _model_calls(self.channel)
        self._streams = StreamPool(exchange)
        self._lane = PeerLane(
            address,
            tls,
            expected,
            2 * self.streams,
            enabled=bulk and shaper is None,
            min_bytes=BULK_MIN_BYTES,
            handshake=self.handshake,
        )
        self._pushes = PushSender(
            address,
            identity,
            codec=codec,
            feedback=feedback,
            chunk_bytes=self.chunk_bytes,
            streams=self.streams,
            shaper=shaper,
            pool=self._streams,
            peer_lane=self._lane,
        )
        self._pulls = PullReader(
            address,
            identity,
            codec=codec,
            shaper=shaper,
            tls=tls,
            pull_model=pull_model,
            peer_lane=self._lane,
        )

    @property
    def _bulk(self) -> BulkDialer | None:
        """The dialer of the peer's bulk lane (None: not asked yet, the peer has none, or
        it failed); the tests read and set it."""
        return self._lane.dialer

    @_bulk.setter
    def _bulk(self, dialer: BulkDialer | None) -> None:
        self._lane.dialer = dialer

    async def close(self, grace_s: float | None = None) -> None:
        """Close the channel: at once, or once its calls finished (at most ``grace_s``)."""
        self._streams.close()
        self._lane.close()
        await self.channel.close(grace=grace_s)

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
        addressed_to: int = 0,
    ) -> list[Ack]:
        """One attempt: stream the snapshot (or ``segments`` of it), return the acks.
        ``addressed_to``: the receiver's incarnation this node verified; another one
        refuses the push (0: any).

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

                results = await self._pushes.send(
                    out,
                    sorted(out.push.weights) if segments is None else segments,
                    timeout_s,
                    progressed,
                    addressed_to,
                )
        except TimeoutError:
            raise OutcomeUnknown(
                f"{self.address}: push #{out.push.sequence} made no progress for "
                f"{progress_s:.1f} s (gossip.progress_timeout_s)"
            ) from None
        acks = [
            Ack(a.segment, a.result == pb.SEGMENT_RESULT_DUPLICATE, a.receiver_weight, a.kept)
            for r in results
            if isinstance(r, pb.PushReply)
            for a in r.acks
            if a.result in (pb.SEGMENT_RESULT_MERGED, pb.SEGMENT_RESULT_DUPLICATE)
        ]
        errors = [
            stream_failure(r, self.address) for r in results if not isinstance(r, pb.PushReply)
        ]
        if not errors:
            return acks
        if acks:
            raise PartialPush(acks, errors)
        raise next((e for e in errors if isinstance(e, OutcomeUnknown)), errors[0])

    def _frames(
        self,
        out: OutboundPush,
        segments: list[int],
        timeout_s: float,
        lane: BulkConn | None = None,
        progressed: Callable[[], None] = lambda: None,
    ) -> AsyncIterator[bytes]:
        """The push's serialized frames (:meth:`PushSender.frames`)."""
        return self._pushes.frames(out, segments, timeout_s, lane, progressed)

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
        return await self._pulls.pull(
            plan,
            limits,
            timeout_s,
            segments=segments,
            round=round,
            progress_timeout_s=progress_timeout_s,
            gauge=gauge,
        )

    async def leave(self, timeout_s: float, merged: Iterable[Receipts] = ()) -> None:
        """Say goodbye, with what this node merged of the peer's own pushes."""
        request = pb.LeaveRequest(
            mesh_id=self.identity.mesh_id,
            node_id=self.identity.node_id,
            incarnation=self.identity.incarnation,
            merged=to_messages(merged),
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
