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

The parts: :mod:`~gossipd.node.net.intake` (parsing and the mesh check),
:mod:`~gossipd.node.net.statuscodes` (error to status), :mod:`~gossipd.node.net.pushreceiver`
(a push received) and :mod:`~gossipd.node.net.pullserver` (a pull served).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from google.protobuf.message import Message

from gossipd.node.errors import GossipdError, MeshMismatch
from gossipd.node.net.intake import check_mesh, parse_push_frame, parser, require
from gossipd.node.net.pullserver import PullServer, write_within
from gossipd.node.net.pushreceiver import PushReceiver
from gossipd.node.net.statuscodes import STATUS_CODES, status_code
from gossipd.node.net.wire import ReceivedSegment, SegmentAssembler
from gossipd.node.shared.tls import Credentials, check_claim
from gossipd.node.trainer.segments import check_fingerprint, check_protocol
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipd.node.net.bulkserver import BulkServer
    from gossipd.node.net.metrics import NodeMetrics
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
    def check_addressed(self, sender: str, sequence: int, incarnation: int) -> None: ...
    async def on_push(
        self, open_: pb.PushOpen, segments: list[ReceivedSegment], deadline_s: float | None
    ) -> pb.PushReply: ...
    def on_pull(
        self, request: pb.PullRequest, whole: bool = False, sealed: bool = False
    ) -> AsyncIterator[pb.SegmentHeader | memoryview]: ...
    async def on_peer_left(self, request: pb.LeaveRequest, peer: str) -> None: ...
    def on_peers(self, request: pb.PeersRequest) -> pb.PeersReply: ...
    async def on_status(self, checksum: bool, sketch_size: int) -> pb.StatusReply: ...
    def on_rejected(self, peer: str, err: GossipdError) -> None: ...


class GossipServicer:
    def __init__(self, node: Handlers) -> None:
        """Raises ConfigError if ``limits.max_pending_bytes`` could never hold a segment, or
        ``limits.max_push_s`` could not fit a push of one at the minimum rate."""
        self.node = node
        self.idle_s = node.config.limits.stream_idle_timeout_s
        plan = node.new_assembler().plan
        self.push_receiver = PushReceiver(node, plan)
        self.pull_server = PullServer(node, plan)
        pushes, pulls = self.push_receiver.pushes, self.pull_server.pulls
        node.metrics.inbound_push_streams.set_function(lambda: pushes.in_use)
        node.metrics.inbound_pull_streams.set_function(lambda: pulls.in_use)

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

    async def PushSegments(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        """One push per call (a peer's Exchange stream carries many: :mod:`exchange`)."""

        async def call() -> pb.PushReply:
            who = self.node.tls.peer_id(context)
            return await self.receive_push(who, aiter(request_iterator), context.time_remaining())

        return await self._guard(context, context.peer(), call)

    async def receive_push(
        self, who: str | None, request_frames: AsyncIterator[Any], deadline_s: float | None
    ) -> pb.PushReply:
        """One push (:meth:`PushReceiver.receive`), for ``PushSegments`` and ``Exchange``."""
        return await self.push_receiver.receive(who, request_frames, deadline_s)

    async def write_within(
        self, context: grpc.aio.ServicerContext, data: Any, stalled: str, ended: str
    ) -> None:
        """One write to a peer that must read within ``limits.stream_idle_timeout_s``;
        a peer that does not is a :class:`StreamIdle` refusal (``stalled``, ``ended``)."""
        await write_within(context, data, self.idle_s, stalled, ended)

    async def PullModel(self, request: Any, context: grpc.aio.ServicerContext) -> None:
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
            self.node.on_rejected(peer, err)
            context.set_code(status_code(err))
            context.set_details(str(err))
        except Exception as err:
            log.exception("internal error serving a pull to %s", peer)
            context.set_code(grpc.StatusCode.INTERNAL)
            context.set_details(f"internal error: {err!r}")

    async def Leave(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.LeaveReply:
            req = require(request)
            check_claim(self.node.tls.peer_id(context), req.node_id, "a Leave")
            check_mesh(self.node.mesh_id, req.mesh_id, f"node {req.node_id!r}")
            await self.node.on_peer_left(req, context.peer())
            return pb.LeaveReply()

        return await self._guard(context, context.peer(), call)

    async def Peers(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        async def call() -> pb.PeersReply:
            req = require(request)
            check_claim(self.node.tls.peer_id(context), req.sender.node_id, "a peer list")
            check_mesh(self.node.mesh_id, req.mesh_id, f"node {req.sender.node_id!r}")
            return self.node.on_peers(req)

        return await self._guard(context, context.peer(), call)

    async def Status(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
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
    more: dict[str, grpc.RpcMethodHandler] | None = None,
) -> None:
    """Register with tolerant deserializers (the generated helper would answer UNKNOWN);
    ``more``: handlers of the service's methods served elsewhere (``Exchange``)."""

    def ser(message: Message) -> bytes:
        return message.SerializeToString()

    handlers = {
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
