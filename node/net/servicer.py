"""The gRPC face of a node: validate, convert, hand off; never let an exception escape.

Request bytes are parsed by our own deserializer, so a frame that is not valid
protobuf reaches the method as :class:`Malformed` and is answered with
INVALID_ARGUMENT instead of grpc's generic UNKNOWN. Every gossipd error maps to
its status code with the same text the local log gets.

Streams are admitted against the caps in ``limits`` (see :mod:`admission`):
concurrent pushes and pulls, pushes and pulls per peer (a member with a valid certificate
still cannot take the slots the others need), payload bytes held by unfinished
pushes, how long a stream may stay silent, how slowly a push may arrive and how
long it may take, and the same for pulls we serve (per peer, and how slowly one may
be read). A silent, trickling or overlong push, or a pull whose reader stopped
reading or reads too slowly, is ended with DEADLINE_EXCEEDED (:class:`StreamIdle`,
:class:`PushTooSlow`, :class:`PushTooLong`, :class:`PullTooSlow`, counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from gossipd.node import errors
from gossipd.node.errors import (
    GossipdError,
    InvalidFrame,
    MeshMismatch,
    PullTooSlow,
    StreamIdle,
)
from gossipd.node.net.admission import ByteBudget, IdleBounded, PeerSlots, Slots, push_deadline_s
from gossipd.node.net.bulk import InOrder
from gossipd.node.net.wire import (
    PUSH_CHUNK_TAG,
    ReceivedSegment,
    SegmentAssembler,
    chunk_view,
    pull_chunk_frame,
)
from gossipd.node.shared.certs import CertificateError
from gossipd.node.shared.tls import Credentials, IdentityMismatch, NotAllowed, check_claim
from gossipd.node.trainer.segments import check_fingerprint, check_protocol
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipd.node.net.bulk import BulkConn, BulkServer
    from gossipd.node.net.metrics import NodeMetrics
    from gossipd.node.shared.config import NodeConfig

log = logging.getLogger(__name__)
SERVICE = "gossipd.v1.Gossip"
T = TypeVar("T", bound=Message)

# The one place a gossipd error becomes a gRPC status: the nearest class in an
# error's MRO that is listed here gives its code (GossipdError itself: INTERNAL).
STATUS_CODES: dict[type[GossipdError], grpc.StatusCode] = {
    GossipdError: grpc.StatusCode.INTERNAL,
    errors.ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidFrame: grpc.StatusCode.INVALID_ARGUMENT,
    errors.WeightOverCap: grpc.StatusCode.INVALID_ARGUMENT,
    errors.PayloadTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.NonFinitePayload: grpc.StatusCode.INVALID_ARGUMENT,
    errors.MeshMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    errors.UnknownPeer: grpc.StatusCode.UNAUTHENTICATED,
    errors.Busy: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PeerUnreachable: grpc.StatusCode.UNAVAILABLE,
    errors.BulkClosed: grpc.StatusCode.UNAVAILABLE,
    errors.CheckpointError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.JobError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ForgedLeave: grpc.StatusCode.PERMISSION_DENIED,
    errors.Leaving: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StreamIdle: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.TooManyStreams: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PushTooSlow: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.PushTooLong: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.PullTooSlow: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.PayloadOutOfBounds: grpc.StatusCode.INVALID_ARGUMENT,
    IdentityMismatch: grpc.StatusCode.PERMISSION_DENIED,
    NotAllowed: grpc.StatusCode.PERMISSION_DENIED,
    CertificateError: grpc.StatusCode.UNAUTHENTICATED,
}


def status_code(err: GossipdError) -> grpc.StatusCode:
    """The status a servicer answers ``err`` with (see ``STATUS_CODES``)."""
    for cls in type(err).__mro__:
        if cls in STATUS_CODES:
            return STATUS_CODES[cls]
    return grpc.StatusCode.INTERNAL


@dataclass(frozen=True)
class Malformed:
    """Bytes that did not parse as the expected message."""

    type_name: str
    size: int
    error: str


def _parser(cls: type[T]) -> Callable[[bytes], T | Malformed]:
    def parse(data: bytes) -> T | Malformed:
        try:
            return cls.FromString(data)
        except DecodeError as err:
            return Malformed(cls.DESCRIPTOR.full_name, len(data), str(err))

    return parse


def parse_push_frame(data: bytes) -> pb.PushFrame | memoryview | Malformed:
    """A chunk frame as a view of its payload (:func:`wire.chunk_view`); anything else
    parsed, or Malformed."""
    view = chunk_view(data, PUSH_CHUNK_TAG)
    return _push_frame_parser(data) if view is None else view


def _frame_size(frame: pb.PushFrame | memoryview | Malformed) -> int:
    """Bytes a push frame brought, for the minimum rate (a chunk: its payload)."""
    if isinstance(frame, memoryview):
        return len(frame)
    if isinstance(frame, Malformed):
        return frame.size
    return frame.ByteSize()


def _require(message: T | Malformed) -> T:
    if isinstance(message, Malformed):
        raise InvalidFrame(
            f"{message.size} bytes do not parse as {message.type_name}: {message.error}"
        )
    return message


_push_frame_parser = _parser(pb.PushFrame)


class Handlers(Protocol):
    """What the servicer hands off to; the site's Network implements it."""

    mesh_id: str
    fingerprint: str
    protocol: str
    tls: Credentials
    config: NodeConfig
    metrics: NodeMetrics
    bulk: BulkServer | None

    def new_assembler(self) -> SegmentAssembler: ...
    def on_handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeReply: ...
    def check_sender(self, sender: str, incarnation: int) -> None: ...
    async def on_push(
        self, open_: pb.PushOpen, segments: list[ReceivedSegment], deadline_s: float | None
    ) -> pb.PushReply: ...
    def on_pull(
        self, request: pb.PullRequest, whole: bool = False, sealed: bool = False
    ) -> AsyncIterator[pb.SegmentHeader | memoryview]: ...
    async def on_peer_left(self, request: pb.LeaveRequest, peer: str) -> None: ...
    def on_peers(self, request: pb.PeersRequest) -> pb.PeersReply: ...
    async def on_status(self, checksum: bool) -> pb.StatusReply: ...
    def on_rejected(self, peer: str, err: GossipdError) -> None: ...


class GossipServicer:
    def __init__(self, node: Handlers) -> None:
        """Raises ConfigError if ``limits.max_pending_bytes`` could never hold a segment, or
        ``limits.max_push_s`` could not fit a push of one at the minimum rate."""
        self.node = node
        limits = node.config.limits
        self.idle_s = limits.stream_idle_timeout_s
        self.pushes = Slots(
            limits.max_inbound_pushes, "inbound push streams", "limits.max_inbound_pushes"
        )
        self.pulls = Slots(
            limits.max_inbound_pulls, "PullModel streams", "limits.max_inbound_pulls"
        )
        self.peer_pushes = PeerSlots(
            limits.max_inbound_pushes_per_peer,
            "inbound push streams",
            "limits.max_inbound_pushes_per_peer",
        )
        self.peer_pulls = PeerSlots(
            limits.max_inbound_pulls_per_peer,
            "PullModel streams",
            "limits.max_inbound_pulls_per_peer",
        )
        self.min_push_rate = limits.min_push_rate_bytes_s
        self.min_pull_rate = limits.min_pull_rate_bytes_s
        self.pending = ByteBudget(limits.max_pending_bytes, "limits.max_pending_bytes")
        self.plan = plan = node.new_assembler().plan
        self.pending.check_fits(plan)
        self.push_deadline_s = push_deadline_s(node.config, plan)
        node.metrics.inbound_push_streams.set_function(lambda: self.pushes.in_use)
        node.metrics.inbound_pull_streams.set_function(lambda: self.pulls.in_use)

    def check_mesh(self, mesh_id: str, who: str) -> None:
        if mesh_id != self.node.mesh_id:
            raise MeshMismatch(
                f"{who} belongs to mesh {mesh_id!r} but this node is in mesh "
                f"{self.node.mesh_id!r}; check mesh_id in both configs"
            )

    async def _guard(
        self, context: grpc.aio.ServicerContext, peer: str, call: Callable[[], Awaitable[Any]]
    ) -> Any:
        try:
            return await call()
        except GossipdError as err:
            self.node.on_rejected(peer, err)
            await context.abort(status_code(err), str(err))
        except grpc.aio.AbortError:
            raise
        except Exception as err:
            log.exception("internal error serving %s", peer)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {err!r}")

    async def Handshake(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.HandshakeReply:
            req = _require(request)
            if req.schema_version != SCHEMA_VERSION:
                raise MeshMismatch(
                    f"schema version {req.schema_version} is not ours ({SCHEMA_VERSION}); "
                    "run the same gossipd release on every site"
                )
            check_claim(self.node.tls.peer_id(context), req.node.node_id, "a Handshake")
            self.check_mesh(req.mesh_id, f"node {req.node.node_id!r}")
            check_fingerprint(self.node.fingerprint, req.fingerprint, f"node {req.node.node_id!r}")
            check_protocol(self.node.protocol, req.protocol, f"node {req.node.node_id!r}")
            return self.node.on_handshake(req)

        return await self._guard(context, context.peer(), call)

    async def PushSegments(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        """One push per call (a peer's Exchange stream carries many: :mod:`exchange`)."""

        async def call() -> pb.PushReply:
            who = self.node.tls.peer_id(context)
            return await self.receive_push(who, aiter(request_iterator), context.time_remaining())

        return await self._guard(context, context.peer(), call)

    async def receive_push(
        self, who: str | None, request_frames: AsyncIterator[Any], deadline_s: float | None
    ) -> pb.PushReply:
        """Receive one push within the caps; what it reserved is released however it ends.

        ``who``: the node id of the peer's certificate (None in plaintext);
        ``request_frames``: this push's frames, open first; ``deadline_s``: how long
        the sender still waits for the reply (None: no deadline). Completed segments
        stay charged to ``limits.max_pending_bytes`` until the merge has answered,
        since until then their buffers are alive.
        """
        with contextlib.ExitStack() as slots:
            # A peer's own cap first: over it, a stream never touches the shared one.
            # In plaintext nobody is known before the open frame names its sender.
            if who is not None:
                slots.enter_context(self.peer_pushes.take(who))
            slots.enter_context(self.pushes.take())
            held = slots.enter_context(self.pending.hold())
            frames = IdleBounded(
                request_frames,
                self.idle_s,
                "limits.stream_idle_timeout_s",
                min_rate=self.min_push_rate,
                rate_key="limits.min_push_rate_bytes_s",
                size=_frame_size,
                deadline_s=self.push_deadline_s,
                deadline_key="limits.max_push_s",
            )
            first = _require(await anext(frames, Malformed("PushFrame", 0, "empty stream")))
            if isinstance(first, memoryview) or first.WhichOneof("kind") != "open":
                raise InvalidFrame("a push stream must start with a PushOpen frame")
            opened = first.open
            check_claim(who, opened.sender, "a push")
            if who is None:
                slots.enter_context(self.peer_pushes.take(opened.sender))
            self.check_mesh(opened.mesh_id, f"sender {opened.sender!r}")
            check_fingerprint(self.node.fingerprint, opened.fingerprint, f"{opened.sender!r}")
            self.node.check_sender(opened.sender, opened.incarnation)
            if not 1 <= opened.sequence_base <= opened.sequence:
                raise InvalidFrame(
                    f"push {opened.sender!r}#{opened.sequence} names sequence_base "
                    f"{opened.sequence_base}; it must be in 1..{opened.sequence}"
                )
            assembler = self.node.new_assembler()
            assembler.reserve = held.reserve
            lane = None
            if opened.bulk_token:
                if self.node.bulk is None:
                    raise InvalidFrame(
                        f"push {opened.sender!r}#{opened.sequence} names a bulk-lane connection "
                        "but this node has no bulk lane (bulk = false)"
                    )
                lane = slots.enter_context(
                    await self.node.bulk.claim(opened.bulk_token, who or opened.sender)
                )
            segments = await self._receive(opened, frames, assembler, lane)
            return await self.node.on_push(opened, segments, deadline_s)

    async def _receive(
        self,
        opened: pb.PushOpen,
        frames: IdleBounded[Any],
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
                frame = _require(message)
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
        self, frames: IdleBounded[Any], assembler: SegmentAssembler, lane: BulkConn | None
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

    async def write_within(
        self, context: grpc.aio.ServicerContext, data: Any, stalled: str, ended: str
    ) -> None:
        """One write to a peer that must read within ``limits.stream_idle_timeout_s``;
        a peer that does not is a :class:`StreamIdle` refusal (``stalled``, ``ended``)."""
        try:
            async with asyncio.timeout(self.idle_s):
                await context.write(data)
        except TimeoutError:
            raise StreamIdle(
                f"{stalled} for {self.idle_s:g} s (limits.stream_idle_timeout_s); {ended}"
            ) from None

    async def PullModel(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Stream the model; each write waits at most ``limits.stream_idle_timeout_s``,
        and the whole reply :meth:`_pull_deadline_s`.

        A reader that stops reading, or reads too slowly, is cut off there, its snapshot
        and slots released (one peer holds at most ``limits.max_inbound_pulls_per_peer``
        of the ``limits.max_inbound_pulls`` we serve). The refusal is sent with ``set_code``, not
        ``abort``, which would wait behind frames the reader never takes. grpc keeps
        such a call (a frame and a window) until its client goes away or its
        connection is closed (:func:`admission.server_options`).
        """
        peer = context.peer()
        try:
            req = _require(request)
            check_claim(self.node.tls.peer_id(context), req.requester, "a pull")
            self.check_mesh(req.mesh_id, f"requester {req.requester!r}")
            check_fingerprint(self.node.fingerprint, req.fingerprint, f"{req.requester!r}")
            with contextlib.ExitStack() as held:
                held.enter_context(self.peer_pulls.take(req.requester))
                held.enter_context(self.pulls.take())
                bulk, lane = self.node.bulk, None
                if req.bulk_token and bulk is not None:
                    conn = held.enter_context(await bulk.claim(req.bulk_token, req.requester))
                    lane = (bulk, conn)
                await self._serve_pull(context, req, lane)
        except GossipdError as err:
            self.node.on_rejected(peer, err)
            context.set_code(status_code(err))
            context.set_details(str(err))
        except Exception as err:
            log.exception("internal error serving a pull to %s", peer)
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(f"internal error: {err!r}")

    async def _serve_pull(
        self,
        context: grpc.aio.ServicerContext,
        req: Any,
        lane: tuple[BulkServer, BulkConn] | None,
    ) -> None:
        """A pull's headers in gRPC frames, its payloads there too or whole on ``lane``.

        A payload goes on the lane in a worker while the next header's checksum is
        computed and sent (:class:`~gossipd.node.net.bulk.InOrder`); a socket timeout
        (``stream_idle_timeout_s``) per piece bounds a reader that stops reading. The
        snapshot stays held until the last payload is written, or until the reply's
        deadline, which starts with its first frame (the snapshot waits for the
        trainer's step boundary, however long a step takes).
        """
        nbytes, allowed_s = self._pull_deadline_s(req)
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
                    await self.write_within(
                        context, data, "the reader took no frame", "the pull was cut off"
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

    def _pull_deadline_s(self, req: Any) -> tuple[int, float]:
        """The bytes a pull asks for (as this node holds them: a codec only sends fewer)
        and how long its reply may take from its first frame: the first
        ``limits.stream_idle_timeout_s`` free, then ``limits.min_pull_rate_bytes_s``."""
        wanted = set(req.segments) or range(len(self.plan))
        nbytes = sum(seg.nbytes for seg in self.plan.segments if seg.index in wanted)
        return nbytes, self.idle_s + nbytes / self.min_pull_rate

    async def Leave(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.LeaveReply:
            req = _require(request)
            check_claim(self.node.tls.peer_id(context), req.node_id, "a Leave")
            self.check_mesh(req.mesh_id, f"node {req.node_id!r}")
            await self.node.on_peer_left(req, context.peer())
            return pb.LeaveReply()

        return await self._guard(context, context.peer(), call)

    async def Peers(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.PeersReply:
            req = _require(request)
            check_claim(self.node.tls.peer_id(context), req.sender.node_id, "a peer list")
            self.check_mesh(req.mesh_id, f"node {req.sender.node_id!r}")
            return self.node.on_peers(req)

        return await self._guard(context, context.peer(), call)

    async def Status(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.StatusReply:
            self.node.tls.peer_id(context)  # any site of the mesh (on the allow-list) may ask
            return await self.node.on_status(_require(request).checksum)

        return await self._guard(context, context.peer(), call)


def _pass_bytes(message: bytes) -> bytes:
    """Pull frames are serialized by the servicer (chunks by hand) and go out as they are."""
    return message


def add_to_server(
    servicer: GossipServicer,
    server: grpc.aio.Server,
    more: dict[str, grpc.RpcMethodHandler] | None = None,
) -> None:
    """Register with tolerant deserializers (the generated helper would answer UNKNOWN);
    ``more``: handlers of the service's methods served elsewhere (``Exchange``)."""

    def ser(message: Message) -> bytes:
        return message.SerializeToString()

    handlers = {
        "Handshake": grpc.unary_unary_rpc_method_handler(
            servicer.Handshake, _parser(pb.HandshakeRequest), ser
        ),
        "PushSegments": grpc.stream_unary_rpc_method_handler(
            servicer.PushSegments, parse_push_frame, ser
        ),
        "PullModel": grpc.unary_stream_rpc_method_handler(
            servicer.PullModel, _parser(pb.PullRequest), _pass_bytes
        ),
        "Leave": grpc.unary_unary_rpc_method_handler(servicer.Leave, _parser(pb.LeaveRequest), ser),
        "Peers": grpc.unary_unary_rpc_method_handler(servicer.Peers, _parser(pb.PeersRequest), ser),
        "Status": grpc.unary_unary_rpc_method_handler(
            servicer.Status, _parser(pb.StatusRequest), ser
        ),
    }
    handlers.update(more or {})
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
