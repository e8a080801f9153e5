"""One push attempt to one peer: its segments split over the peer's long-lived streams,
each part's frames made and fed while its reply is awaited.

A push splits its segments over up to ``streams`` concurrent streams so several
segments are on the wire at once; each part repeats the push's sequence number,
and the receiver de-duplicates per (sequence, segment), so a retry of any part is
safe. The streams are long-lived ``Exchange`` calls kept per peer and reused push
after push (:mod:`gossipd.node.net.dial.streams`): a call per push cost as much CPU as the rest of a
small push, on both sides.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable

from gossipd.node.compression.codecs import Codec
from gossipd.node.compression.feedback import FeedbackSender
from gossipd.node.errors import InvalidFrame
from gossipd.node.net.bulk.connection import BulkConn, InOrder
from gossipd.node.net.bulk.dialer import PeerLane
from gossipd.node.net.dial.streams import COALESCE_BYTES, END_FRAME, Stream, StreamPool, batched
from gossipd.node.net.wire.frames import chunks, encoded_segment, push_chunk_frame
from gossipd.node.net.wire.identity import Identity
from gossipd.node.net.wire.outcomes import OutcomeUnknown
from gossipd.node.net.wire.shaping import LinkShaper
from gossipd.node.trainer.messages import OutboundPush
from gossipd.proto import gossip_pb2 as pb


class PushSender:
    """A peer client's pushes: each part on one of the peer's streams, its payloads in
    chunk frames or, where the peer has a lane, whole on a lane connection."""

    def __init__(
        self,
        address: str,
        identity: Identity,
        *,
        codec: Codec,
        chunk_bytes: int,
        streams: int,
        feedback: FeedbackSender | None = None,
        shaper: LinkShaper | None,
        pool: StreamPool,
        peer_lane: PeerLane,
    ) -> None:
        """``streams``: how many parts a push is split into at most; ``pool``: the peer's
        long-lived streams; ``peer_lane``: the peer's bulk lane, shared with the client's pulls;
        ``feedback``: the node's copies for error feedback (None: each segment sent whole)."""
        self.address = address
        self.feedback = feedback
        self.identity = identity
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self.streams = streams
        self.shaper = shaper
        self.pool = pool
        self.peer_lane = peer_lane

    async def send(
        self,
        out: OutboundPush,
        segments: list[int],
        timeout_s: float,
        progressed: Callable[[], None],
        addressed_to: int = 0,
    ) -> list[pb.PushReply | BaseException]:
        """Every stream's reply or failure: one stream failing must not hide what the
        others merged, nor leave them running unobserved. ``addressed_to``: the
        receiver's incarnation this node verified (0: any)."""
        groups = [segments[i :: self.streams] for i in range(min(self.streams, len(segments)))]
        if out.closes:
            groups = [[]]  # a settle: its open frame alone

        async def one(group: list[int]) -> pb.PushReply:
            async with asyncio.timeout(timeout_s):
                return await self._on_stream(out, group, timeout_s, progressed, addressed_to)

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
        addressed_to: int,
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
            reply = await self._on_one_stream(
                out, group, timeout_s, progressed, addressed_to, small=small, fresh=fresh
            )
            if reply is not None:
                return reply
        raise AssertionError("unreachable: the second pass takes a fresh stream")

    async def _on_one_stream(
        self,
        out: OutboundPush,
        group: list[int],
        timeout_s: float,
        progressed: Callable[[], None],
        addressed_to: int,
        *,
        small: bool,
        fresh: bool,
    ) -> pb.PushReply | None:
        """One pass of :meth:`_on_stream`: the reply, or None when a reused stream turned
        out to have been ended at the receiver (then nothing of this push reached it)."""
        lane = None
        if not small:
            nbytes = sum(out.snapshot[i].nbytes for i in group)
            lane = await self.peer_lane.conn(nbytes, timeout_s)
        stream = self.pool.take(fresh)
        frames = self.frames(out, group, timeout_s, lane, progressed, addressed_to)
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
            if not isinstance(reply, pb.PushReply):  # grpc.aio.EOF: ended OK, idle there
                if stream.reused and not fresh:
                    return None
                raise OutcomeUnknown(
                    f"{self.address}: the receiver ended the stream without answering "
                    f"push #{out.push.sequence}"
                )
            if not feeding.done():
                raise InvalidFrame(
                    f"{self.address} answered push #{out.push.sequence} before all of it was sent"
                )
            progressed()
            answered = True
            return reply
        finally:
            feeding.cancel()
            reading.cancel()
            with contextlib.suppress(BaseException):
                await feeding
            self._settle(stream, lane, answered)

    def _settle(self, stream: Stream, lane: BulkConn | None, answered: bool) -> None:
        """An answered part's stream (and lane connection) go back to the idle ones; any
        other is dropped."""
        if answered:
            self.pool.put_back(stream)
        else:
            stream.drop()
        if lane is not None:
            # A lane may hold bytes of a push that was not answered: never reused.
            if answered and not lane.closed and self.peer_lane.dialer is not None:
                self.peer_lane.dialer.put_back(lane)
            else:
                lane.abort()

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
        if self.shaper is not None and self.shaper.rate_bytes_s:
            return False  # a capped rate paces chunk by chunk; latency alone waits once
        return sum(out.snapshot[i].nbytes for i in group) <= COALESCE_BYTES

    async def frames(
        self,
        out: OutboundPush,
        segments: list[int],
        timeout_s: float,
        lane: BulkConn | None = None,
        progressed: Callable[[], None] = lambda: None,
        addressed_to: int = 0,
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
        yield self._open_frame(out, len(segments), timeout_s, lane, addressed_to)
        async with InOrder() as lane_writes:
            for index in segments:
                sent = None
                if self.feedback is not None and not out.exact:
                    sent = self.feedback.encode(
                        out.push.peer, index, out.snapshot[index], out.push.sequence
                    )
                header, data = encoded_segment(
                    sender=self.identity.node_id,
                    sequence=out.push.sequence,
                    segment=index,
                    sum_weight=out.push.weights[index],
                    flat=out.snapshot[index],
                    codec=Codec.RAW if out.exact else self.codec,
                    checksum=lane is None or lane.seal is None,  # sealed: the tags prove it
                    sent=sent,
                )
                header.bulk = lane is not None
                yield pb.PushFrame(header=header).SerializeToString()
                if lane is not None and self.peer_lane.dialer is not None:
                    # A push not answered (this block left early) closes its lane: never reused.
                    send = functools.partial(self.peer_lane.dialer.send, lane, data, progressed)
                    await lane_writes.write(send)
                    continue
                for piece in chunks(data, self.chunk_bytes):
                    if self.shaper:
                        await self.shaper.pace(piece.nbytes)
                    yield push_chunk_frame(piece)
        yield END_FRAME

    def _open_frame(
        self,
        out: OutboundPush,
        segment_count: int,
        timeout_s: float,
        lane: BulkConn | None,
        addressed_to: int,
    ) -> bytes:
        """The push's first frame: who sends it, to which incarnation, what it carries."""
        return pb.PushFrame(
            open=pb.PushOpen(
                mesh_id=self.identity.mesh_id,
                sender=self.identity.node_id,
                fingerprint=self.identity.fingerprint,
                sequence=out.push.sequence,
                segment_count=segment_count,
                incarnation=self.identity.incarnation,
                round=out.push.round,
                sequence_base=out.push.sequence_base,
                deadline_s=timeout_s,
                bulk_token=lane.token if lane is not None else b"",
                receiver_incarnation=addressed_to,
                settled=out.push.settled,
                closes=out.closes,
            )
        ).SerializeToString()
