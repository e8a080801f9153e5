"""A member of the mesh for insider tests: a valid certificate, its own TLS server, no honesty.

Daemons accept a member only after dialling it back and checking the node id in its
certificate, so an insider really serves TLS (Handshake, Peers) on its own event
loop in a background thread; what it does with the pushes honest sites make to it is
its subclass's :meth:`Member.on_push`. It can introduce itself to a daemon and push
any values at any weight under its own name. ``tests/insider_streams.py`` (slots and
values) and ``tests/insider_weight.py`` (sinking and inflating weight) build on it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from typing import Any, Self, TypeVar

import grpc
import torch

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.shared.tls import Credentials
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb
from tests.conftest import DaemonHandle, check_alive, status_of, wait_until
from tests.fakepeer import (
    MESH,
    PushOutcome,
    exchange_handler,
    push_frames,
    synthetic_plan,
)
from tests.outsider import push_on
from tests.outsider_tls import sync_channel

T = TypeVar("T")


class Member(ABC):
    """A member with a valid certificate for ``node_id``, speaking ``protocol`` as the mesh
    does (a daemon refuses a member of another); subclasses decide how it misbehaves."""

    def __init__(
        self, node_id: str, tls: Credentials, *, incarnation: int = 1, protocol: str = "sumweight"
    ) -> None:
        self.node_id = node_id
        self.tls = tls
        self.incarnation = incarnation
        self.protocol = protocol
        plan = synthetic_plan()
        self.fingerprint = plan.fingerprint
        self.numel = plan.segments[0].numel
        self._sequence = 1  # pushes are numbered 2, 3, ...; 1 is left to hand-made streams
        self._channels: dict[str, grpc.aio.Channel] = {}
        # Pushes go over grpc's sync client, which reports a refusal the daemon sends
        # before the last frame as sent (see tests.outsider.push_on).
        self._push_channels: dict[str, grpc.Channel] = {}
        # What a subclass runs on the member's loop; cancelled at close.
        self.tasks: list[asyncio.Task[None]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self.address = self.run(self._start())

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run ``coro`` on the member's loop (where its channels live) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(node_id=self.node_id, address=self.address, incarnation=self.incarnation)

    @abstractmethod
    async def on_push(self, request_iterator: Any, context: Any) -> pb.PushReply:
        """What the member does with a push an honest site makes to it."""

    async def _start(self) -> str:
        async def handshake(request: pb.HandshakeRequest, context: Any) -> pb.HandshakeReply:
            return pb.HandshakeReply(
                schema_version=SCHEMA_VERSION,
                node=self.info(),
                fingerprint=self.fingerprint,
                step=0,
                protocol=self.protocol,
            )

        async def peers(request: pb.PeersRequest, context: Any) -> pb.PeersReply:
            return pb.PeersReply(peers=[self.info()])

        handlers = {
            "Handshake": grpc.unary_unary_rpc_method_handler(
                handshake, pb.HandshakeRequest.FromString, pb.HandshakeReply.SerializeToString
            ),
            "Peers": grpc.unary_unary_rpc_method_handler(
                peers, pb.PeersRequest.FromString, pb.PeersReply.SerializeToString
            ),
            "PushSegments": grpc.stream_unary_rpc_method_handler(
                self.on_push, pb.PushFrame.FromString, pb.PushReply.SerializeToString
            ),
            "Exchange": exchange_handler(self.on_push),
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

    def join(self, mesh: list[DaemonHandle]) -> None:
        """Introduce this member to every site of ``mesh`` and wait until each lists it live."""
        for h in mesh:
            self.introduce_to(h.address)
        wait_until(
            lambda: all(self.node_id in status_of(h)["live_peers"] for h in mesh),
            f"every honest site to list {self.node_id} as live",
            60.0,
            lambda: check_alive(mesh),
        )

    def introduce_to(self, address: str, timeout_s: float = 10.0) -> None:
        """Handshake with a daemon over TLS; it dials back, checks the certificate, admits us."""
        request = pb.HandshakeRequest(
            schema_version=SCHEMA_VERSION,
            mesh_id=MESH,
            node=self.info(),
            fingerprint=self.fingerprint,
            protocol=self.protocol,
        )

        async def call() -> None:
            rpc = self._channel(address).unary_unary(
                "/gossipd.v1.Gossip/Handshake",
                pb.HandshakeRequest.SerializeToString,
                pb.HandshakeReply.FromString,
            )
            await rpc(request, timeout=timeout_s)

        self.run(call())

    def push(
        self, address: str, *, weight: float, values: torch.Tensor | None = None
    ) -> PushOutcome:
        """One whole push of ``values`` (zeros by default) at ``weight`` to a daemon, as this
        member, over TLS."""
        self._sequence += 1
        frames = push_frames(
            sender=self.node_id,
            incarnation=self.incarnation,
            sequence=self._sequence,
            weight=weight,
            values=torch.zeros(self.numel) if values is None else values,
            fingerprint=self.fingerprint,
        )
        if address not in self._push_channels:
            self._push_channels[address] = sync_channel(self.tls, address)
        return push_on(self._push_channels[address], frames, 20.0)

    def pull(self, address: str) -> list[torch.Tensor]:
        """A daemon's model as this member pulls it, segment by segment, decoded unchecked."""
        request = pb.PullRequest(
            mesh_id=MESH, requester=self.node_id, fingerprint=self.fingerprint, codec=pb.CODEC_RAW
        )

        async def call() -> list[torch.Tensor]:
            rpc = self._channel(address).unary_stream(
                "/gossipd.v1.Gossip/PullModel",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=pb.PullFrame.FromString,
            )
            segments: dict[int, torch.Tensor] = {}
            header: pb.SegmentHeader | None = None
            buffer = bytearray()
            async for frame in rpc(request, timeout=30.0):
                if frame.WhichOneof("kind") == "header":
                    header, buffer = frame.header, bytearray()
                else:
                    buffer += frame.chunk
                if header is not None and len(buffer) == header.payload_bytes:
                    raw = torch.frombuffer(buffer, dtype=torch.uint8)
                    segments[header.segment] = raw.view(wirecodec.WIRE_TO_DTYPE[header.dtype])
                    header = None
            return [segments[k] for k in sorted(segments)]

        return self.run(call())

    def close(self) -> None:
        async def stop() -> None:
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            for channel in self._channels.values():
                await channel.close()
            if self._server is not None:
                await self._server.stop(0)

        self.run(stop())
        for push_channel in self._push_channels.values():
            push_channel.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def acked(mesh: list[DaemonHandle]) -> int:
    """Pushes the honest sites have had acknowledged, all together."""
    return sum(status_of(h)["pushes_acked"] for h in mesh)


def ack_rate(mesh: list[DaemonHandle], progress: int, what: str, timeout_s: float) -> float:
    """Acknowledged pushes per second over a window that ends after ``progress`` of them:
    the window follows the mesh's progress, so a slow machine stretches it instead of
    failing it, and a stalled mesh fails after ``timeout_s`` saying how far it got."""
    start, started = acked(mesh), time.monotonic()
    latest = [start]

    def grown() -> bool:
        latest[0] = acked(mesh)
        return latest[0] - start >= progress

    try:
        wait_until(
            grown, f"{progress} acknowledged pushes {what}", timeout_s, lambda: check_alive(mesh)
        )
    except AssertionError as err:
        raise AssertionError(f"{err}: only {latest[0] - start} in {timeout_s:g} s") from None
    return (latest[0] - start) / (time.monotonic() - started)
