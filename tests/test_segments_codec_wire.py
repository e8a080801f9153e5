"""Segments, codecs and wire framing (node/trainer/segments.py, codec.py, node/net/wire.py).

Protects docs/design.md §4 and §8: segment plans and fingerprints, flat storage that the
module and optimizer really use, exact raw codec, and an assembler that hands on
a segment whole and verified, or refuses it with a message naming the bad value.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from gossipd.node.errors import (
    GossipdError,
    InvalidFrame,
    MeshMismatch,
    NonFinitePayload,
    PayloadTooLarge,
)
from gossipd.node.net.wire import (
    PULL_CHUNK_TAG,
    PUSH_CHUNK_TAG,
    Limits,
    ReceivedSegment,
    SegmentAssembler,
    chunk_view,
    pull_frame,
    segment_frames,
)
from gossipd.node.trainer import codec as wirecodec
from gossipd.node.trainer.codec import Codec
from gossipd.node.trainer.segments import (
    FlatModel,
    SegmentPlan,
    check_fingerprint,
    plan_segments,
    shareable_tensors,
)
from gossipd.proto import gossip_pb2 as pb


def named(*specs: tuple[str, tuple[int, ...], torch.dtype]) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.zeros(shape, dtype=dtype)) for name, shape, dtype in specs]


F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16


# ----------------------------------------------------------------------------------
# Segment plans
# ----------------------------------------------------------------------------------
def test_plan_packs_tensors_in_order_up_to_segment_bytes():
    # four 40-byte float32 tensors, 100-byte segments: [a, b], [c, d]
    plan = plan_segments(named(*[(n, (10,), F32) for n in "abcd"]), segment_bytes=100)
    assert [[t.name for t in s.tensors] for s in plan.segments] == [["a", "b"], ["c", "d"]]
    assert [s.index for s in plan.segments] == [0, 1]
    assert [s.nbytes for s in plan.segments] == [80, 80]
    assert plan.nbytes == 160
    assert len(plan) == 2


def test_plan_segments_never_exceed_segment_bytes_unless_one_tensor_does():
    sizes = [3, 17, 1, 64, 5, 5, 5, 300, 2, 2, 40]
    tensors = named(*[(f"t{i}", (n,), F32) for i, n in enumerate(sizes)])
    plan = plan_segments(tensors, segment_bytes=128)
    flat_names = [t.name for s in plan.segments for t in s.tensors]
    assert flat_names == [name for name, _ in tensors]  # order kept, nothing lost or repeated
    for seg in plan.segments:
        assert seg.nbytes <= 128 or len(seg.tensors) == 1


def test_tensor_larger_than_segment_bytes_forms_a_segment_alone():
    plan = plan_segments(
        named(("small1", (4,), F32), ("big", (1000,), F32), ("small2", (4,), F32)),
        segment_bytes=64,
    )
    assert [[t.name for t in s.tensors] for s in plan.segments] == [
        ["small1"],
        ["big"],
        ["small2"],
    ]
    assert plan.segments[1].nbytes == 4000


def test_every_segment_holds_a_single_dtype_and_a_dtype_change_starts_a_new_one():
    tensors = named(
        ("a", (2,), F32),
        ("b", (2,), F32),
        ("c", (2,), F64),
        ("d", (2,), F16),
        ("e", (2,), F16),
        ("f", (2,), F32),
    )
    plan = plan_segments(tensors, segment_bytes=1 << 20)
    assert [[t.name for t in s.tensors] for s in plan.segments] == [
        ["a", "b"],
        ["c"],
        ["d", "e"],
        ["f"],
    ]
    for seg in plan.segments:
        assert {t.dtype for t in seg.tensors} == {seg.dtype}
    assert [s.nbytes for s in plan.segments] == [16, 16, 8, 8]


@pytest.mark.parametrize("segment_bytes", [0, -1])
def test_plan_refuses_non_positive_segment_bytes_naming_the_value(segment_bytes):
    with pytest.raises(ValueError, match=f"got {segment_bytes}"):
        plan_segments(named(("a", (1,), F32)), segment_bytes)


def test_plan_refuses_an_empty_model():
    with pytest.raises(ValueError, match="no parameters"):
        plan_segments([])


def test_plan_refuses_integer_tensors_naming_them():
    with pytest.raises(ValueError, match=r"'steps'.*torch\.int64"):
        plan_segments([("w", torch.zeros(2)), ("steps", torch.zeros(2, dtype=torch.int64))])


def _fingerprint(specs, segment_bytes=1 << 20) -> str:
    return plan_segments(named(*specs), segment_bytes).fingerprint


BASE = (("enc.weight", (4, 3), F32), ("enc.bias", (4,), F32), ("head", (2, 4), F32))


def test_fingerprint_is_equal_for_identical_models():
    assert _fingerprint(BASE) == _fingerprint(BASE)
    fp = _fingerprint(BASE)
    assert re.fullmatch(r"[0-9a-f]{32}", fp)
    a, b = FlatModel(nn.Linear(3, 4)), FlatModel(nn.Linear(3, 4))  # different values
    assert a.fingerprint == b.fingerprint


@pytest.mark.parametrize(
    "changed",
    [
        (("enc.weight", (3, 4), F32), BASE[1], BASE[2]),  # shape, same numel
        (("enc.weight", (4, 3, 1), F32), BASE[1], BASE[2]),  # rank
        (("enc.W", (4, 3), F32), BASE[1], BASE[2]),  # name
        (("enc.weight", (4, 3), F64), BASE[1], BASE[2]),  # dtype
        (BASE[0], BASE[1]),  # a tensor removed
        (BASE[1], BASE[0], BASE[2]),  # order
    ],
    ids=["shape", "rank", "name", "dtype", "removed", "order"],
)
def test_fingerprint_changes_with_any_name_shape_dtype_or_order(changed):
    assert _fingerprint(changed) != _fingerprint(BASE)


def test_fingerprint_changes_when_segment_bytes_moves_the_cut_points():
    one = plan_segments(named(*BASE), segment_bytes=1 << 20)
    cut = plan_segments(named(*BASE), segment_bytes=64)
    assert len(one) == 1 and len(cut) > 1
    assert one.fingerprint != cut.fingerprint


def test_check_fingerprint_raises_mesh_mismatch_naming_both_fingerprints_and_peer():
    check_fingerprint("abc", "abc", "peer-1")
    with pytest.raises(MeshMismatch, match=r"peer-1.*ours is abc, theirs is abd"):
        check_fingerprint("abc", "abd", "peer-1")


# ----------------------------------------------------------------------------------
# FlatModel
# ----------------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _inside(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    base = flat.data_ptr()
    return base <= tensor.data_ptr() < base + flat.numel() * flat.element_size()


@pytest.mark.parametrize("segment_bytes", [1 << 20, 256, 16])
def test_every_shared_tensor_becomes_a_view_of_its_segment_buffer(segment_bytes):
    net = _net()
    flat = FlatModel(net, segment_bytes=segment_bytes)
    tensors = dict(shareable_tensors(net))
    for seg, buffer in zip(flat.plan.segments, flat.buffers, strict=True):
        assert buffer.dtype == seg.dtype and buffer.numel() == seg.numel
        offset = 0
        for spec in seg.tensors:
            t = tensors[spec.name]
            assert _inside(t, buffer), spec.name
            assert torch.equal(t.flatten(), buffer[offset : offset + spec.numel])
            offset += spec.numel
    flat.check_bound()


def test_binding_keeps_module_output_and_parameter_identity():
    net = _net()
    net.eval()
    x = torch.randn(3, 2, 6, 6, generator=torch.Generator().manual_seed(1))
    before = net(x)
    params = list(net.parameters())
    values = [p.detach().clone() for p in params]
    FlatModel(net, segment_bytes=512)
    assert list(net.parameters()) == params  # same Parameter objects
    for p, v in zip(net.parameters(), values, strict=True):
        assert torch.equal(p, v)
    assert torch.equal(net(x), before)


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.Adam(ps, lr=0.01),
    ],
    ids=["sgd", "adam"],
)
def test_optimizer_step_updates_the_flat_buffers(make_opt):
    net = _net()
    opt = make_opt(net.parameters())  # built before binding: must keep working
    flat = FlatModel(net, segment_bytes=512)
    before = [b.clone() for b in flat.buffers]
    x = torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(2))
    net(x).square().mean().backward()
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, flat.buffers, strict=True))
    tensors = dict(shareable_tensors(net))
    for seg, buffer in zip(flat.plan.segments, flat.buffers, strict=True):
        offset = 0
        for spec in seg.tensors:
            assert torch.equal(
                tensors[spec.name].detach().flatten(), buffer[offset : offset + spec.numel]
            )
            offset += spec.numel
    flat.check_bound()


def test_batchnorm_running_stats_are_shared_but_num_batches_tracked_is_not():
    net = _net()
    flat = FlatModel(net)
    names = {t.name for s in flat.plan.segments for t in s.tensors}
    assert {"bn.running_mean", "bn.running_var", "bn.weight", "bn.bias"} <= names
    assert "bn.num_batches_tracked" not in names
    before = [b.clone() for b in flat.buffers]
    net.train()
    net(torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(3)))
    mean_seg = next(
        s for s in flat.plan.segments if "bn.running_mean" in {t.name for t in s.tensors}
    )
    assert not torch.equal(before[mean_seg.index], flat.buffers[mean_seg.index])
    assert _inside(net.bn.running_mean, flat.buffers[mean_seg.index])
    assert int(net.bn.num_batches_tracked) == 1
    flat.check_bound()


def test_check_bound_fails_loudly_when_a_parameter_is_reassigned():
    net = _net()
    flat = FlatModel(net)
    net.fc.weight.data = net.fc.weight.data.clone()
    with pytest.raises(MeshMismatch, match=r"'fc\.weight'.*segment 0"):
        flat.check_bound()


@pytest.mark.parametrize("alpha", [0.0, 0.25, 0.5, 1.0])
def test_merge_segment_computes_convex_combination_in_place(alpha):
    net = nn.Linear(3, 2)
    flat = FlatModel(net)
    x = flat.buffers[0].clone()
    received = torch.randn(
        x.numel(), dtype=torch.float64, generator=torch.Generator().manual_seed(4)
    )
    flat.merge_segment(0, received, alpha)
    expected = (1 - alpha) * x + alpha * received.to(torch.float32)
    torch.testing.assert_close(flat.buffers[0], expected, rtol=1e-6, atol=1e-7)
    assert flat.buffers[0].dtype == torch.float32
    torch.testing.assert_close(net.weight.detach().flatten(), flat.buffers[0][:6])
    if alpha == 0.0:
        assert torch.equal(flat.buffers[0], x)
    if alpha == 1.0:
        assert torch.equal(flat.buffers[0], received.to(torch.float32))


def test_merge_segment_touches_only_its_segment():
    net = _net()
    flat = FlatModel(net, segment_bytes=256)
    assert len(flat.buffers) > 2
    others = {i: b.clone() for i, b in enumerate(flat.buffers) if i != 1}
    flat.merge_segment(1, torch.zeros_like(flat.buffers[1]), 0.5)
    for i, b in others.items():
        assert torch.equal(flat.buffers[i], b)


def test_snapshot_is_a_detached_copy_unaffected_by_later_updates():
    net = _net()
    flat = FlatModel(net, segment_bytes=256)
    snap = flat.snapshot()
    assert sorted(snap) == list(range(len(flat.buffers)))
    partial = flat.snapshot([1])
    assert sorted(partial) == [1]
    copies = {i: t.clone() for i, t in snap.items()}
    for i in range(len(flat.buffers)):
        assert snap[i].data_ptr() != flat.buffers[i].data_ptr()
        assert not snap[i].requires_grad
        flat.load_segment(i, torch.full_like(flat.buffers[i], 7.0))
    for i, t in snap.items():
        assert torch.equal(t, copies[i])
    assert not torch.equal(partial[1], flat.buffers[1])


def test_load_segment_and_checksum_track_model_content():
    a, b = FlatModel(_net(0)), FlatModel(_net(1))
    assert a.checksum() != b.checksum()
    for i, buf in enumerate(b.buffers):
        a.load_segment(i, buf)
    assert a.checksum() == b.checksum()
    assert torch.equal(a.buffers[0], b.buffers[0])


# ----------------------------------------------------------------------------------
# Codec
# ----------------------------------------------------------------------------------
def _values(dtype: torch.dtype, n: int = 1000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g, dtype=torch.float64) * 10).to(dtype)


@pytest.mark.parametrize("dtype", [F32, F64, F16, BF16])
def test_raw_codec_round_trip_is_bit_exact(dtype):
    x = _values(dtype)
    data = wirecodec.encode(x, Codec.RAW)
    assert len(data) == x.numel() * x.element_size()
    y = wirecodec.decode(bytearray(data), Codec.RAW, dtype, x.numel())
    assert y.dtype == dtype
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize(
    ("codec", "rtol"), [(Codec.FP16, 2**-11), (Codec.BF16, 2**-8)], ids=["fp16", "bf16"]
)
@pytest.mark.parametrize("dtype", [F32, F64])
def test_half_codecs_halve_the_bytes_and_round_within_their_precision(codec, rtol, dtype):
    x = _values(dtype)
    data = wirecodec.encode(x, codec)
    assert len(data) == x.numel() * 2 == x.numel() * wirecodec.encoded_itemsize(codec, dtype)
    y = wirecodec.decode(bytearray(data), codec, dtype, x.numel())
    assert y.dtype == dtype
    torch.testing.assert_close(y, x, rtol=rtol, atol=1e-4)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("codec", list(Codec))
def test_decode_refuses_nan_and_infinity_counting_them(bad, codec):
    x = _values(F32, 50)
    x[3] = bad
    x[40] = bad
    data = bytearray(wirecodec.encode(x, codec))
    with pytest.raises(NonFinitePayload, match="2 NaN or infinite values out of 50"):
        wirecodec.decode(data, codec, F32, 50)


def test_fp16_overflow_is_refused_at_decode_instead_of_merged_as_infinity():
    x = torch.tensor([1.0, 70000.0], dtype=F32)  # above fp16's 65504
    data = bytearray(wirecodec.encode(x, Codec.FP16))
    with pytest.raises(NonFinitePayload):
        wirecodec.decode(data, Codec.FP16, F32, 2)


def test_decode_refuses_wrong_length_naming_both_sizes():
    data = bytearray(wirecodec.encode(_values(F32, 10), Codec.RAW))
    with pytest.raises(InvalidFrame, match=r"payload is 40 bytes but 11 elements .* need 44"):
        wirecodec.decode(data, Codec.RAW, F32, 11)


def test_codec_parse_accepts_names_and_refuses_unknown_listing_choices():
    assert Codec.parse("raw") is Codec.RAW
    assert Codec.parse("FP16") is Codec.FP16
    assert Codec.parse("bf16") is Codec.BF16
    with pytest.raises(ValueError, match=r"'int4'.*raw, fp16, bf16"):
        Codec.parse("int4")


def test_every_codec_error_is_a_gossipd_error():
    for err in (InvalidFrame, NonFinitePayload, PayloadTooLarge, MeshMismatch):
        assert issubclass(err, GossipdError)


# ----------------------------------------------------------------------------------
# Wire: segment_frames and SegmentAssembler
# ----------------------------------------------------------------------------------
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
    return _values(seg.dtype, seg.numel, seed)


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
