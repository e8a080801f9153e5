"""The push frames the node's client encodes by hand (and the bench times) are byte for
byte what protobuf writes, and segment frames that are views hold the bytes copies do.
They protect the wire schema.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from gossipd.node.compression.codecs import Codec
from gossipd.node.net.dial.client import Identity, PeerClient
from gossipd.node.net.wire.frames import segment_frames
from gossipd.node.protocols.sumweight import Push
from gossipd.node.shared.tls import Credentials
from gossipd.node.trainer.messages import OutboundPush
from gossipd.proto import gossip_pb2 as pb

DEADLINE_S = 30.0  # the push deadline the open frame carries


def _protobuf_frames(out: OutboundPush, identity: Identity, chunk_bytes: int) -> list[bytes]:
    frames = [
        pb.PushFrame(
            open=pb.PushOpen(
                mesh_id=identity.mesh_id,
                sender=identity.node_id,
                fingerprint=identity.fingerprint,
                sequence=out.push.sequence,
                segment_count=len(out.push.weights),
                incarnation=identity.incarnation,
                round=out.push.round,
                sequence_base=out.push.sequence_base,
                deadline_s=DEADLINE_S,
            )
        )
    ]
    for index in sorted(out.push.weights):
        for part in segment_frames(
            sender=identity.node_id,
            sequence=out.push.sequence,
            segment=index,
            sum_weight=out.push.weights[index],
            flat=out.snapshot[index],
            codec=Codec.RAW,
            chunk_bytes=chunk_bytes,
        ):
            frame = (
                pb.PushFrame(chunk=part) if isinstance(part, bytes) else pb.PushFrame(header=part)
            )
            frames.append(frame)
    frames.append(pb.PushFrame(end=pb.PushEnd()))
    return [f.SerializeToString() for f in frames]


@pytest.mark.parametrize("chunk_bytes", [4, 124, 128, 1000, 16384, 1 << 20, 4 << 20])
def test_push_frames_encoded_by_hand_equal_protobuf_serialization(chunk_bytes: int) -> None:
    identity = Identity("mesh", "sender", "127.0.0.1:1", 7, "f" * 32, "sumweight")
    gen = torch.Generator().manual_seed(0)
    snapshot = {i: torch.randn(n, generator=gen) for i, n in enumerate([1, 33, 700, (5 << 18) + 3])}
    out = OutboundPush(Push("peer", 3, {0: 0.5, 1: 0.25, 2: 0.0, 3: 1.0}), snapshot)

    async def frames() -> list[bytes]:
        client = PeerClient(
            "127.0.0.1:1", identity, chunk_bytes=chunk_bytes, tls=Credentials(insecure=True)
        )
        try:
            return [f async for f in client._frames(out, sorted(out.push.weights), DEADLINE_S)]
        finally:
            await client.close()

    assert asyncio.run(frames()) == _protobuf_frames(out, identity, chunk_bytes)


def test_segment_frames_views_hold_the_same_bytes_as_copies() -> None:
    flat = torch.arange(1000, dtype=torch.float32)
    kwargs = {"sender": "s", "sequence": 1, "segment": 0, "sum_weight": 1.0, "flat": flat}
    copies = list(segment_frames(**kwargs, codec=Codec.RAW, chunk_bytes=512))
    views = list(segment_frames(**kwargs, codec=Codec.RAW, chunk_bytes=512, copy=False))
    assert copies[0] == views[0]
    assert all(isinstance(v, memoryview) and v.readonly for v in views[1:])
    assert [bytes(v) for v in views[1:]] == copies[1:]
