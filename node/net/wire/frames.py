"""Segments into frames: a header and its payload in chunks, chunk frames written and
read by hand, without a protobuf round trip.

Frames back into segments, validated, are :mod:`.assembly`'s; its names are importable
from here too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, cast, overload

import torch

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.compression.codecs import Codec
from gossipd.node.compression.feedback import Encoded
from gossipd.node.net.wire.assembly import Limits, SegmentAssembler
from gossipd.node.trainer.messages import ReceivedSegment
from gossipd.proto import gossip_pb2 as pb

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "PULL_CHUNK_TAG",
    "PUSH_CHUNK_TAG",
    "Limits",
    "ReceivedSegment",
    "SegmentAssembler",
    "chunk_view",
    "chunks",
    "encoded_segment",
    "pull_chunk_frame",
    "pull_frame",
    "push_chunk_frame",
    "segment_frames",
    "wire_codec",
]

DEFAULT_CHUNK_BYTES = 1 << 20


def encoded_segment(
    *,
    sender: str,
    sequence: int,
    segment: int,
    sum_weight: float,
    flat: torch.Tensor,
    codec: Codec,
    checksum: bool = True,
    sent: Encoded | None = None,
) -> tuple[pb.SegmentHeader, memoryview]:
    """A segment's header and its encoded payload (a read-only view, valid while ``flat``
    is unchanged): what chunk frames or the bulk lane then carry. ``checksum=False``
    (a payload in sealed records, whose receiver does not check it) leaves it 0.
    ``sent``: the segment as error feedback encoded it (a difference, and its versions)."""
    data = wirecodec.encode(flat, codec) if sent is None else sent.data
    header = pb.SegmentHeader(
        sender=sender,
        segment=segment,
        sequence=sequence,
        sum_weight=sum_weight,
        dtype=cast("pb.DType", wirecodec.DTYPE_TO_WIRE[flat.dtype]),
        numel=flat.numel(),
        codec=wire_codec(codec if sent is None else sent.codec),
        payload_bytes=len(data),
        checksum=wirecodec.checksum(data) if checksum else 0,
        base_version=sent.base if sent is not None else 0,
        version=sent.version if sent is not None else 0,
    )
    return header, data.toreadonly()


def wire_codec(codec: Codec) -> pb.Codec:
    """``codec`` as a message field takes it (the stubs type protobuf enums apart from int)."""
    return cast("pb.Codec", int(codec))


@overload
def segment_frames(
    *,
    sender: str,
    sequence: int,
    segment: int,
    sum_weight: float,
    flat: torch.Tensor,
    codec: Codec,
    chunk_bytes: int | None = ...,
    copy: Literal[True] = ...,
    checksum: bool = ...,
) -> Iterator[pb.SegmentHeader | bytes]: ...
@overload
def segment_frames(
    *,
    sender: str,
    sequence: int,
    segment: int,
    sum_weight: float,
    flat: torch.Tensor,
    codec: Codec,
    chunk_bytes: int | None = ...,
    copy: Literal[False],
    checksum: bool = ...,
) -> Iterator[pb.SegmentHeader | memoryview]: ...
def segment_frames(
    *,
    sender: str,
    sequence: int,
    segment: int,
    sum_weight: float,
    flat: torch.Tensor,
    codec: Codec,
    chunk_bytes: int | None = DEFAULT_CHUNK_BYTES,
    copy: bool = True,
    checksum: bool = True,
) -> Iterator[pb.SegmentHeader | bytes | memoryview]:
    """A header, then the encoded payload in ``chunk_bytes`` pieces (None: one piece,
    for the bulk lane).

    Pieces are ``bytes``; with ``copy=False`` they are read-only views of the
    encoded payload instead, valid while ``flat`` is unchanged, for a caller
    that copies them into its own frames anyway.
    """
    header, data = encoded_segment(
        sender=sender,
        sequence=sequence,
        segment=segment,
        sum_weight=sum_weight,
        flat=flat,
        codec=codec,
        checksum=checksum,
    )
    yield header
    for piece in chunks(data, chunk_bytes or max(len(data), 1)):
        yield piece.tobytes() if copy else piece


def chunks(data: memoryview, chunk_bytes: int) -> Iterator[memoryview]:
    """``data`` in views of ``chunk_bytes`` (the last one shorter), as chunk frames carry it."""
    for start in range(0, len(data), chunk_bytes):
        yield data[start : start + chunk_bytes]


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# Field tag of `bytes chunk`, wire type 2 (length-delimited), in each frame message.
PULL_CHUNK_TAG = _varint(pb.PullFrame.DESCRIPTOR.fields_by_name["chunk"].number << 3 | 2)
PUSH_CHUNK_TAG = _varint(pb.PushFrame.DESCRIPTOR.fields_by_name["chunk"].number << 3 | 2)


def chunk_view(data: bytes, tag: bytes) -> memoryview | None:
    """The payload of a chunk frame (``tag``, its length, the payload and nothing else)
    as a view of ``data``; None for any other frame, which the caller parses.

    Chunks are nearly all the bytes of a push or a pull; reading them through
    protobuf copies each megabyte twice more before it reaches the segment buffer.
    Push receivers and pull requesters read frames through this one function.
    """
    if not data.startswith(tag):
        return None
    length, shift, offset = 0, 0, len(tag)
    while offset < len(data) and offset <= len(tag) + 9:
        byte = data[offset]
        length |= (byte & 0x7F) << shift
        offset += 1
        shift += 7
        if not byte & 0x80:
            return memoryview(data)[offset:] if offset + length == len(data) else None
    return None


def pull_frame(data: bytes) -> pb.PullFrame | memoryview:
    """A pull reply frame: a chunk as a view of its payload, a header parsed."""
    view = chunk_view(data, PULL_CHUNK_TAG)
    return pb.PullFrame.FromString(data) if view is None else view


def pull_chunk_frame(data: bytes | memoryview) -> bytes:
    """``PullFrame(chunk=data)`` serialized by hand, byte for byte what protobuf writes.

    Chunks are nearly all the bytes of a transfer; going through a message would
    copy each megabyte twice more (into the message, then out of it).
    """
    return b"".join((PULL_CHUNK_TAG, _varint(len(data)), data))


def push_chunk_frame(data: bytes | memoryview) -> bytes:
    """``PushFrame(chunk=data)`` serialized by hand, like :func:`pull_chunk_frame`."""
    return b"".join((PUSH_CHUNK_TAG, _varint(len(data)), data))
