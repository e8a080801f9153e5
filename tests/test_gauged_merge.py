"""A received segment gauged against our own as it arrives, then blended in one pass.

The receiving assembler measures ‖v‖², v·x and ‖x‖² off the trainer thread; the merge
at the step boundary checks the bound from those numbers and blends with
``lerp_``. These tests drive the real assembler (header and chunk frames, checksum,
decode) and a real replica on its trainer-thread path (``idle``); no daemon. The
daemon's pushes and pulls run this path in every mesh test (tests/test_pulls.py's
pulling core averages through it).
"""

from __future__ import annotations

import math

import pytest
import torch

from gossipd.node.compression.codecs import BlockHasher, Codec, checksum
from gossipd.node.errors import InvalidFrame, NonFinitePayload, PayloadOutOfBounds
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.model.payload_bound import PayloadBound
from gossipd.node.net.wire.frames import Limits, SegmentAssembler, segment_frames
from gossipd.node.trainer.messages import InboundPush, ReceivedSegment
from gossipd.node.trainer.replica import Replica


def _replica(bound: PayloadBound | None = None, numel: int | None = None) -> Replica:
    options = {} if numel is None else {"numel": numel}
    job = build_job(JobSpec("synthetic", seed=3, learning_rate=0.0, options=options))
    settings = {"options": {"push_probability": 0.0}, "max_weight": 100.0}
    return Replica(
        "r", job.model, segment_bytes=4 << 20, settings=settings, bound=bound or PayloadBound()
    )


def _received(replica: Replica, values: torch.Tensor, weight: float = 1.0) -> ReceivedSegment:
    """``values`` as segment 0 through the assembler a receiving node uses."""
    assembler = SegmentAssembler(replica.flat.plan, Limits(), gauge=replica.gauge)
    frames = segment_frames(
        sender="s", sequence=1, segment=0, sum_weight=weight, flat=values, codec=Codec.RAW,
        chunk_bytes=1 << 16,
    )  # fmt: skip
    out = [assembler.header(next(frames))] + [assembler.chunk(piece) for piece in frames]
    segments = [seg for seg in out if seg is not None]
    assert len(segments) == 1
    return segments[0]


def _merge(replica: Replica, seg: ReceivedSegment, sequence: int = 1) -> None:
    item = InboundPush("s", 1, sequence, [seg])
    replica.inbox.put(item)
    replica.idle(0)
    item.reply.result(timeout=5.0)


def test_a_gauged_push_is_blended_by_lerp_with_exact_weights() -> None:
    replica = _replica()
    own = replica.flat.buffers[0].clone()
    incoming = own + torch.linspace(-0.3, 0.7, own.numel())
    seg = _received(replica, incoming, weight=0.25)
    assert seg.gauge is not None
    version = replica.flat.version
    _merge(replica, seg)
    assert torch.equal(replica.flat.buffers[0], torch.lerp(own, incoming, 0.2))
    # The same blend as the textbook x + α(v − x), to rounding.
    torch.testing.assert_close(replica.flat.buffers[0], own + 0.2 * (incoming - own))
    assert replica.flat.version > version
    assert replica.summary.weights == (1.25,)


def test_the_gauge_measures_the_exact_distance_and_scale() -> None:
    replica = _replica(numel=1 << 21)
    own = replica.flat.buffers[0]
    gen = torch.Generator().manual_seed(11)
    incoming = own + 0.5 * torch.randn(own.numel(), generator=gen)
    gauge = PayloadBound().gauge(own, incoming)
    assert gauge is not None and gauge.numel == own.numel()
    exact = float(torch.linalg.vector_norm((incoming - own).double()))
    assert math.sqrt(gauge.distance_sq) == pytest.approx(exact, rel=1e-4)
    assert math.sqrt(gauge.own_sq) == pytest.approx(
        float(torch.linalg.vector_norm(own.double())), rel=1e-5
    )


def test_the_blend_uses_our_segment_as_it_is_at_merge_time() -> None:
    """The gauge may read our segment a step before the merge; the blend does not."""
    replica = _replica()
    incoming = replica.flat.buffers[0] + 0.5
    seg = _received(replica, incoming.clone())
    replica.flat.buffers[0].add_(0.01)  # a training step between arrival and merge
    moved = replica.flat.buffers[0].clone()
    _merge(replica, seg)
    assert torch.equal(replica.flat.buffers[0], torch.lerp(moved, incoming, 0.5))
    assert replica.summary.weights == (2.0,)


def test_a_gauged_payload_beyond_the_bound_is_refused_and_the_model_is_untouched() -> None:
    replica = _replica()
    before = replica.flat.buffers[0].clone()
    seg = _received(replica, before + 1e6)
    assert seg.gauge is not None
    with pytest.raises(PayloadOutOfBounds, match=r"limits\.max_payload_distance"):
        _merge(replica, seg)
    assert torch.equal(replica.flat.buffers[0], before)
    assert replica.summary.weights == (1.0,)


def test_a_nan_payload_is_refused_at_the_assembler_though_the_gauge_skips_the_sum() -> None:
    replica = _replica()
    poisoned = replica.flat.buffers[0].clone()
    poisoned[7] = float("nan")
    with pytest.raises(NonFinitePayload, match="1 NaN or infinite values"):
        _received(replica, poisoned)


def test_values_whose_squares_overflow_take_the_exact_path() -> None:
    """Finite values of 1e20 square past float32: the gauge proves nothing, the
    assembler checks finiteness itself and the merge measures exactly (and refuses)."""
    replica = _replica()
    before = replica.flat.buffers[0].clone()
    seg = _received(replica, torch.full_like(before, 1e20))
    assert seg.gauge is None
    with pytest.raises(PayloadOutOfBounds):
        _merge(replica, seg)
    assert torch.equal(replica.flat.buffers[0], before)


def test_a_gauged_segment_beyond_the_clip_radius_is_clipped_on_the_exact_path() -> None:
    replica = _replica(PayloadBound(clip=2.0))
    own = replica.flat.buffers[0].clone()
    far = own + 10.0 * max(float(own.pow(2).mean().sqrt()), 1.0)
    seg = _received(replica, far)
    assert seg.gauge is not None
    item = InboundPush("s", 1, 1, [seg])
    replica.inbox.put(item)
    report = replica.idle(0)
    item.reply.result(timeout=5.0)
    assert [m.clipped_segments for m in report.merged] == [(0,)]
    moved = float((replica.flat.buffers[0] - own).pow(2).mean().sqrt())
    assert moved == pytest.approx(0.5 * 2.0 * 1.0, rel=1e-3)  # α · clip · scale (floor 1)
    assert replica.summary.weights == (2.0,)


@pytest.mark.parametrize("block", [0, 1, -1], ids=["first block", "second block", "last byte"])
def test_the_checksum_hashed_block_by_block_with_the_gauge_still_refuses_a_flipped_byte(
    block: int,
) -> None:
    """The receiver hashes each block as the gauge reads it: the same digest as the whole
    payload's, so a byte flipped anywhere (here in one of several gauge blocks) is refused."""
    replica = _replica(numel=1 << 20)  # one 4 MiB segment: two gauge blocks
    own = replica.flat.buffers[0].clone()
    incoming = own + 0.1
    assembler = SegmentAssembler(replica.flat.plan, Limits(), gauge=replica.gauge)
    frames = segment_frames(
        sender="s", sequence=1, segment=0, sum_weight=1.0, flat=incoming, codec=Codec.RAW,
        chunk_bytes=None,
    )  # fmt: skip
    header, payload = next(frames), bytearray(b"".join(bytes(p) for p in frames))
    at = len(payload) - 1 if block == -1 else block * (2 << 20) + 12345
    payload[at] ^= 0x10
    assembler.header(header)
    pieces = [bytes(payload[i : i + (1 << 20)]) for i in range(0, len(payload), 1 << 20)]
    for piece in pieces[:-1]:
        assert assembler.chunk(piece) is None
    with pytest.raises(InvalidFrame, match="checksum mismatch on segment 0"):
        assembler.chunk(pieces[-1])
    assert torch.equal(replica.flat.buffers[0], own)


def test_a_block_hasher_gives_the_whole_payloads_checksum() -> None:
    values = torch.randn(3 << 19, generator=torch.Generator().manual_seed(5))
    hasher = BlockHasher()
    for start in range(0, values.numel(), 1 << 19):
        hasher.update(values[start : start + (1 << 19)])
    data = memoryview(values.numpy()).cast("B")
    assert hasher.digest(len(data)) == checksum(data)
    assert hasher.digest(len(data) + 4) is None, "a payload not fed whole has no digest"
