"""The gRPC face of a node: validate, convert, hand off; never let an exception escape.

Request bytes are parsed by our own deserializer, so a frame that is not valid
protobuf reaches the method as :class:`Malformed` and is answered with
INVALID_ARGUMENT instead of grpc's generic UNKNOWN. Every gossipd error maps to
its status code with the same text the local log gets.

Streams are admitted against the caps in ``limits`` (see :mod:`gossipd.node.net.limits.admission`):
concurrent pushes and pulls, pushes and pulls per peer (a member with a valid certificate
still cannot take the slots the others need), payload bytes held by unfinished
pushes, how long a stream may stay silent, how slowly a push may arrive and how
long it may take, and the same for pulls we serve (per peer, and how slowly one may
be read). A silent, trickling or overlong push, or a pull whose reader stopped
reading or reads too slowly, is ended with DEADLINE_EXCEEDED (:class:`StreamIdle`,
:class:`PushTooSlow`, :class:`PushTooLong`, :class:`PullTooSlow`, counted). Push streams
one peer opens are budgeted too (:mod:`~gossipd.node.net.limits.open_budget`): a peer reopening
refused streams in a loop is refused for a back-off (:class:`TooManyOpens`), each
refusal answered after a wait, and what refusing costs is not charged to gossip's CPU
budget (:meth:`CpuBudget.refused`).

A stream refused before its first frame is read is answered once that frame has come
(:meth:`GossipServicer.refuse_early`): the sender writes it as it opens the stream, and
grpc.aio reports a status that arrives while a write is in flight as its own INTERNAL
instead (grpc/grpc#36066), which a sender takes for an unknown outcome and retries
rather than a refusal it settles.

The parts: :mod:`~gossipd.node.net.wire.intake` (parsing and the mesh check),
:mod:`~gossipd.node.net.wire.statuscodes` (error to status), :mod:`~gossipd.node.net.serve.push`
(a push received) and :mod:`~gossipd.node.net.serve.pull` (a pull served).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from gossipd.node.errors import Busy, GossipdError, MeshMismatch, TooManyOpens
from gossipd.node.model.segments import check_fingerprint, check_protocol
from gossipd.node.net.limits.admission import Slots
from gossipd.node.net.limits.open_budget import OpenBudget
from gossipd.node.net.serve.pull import PullServer, write_within
from gossipd.node.net.serve.push import PushReceiver
from gossipd.node.net.wire.assembly import SegmentAssembler
from gossipd.node.net.wire.intake import (
    Malformed,
    PushFrameIn,
    check_mesh,
    parse_push_frame,
    parser,
    require,
)
from gossipd.node.net.wire.statuscodes import STATUS_CODES, status_code
from gossipd.node.shared.tls import Credentials, check_claim
from gossipd.node.trainer.messages import ReceivedSegment
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipd.node.net.bulk.listener import BulkServer
    from gossipd.node.net.limits.cpu_budget import CpuBudget
    from gossipd.node.net.relay.hub import RelayHub
    from gossipd.node.net.relay.reach import ReachChecker
    from gossipd.node.net.telemetry.metrics import NodeMetrics
    from gossipd.node.shared.config import NodeConfig

__all__ = [
    "SERVICE",
    "STATUS_CODES",
    "GossipServicer",
    "Handlers",
    "add_to_server",
    "parse_push_frame",
    "status_code",
]

log = logging.getLogger(__name__)
SERVICE = "gossipd.v1.Gossip"
# How long a stream refused before its first frame waits for that frame: a sender writes it
# as it opens the stream, so it comes within a round trip, or never (then no write of the
# sender's is in flight to race the status).
FIRST_FRAME_WAIT_S = 1.0
# Refusals that wait at once (for a first frame, or out a back-off's hold): each holds a
# call and a coroutine, about 20 KiB measured, so about 20 MiB in all; past it, answered
# at once.
MAX_WAITING_REFUSALS = 1024

RequestT = TypeVar("RequestT")
ReplyT = TypeVar("ReplyT")
# A call's context, by what its requests are (as our deserializers hand them over) and
# what it answers.
PushContext = grpc.aio.ServicerContext[PushFrameIn, pb.PushReply]
PullContext = grpc.aio.ServicerContext[pb.PullRequest | Malformed, bytes]


class Handlers(Protocol):
    """What the servicer hands off to; the site's Network implements it."""

    mesh_id: str
    fingerprint: str
    protocol: str
    tls: Credentials
    config: NodeConfig
    metrics: NodeMetrics
    bulk: BulkServer | None
    budget: CpuBudget
    hub: RelayHub
    reach_checker: ReachChecker

    def new_assembler(self) -> SegmentAssembler: ...
    def on_handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeReply: ...
    def check_sender(self, sender: str, incarnation: int) -> None: ...
    def check_addressed(self, sender: str, sequence: int, incarnation: int) -> None: ...
    async def on_push(
        self, open_: pb.PushOpen, segments: list[ReceivedSegment], deadline_s: float | None
    ) -> pb.PushReply: ...
    def on_pull(
        self, request: pb.PullRequest, whole: bool = False, sealed: bool = False
    ) -> AsyncGenerator[pb.SegmentHeader | memoryview, None]: ...
    async def on_peer_left(self, request: pb.LeaveRequest, peer: str) -> None: ...
    def on_peers(self, request: pb.PeersRequest) -> pb.PeersReply: ...
    async def on_status(self, checksum: bool, sketch_size: int) -> pb.StatusReply: ...
    def on_rejected(self, peer: str, err: GossipdError) -> None: ...


class GossipServicer:
    def __init__(self, node: Handlers) -> None:
        """Raises ConfigError if ``limits.max_pending_bytes`` could never hold a segment, or
        ``limits.max_push_s`` could not fit a push of one at the minimum rate."""
        limits = node.config.limits
        self.node = node
        self.idle_s = limits.stream_idle_timeout_s
        plan = node.new_assembler().plan
        self.push_receiver = PushReceiver(node, plan)
        self.pull_server = PullServer(node, plan)
        self.opens = OpenBudget.from_limits(limits)
        self.waiting = Slots(MAX_WAITING_REFUSALS, "refusals waiting", "MAX_WAITING_REFUSALS")
        pushes, pulls = self.push_receiver.pushes, self.pull_server.pulls
        node.metrics.inbound_push_streams.set_function(lambda: pushes.in_use)
        node.metrics.inbound_pull_streams.set_function(lambda: pulls.in_use)
        node.metrics.peers_in_open_backoff.set_function(self.opens.in_backoff)

    def refused(self, peer: str, err: GossipdError) -> None:
        """Count, log and report a refusal; what it cost the CPU is refusal work, not gossip."""
        self.node.budget.refused()
        self.node.on_rejected(peer, err)

    def open_stream(self, context: PushContext) -> str | None:
        """The node id of a new push stream's peer (None in plaintext), within its budget of
        opens (:class:`TooManyOpens` if not). In plaintext anyone may claim any sender, so
        there is no peer to budget; the node's caps still hold."""
        who = self.node.tls.peer_id(context)
        if who is not None:
            self.opens.admit(who)
        return who

    async def refuse_early(
        self,
        context: PushContext,
        peer: str,
        frames: AsyncIterator[PushFrameIn],
        err: GossipdError,
    ) -> NoReturn:
        """Refuse a stream none of whose frames was read yet, once its first frame came.

        It waits at most ``FIRST_FRAME_WAIT_S`` for it; a :class:`TooManyOpens` refusal also
        waits out its ``hold_s``, so a peer in a back-off that waits for its answers before
        reopening opens slowly. At most ``MAX_WAITING_REFUSALS`` wait at once; the others
        are answered at once.
        """
        self.refused(peer, err)
        hold_s = err.hold_s if isinstance(err, TooManyOpens) else 0.0
        try:
            waiting = self.waiting.take()
        except Busy:
            waiting = None  # too many wait already: answered at once
        if waiting is not None:
            with waiting:
                loop = asyncio.get_running_loop()
                until = loop.time() + hold_s
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(FIRST_FRAME_WAIT_S):
                        await anext(frames, None)
                await asyncio.sleep(max(0.0, until - loop.time()))
        await context.abort(status_code(err), str(err))

    async def _guard(
        self,
        context: grpc.aio.ServicerContext[RequestT, ReplyT],
        peer: str,
        call: Callable[[], Awaitable[ReplyT]],
    ) -> ReplyT:
        try:
            return await call()
        except GossipdError as err:
            self.refused(peer, err)
            await context.abort(status_code(err), str(err))
        except grpc.aio.AbortError:
            raise
        except Exception as err:
            log.exception("internal error serving %s", peer)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {err!r}")

    async def Handshake(
        self,
        request: pb.HandshakeRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.HandshakeRequest | Malformed, pb.HandshakeReply],
    ) -> pb.HandshakeReply:
        async def call() -> pb.HandshakeReply:
            req = require(request)
            if req.schema_version != SCHEMA_VERSION:
                raise MeshMismatch(
                    f"schema version {req.schema_version} is not ours ({SCHEMA_VERSION}); "
                    "run the same gossipd release on every site"
                )
            check_claim(self.node.tls.peer_id(context), req.node.node_id, "a Handshake")
            check_mesh(self.node.mesh_id, req.mesh_id, f"node {req.node.node_id!r}")
            check_fingerprint(self.node.fingerprint, req.fingerprint, f"node {req.node.node_id!r}")
            check_protocol(self.node.protocol, req.protocol, f"node {req.node.node_id!r}")
            return self.node.on_handshake(req)

        return await self._guard(context, context.peer(), call)

    async def PushSegments(
        self, request_iterator: AsyncIterator[PushFrameIn], context: PushContext
    ) -> pb.PushReply:
        """One push per call (a peer's Exchange stream carries many: :mod:`.exchange`)."""
        peer, frames = context.peer(), aiter(request_iterator)
        try:
            who = self.open_stream(context)
            slots = self.push_receiver.admit(who)
        except GossipdError as err:
            await self.refuse_early(context, peer, frames, err)

        async def call() -> pb.PushReply:
            return await self.push_receiver.receive(who, slots, frames, context.time_remaining())

        return await self._guard(context, peer, call)

    async def receive_push(
        self,
        who: str | None,
        request_frames: AsyncIterator[PushFrameIn],
        deadline_s: float | None,
    ) -> pb.PushReply:
        """One push on an ``Exchange`` stream, whose first frame was read
        (:meth:`PushReceiver.receive`)."""
        slots = self.push_receiver.admit(who)
        return await self.push_receiver.receive(who, slots, request_frames, deadline_s)

    async def write_within(
        self,
        context: grpc.aio.ServicerContext[RequestT, ReplyT],
        data: ReplyT,
        stalled: str,
        ended: str,
    ) -> None:
        """One write to a peer that must read within ``limits.stream_idle_timeout_s``;
        a peer that does not is a :class:`StreamIdle` refusal (``stalled``, ``ended``)."""
        await write_within(context, data, self.idle_s, stalled, ended)

    async def PullModel(self, request: pb.PullRequest | Malformed, context: PullContext) -> None:
        """Stream the model; each write waits at most ``limits.stream_idle_timeout_s``,
        and the whole reply :meth:`PullServer._deadline_s`.

        A reader that stops reading, or reads too slowly, is cut off there, its snapshot
        and slots released (one peer holds at most ``limits.max_inbound_pulls_per_peer``
        of the ``limits.max_inbound_pulls`` we serve). The refusal is sent with ``set_code``, not
        ``abort``, which would wait behind frames the reader never takes. grpc keeps
        such a call (a frame and a window) until its client goes away or its
        connection is closed (:func:`admission.server_options`).
        """
        peer = context.peer()
        try:
            req = require(request)
            check_claim(self.node.tls.peer_id(context), req.requester, "a pull")
            check_mesh(self.node.mesh_id, req.mesh_id, f"requester {req.requester!r}")
            check_fingerprint(self.node.fingerprint, req.fingerprint, f"{req.requester!r}")
            await self.pull_server.serve(context, req)
        except GossipdError as err:
            self.refused(peer, err)
            context.set_code(status_code(err))
            context.set_details(str(err))
        except Exception as err:
            log.exception("internal error serving a pull to %s", peer)
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(f"internal error: {err!r}")

    async def Leave(
        self,
        request: pb.LeaveRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.LeaveRequest | Malformed, pb.LeaveReply],
    ) -> pb.LeaveReply:
        async def call() -> pb.LeaveReply:
            req = require(request)
            check_claim(self.node.tls.peer_id(context), req.node_id, "a Leave")
            check_mesh(self.node.mesh_id, req.mesh_id, f"node {req.node_id!r}")
            await self.node.on_peer_left(req, context.peer())
            return pb.LeaveReply()

        return await self._guard(context, context.peer(), call)

    async def Peers(
        self,
        request: pb.PeersRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.PeersRequest | Malformed, pb.PeersReply],
    ) -> pb.PeersReply:
        async def call() -> pb.PeersReply:
            req = require(request)
            check_claim(self.node.tls.peer_id(context), req.sender.node_id, "a peer list")
            check_mesh(self.node.mesh_id, req.mesh_id, f"node {req.sender.node_id!r}")
            return self.node.on_peers(req)

        return await self._guard(context, context.peer(), call)

    async def Status(
        self,
        request: pb.StatusRequest | Malformed,
        context: grpc.aio.ServicerContext[pb.StatusRequest | Malformed, pb.StatusReply],
    ) -> pb.StatusReply:
        async def call() -> pb.StatusReply:
            self.node.tls.peer_id(context)  # any site of the mesh (on the allow-list) may ask
            req = require(request)
            return await self.node.on_status(req.checksum, req.sketch_size)

        return await self._guard(context, context.peer(), call)


def _pass_bytes(message: bytes) -> bytes:
    """Pull frames are serialized by the servicer (chunks by hand) and go out as they are."""
    return message


def add_to_server(
    servicer: GossipServicer,
    server: grpc.aio.Server,
    more: dict[str, grpc.RpcMethodHandler[Any, Any]] | None = None,
) -> None:
    """Register with tolerant deserializers (the generated helper would answer UNKNOWN);
    ``more``: handlers of the service's methods served elsewhere (``Exchange``)."""

    def ser(message: Message) -> bytes:
        return message.SerializeToString()

    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
        "Handshake": grpc.unary_unary_rpc_method_handler(
            servicer.Handshake, parser(pb.HandshakeRequest), ser
        ),
        "PushSegments": grpc.stream_unary_rpc_method_handler(
            servicer.PushSegments, parse_push_frame, ser
        ),
        "PullModel": grpc.unary_stream_rpc_method_handler(
            servicer.PullModel, parser(pb.PullRequest), _pass_bytes
        ),
        "Leave": grpc.unary_unary_rpc_method_handler(servicer.Leave, parser(pb.LeaveRequest), ser),
        "Peers": grpc.unary_unary_rpc_method_handler(servicer.Peers, parser(pb.PeersRequest), ser),
        "Status": grpc.unary_unary_rpc_method_handler(
            servicer.Status, parser(pb.StatusRequest), ser
        ),
    }
    handlers.update(more or {})
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
