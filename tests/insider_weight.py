"""An insider for tests of weight: a member of the mesh (its own certificate of the mesh CA,
its own TLS server, so daemons admit it after dialling it back) that sinks weight and
inflates it.

As a **sink** it acknowledges every segment of every push as merged and never pushes
back, which is what drained a 3-site mesh to Σw 8e-14 (issue 12). It counts, per
sender, how many pushes it took and how much sum-weight they carried. As an
**inflater** it pushes made-up weight to a daemon (:meth:`push`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc
import torch

from gossipd.node.tls import Credentials
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb
from tests.fakepeer import MESH, PushOutcome, _push, push_frames, synthetic_plan

T = TypeVar("T")


class WeightInsider:
    """A member that takes every push it is sent (a sink) and can push any weight."""

    def __init__(self, node_id: str, tls: Credentials, *, incarnation: int = 1) -> None:
        self.node_id = node_id
        self.tls = tls
        self.incarnation = incarnation
        self.fingerprint = synthetic_plan().fingerprint
        self.numel = synthetic_plan().segments[0].numel
        self.pushes_taken: Counter[str] = Counter()  # pushes acknowledged, by sender
        self.weight_taken: Counter[str] = Counter()  # Σ sum-weight they carried, by sender
        self._sequence = 0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self.address = self.run(self._start())

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run ``coro`` on the insider's loop (where its channels live) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(node_id=self.node_id, address=self.address, incarnation=self.incarnation)

    async def _start(self) -> str:
        async def handshake(request: pb.HandshakeRequest, context: Any) -> pb.HandshakeReply:
            return pb.HandshakeReply(
                schema_version=SCHEMA_VERSION,
                node=self.info(),
                fingerprint=self.fingerprint,
                step=0,
                protocol="sumweight",
            )

        async def peers(request: pb.PeersRequest, context: Any) -> pb.PeersReply:
            return pb.PeersReply(peers=[self.info()])

        async def sink(request_iterator: Any, context: Any) -> pb.PushReply:
            sender, acks = "", []
            async for frame in request_iterator:
                kind = frame.WhichOneof("kind")
                if kind == "open":
                    sender = frame.open.sender
                elif kind == "header":
                    acks.append(
                        pb.SegmentAck(
                            segment=frame.header.segment,
                            result=pb.SEGMENT_RESULT_MERGED,
                            receiver_weight=1.0,
                        )
                    )
                    self.weight_taken[sender] += frame.header.sum_weight
            self.pushes_taken[sender] += 1
            return pb.PushReply(acks=acks)

        handlers = {
            "Handshake": grpc.unary_unary_rpc_method_handler(
                handshake, pb.HandshakeRequest.FromString, pb.HandshakeReply.SerializeToString
            ),
            "Peers": grpc.unary_unary_rpc_method_handler(
                peers, pb.PeersRequest.FromString, pb.PeersReply.SerializeToString
            ),
            "PushSegments": grpc.stream_unary_rpc_method_handler(
                sink, pb.PushFrame.FromString, pb.PushReply.SerializeToString
            ),
        }
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("gossipd.v1.Gossip", handlers),)
        )
        port = self.tls.add_port(server, "127.0.0.1:0")
        await server.start()
        self._server = server
        return f"127.0.0.1:{port}"

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self.tls.channel(address, [])
        return self._channels[address]

    def introduce_to(self, address: str, timeout_s: float = 10.0) -> None:
        """Handshake with a daemon over TLS; it dials back, checks the certificate, admits us."""
        request = pb.HandshakeRequest(
            schema_version=SCHEMA_VERSION,
            mesh_id=MESH,
            node=self.info(),
            fingerprint=self.fingerprint,
            protocol="sumweight",
        )

        async def call() -> None:
            rpc = self._channel(address).unary_unary(
                "/gossipd.v1.Gossip/Handshake",
                pb.HandshakeRequest.SerializeToString,
                pb.HandshakeReply.FromString,
            )
            await rpc(request, timeout=timeout_s)

        self.run(call())

    def push(self, address: str, *, weight: float) -> PushOutcome:
        """One whole push of zeros at ``weight`` to a daemon, as this member, over TLS."""
        self._sequence += 1

        async def call() -> PushOutcome:
            frames = push_frames(
                sender=self.node_id,
                incarnation=self.incarnation,
                sequence=self._sequence,
                weight=weight,
                values=torch.zeros(self.numel),
                fingerprint=self.fingerprint,
            )
            return await _push(self._channel(address), frames, 20.0)

        return self.run(call())

    def close(self) -> None:
        async def stop() -> None:
            for channel in self._channels.values():
                await channel.close()
            if self._server is not None:
                await self._server.stop(0)

        self.run(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()

    def __enter__(self) -> WeightInsider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
