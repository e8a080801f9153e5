"""A pull from one peer: the request, then the model's segments verified as they arrive.

The segments come in ``PullModel`` frames, or, where the peer has a bulk lane and the
pull is large, as headers in frames and payloads read whole from a lane connection
(:mod:`gossipd.node.net.bulk.lane`), their checks running in workers while the pull reads on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from gossipd.node.compression.codecs import Codec
from gossipd.node.errors import GossipdError, InvalidFrame
from gossipd.node.model.payload_bound import Gauge
from gossipd.node.model.segments import SegmentPlan
from gossipd.node.net.bulk.connection import BulkConn
from gossipd.node.net.bulk.dialer import PeerLane
from gossipd.node.net.wire.assembly import Limits, SegmentAssembler
from gossipd.node.net.wire.frames import wire_codec
from gossipd.node.net.wire.identity import Identity
from gossipd.node.net.wire.outcomes import remote_error
from gossipd.node.net.wire.shaping import LinkShaper
from gossipd.node.shared.tls import Credentials
from gossipd.node.trainer.messages import Pulled, ReceivedSegment
from gossipd.proto import gossip_pb2 as pb

BULK_READ_PIECE = 4 << 20  # a pulled payload read from the lane counts as progress per piece


class PullReader:
    """A peer client's pulls: one ``PullModel`` call each, its payloads in chunk frames or
    whole on a connection to the peer's lane."""

    def __init__(
        self,
        address: str,
        identity: Identity,
        *,
        codec: Codec,
        shaper: LinkShaper | None,
        tls: Credentials,
        pull_model: grpc.aio.UnaryStreamMultiCallable[pb.PullRequest, pb.PullFrame | memoryview],
        peer_lane: PeerLane,
    ) -> None:
        """``pull_model``: the channel's ``PullModel`` call (its frames parsed by
        :func:`wire.pull_frame`); ``peer_lane``: the peer's bulk lane, shared with the
        client's pushes."""
        self.address = address
        self.identity = identity
        self.codec = codec
        self.shaper = shaper
        self.tls = tls
        self._pull_model = pull_model
        self.peer_lane = peer_lane

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
        """One pull as :meth:`PeerClient.pull <gossipd.node.net.dial.client.PeerClient.pull>`
        describes it. However it ends, its running checks are cancelled and its lane
        connection settled: kept for the next pull only after a clean one."""
        wanted = list(range(len(plan))) if segments is None else list(segments)
        request = self._request([] if segments is None else wanted, round)
        assembler = SegmentAssembler(plan, limits, gauge=gauge)
        pulled = Pulled()
        progress_s = progress_timeout_s or timeout_s
        if self.shaper:
            await self.shaper.delay()  # the request's one-way latency; the reply is the server's
        lane = await self._lane(plan, wanted, timeout_s)
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
            await self._read(request, assembler, lane, checks, take, timeout_s, progress_s)
            done = True
        finally:
            for check in checks:
                check.cancel()  # a failed pull's checks: their results are not wanted
            if lane is not None:
                self._settle(lane, done)
        assembler.close()
        if sorted(pulled.values) != sorted(wanted):
            raise InvalidFrame(
                f"{self.address} sent {len(pulled.values)} of {len(wanted)} segments in PullModel"
            )
        return pulled

    def _request(self, segments: list[int], round: int) -> pb.PullRequest:
        return pb.PullRequest(
            mesh_id=self.identity.mesh_id,
            requester=self.identity.node_id,
            fingerprint=self.identity.fingerprint,
            # Round 0 is a joiner's first model: it comes exact, whatever the codec.
            codec=wire_codec(self.codec if round else Codec.RAW),
            segments=segments,
            round=round,
        )

    async def _lane(
        self, plan: SegmentPlan, wanted: list[int], timeout_s: float
    ) -> BulkConn | None:
        """A lane connection for the pull's payloads, or None: they come in chunk frames."""
        # The server refuses segments it does not have; the lane is sized for those it has.
        nbytes = sum(plan.segments[i].nbytes for i in wanted if 0 <= i < len(plan))
        lane = await self.peer_lane.conn(nbytes, timeout_s)
        if lane is not None and not self.tls.insecure and lane.seal is None:
            # A peer without sealed records: TLS bytes on one connection of Python's ssl
            # (a 16 KB record per read) moved 0.4 to 0.5 of what grpc's C core does for a
            # pull, which is one stream; pushes, split over several connections, still gain.
            assert self.peer_lane.dialer is not None
            self.peer_lane.dialer.put_back(lane)
            lane = None
        return lane

    def _settle(self, lane: BulkConn, done: bool) -> None:
        """A finished pull's lane connection goes back to the idle ones; a failed one's is
        closed (bytes may be left unread on it)."""
        if done and not lane.closed and self.peer_lane.dialer is not None:
            self.peer_lane.dialer.put_back(lane)
        else:
            lane.abort()

    async def _read(
        self,
        request: pb.PullRequest,
        assembler: SegmentAssembler,
        lane: BulkConn | None,
        checks: list[asyncio.Future[ReceivedSegment]],
        take: Callable[[ReceivedSegment], None],
        timeout_s: float,
        progress_s: float,
    ) -> None:
        """The pull's frames, each complete segment to ``take`` (a bulk one once its
        ``checks`` pass); nothing arriving for ``progress_s`` ends it."""
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
        except TimeoutError:
            raise GossipdError(
                f"{self.address}: pull made no progress for {progress_s:.1f} s "
                "(gossip.progress_timeout_s)"
            ) from None
        except grpc.aio.AioRpcError as err:
            raise remote_error(err, self.address) from None

    async def _pulled_payload(
        self,
        assembler: SegmentAssembler,
        lane: BulkConn | None,
        progressed: Callable[[], None],
    ) -> asyncio.Future[ReceivedSegment] | None:
        """The payload of a pulled header marked bulk, read from our lane connection
        straight into the segment's buffer, a piece at a time (each piece is progress);
        its checks then run in a worker thread while the pull reads on (None: no payload)."""
        if lane is None or self.peer_lane.dialer is None:
            raise InvalidFrame(f"{self.address} marked a pulled segment bulk; we named no lane")
        view = assembler.unfilled()
        if not len(view):
            return None
        for start in range(0, len(view), BULK_READ_PIECE):
            await self.peer_lane.dialer.read(lane, view[start : start + BULK_READ_PIECE])
            progressed()
        check = assembler.filled(len(view), sealed=lane.seal is not None)
        assert check is not None, "a filled segment is complete"
        return self.peer_lane.dialer.verify(check)
