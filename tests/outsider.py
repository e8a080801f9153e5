"""An outsider for tests: plain gRPC clients that claim whatever identity a test chooses.

These speak the wire directly (no server behind them), for forged handshakes, poisoned
peer lists, spoofed leaves and push floods. Each call opens its own channel; the flood
helpers share one channel and keep ``concurrency`` calls in flight. The same calls over
mutual TLS are :mod:`tests.outsider_tls`; a fake site that also answers Handshake is
:class:`tests.fakepeer.FakePeer`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.model.segments import FlatModel, SegmentPlan
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb

MESH = "test-mesh"


def synthetic_plan(**options: Any) -> SegmentPlan:
    """The segment plan of the synthetic job that the conftest daemons run."""
    job = build_job(JobSpec("synthetic", learning_rate=0.0, options=options))
    return FlatModel(job.model).plan


@functools.cache
def default_fingerprint() -> str:
    """The conftest daemons' fingerprint, built once (a flood needs it thousands of times)."""
    return synthetic_plan().fingerprint


def node_info(node_id: str, address: str, incarnation: int) -> pb.NodeInfo:
    return pb.NodeInfo(node_id=node_id, address=address, incarnation=incarnation)


def dead_address(index: int, block: int = 77) -> str:
    """A loopback address nobody listens on (127.<block>.x.y port 9): a connect gets RST."""
    return f"127.{block}.{index // 250 % 250}.{index % 250 + 1}:9"


async def unary_call(
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


def handshake_request(
    info: pb.NodeInfo, fingerprint: str | None, mesh_id: str
) -> pb.HandshakeRequest:
    return pb.HandshakeRequest(
        schema_version=SCHEMA_VERSION,
        mesh_id=mesh_id,
        node=info,
        fingerprint=fingerprint or default_fingerprint(),
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
    request = handshake_request(info, fingerprint, mesh_id)

    async def call() -> tuple[grpc.StatusCode, pb.HandshakeReply | None]:
        async with grpc.aio.insecure_channel(address) as channel:
            code, reply, _ = await unary_call(
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
    requests = [handshake_request(i, fingerprint, MESH) for i in infos]

    async def call() -> list[grpc.StatusCode]:
        gate = asyncio.Semaphore(concurrency)
        async with grpc.aio.insecure_channel(address) as channel:

            async def one(request: pb.HandshakeRequest) -> grpc.StatusCode:
                async with gate:
                    code, _, _ = await unary_call(
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
            code, reply, _ = await unary_call(channel, "Peers", request, pb.PeersReply, timeout_s)
            return code, list(reply.peers) if reply is not None else []

    return asyncio.run(call())


def leave_as(
    address: str,
    node_id: str,
    incarnation: int,
    *,
    mesh_id: str = MESH,
    timeout_s: float = 20.0,
    merged: Iterable[pb.Receipts] = (),
) -> grpc.StatusCode:
    """One Leave claiming that ``node_id`` (at ``incarnation``) is leaving, and that it
    merged ``merged`` of the receiver's pushes."""
    request = pb.LeaveRequest(
        mesh_id=mesh_id, node_id=node_id, incarnation=incarnation, merged=merged
    )

    async def call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(address) as channel:
            code, _, _ = await unary_call(channel, "Leave", request, pb.LeaveReply, timeout_s)
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
        fingerprint=fingerprint or default_fingerprint(),
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


async def send_push(
    channel: grpc.aio.Channel, frames: list[bytes], timeout_s: float
) -> PushOutcome:
    """One push on a grpc.aio channel, for floods that need many in flight: a push refused
    before its last frame may read ``INTERNAL`` here (see :func:`push_on`), so a flood's
    outcomes say what merged, not why the rest did not."""
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


def push_on(channel: grpc.Channel, frames: list[bytes], timeout_s: float = 20.0) -> PushOutcome:
    """``frames`` in one PushSegments call on a channel of grpc's sync API.

    For a push the daemon may refuse before its last frame is written: grpc.aio's client
    then reports ``INTERNAL: Internal error from Core`` instead of the daemon's status
    whenever one of its writes loses the race with the end of the stream
    (grpc/grpc#36066); the sync client reports the status the daemon sent.
    """
    rpc = channel.stream_unary(
        "/gossipd.v1.Gossip/PushSegments",
        request_serializer=None,
        response_deserializer=pb.PushReply.FromString,
    )
    try:
        reply = rpc(iter(frames), timeout=timeout_s)
    except grpc.RpcError as err:
        return PushOutcome(err.code(), (), err.details() or "")
    return PushOutcome(grpc.StatusCode.OK, tuple(a.result for a in reply.acks))


def push_sync(address: str, frames: list[bytes], timeout_s: float = 20.0) -> PushOutcome:
    """:func:`push_on` over a plaintext channel of its own."""
    with grpc.insecure_channel(address) as channel:
        return push_on(channel, frames, timeout_s)


def push_as(address: str, *, timeout_s: float = 20.0, **frame_fields: Any) -> PushOutcome:
    """One push built by :func:`push_frames` from ``frame_fields``, sent to ``address``."""
    return push_sync(address, push_frames(**frame_fields), timeout_s)


def flood_pushes(
    address: str, pushes: Iterable[list[bytes]], *, concurrency: int = 8, timeout_s: float = 20.0
) -> list[PushOutcome]:
    """Send every push in ``pushes`` (frames from :func:`push_frames`), ``concurrency`` at once."""

    async def call() -> list[PushOutcome]:
        gate = asyncio.Semaphore(concurrency)
        async with grpc.aio.insecure_channel(address) as channel:

            async def one(frames: list[bytes]) -> PushOutcome:
                async with gate:
                    return await send_push(channel, frames, timeout_s)

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
        fingerprint=fingerprint or default_fingerprint(),
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
