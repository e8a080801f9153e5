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
import functools
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from gossipd.node.trainer import codec as wirecodec
from gossipd.node.trainer.jobs import JobSpec, build_job
from gossipd.node.trainer.segments import FlatModel, SegmentPlan
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb

T = TypeVar("T")
MESH = "test-mesh"


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


def synthetic_plan(**options: Any) -> SegmentPlan:
    """The segment plan of the synthetic job that the conftest daemons run."""
    job = build_job(JobSpec("synthetic", learning_rate=0.0, options=options))
    return FlatModel(job.model).plan


@functools.cache
def _default_fingerprint() -> str:
    """The conftest daemons' fingerprint, built once (a flood needs it thousands of times)."""
    return synthetic_plan().fingerprint


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
    ) -> None:
        self.node_id = node_id
        # Take every push stream in and never answer it: a peer that hangs after reading.
        self.hang_pushes = hang_pushes
        self.pushes_hanging = 0
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
            async for _ in request_iterator:
                pass
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


# -- An outsider: plain clients that claim whatever identity a test chooses ----------------
#
# These speak the wire directly (no server behind them), for forged handshakes, poisoned
# peer lists, spoofed leaves and push floods. Each call opens its own channel; the flood
# helpers share one channel and keep ``concurrency`` calls in flight.


def node_info(node_id: str, address: str, incarnation: int) -> pb.NodeInfo:
    return pb.NodeInfo(node_id=node_id, address=address, incarnation=incarnation)


def dead_address(index: int, block: int = 77) -> str:
    """A loopback address nobody listens on (127.<block>.x.y port 9): a connect gets RST."""
    return f"127.{block}.{index // 250 % 250}.{index % 250 + 1}:9"


async def _unary(
    channel: grpc.aio.Channel, method: str, request: Any, reply_type: Any, timeout_s: float
) -> tuple[grpc.StatusCode, Any, str]:
    rpc = channel.unary_unary(
        f"/gossipd.v1.Gossip/{method}",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=reply_type.FromString,
    )
    try:
        reply = await rpc(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as err:
        return err.code(), None, err.details() or ""
    return grpc.StatusCode.OK, reply, ""


def _handshake_request(
    info: pb.NodeInfo, fingerprint: str | None, mesh_id: str
) -> pb.HandshakeRequest:
    return pb.HandshakeRequest(
        schema_version=SCHEMA_VERSION,
        mesh_id=mesh_id,
        node=info,
        fingerprint=fingerprint or _default_fingerprint(),
        protocol="sumweight",
    )


def handshake_as(
    address: str,
    info: pb.NodeInfo,
    *,
    fingerprint: str | None = None,
    mesh_id: str = MESH,
    timeout_s: float = 10.0,
) -> tuple[grpc.StatusCode, pb.HandshakeReply | None]:
    """One Handshake claiming ``info``; returns the status code and the reply (None on error)."""
    request = _handshake_request(info, fingerprint, mesh_id)

    async def call() -> tuple[grpc.StatusCode, pb.HandshakeReply | None]:
        async with grpc.aio.insecure_channel(address) as channel:
            code, reply, _ = await _unary(
                channel, "Handshake", request, pb.HandshakeReply, timeout_s
            )
            return code, reply

    return asyncio.run(call())


def true_identity(address: str) -> pb.NodeInfo:
    """What the daemon at ``address`` says it is (asked as a throwaway outsider)."""
    code, reply = handshake_as(address, node_info("identity-probe", dead_address(0, 99), 1))
    assert code == grpc.StatusCode.OK and reply is not None, (address, code)
    return reply.node


def flood_handshakes(
    address: str,
    infos: Iterable[pb.NodeInfo],
    *,
    concurrency: int = 32,
    fingerprint: str | None = None,
    timeout_s: float = 20.0,
) -> list[grpc.StatusCode]:
    """A Handshake claiming each of ``infos``, ``concurrency`` at a time; their status codes."""
    requests = [_handshake_request(i, fingerprint, MESH) for i in infos]

    async def call() -> list[grpc.StatusCode]:
        gate = asyncio.Semaphore(concurrency)
        async with grpc.aio.insecure_channel(address) as channel:

            async def one(request: pb.HandshakeRequest) -> grpc.StatusCode:
                async with gate:
                    code, _, _ = await _unary(
                        channel, "Handshake", request, pb.HandshakeReply, timeout_s
                    )
                    return code

            return list(await asyncio.gather(*(one(r) for r in requests)))

    return asyncio.run(call())


def peers_as(
    address: str,
    sender: pb.NodeInfo,
    known: Sequence[pb.NodeInfo],
    *,
    mesh_id: str = MESH,
    timeout_s: float = 20.0,
) -> tuple[grpc.StatusCode, list[pb.NodeInfo]]:
    """One Peers request from ``sender`` listing ``known``; the code and the peers relayed back."""
    request = pb.PeersRequest(mesh_id=mesh_id, sender=sender, known=list(known))

    async def call() -> tuple[grpc.StatusCode, list[pb.NodeInfo]]:
        options = [("grpc.max_receive_message_length", 64 << 20)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            code, reply, _ = await _unary(channel, "Peers", request, pb.PeersReply, timeout_s)
            return code, list(reply.peers) if reply is not None else []

    return asyncio.run(call())


def leave_as(
    address: str, node_id: str, incarnation: int, *, mesh_id: str = MESH, timeout_s: float = 20.0
) -> grpc.StatusCode:
    """One Leave claiming that ``node_id`` (at ``incarnation``) is leaving."""
    request = pb.LeaveRequest(mesh_id=mesh_id, node_id=node_id, incarnation=incarnation)

    async def call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(address) as channel:
            code, _, _ = await _unary(channel, "Leave", request, pb.LeaveReply, timeout_s)
            return code

    return asyncio.run(call())


@dataclass(frozen=True)
class PushOutcome:
    """How a daemon answered one push: status code, per-segment results, error text."""

    code: grpc.StatusCode
    results: tuple[int, ...] = ()
    details: str = ""

    @property
    def merged(self) -> bool:
        return self.code == grpc.StatusCode.OK and pb.SEGMENT_RESULT_MERGED in self.results

    @property
    def duplicate(self) -> bool:
        return self.code == grpc.StatusCode.OK and pb.SEGMENT_RESULT_DUPLICATE in self.results


def push_frames(
    *,
    sender: str,
    incarnation: int,
    sequence: int,
    weight: float,
    values: torch.Tensor,
    segment: int = 0,
    fingerprint: str | None = None,
    mesh_id: str = MESH,
) -> list[bytes]:
    """A whole one-segment push, serialized: PushOpen, SegmentHeader, one chunk (raw codec)."""
    data = bytes(wirecodec.encode(values.to(torch.float32).contiguous(), wirecodec.Codec.RAW))
    opened = pb.PushOpen(
        mesh_id=mesh_id,
        sender=sender,
        fingerprint=fingerprint or _default_fingerprint(),
        sequence=sequence,
        segment_count=1,
        incarnation=incarnation,
        sequence_base=1,
    )
    header = pb.SegmentHeader(
        sender=sender,
        segment=segment,
        sequence=sequence,
        sum_weight=weight,
        dtype=pb.DTYPE_FLOAT32,
        numel=values.numel(),
        codec=pb.CODEC_RAW,
        payload_bytes=len(data),
        checksum=wirecodec.checksum(data),
    )
    return [
        pb.PushFrame(open=opened).SerializeToString(),
        pb.PushFrame(header=header).SerializeToString(),
        pb.PushFrame(chunk=data).SerializeToString(),
    ]


async def _push(channel: grpc.aio.Channel, frames: list[bytes], timeout_s: float) -> PushOutcome:
    rpc = channel.stream_unary(
        "/gossipd.v1.Gossip/PushSegments",
        request_serializer=lambda b: b,
        response_deserializer=pb.PushReply.FromString,
    )
    try:
        reply = await rpc(iter(frames), timeout=timeout_s)
    except grpc.aio.AioRpcError as err:
        return PushOutcome(err.code(), (), err.details() or "")
    return PushOutcome(grpc.StatusCode.OK, tuple(a.result for a in reply.acks))


def push_as(address: str, *, timeout_s: float = 20.0, **frame_fields: Any) -> PushOutcome:
    """One push built by :func:`push_frames` from ``frame_fields``, sent to ``address``."""
    frames = push_frames(**frame_fields)

    async def call() -> PushOutcome:
        async with grpc.aio.insecure_channel(address) as channel:
            return await _push(channel, frames, timeout_s)

    return asyncio.run(call())


def flood_pushes(
    address: str, pushes: Iterable[list[bytes]], *, concurrency: int = 8, timeout_s: float = 20.0
) -> list[PushOutcome]:
    """Send every push in ``pushes`` (frames from :func:`push_frames`), ``concurrency`` at once."""

    async def call() -> list[PushOutcome]:
        gate = asyncio.Semaphore(concurrency)
        async with grpc.aio.insecure_channel(address) as channel:

            async def one(frames: list[bytes]) -> PushOutcome:
                async with gate:
                    return await _push(channel, frames, timeout_s)

            return list(await asyncio.gather(*(one(f) for f in pushes)))

    return asyncio.run(call())


def pull_unchecked(
    address: str, *, fingerprint: str | None = None, mesh_id: str = MESH, timeout_s: float = 30.0
) -> list[torch.Tensor]:
    """A daemon's model, segment by segment, decoded WITHOUT the finite check.

    ``PeerClient.pull`` refuses NaN and infinity; a test that asks "is every
    parameter finite?" must see them.
    """
    request = pb.PullRequest(
        mesh_id=mesh_id,
        requester="test-observer",
        fingerprint=fingerprint or _default_fingerprint(),
        codec=pb.CODEC_RAW,
    )

    async def call() -> list[torch.Tensor]:
        segments: dict[int, torch.Tensor] = {}
        async with grpc.aio.insecure_channel(address) as channel:
            rpc = channel.unary_stream(
                "/gossipd.v1.Gossip/PullModel",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=pb.PullFrame.FromString,
            )
            header: pb.SegmentHeader | None = None
            buffer = bytearray()
            async for frame in rpc(request, timeout=timeout_s):
                if frame.WhichOneof("kind") == "header":
                    header, buffer = frame.header, bytearray()
                else:
                    buffer += frame.chunk
                if header is not None and len(buffer) == header.payload_bytes:
                    dtype = wirecodec.WIRE_TO_DTYPE[header.dtype]
                    raw = torch.frombuffer(buffer, dtype=torch.uint8)
                    segments[header.segment] = raw.view(dtype)
                    header = None
        return [segments[k] for k in sorted(segments)]

    return asyncio.run(call())


# -- The same outsider over mutual TLS ----------------------------------------------------
#
# ``tls`` is anything with the ``channel(address, options, expected)`` of
# :class:`gossipd.node.shared.tls.Credentials`: a site's Credentials (a valid certificate of
# the mesh), ``Credentials(insecure=True)`` (plaintext), or a test's own object that
# presents files Credentials would refuse to load (expired, another CA's). Each call
# opens its own channel and returns (status code, reply or None, error details).


def call_tls(
    tls: Any,
    address: str,
    method: str,
    request: Any,
    reply_type: Any,
    *,
    expected: str | None = None,
    timeout_s: float = 10.0,
) -> tuple[grpc.StatusCode, Any, str]:
    """One unary RPC ``method`` over a channel from ``tls`` (server checked as ``expected``)."""

    async def call() -> tuple[grpc.StatusCode, Any, str]:
        async with tls.channel(address, [], expected) as channel:
            return await _unary(channel, method, request, reply_type, timeout_s)

    return asyncio.run(call())


def handshake_tls(
    tls: Any,
    address: str,
    info: pb.NodeInfo,
    *,
    fingerprint: str | None = None,
    mesh_id: str = MESH,
    timeout_s: float = 10.0,
) -> tuple[grpc.StatusCode, pb.HandshakeReply | None, str]:
    """One Handshake claiming ``info``, presenting ``tls``'s certificate."""
    request = _handshake_request(info, fingerprint, mesh_id)
    return call_tls(tls, address, "Handshake", request, pb.HandshakeReply, timeout_s=timeout_s)


def push_tls(
    tls: Any, address: str, *, timeout_s: float = 20.0, **frame_fields: Any
) -> PushOutcome:
    """One push built by :func:`push_frames` from ``frame_fields``, presenting ``tls``."""
    frames = push_frames(**frame_fields)

    async def call() -> PushOutcome:
        async with tls.channel(address, [], None) as channel:
            return await _push(channel, frames, timeout_s)

    return asyncio.run(call())


def leave_tls(
    tls: Any,
    address: str,
    node_id: str,
    incarnation: int,
    *,
    mesh_id: str = MESH,
    timeout_s: float = 20.0,
) -> tuple[grpc.StatusCode, str]:
    """One Leave claiming that ``node_id`` is leaving, presenting ``tls``; code and details."""
    request = pb.LeaveRequest(mesh_id=mesh_id, node_id=node_id, incarnation=incarnation)
    code, _, details = call_tls(tls, address, "Leave", request, pb.LeaveReply, timeout_s=timeout_s)
    return code, details


def peers_tls(
    tls: Any,
    address: str,
    sender: pb.NodeInfo,
    known: Sequence[pb.NodeInfo],
    *,
    mesh_id: str = MESH,
    timeout_s: float = 20.0,
) -> tuple[grpc.StatusCode, list[pb.NodeInfo], str]:
    """One Peers request from ``sender`` listing ``known``, presenting ``tls``."""
    request = pb.PeersRequest(mesh_id=mesh_id, sender=sender, known=list(known))
    code, reply, details = call_tls(
        tls, address, "Peers", request, pb.PeersReply, timeout_s=timeout_s
    )
    return code, list(reply.peers) if reply is not None else [], details


def status_tls(
    tls: Any, address: str, *, timeout_s: float = 10.0
) -> tuple[grpc.StatusCode, pb.StatusReply | None, str]:
    """One Status, presenting ``tls``'s certificate (or none, for a plaintext one)."""
    request = pb.StatusRequest()
    return call_tls(tls, address, "Status", request, pb.StatusReply, timeout_s=timeout_s)
