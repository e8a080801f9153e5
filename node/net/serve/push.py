"""A push received by the servicer: admitted against the caps in ``limits`` (see
:mod:`..limits.admission`), its open frame checked, its segments assembled from chunk frames or
read whole from the sender's bulk-lane connection, then handed to the node to merge.

A silent, trickling or overlong push is ended with DEADLINE_EXCEEDED
(:class:`StreamIdle`, :class:`PushTooSlow`, :class:`PushTooLong`, counted).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from gossipd.node.errors import InvalidFrame
from gossipd.node.model.segments import SegmentPlan, check_fingerprint
from gossipd.node.net.limits.admission import (
    ByteBudget,
    IdleBounded,
    PeerSlots,
    Slots,
    push_deadline_s,
)
from gossipd.node.net.wire.assembly import SegmentAssembler
from gossipd.node.net.wire.intake import Malformed, PushFrameIn, check_mesh, frame_size, require
from gossipd.node.shared.tls import check_claim
from gossipd.node.trainer.messages import ReceivedSegment
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipd.node.net.bulk.connection import BulkConn
    from gossipd.node.net.serve.servicer import Handlers


class PushReceiver:
    """Inbound pushes, from ``PushSegments`` calls and ``Exchange`` streams alike."""

    def __init__(self, node: Handlers, plan: SegmentPlan) -> None:
        """Raises ConfigError if ``limits.max_pending_bytes`` could never hold a segment of
        ``plan``, or ``limits.max_push_s`` could not fit a push of one at the minimum rate."""
        limits = node.config.limits
        self.node = node
        self.idle_s = limits.stream_idle_timeout_s
        self.pushes = Slots(
            limits.max_inbound_pushes, "inbound push streams", "limits.max_inbound_pushes"
        )
        self.peer_pushes = PeerSlots(
            limits.max_inbound_pushes_per_peer,
            "inbound push streams",
            "limits.max_inbound_pushes_per_peer",
        )
        self.min_push_rate = limits.min_push_rate_bytes_s
        self.pending = ByteBudget(limits.max_pending_bytes, "limits.max_pending_bytes")
        self.pending.check_fits(plan, differences=node.config.gossip.error_feedback)
        self.push_deadline_s = push_deadline_s(node.config, plan)

    def admit(self, who: str | None) -> contextlib.ExitStack:
        """The slots a push takes before its first frame is read (:class:`TooManyStreams` or
        :class:`Busy` if there is none), to hand to :meth:`receive`.

        A peer's own cap first: over it, a stream never touches the shared one. In
        plaintext nobody is known before the open frame names its sender (``who`` None).
        """
        slots = contextlib.ExitStack()
        try:
            if who is not None:
                slots.enter_context(self.peer_pushes.take(who))
            slots.enter_context(self.pushes.take())
        except BaseException:
            slots.close()
            raise
        return slots

    async def receive(
        self,
        who: str | None,
        slots: contextlib.ExitStack,
        request_frames: AsyncIterator[PushFrameIn],
        deadline_s: float | None,
    ) -> pb.PushReply:
        """Receive one push within the caps; what it reserved is released however it ends.

        ``who``: the node id of the peer's certificate (None in plaintext); ``slots``:
        what :meth:`admit` took for it; ``request_frames``: this push's frames, open
        first; ``deadline_s``: how long the sender still waits for the reply (None: no
        deadline). Completed segments stay charged to ``limits.max_pending_bytes``
        until the merge has answered, since until then their buffers are alive.
        """
        with slots:
            held = slots.enter_context(self.pending.hold())
            frames = IdleBounded(
                request_frames,
                self.idle_s,
                "limits.stream_idle_timeout_s",
                min_rate=self.min_push_rate,
                rate_key="limits.min_push_rate_bytes_s",
                size=frame_size,
                deadline_s=self.push_deadline_s,
                deadline_key="limits.max_push_s",
            )
            opened = await self._open(who, frames, slots)
            assembler = self.node.new_assembler()
            assembler.reserve = held.reserve
            lane = await self._lane(who, opened, slots)
            segments = await self._receive(opened, frames, assembler, lane)
            return await self.node.on_push(opened, segments, deadline_s)

    async def _open(
        self, who: str | None, frames: IdleBounded[PushFrameIn], slots: contextlib.ExitStack
    ) -> pb.PushOpen:
        """The push's open frame, checked: its sender is who it claims, within its own cap
        (taken into ``slots`` here in plaintext), of this mesh and model, not a stale
        incarnation, and its sequence range makes sense."""
        frame = await anext(frames, Malformed("PushFrame", 0, "empty stream"))
        first = None if isinstance(frame, memoryview) else require(frame)
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidFrame("a push stream must start with a PushOpen frame")
        opened = first.open
        check_claim(who, opened.sender, "a push")
        if who is None:
            slots.enter_context(self.peer_pushes.take(opened.sender))
        check_mesh(self.node.mesh_id, opened.mesh_id, f"sender {opened.sender!r}")
        check_fingerprint(self.node.fingerprint, opened.fingerprint, f"{opened.sender!r}")
        self.node.check_sender(opened.sender, opened.incarnation)
        self.node.check_addressed(opened.sender, opened.sequence, opened.receiver_incarnation)
        if not 1 <= opened.sequence_base <= opened.sequence:
            raise InvalidFrame(
                f"push {opened.sender!r}#{opened.sequence} names sequence_base "
                f"{opened.sequence_base}; it must be in 1..{opened.sequence}"
            )
        if opened.closes and (opened.segment_count or opened.settled != opened.sequence):
            raise InvalidFrame(
                f"settle {opened.sender!r}#{opened.sequence} carries {opened.segment_count} "
                f"segments and settles up to {opened.settled}: a settle carries none, and "
                "settles up to its own sequence"
            )
        if not opened.closes and opened.settled >= opened.sequence:
            raise InvalidFrame(
                f"push {opened.sender!r}#{opened.sequence} says it settled up to "
                f"{opened.settled}: only pushes before it can have settled"
            )
        return opened

    async def _lane(
        self, who: str | None, opened: pb.PushOpen, slots: contextlib.ExitStack
    ) -> BulkConn | None:
        """The bulk-lane connection the push names, claimed into ``slots`` (None: none)."""
        if not opened.bulk_token:
            return None
        if self.node.bulk is None:
            raise InvalidFrame(
                f"push {opened.sender!r}#{opened.sequence} names a bulk-lane connection "
                "but this node has no bulk lane (bulk = false)"
            )
        return slots.enter_context(
            await self.node.bulk.claim(opened.bulk_token, who or opened.sender)
        )

    async def _receive(
        self,
        opened: pb.PushOpen,
        frames: IdleBounded[PushFrameIn],
        assembler: SegmentAssembler,
        lane: BulkConn | None,
    ) -> list[ReceivedSegment]:
        segments: list[ReceivedSegment] = []
        checks: list[asyncio.Future[ReceivedSegment]] = []  # bulk segments' checks, running
        try:
            async for message in frames:
                if isinstance(message, memoryview):
                    done = assembler.chunk(message)
                    if done is not None:
                        segments.append(done)
                    continue
                frame = require(message)
                kind = frame.WhichOneof("kind")
                if kind == "header":
                    if frame.header.sequence != opened.sequence or frame.header.sender != (
                        opened.sender
                    ):
                        raise InvalidFrame(
                            f"header says {frame.header.sender!r}#{frame.header.sequence} "
                            f"inside push {opened.sender!r}#{opened.sequence}"
                        )
                    done = assembler.header(frame.header)
                    if frame.header.bulk and (check := await self._bulk(frames, assembler, lane)):
                        checks.append(check)
                elif kind == "chunk":
                    done = assembler.chunk(frame.chunk)
                else:
                    raise InvalidFrame(f"unexpected {kind or 'empty'} frame inside a push stream")
                if done is not None:
                    segments.append(done)
            assembler.close()
            segments += await asyncio.gather(*checks)
        finally:
            for check in checks:
                check.cancel()  # a refused push's checks: their results are not wanted
        if len(segments) != opened.segment_count:
            raise InvalidFrame(
                f"push announced {opened.segment_count} segments but carried {len(segments)}"
            )
        return segments

    async def _bulk(
        self, frames: IdleBounded[PushFrameIn], assembler: SegmentAssembler, lane: BulkConn | None
    ) -> asyncio.Future[ReceivedSegment] | None:
        """The payload of the header just taken, read from the push's bulk-lane connection
        straight into the segment's buffer (within the stream's rate and deadline); its
        checks then run in a worker thread while the stream reads on (None: no payload)."""
        if lane is None or self.node.bulk is None:
            raise InvalidFrame("a header marked bulk in a push that names no bulk-lane connection")
        view = assembler.unfilled()
        if not len(view):
            return None
        await frames.wait(self.node.bulk.read(lane, view), len(view))
        check = assembler.filled(len(view), sealed=lane.seal is not None)
        assert check is not None, "a filled segment is complete"
        return self.node.bulk.verify(check)
