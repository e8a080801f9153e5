"""Inbound model traffic: a push merged by the trainer and acknowledged, a pull served.

The servicer validates and assembles the frames; this part hands a whole push to the
replica's bounded inbox, waits (bounded) for the trainer's step boundary to merge it,
and turns the replica's acknowledgements into the reply; and it streams a snapshot
of the requested segments to a puller. It writes no parameter: the trainer merges,
and snapshots are taken under the replica's lock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Protocol

from gossipd.node.compression.codecs import Codec
from gossipd.node.compression.feedback import FeedbackReceiver
from gossipd.node.errors import Busy, InvalidFrame, UnknownPeer
from gossipd.node.net.peers.health import PeerHealth
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.net.wire.assembly import Limits, SegmentAssembler
from gossipd.node.net.wire.frames import segment_frames
from gossipd.node.net.wire.shaping import LinkShaper
from gossipd.node.protocols.base import SettleArrived
from gossipd.node.trainer.messages import InboundPush, ReceivedSegment, ReplicaLink
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    import torch


class Departure(Protocol):
    """Whether this node is leaving the mesh (its outbound side knows)."""

    @property
    def leaving(self) -> bool: ...


class Inbound:
    def __init__(
        self,
        *,
        node_id: str,
        incarnation: int,
        limits: Limits,
        chunk_bytes: int,
        merge_wait_s: float,
        replica: ReplicaLink,
        metrics: NodeMetrics,
        codec: Codec,
        feedback: FeedbackReceiver | None = None,
        health: PeerHealth,
        departure: Departure,
        shaper: LinkShaper | None = None,
        serves_one_pull: bool = False,
    ) -> None:
        """``incarnation``: this node's, which a push must be addressed to; ``limits``: what
        an assembled segment may hold; ``health`` checks that a sender is a verified peer
        and hears that it answered;
        ``departure`` says whether this node is leaving the mesh; ``shaper`` is the node's
        ``[link]`` shaping of what it sends (None: off); ``serves_one_pull``: the protocol
        serves one pull at a time (its core says so)."""
        self.node_id = node_id
        self.incarnation = incarnation
        self.limits = limits
        self.chunk_bytes = chunk_bytes
        self.merge_wait_s = merge_wait_s
        self.replica = replica
        self.metrics = metrics
        self.codec = codec
        self.feedback = feedback
        self.health = health
        self.departure = departure
        self.shaper = shaper
        self.serves_one_pull = serves_one_pull
        self.serving_pull: str | None = None  # whom a one-pull-at-a-time protocol serves

    def new_assembler(self) -> SegmentAssembler:
        """A push's assembler; it gauges each segment against our own as it arrives."""
        return SegmentAssembler(
            self.replica.flat.plan, self.limits, gauge=self.replica.gauge, feedback=self.feedback
        )

    def check_addressed(self, sender: str, sequence: int, incarnation: int) -> None:
        """Refuse a push addressed to another incarnation of this node (0: to any)."""
        if incarnation not in (0, self.incarnation):
            raise UnknownPeer(
                f"push {sender!r}#{sequence} is addressed to incarnation {incarnation} of "
                f"{self.node_id}, which restarted as {self.incarnation}: the sender must verify "
                "this incarnation first (usual for a moment after a restart; the push is retried)"
            )

    async def _settled(self, open_: pb.PushOpen) -> pb.PushReply:
        """A settle: forgotten at once, off the loop, never queued behind pushes."""
        settled = SettleArrived(
            open_.sender, open_.incarnation, open_.sequence_base, open_.sequence
        )
        await asyncio.to_thread(self.replica.forget_settled, settled)
        return pb.PushReply()

    async def on_push(
        self, open_: pb.PushOpen, segments: list[ReceivedSegment], deadline_s: float | None
    ) -> pb.PushReply:
        self.health.check_sender(open_.sender, open_.incarnation)
        if open_.closes:
            return await self._settled(open_)
        # A leaving node merges nothing new (its weight is being handed off), but it still
        # answers DUPLICATE for what it merged: that answer lets a sender whose acknowledgement
        # was lost commit exactly instead of folding back weight this node already passed on.
        # The rest it leaves unacknowledged; never merged, the sender folds them back exactly.
        item = InboundPush(
            open_.sender,
            open_.incarnation,
            open_.sequence,
            segments,
            open_.round,
            merge_new=not self.departure.leaving,
            sequence_base=open_.sequence_base,
            settled=open_.settled,
        )
        nbytes = sum(s.values.numel() * s.values.element_size() for s in segments)
        self.replica.inbox.put(item)
        # Answer Busy well before the sender's own deadline: a refusal is a known
        # outcome it can settle at once, a timeout an unknown one it must retry.
        wait_s = self.merge_wait_s
        if deadline_s is not None:
            wait_s = min(wait_s, deadline_s * 0.8)
        future = asyncio.wrap_future(item.reply)
        try:
            acks = await asyncio.wait_for(asyncio.shield(future), max(0.1, wait_s))
        except asyncio.CancelledError:
            # The sender is gone (deadline, cancel): don't merge what nobody will hear
            # of unless the trainer already started; a retry merges it then.
            item.reply.cancel()
            raise
        except TimeoutError:
            if item.reply.cancel():
                raise Busy(
                    f"trainer did not reach a step boundary within {wait_s:.1f} s "
                    "(limits.merge_wait_s); the push was not merged, retry later"
                ) from None
            acks = await future
        result = "ok" if item.merge_new else "leaving"  # leaving: acknowledged, not merged
        self.metrics.messages.labels("received", "push", result).inc()
        self.metrics.bytes.labels("received", "push", result).inc(nbytes)
        self.health.succeeded(open_.sender)
        versions = {s.segment: s.version for s in segments}
        feedback = self.feedback
        return pb.PushReply(
            acks=[
                pb.SegmentAck(
                    segment=a.segment,
                    result=pb.SEGMENT_RESULT_DUPLICATE if a.duplicate else pb.SEGMENT_RESULT_MERGED,
                    receiver_weight=a.receiver_weight,
                    kept=feedback is not None
                    and feedback.kept(open_.sender, a.segment, versions.get(a.segment, 0)),
                )
                for a in acks
            ]
        )

    def on_pull(
        self, request: pb.PullRequest, whole: bool = False, sealed: bool = False
    ) -> AsyncGenerator[pb.SegmentHeader | memoryview, None]:
        if request.round and self.serves_one_pull:
            return self._serve_one_pull(request, whole, sealed)
        return self._serve_pull(request, whole, sealed)

    async def _serve_one_pull(
        self, request: pb.PullRequest, whole: bool, sealed: bool
    ) -> AsyncGenerator[pb.SegmentHeader | memoryview, None]:
        """One protocol pull at a time (a join's bootstrap, round 0, is never refused):
        when several nodes scheduling alone pick this one, it serves one and the others
        hear at once that it is busy and pick another peer (docs/design.md §5)."""
        if self.serving_pull is not None:
            raise Busy(
                f"serving a pull to {self.serving_pull} already; this protocol serves one "
                "pull at a time: pick another peer"
            )
        self.serving_pull = request.requester or "a peer"
        try:
            async for item in self._serve_pull(request, whole, sealed):
                yield item
        finally:
            self.serving_pull = None

    async def _serve_pull(
        self, request: pb.PullRequest, whole: bool = False, sealed: bool = False
    ) -> AsyncGenerator[pb.SegmentHeader | memoryview, None]:
        """Headers and chunk views of a snapshot of the requested segments (all when none
        are named); closing the generator drops the snapshot. ``whole``: each payload in
        one view, for the bulk lane (unless shaping paces it chunk by chunk); ``sealed``:
        in sealed records, which the reader does not checksum, so none is computed.

        With ``[link]`` shaping the reply waits its latency once, after the snapshot
        (the replica's lock is released by then), and each chunk waits for its turn at
        the rate this node's pushes share.
        """
        count = len(self.replica.flat.plan)
        wanted = list(request.segments) or list(range(count))
        if len(set(wanted)) != len(wanted) or not all(0 <= s < count for s in wanted):
            raise InvalidFrame(
                f"pull asks for segments {wanted[:16]}: each must be in 0..{count - 1}, once"
            )
        snapshot, weights = await asyncio.to_thread(self._snapshot, wanted)
        codec = Codec(request.codec) if int(request.codec) in list(Codec) else self.codec
        shaper = self.shaper
        chunk_bytes: int | None = self.chunk_bytes
        if shaper:
            chunk_bytes = shaper.chunk_bytes(self.chunk_bytes)
            await shaper.delay()
        elif whole:
            chunk_bytes = None
        for index, flat in snapshot.items():
            for frame in segment_frames(
                sender=self.node_id,
                sequence=0,
                segment=index,
                sum_weight=weights[index] if weights else 0.0,  # a core without weights
                flat=flat,
                codec=codec,
                chunk_bytes=chunk_bytes,
                copy=False,
                checksum=not sealed,
            ):
                if shaper and isinstance(frame, memoryview):
                    await shaper.pace(frame.nbytes)
                yield frame
        self.metrics.messages.labels("sent", "pull", "ok").inc()
        nbytes = sum(t.numel() * t.element_size() for t in snapshot.values())
        self.metrics.bytes.labels("sent", "pull", "ok").inc(nbytes)

    def _snapshot(self, segments: list[int]) -> tuple[dict[int, torch.Tensor], list[float]]:
        with self.replica.lock:
            return self.replica.flat.snapshot(segments), list(self.replica.summary.weights)
