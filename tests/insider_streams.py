"""An insider for tests: a 4th member with its own certificate of the mesh CA and its own
TLS server, that holds inbound push slots and sends poisoned values.

Daemons accept a member only after dialling it back and checking the node id in its
certificate, so this insider really serves TLS (Handshake, Peers) on its own event
loop in a background thread. Pushes the honest sites make to it are refused with
RESOURCE_EXHAUSTED, a known outcome their senders settle by folding the weight back,
so the mesh's sum of weights stays exact whatever the attack.

The attacks open push streams to daemons over its TLS channels: ``stall`` sends a
valid PushOpen and then nothing, ``trickle`` sends a PushOpen, a segment header and
then one payload byte every ``every_s``. Each stream is reopened as soon as the
daemon ends it, so the attack holds every slot it is given for as long as it runs.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import grpc
import torch

from gossipd.node import codec as wirecodec
from gossipd.node.tls import Credentials
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb
from tests.fakepeer import MESH, PushOutcome, _push, push_frames, synthetic_plan

T = TypeVar("T")
REOPEN_PAUSE_S = 0.05  # between a stream the daemon ended and the next, so a refusal is no spin


class Insider:
    """A member of the mesh (a valid certificate for ``node_id``) that misbehaves on request."""

    def __init__(self, node_id: str, tls: Credentials, *, incarnation: int = 1) -> None:
        self.node_id = node_id
        self.tls = tls
        self.incarnation = incarnation
        self.fingerprint = synthetic_plan().fingerprint
        self.numel = synthetic_plan().segments[0].numel
        self.open_streams = 0  # attack streams the daemons have not ended yet
        self.ended: Counter[str] = Counter()  # how the daemons ended attack streams, by code
        self.pushes_refused = 0  # honest pushes to this insider, refused
        self._sequence = 1  # real pushes: 2, 3, ...
        self._stop_attack = asyncio.Event()
        self._attack: list[asyncio.Task[None]] = []
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

        async def refuse(request_iterator: Any, context: Any) -> bytes:
            self.pushes_refused += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the insider merges nothing")
            return b""

        handlers = {
            "Handshake": grpc.unary_unary_rpc_method_handler(
                handshake, pb.HandshakeRequest.FromString, pb.HandshakeReply.SerializeToString
            ),
            "Peers": grpc.unary_unary_rpc_method_handler(
                peers, pb.PeersRequest.FromString, pb.PeersReply.SerializeToString
            ),
            "PushSegments": grpc.stream_unary_rpc_method_handler(refuse),
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

    # -- attacks on the inbound push slots --------------------------------------------------

    def _next_sequence(self) -> int:
        self._sequence += 1
        return self._sequence

    def _open_frame(self) -> pb.PushFrame:
        # Every attack stream says sequence 1: none is ever merged, and real pushes stay
        # within the receiver's window of sequences admitted from this sender.
        sequence = 1
        return pb.PushFrame(
            open=pb.PushOpen(
                mesh_id=MESH,
                sender=self.node_id,
                fingerprint=self.fingerprint,
                sequence=sequence,
                segment_count=1,
                incarnation=self.incarnation,
                sequence_base=1,
            )
        )

    def _header_frame(self, sequence: int) -> pb.PushFrame:
        payload = bytes(self.numel * 4)
        return pb.PushFrame(
            header=pb.SegmentHeader(
                sender=self.node_id,
                segment=0,
                sequence=sequence,
                sum_weight=0.5,
                dtype=pb.DTYPE_FLOAT32,
                numel=self.numel,
                codec=pb.CODEC_RAW,
                payload_bytes=len(payload),
                checksum=wirecodec.checksum(payload),
            )
        )

    async def _frames(self, trickle_every_s: float | None) -> AsyncIterator[bytes]:
        opened = self._open_frame()
        yield opened.SerializeToString()
        if trickle_every_s is not None:
            yield self._header_frame(opened.open.sequence).SerializeToString()
            for _ in range(self.numel * 4):
                try:
                    await asyncio.wait_for(self._stop_attack.wait(), trickle_every_s)
                    return
                except TimeoutError:
                    yield pb.PushFrame(chunk=b"\0").SerializeToString()
        await self._stop_attack.wait()

    async def _hold(self, address: str, trickle_every_s: float | None) -> None:
        rpc = self._channel(address).stream_unary(
            "/gossipd.v1.Gossip/PushSegments",
            request_serializer=lambda b: b,
            response_deserializer=pb.PushReply.FromString,
        )
        while not self._stop_attack.is_set():
            self.open_streams += 1
            call = rpc(self._frames(trickle_every_s), timeout=3600.0)
            try:
                await call
                self.ended["OK"] += 1
            except grpc.aio.AioRpcError as err:
                self.ended[err.code().name] += 1
            finally:
                self.open_streams -= 1
                if self._stop_attack.is_set():
                    call.cancel()
            if not self._stop_attack.is_set():
                await asyncio.sleep(REOPEN_PAUSE_S)

    def start_attack(
        self, addresses: list[str], streams: int, trickle_every_s: float | None = None
    ) -> None:
        """``streams`` push streams to each address, held until :meth:`stop_attack`."""

        async def start() -> None:
            self._stop_attack = asyncio.Event()
            self._attack = [
                asyncio.create_task(self._hold(a, trickle_every_s))
                for a in addresses
                for _ in range(streams)
            ]

        self.run(start())

    def stop_attack(self) -> None:
        """End every attack stream (from this side) and wait until they are all gone."""

        async def stop() -> None:
            self._stop_attack.set()
            for task in self._attack:
                task.cancel()
            await asyncio.gather(*self._attack, return_exceptions=True)
            self._attack = []

        self.run(stop())

    # -- poisoned values ----------------------------------------------------------------------

    def push(self, address: str, *, weight: float, values: torch.Tensor) -> PushOutcome:
        """One whole push of ``values`` at ``weight`` to a daemon, as this member, over TLS."""

        async def call() -> PushOutcome:
            frames = push_frames(
                sender=self.node_id,
                incarnation=self.incarnation,
                sequence=self._next_sequence(),
                weight=weight,
                values=values,
                fingerprint=self.fingerprint,
            )
            return await _push(self._channel(address), frames, 20.0)

        return self.run(call())

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
        async def close() -> None:
            self._stop_attack.set()
            for task in self._attack:
                task.cancel()
            await asyncio.gather(*self._attack, return_exceptions=True)
            for channel in self._channels.values():
                await channel.close()
            if self._server is not None:
                await self._server.stop(0)

        self.run(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()

    def __enter__(self) -> Insider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
