"""A fake site for tests: a real gRPC server that answers Handshake as any identity we choose.

Daemons only accept a peer after their own handshake to the address it
advertises. Tests that play a misbehaving *member* (bad values, stalled
streams, floods from an accepted sender) need something that passes that
check: this server answers Handshake with its own identity and the mesh's
fingerprint, on its own event loop in a background thread, and answers every
other RPC with UNIMPLEMENTED. The sync methods let plain pytest functions drive it.

The outsider's clients (:mod:`tests.outsider`, :mod:`tests.outsider_tls`) are imported
here too, so ``from tests.fakepeer import ...`` of any of them keeps working.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc
import torch

from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb
from tests.outsider import (
    MESH,
    PushOutcome,
    dead_address,
    flood_handshakes,
    flood_pushes,
    handshake_as,
    leave_as,
    node_info,
    peers_as,
    pull_unchecked,
    push_as,
    push_frames,
    synthetic_plan,
    true_identity,
)
from tests.outsider_tls import (
    call_tls,
    handshake_tls,
    leave_tls,
    peers_tls,
    push_tls,
    status_tls,
)

__all__ = [
    "MESH",
    "FakePeer",
    "PushOutcome",
    "call_tls",
    "dead_address",
    "exchange_handler",
    "flood_handshakes",
    "flood_pushes",
    "handshake_as",
    "handshake_tls",
    "leave_as",
    "leave_tls",
    "node_info",
    "peers_as",
    "peers_tls",
    "pull_unchecked",
    "push_as",
    "push_frames",
    "push_tls",
    "status_tls",
    "synthetic_plan",
    "true_identity",
]

T = TypeVar("T")


def exchange_handler(
    on_push: Callable[[AsyncIterator[pb.PushFrame], Any], Awaitable[pb.PushReply]],
) -> grpc.RpcMethodHandler:
    """``Exchange`` (an honest site's long-lived push stream) served push by push: each
    push's frames, up to its end frame (a small push's unpacked from its batch), go to
    ``on_push`` as one PushSegments call's would, and its reply goes back on the stream."""

    async def exchange(request_iterator: Any, context: Any) -> AsyncIterator[pb.PushReply]:
        frames = aiter(request_iterator)
        while (first := await anext(frames, None)) is not None:

            async def one_push(first: pb.PushFrame = first) -> AsyncIterator[pb.PushFrame]:
                if first.WhichOneof("kind") == "batch":  # a small push, whole
                    for data in first.batch.frames[:-1]:
                        yield pb.PushFrame.FromString(data)
                    return
                yield first
                async for frame in frames:
                    if frame.WhichOneof("kind") == "end":
                        return
                    yield frame

            yield await on_push(one_push(), context)

    return grpc.stream_stream_rpc_method_handler(
        exchange, pb.PushFrame.FromString, pb.PushReply.SerializeToString
    )


class FakePeer:
    """Answers Handshake as ``node_id``; ``answer_as`` can change the identity it claims."""

    def __init__(
        self,
        node_id: str,
        *,
        fingerprint: str | None = None,
        incarnation: int = 1,
        mesh_id: str = MESH,
        serve_peers: bool = False,
        hang_pushes: bool = False,
        take_leaves: bool = False,
        take_pushes: bool = False,
    ) -> None:
        self.node_id = node_id
        # Take every push stream in and never answer it: a peer that hangs after reading.
        self.hang_pushes = hang_pushes
        self.pushes_hanging = 0
        self.push_opens: list[pb.PushOpen] = []  # of the hung pushes sent on Exchange
        # Answer Leave (and keep each request), as a peer a leaving daemon says goodbye to.
        self.take_leaves = take_leaves
        self.leaves: list[pb.LeaveRequest] = []
        # Acknowledge every push on Exchange as merged (a sink that keeps nothing), as the
        # peer a leaving daemon hands its weight to.
        self.take_pushes = take_pushes
        # Also answer Peers (with only itself), so a daemon's anti-entropy rounds against
        # this fake succeed instead of counting failures that would get it suspected.
        self.serve_peers = serve_peers
        self.pushes_sent = 0
        self.incarnation = incarnation
        self.mesh_id = mesh_id
        self.fingerprint = fingerprint or synthetic_plan().fingerprint
        self.handshakes: list[pb.HandshakeRequest] = []
        self.refuse_handshakes: grpc.StatusCode | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self.address = self.run(self._start())

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run ``coro`` on the fake's loop (where its channels must live) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(node_id=self.node_id, address=self.address, incarnation=self.incarnation)

    async def _start(self) -> str:
        async def handshake(request: pb.HandshakeRequest, context: Any) -> pb.HandshakeReply:
            self.handshakes.append(request)
            if self.refuse_handshakes is not None:
                await context.abort(self.refuse_handshakes, "refused by the test")
            return pb.HandshakeReply(
                schema_version=SCHEMA_VERSION,
                node=self.info(),
                fingerprint=self.fingerprint,
                step=0,
                protocol="sumweight",
            )

        async def peers(request: pb.PeersRequest, context: Any) -> pb.PeersReply:
            return pb.PeersReply(peers=[self.info()])

        async def hang(request_iterator: Any, context: Any) -> bytes:
            async for frame in request_iterator:
                if isinstance(frame, pb.PushFrame) and frame.WhichOneof("kind") == "open":
                    self.push_opens.append(frame.open)
            self.pushes_hanging += 1
            await asyncio.Event().wait()  # until the server stops and cancels this
            return b""

        handlers = {
            "Handshake": grpc.unary_unary_rpc_method_handler(
                handshake,
                pb.HandshakeRequest.FromString,
                pb.HandshakeReply.SerializeToString,
            )
        }
        if self.serve_peers:
            handlers["Peers"] = grpc.unary_unary_rpc_method_handler(
                peers, pb.PeersRequest.FromString, pb.PeersReply.SerializeToString
            )

        async def leave(request: pb.LeaveRequest, context: Any) -> pb.LeaveReply:
            self.leaves.append(request)
            return pb.LeaveReply()

        if self.take_leaves:
            handlers["Leave"] = grpc.unary_unary_rpc_method_handler(
                leave, pb.LeaveRequest.FromString, pb.LeaveReply.SerializeToString
            )

        async def take(frames: AsyncIterator[pb.PushFrame], context: Any) -> pb.PushReply:
            merged = pb.SEGMENT_RESULT_MERGED
            segments = [f.header.segment async for f in frames if f.WhichOneof("kind") == "header"]
            return pb.PushReply(acks=[pb.SegmentAck(segment=s, result=merged) for s in segments])

        if self.take_pushes:
            handlers["Exchange"] = exchange_handler(take)
        if self.hang_pushes:
            handlers["PushSegments"] = grpc.stream_unary_rpc_method_handler(hang)
            handlers["Exchange"] = exchange_handler(hang)
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("gossipd.v1.Gossip", handlers),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self._server = server
        return f"127.0.0.1:{port}"

    def handshake_request(self) -> pb.HandshakeRequest:
        return pb.HandshakeRequest(
            schema_version=SCHEMA_VERSION,
            mesh_id=self.mesh_id,
            node=self.info(),
            fingerprint=self.fingerprint,
            protocol="sumweight",
        )

    def introduce_to(self, address: str, timeout_s: float = 10.0) -> pb.HandshakeReply:
        """Handshake with a daemon; it then dials back here and accepts this fake as a peer."""

        async def call() -> pb.HandshakeReply:
            async with grpc.aio.insecure_channel(address) as channel:
                rpc = channel.unary_unary(
                    "/gossipd.v1.Gossip/Handshake",
                    pb.HandshakeRequest.SerializeToString,
                    pb.HandshakeReply.FromString,
                )
                return await rpc(self.handshake_request(), timeout=timeout_s)

        return self.run(call())

    def push(
        self,
        address: str,
        *,
        sequence: int,
        weight: float,
        values: torch.Tensor,
        segment: int = 0,
        timeout_s: float = 20.0,
    ) -> PushOutcome:
        """One push to a daemon as this fake (its id and incarnation); see :func:`push_as`."""
        self.pushes_sent += 1
        return push_as(
            address,
            sender=self.node_id,
            incarnation=self.incarnation,
            sequence=sequence,
            weight=weight,
            values=values,
            segment=segment,
            fingerprint=self.fingerprint,
            mesh_id=self.mesh_id,
            timeout_s=timeout_s,
        )

    def stop_serving(self) -> None:
        """Stop the server, as a peer that left: every dial to it fails from now on."""
        if self._server is not None:
            self.run(self._server.stop(0))
            self._server = None

    def close(self) -> None:
        self.stop_serving()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()

    def __enter__(self) -> FakePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
