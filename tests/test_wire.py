"""Wire framing (node/net/wire/frames.py): segment frames, the assembler, chunk views.

Protects docs/design.md §8: an assembler that hands on a segment whole and verified, or
refuses it with a message naming the bad value.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.compression.codecs import Codec
from gossipd.node.errors import (
    InvalidFrame,
    NonFinitePayload,
    PayloadTooLarge,
)
from gossipd.node.model.segments import (
    SegmentPlan,
    plan_segments,
)
from gossipd.node.net.wire.frames import (
    PULL_CHUNK_TAG,
    PUSH_CHUNK_TAG,
    Limits,
    ReceivedSegment,
    SegmentAssembler,
    chunk_view,
    pull_frame,
    segment_frames,
)
from gossipd.proto import gossip_pb2 as pb
from tests.tensors import F16, F32, F64, named, seeded_values


@pytest.fixture
def plan() -> SegmentPlan:
    # segment 0: float32 x 37, segment 1: float64 x 10, segment 2: float16 x 5
    return plan_segments(
        named(
            ("w", (37,), F32),
            ("d", (10,), F64),
            ("h", (5,), F16),
        ),
        segment_bytes=1 << 20,
    )


def _payload(plan: SegmentPlan, index: int, seed: int = 0) -> torch.Tensor:
    seg = plan.segments[index]
    return seeded_values(seg.dtype, seg.numel, seed)


def _frames(plan, index, *, codec=Codec.RAW, chunk_bytes=1 << 20, sum_weight=0.5, flat=None):
    flat = _payload(plan, index) if flat is None else flat
    frames = list(
        segment_frames(
            sender="peer-a",
            sequence=9,
            segment=index,
            sum_weight=sum_weight,
            flat=flat,
            codec=codec,
            chunk_bytes=chunk_bytes,
        )
    )
    header, chunks = frames[0], frames[1:]
    assert isinstance(header, pb.SegmentHeader)
    assert all(isinstance(c, bytes) for c in chunks)
    return header, chunks


def _feed(asm: SegmentAssembler, header, chunks) -> list[ReceivedSegment]:
    out = [asm.header(header)]
    out += [asm.chunk(c) for c in chunks]
    done = [r for r in out if r is not None]
    assert out[-1] is not None and len(done) == 1, "segment must complete exactly at its end"
    return done


def test_segment_frames_header_describes_the_payload(plan):
    flat = _payload(plan, 1)
    header, chunks = _frames(plan, 1, chunk_bytes=16)
    data = b"".join(chunks)
    assert header.sender == "peer-a" and header.sequence == 9 and header.segment == 1
    assert header.sum_weight == 0.5
    assert header.dtype == pb.DTYPE_FLOAT64
    assert header.numel == 10
    assert header.codec == pb.CODEC_RAW
    assert header.payload_bytes == len(data) == 80
    assert header.checksum == wirecodec.checksum(data)
    assert data == flat.numpy().tobytes()
    assert [len(c) for c in chunks] == [16] * 5


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 5, 7, 8, 13, 64, 100, 148, 149, 4096])
def test_assembler_rebuilds_every_segment_exactly_for_any_chunk_size(plan, chunk_bytes):
    asm = SegmentAssembler(plan, Limits())
    for index in (2, 0, 1):  # any order of segments within a stream
        flat = _payload(plan, index, seed=index)
        header, chunks = _frames(plan, index, chunk_bytes=chunk_bytes, flat=flat, sum_weight=0.125)
        [got] = _feed(asm, header, chunks)
        assert got.segment == index
        assert got.sum_weight == 0.125
        assert got.values.dtype == flat.dtype
        assert torch.equal(got.values, flat)
    asm.close()


@pytest.mark.parametrize("codec", [Codec.FP16, Codec.BF16])
def test_assembler_decodes_half_codecs_to_the_model_dtype(plan, codec):
    asm = SegmentAssembler(plan, Limits())
    flat = _payload(plan, 0)
    header, chunks = _frames(plan, 0, codec=codec, chunk_bytes=10, flat=flat)
    assert header.payload_bytes == 37 * 2
    [got] = _feed(asm, header, chunks)
    assert got.values.dtype == F32
    torch.testing.assert_close(got.values, flat, rtol=2**-8, atol=1e-4)


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4])
def test_assembler_decodes_int_codecs_checking_their_exact_size(plan, codec):
    asm = SegmentAssembler(plan, Limits())
    flat = _payload(plan, 0)
    header, chunks = _frames(plan, 0, codec=codec, chunk_bytes=10, flat=flat)
    assert header.payload_bytes == wirecodec.encoded_nbytes(codec, F32, 37)
    [got] = _feed(asm, header, chunks)
    assert got.values.dtype == F32
    step = flat.abs().max() / (127 if codec == Codec.INT8 else 7)
    assert (got.values - flat).abs().max() <= 0.51 * step
    asm2 = SegmentAssembler(plan, Limits())
    header.payload_bytes += 1
    with pytest.raises(InvalidFrame, match=f"segment 0 in {codec.name.lower()} is"):
        asm2.header(header)


def test_assembler_completes_an_empty_segment_on_its_header():
    plan = plan_segments(named(("empty", (0,), F32), ("w", (3,), F64)), segment_bytes=1 << 20)
    asm = SegmentAssembler(plan, Limits())
    header, chunks = _frames(plan, 0, flat=torch.zeros(0))
    assert chunks == []
    got = asm.header(header)
    assert got is not None and got.values.numel() == 0
    asm.close()


def _refused(asm, header, chunks=(), error=InvalidFrame, match=""):
    with pytest.raises(error, match=match):
        asm.header(header)
        for c in chunks:
            asm.chunk(c)


def test_assembler_refuses_segment_index_out_of_range_naming_it(plan):
    header, _ = _frames(plan, 0)
    header.segment = 3
    _refused(SegmentAssembler(plan, Limits()), header, match=r"segment index 3 .*model has 3")
    header.segment = 2**32 - 1
    _refused(SegmentAssembler(plan, Limits()), header, match=str(2**32 - 1))


@pytest.mark.parametrize(
    ("wire_dtype", "shown"),
    [(pb.DTYPE_FLOAT64, "torch.float64"), (pb.DTYPE_UNSPECIFIED, "0"), (77, "77")],
)
def test_assembler_refuses_wrong_dtype_naming_both(plan, wire_dtype, shown):
    header, _ = _frames(plan, 0)
    header.dtype = wire_dtype
    _refused(
        SegmentAssembler(plan, Limits()),
        header,
        match=rf"segment 0 has dtype torch\.float32 here but the header says {shown}",
    )


def test_assembler_refuses_wrong_element_count_naming_both(plan):
    header, _ = _frames(plan, 0)
    header.numel = 38
    _refused(SegmentAssembler(plan, Limits()), header, match=r"37 elements here .* says 38")


def test_assembler_refuses_payload_bytes_disagreeing_with_numel_and_codec(plan):
    header, _ = _frames(plan, 0)
    header.payload_bytes = 37 * 4 + 1
    _refused(SegmentAssembler(plan, Limits()), header, match=r"raw is 148 bytes .* says 149")
    header, _ = _frames(plan, 0, codec=Codec.FP16)
    header.payload_bytes = 148  # raw size while announcing fp16
    _refused(SegmentAssembler(plan, Limits()), header, match=r"fp16 is 74 bytes .* says 148")


@pytest.mark.parametrize("codec", [pb.CODEC_UNSPECIFIED, 9])
def test_assembler_refuses_unknown_codec_naming_it(plan, codec):
    header, _ = _frames(plan, 0)
    header.codec = codec
    _refused(SegmentAssembler(plan, Limits()), header, match=rf"unknown codec {codec} ")


@pytest.mark.parametrize("codec", [pb.CODEC_TOPK2, pb.CODEC_TOPK4])
def test_assembler_refuses_the_simulator_only_sparse_codecs_saying_so(plan, codec):
    header, _ = _frames(plan, 0)
    header.codec = codec
    _refused(SegmentAssembler(plan, Limits()), header, match=r"topk\d, which only the simulator")


def test_assembler_refuses_segment_over_size_limit_before_allocating(plan):
    header, _ = _frames(plan, 0)
    asm = SegmentAssembler(plan, Limits(max_segment_bytes=147))
    _refused(asm, header, error=PayloadTooLarge, match=r"148 bytes, over the limit of 147")
    assert SegmentAssembler(plan, Limits(max_segment_bytes=148)).header(header) is None


def test_assembler_refuses_chunk_over_chunk_limit(plan):
    header, _ = _frames(plan, 0)
    asm = SegmentAssembler(plan, Limits(max_chunk_bytes=100))
    assert asm.header(header) is None
    with pytest.raises(PayloadTooLarge, match=r"chunk of 101 bytes .* limit of 100"):
        asm.chunk(bytes(101))


@pytest.mark.parametrize("weight", [-0.5, -1e-300, math.nan, math.inf, -math.inf])
def test_assembler_refuses_negative_or_non_finite_sum_weight(plan, weight):
    header, _ = _frames(plan, 0, sum_weight=weight)
    _refused(
        SegmentAssembler(plan, Limits()),
        header,
        match=re.escape(f"sum-weight {weight} for segment 0"),
    )


def test_assembler_accepts_zero_sum_weight(plan):
    header, chunks = _frames(plan, 0, sum_weight=0.0)
    [got] = _feed(SegmentAssembler(plan, Limits()), header, chunks)
    assert got.sum_weight == 0.0


def test_assembler_refuses_chunk_before_any_header(plan):
    asm = SegmentAssembler(plan, Limits())
    with pytest.raises(InvalidFrame, match="a 12-byte chunk arrived with no segment header"):
        asm.chunk(bytes(12))
    header, chunks = _frames(plan, 1)
    _feed(asm, header, chunks)
    with pytest.raises(InvalidFrame, match="a 3-byte chunk"):
        asm.chunk(bytes(3))  # after a complete segment


def test_assembler_refuses_payload_overflowing_its_header(plan):
    header, chunks = _frames(plan, 0, chunk_bytes=100)
    asm = SegmentAssembler(plan, Limits())
    asm.header(header)
    asm.chunk(chunks[0])
    with pytest.raises(
        InvalidFrame, match=r"segment 0 overflows: 150 bytes received, header says 148"
    ):
        asm.chunk(chunks[1] + b"\0\0")


def test_assembler_refuses_corrupted_payload_by_checksum(plan):
    header, chunks = _frames(plan, 0, chunk_bytes=64)
    corrupted = bytearray(chunks[1])
    corrupted[5] ^= 0x01
    asm = SegmentAssembler(plan, Limits())
    asm.header(header)
    asm.chunk(chunks[0])
    asm.chunk(bytes(corrupted))
    with pytest.raises(
        InvalidFrame, match=rf"checksum mismatch on segment 0: header says {header.checksum:#018x}"
    ):
        asm.chunk(chunks[2])


def test_assembler_refuses_wrong_checksum_in_header(plan):
    header, chunks = _frames(plan, 1)
    header.checksum ^= 1
    _refused(
        SegmentAssembler(plan, Limits()), header, chunks, match="checksum mismatch on segment 1"
    )


def test_assembler_refuses_non_finite_payload_with_a_valid_checksum(plan):
    flat = _payload(plan, 1)
    flat[4] = math.nan
    header, chunks = _frames(plan, 1, flat=flat, chunk_bytes=32)
    _refused(
        SegmentAssembler(plan, Limits()), header, chunks, error=NonFinitePayload, match="1 NaN"
    )


def test_assembler_refuses_a_segment_sent_twice_in_one_stream(plan):
    asm = SegmentAssembler(plan, Limits())
    header, chunks = _frames(plan, 2)
    _feed(asm, header, chunks)
    with pytest.raises(InvalidFrame, match="segment 2 sent twice in one stream"):
        asm.header(header)


def test_assembler_refuses_a_header_inside_an_open_segment(plan):
    asm = SegmentAssembler(plan, Limits())
    h0, chunks0 = _frames(plan, 0, chunk_bytes=100)
    h1, _ = _frames(plan, 1)
    asm.header(h0)
    asm.chunk(chunks0[0])
    with pytest.raises(
        InvalidFrame, match=r"header for segment 1 arrived before segment 0 .*\(100 of 148 bytes\)"
    ):
        asm.header(h1)


@pytest.mark.parametrize("received", [0, 1, 147])
def test_close_inside_a_segment_reports_the_truncated_stream(plan, received):
    header, chunks = _frames(plan, 0)
    asm = SegmentAssembler(plan, Limits())
    asm.header(header)
    if received:
        asm.chunk(b"".join(chunks)[:received])
    with pytest.raises(InvalidFrame, match=rf"ended inside segment 0: {received} of 148 bytes"):
        asm.close()


def test_close_after_complete_segments_or_on_an_empty_stream_is_fine(plan):
    SegmentAssembler(plan, Limits()).close()
    asm = SegmentAssembler(plan, Limits())
    header, chunks = _frames(plan, 0)
    _feed(asm, header, chunks)
    asm.close()


@pytest.mark.parametrize(
    ("message", "tag", "parse"),
    [(pb.PullFrame, PULL_CHUNK_TAG, pull_frame), (pb.PushFrame, PUSH_CHUNK_TAG, None)],
    ids=["pull", "push"],
)
@pytest.mark.parametrize("size", [0, 1, 127, 128, 16383, 16384, 1 << 20])
def test_chunk_view_reads_protobufs_own_chunk_frames_without_a_copy(message, tag, parse, size):
    """Push receivers and pull requesters read chunks through one function: the payload
    of any chunk protobuf writes, as a view of the received bytes (no copy)."""
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    data = message(chunk=payload).SerializeToString()
    view = chunk_view(data, tag)
    assert isinstance(view, memoryview) and view.obj is data and bytes(view) == payload
    if parse is not None:
        assert bytes(parse(data)) == payload


@pytest.mark.parametrize(
    "data",
    [
        pb.PullFrame(header=pb.SegmentHeader(segment=3, payload_bytes=8)).SerializeToString(),
        pb.PullFrame(chunk=b"abcd").SerializeToString() + b"\x0a\x00",  # a field after it
        pb.PullFrame(chunk=b"abcd").SerializeToString()[:-1],  # truncated
        PULL_CHUNK_TAG + b"\xff" * 11,  # a length that never ends
        b"",
    ],
    ids=["header", "trailing-field", "truncated", "endless-length", "empty"],
)
def test_anything_but_a_whole_chunk_frame_is_left_to_protobuf(data):
    assert chunk_view(data, PULL_CHUNK_TAG) is None


def test_a_pulled_header_frame_is_parsed_as_protobuf():
    header = pb.SegmentHeader(segment=3, payload_bytes=8, sum_weight=0.5)
    frame = pull_frame(pb.PullFrame(header=header).SerializeToString())
    assert isinstance(frame, pb.PullFrame) and frame.header == header
