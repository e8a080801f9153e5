"""A pull the servicer serves: admitted against the caps in ``limits`` (see
:mod:`..limits.admission`), then the model streamed to its reader, its payloads in gRPC frames
or whole on the reader's bulk-lane connection.

One peer holds at most ``limits.max_inbound_pulls_per_peer`` of the
``limits.max_inbound_pulls`` we serve; a reader that stops reading, or reads slower
than ``limits.min_pull_rate_bytes_s``, is cut off with DEADLINE_EXCEEDED
(:class:`StreamIdle`, :class:`PullTooSlow`, counted), its snapshot and slots released.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import TYPE_CHECKING, TypeVar

import grpc

from gossipd.node.errors import PullTooSlow, StreamIdle
from gossipd.node.model.segments import SegmentPlan
from gossipd.node.net.bulk.connection import InOrder
from gossipd.node.net.limits.admission import PeerSlots, Slots
from gossipd.node.net.wire.frames import pull_chunk_frame
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipd.node.net.bulk.connection import BulkConn
    from gossipd.node.net.bulk.listener import BulkServer
    from gossipd.node.net.serve.servicer import Handlers, PullContext

RequestT = TypeVar("RequestT")
ReplyT = TypeVar("ReplyT")


async def write_within(
    context: grpc.aio.ServicerContext[RequestT, ReplyT],
    data: ReplyT,
    idle_s: float,
    stalled: str,
    ended: str,
) -> None:
    """One write to a peer that must read within ``idle_s`` (``limits.stream_idle_timeout_s``);
    a peer that does not is a :class:`StreamIdle` refusal (``stalled``, ``ended``)."""
    try:
        async with asyncio.timeout(idle_s):
            await context.write(data)
    except TimeoutError:
        raise StreamIdle(
            f"{stalled} for {idle_s:g} s (limits.stream_idle_timeout_s); {ended}"
        ) from None


class PullServer:
    """Pulls of our model by peers: one ``PullModel`` call each."""

    def __init__(self, node: Handlers, plan: SegmentPlan) -> None:
        limits = node.config.limits
        self.node = node
        self.idle_s = limits.stream_idle_timeout_s
        self.pulls = Slots(
            limits.max_inbound_pulls, "PullModel streams", "limits.max_inbound_pulls"
        )
        self.peer_pulls = PeerSlots(
            limits.max_inbound_pulls_per_peer,
            "PullModel streams",
            "limits.max_inbound_pulls_per_peer",
        )
        self.min_pull_rate = limits.min_pull_rate_bytes_s
        self.plan = plan

    async def serve(self, context: PullContext, req: pb.PullRequest) -> None:
        """Serve a checked pull request within its caps (the requester's slot and a shared
        one), on the bulk-lane connection it names where this node has a lane."""
        with contextlib.ExitStack() as held:
            held.enter_context(self.peer_pulls.take(req.requester))
            held.enter_context(self.pulls.take())
            bulk, lane = self.node.bulk, None
            if req.bulk_token and bulk is not None:
                conn = held.enter_context(await bulk.claim(req.bulk_token, req.requester))
                lane = (bulk, conn)
            await self._stream(context, req, lane)

    async def _stream(
        self,
        context: PullContext,
        req: pb.PullRequest,
        lane: tuple[BulkServer, BulkConn] | None,
    ) -> None:
        """A pull's headers in gRPC frames, its payloads there too or whole on ``lane``.

        A payload goes on the lane in a worker while the next header's checksum is
        computed and sent (:class:`~gossipd.node.net.bulk.lane.InOrder`); a socket timeout
        (``stream_idle_timeout_s``) per piece bounds a reader that stops reading. The
        snapshot stays held until the last payload is written, or until the reply's
        deadline, which starts with its first frame (the snapshot waits for the
        trainer's step boundary, however long a step takes).
        """
        nbytes, allowed_s = self._deadline_s(req)
        loop = asyncio.get_running_loop()
        try:
            async with (
                asyncio.timeout(None) as deadline,
                contextlib.aclosing(
                    self.node.on_pull(
                        req,
                        whole=lane is not None,
                        sealed=lane is not None and lane[1].seal is not None,
                    )
                ) as frames,
                InOrder() as lane_writes,
            ):
                async for frame in frames:
                    if deadline.when() is None:
                        deadline.reschedule(loop.time() + allowed_s)
                    if isinstance(frame, memoryview):
                        if lane is not None:
                            bulk, conn = lane
                            await lane_writes.write(functools.partial(bulk.write, conn, frame))
                            continue
                        data = pull_chunk_frame(frame)
                    else:
                        frame.bulk = lane is not None and frame.payload_bytes > 0
                        data = pb.PullFrame(header=frame).SerializeToString()
                    await write_within(
                        context,
                        data,
                        self.idle_s,
                        "the reader took no frame",
                        "the pull was cut off",
                    )
        except TimeoutError:
            if not deadline.expired():
                raise
            raise PullTooSlow(
                f"{req.requester!r} did not read a pull of {nbytes} bytes within "
                f"{allowed_s:.3g} s (limits.stream_idle_timeout_s = {self.idle_s:g} s, then "
                f"limits.min_pull_rate_bytes_s = {self.min_pull_rate:g}); the pull was cut "
                "off, its slot and snapshot released"
            ) from None

    def _deadline_s(self, req: pb.PullRequest) -> tuple[int, float]:
        """The bytes a pull asks for (as this node holds them: a codec only sends fewer)
        and how long its reply may take from its first frame: the first
        ``limits.stream_idle_timeout_s`` free, then ``limits.min_pull_rate_bytes_s``."""
        wanted = set(req.segments) or range(len(self.plan))
        nbytes = sum(seg.nbytes for seg in self.plan.segments if seg.index in wanted)
        return nbytes, self.idle_s + nbytes / self.min_pull_rate
