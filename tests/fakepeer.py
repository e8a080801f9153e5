"""A fake site for tests: a real gRPC server that answers Handshake as any identity we choose.

Daemons only accept a peer after their own handshake to the address it
advertises. Tests that play a misbehaving *member* (bad values, stalled
streams, floods from an accepted sender) need something that passes that
check: this server answers Handshake with its own identity and the mesh's
fingerprint, on its own event loop in a background thread, and answers every
other RPC with UNIMPLEMENTED. The sync methods let plain pytest functions drive it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from gossipd.node.jobs import JobSpec, build_job
from gossipd.node.segments import FlatModel, SegmentPlan
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb

T = TypeVar("T")
MESH = "test-mesh"


def synthetic_plan(**options: Any) -> SegmentPlan:
    """The segment plan of the synthetic job that the conftest daemons run."""
    job = build_job(JobSpec("synthetic", learning_rate=0.0, options=options))
    return FlatModel(job.model).plan


class FakePeer:
    """Answers Handshake as ``node_id``; ``answer_as`` can change the identity it claims."""

    def __init__(
        self,
        node_id: str,
        *,
        fingerprint: str | None = None,
        incarnation: int = 1,
        mesh_id: str = MESH,
    ) -> None:
        self.node_id = node_id
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
            )

        handlers = {
            "Handshake": grpc.unary_unary_rpc_method_handler(
                handshake,
                pb.HandshakeRequest.FromString,
                pb.HandshakeReply.SerializeToString,
            )
        }
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

    def close(self) -> None:
        if self._server is not None:
            self.run(self._server.stop(0))
            self._server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()

    def __enter__(self) -> FakePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
