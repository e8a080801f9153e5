"""Push frames for the flood tests, written by hand: an open, a segment's header and raw
chunks as an accepted sender (``attacker``) sends them, or the head of a push that stalls
after 4 MiB of its 16 MB segment. The model is the synthetic job's at :data:`NUMEL`
parameters.
"""

from __future__ import annotations

import torch

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.compression.codecs import Codec
from gossipd.proto import gossip_pb2 as pb
from tests.outsider import MESH, synthetic_plan

NUMEL = 4_000_000  # segment 0: one 16 MB tensor; segment 1: the 33-parameter head
PLAN = synthetic_plan(numel=NUMEL)
SEGMENT_BYTES = PLAN.segments[0].nbytes
SENDER, INCARNATION = "attacker", 7
CHUNK_BYTES = 1 << 20


def open_frame(sequence: int, segment_count: int = 1) -> bytes:
    opened = pb.PushOpen(
        mesh_id=MESH,
        sender=SENDER,
        fingerprint=PLAN.fingerprint,
        sequence=sequence,
        segment_count=segment_count,
        incarnation=INCARNATION,
        sequence_base=1,
    )
    return pb.PushFrame(open=opened).SerializeToString()


def header_frame(sequence: int, index: int, payload_bytes: int, checksum: int) -> bytes:
    header = pb.SegmentHeader(
        sender=SENDER,
        segment=index,
        sequence=sequence,
        sum_weight=1.0,
        dtype=pb.DTYPE_FLOAT32,
        numel=PLAN.segments[index].numel,
        codec=pb.CODEC_RAW,
        payload_bytes=payload_bytes,
        checksum=checksum,
    )
    return pb.PushFrame(header=header).SerializeToString()


def segment_frames(sequence: int, index: int, values: torch.Tensor) -> list[bytes]:
    data = bytes(wirecodec.encode(values, Codec.RAW))
    chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
    return [
        header_frame(sequence, index, len(data), wirecodec.checksum(data)),
        *(pb.PushFrame(chunk=c).SerializeToString() for c in chunks),
    ]


def stalling_head(sequence: int) -> list[bytes]:
    """Open, the header of the big segment, then 4 MiB of its 16 MB: a push that stalls."""
    chunk = pb.PushFrame(chunk=b"\x01" * CHUNK_BYTES).SerializeToString()
    return [open_frame(sequence), header_frame(sequence, 0, SEGMENT_BYTES, 0), *[chunk] * 4]
