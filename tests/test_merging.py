"""A push's merge written in place: the same bits as the textbook blend, finiteness proven
from the payload bound's norms, the checked path for models near their dtype's limit, and
large payloads' segments merged side by side with the same bits.

Real torch and a real replica on its trainer-thread path (``idle``); no daemon.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gossipd.node.errors import PayloadOutOfBounds
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.model.payload_bound import Delta, PayloadBound
from gossipd.node.model.segments import PARALLEL_MIN_BYTES, SegmentWork
from gossipd.node.trainer.messages import InboundPush, ReceivedSegment
from gossipd.node.trainer.replica import Replica


def _replica() -> Replica:
    job = build_job(JobSpec("synthetic", seed=3, learning_rate=0.0))
    options = {"options": {"push_probability": 0.0}, "max_weight": 100.0}
    return Replica("r", job.model, segment_bytes=4 << 20, settings=options, bound=PayloadBound())


def _merge(replica: Replica, sequence: int, weight: float, values: torch.Tensor) -> None:
    item = InboundPush("s", 1, sequence, [ReceivedSegment(0, weight, values)])
    replica.inbox.put(item)
    replica.idle(0)
    item.reply.result(timeout=5.0)


def _textbook(own: torch.Tensor, incoming: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.add(own, incoming - own, alpha=alpha)


def test_an_in_place_merge_gives_the_textbook_blend_bit_for_bit() -> None:
    replica = _replica()
    own = replica.flat.buffers[0].clone()
    incoming = own + torch.linspace(-0.3, 0.7, own.numel())
    version = replica.flat.version
    _merge(replica, 1, 0.25, incoming.clone())
    assert torch.equal(replica.flat.buffers[0], _textbook(own, incoming, 0.2))
    assert replica.flat.version > version
    assert replica.summary.weights == (1.25,)


def test_a_model_near_its_dtypes_limit_is_blended_and_checked_whole() -> None:
    """Norms past half of float32's maximum prove nothing; the blend is computed and
    checked, and comes out the same as the textbook one."""
    replica = _replica()
    big = torch.full_like(replica.flat.buffers[0], 1e38)
    replica.flat.load_segment(0, big)
    incoming = big * 0.5
    delta = PayloadBound().delta(big.clone(), incoming.clone(), "test", 0)
    assert not delta.blend_is_finite(0.2)
    _merge(replica, 1, 0.25, incoming.clone())
    assert torch.equal(replica.flat.buffers[0], _textbook(big, incoming, 0.2))
    assert bool(torch.isfinite(replica.flat.buffers[0]).all())
    assert replica.summary.weights == (1.25,)


def test_a_refused_payload_leaves_the_model_bit_for_bit() -> None:
    """The bound writes its difference over the payload, never over the model."""
    replica = _replica()
    before = replica.flat.buffers[0].clone()
    far = before + 1e6
    far[0] = float("nan")
    item = InboundPush("s", 1, 1, [ReceivedSegment(0, 1.0, far)])
    replica.inbox.put(item)
    replica.idle(0)
    with pytest.raises(PayloadOutOfBounds):
        item.reply.result(timeout=5.0)
    assert torch.equal(replica.flat.buffers[0], before)
    assert replica.summary.weights == (1.0,)


@pytest.mark.parametrize(
    ("own_norm", "norm", "alpha", "proven"),
    [
        (1e3, 1e3, 0.5, True),
        (1.5e38, 1e38, 0.5, False),  # together past half of float32's maximum
        (1.0, 1.0, 1.5, False),  # not a blend: α above 1 extrapolates
        (1.0, 1.0, -0.1, False),
    ],
)
def test_the_norms_prove_a_blend_finite_only_inside_a_blend_and_the_dtypes_range(
    own_norm: float, norm: float, alpha: float, proven: bool
) -> None:
    delta = Delta(torch.zeros(4), False, own_norm, norm, 0.0)
    assert delta.blend_is_finite(alpha) is proven


def _four_segment_replica(threads: int) -> Replica:
    """Four 4 MiB segments (16 MiB, over the size below which merges stay on one thread)."""
    gen = torch.Generator().manual_seed(5)
    model = torch.nn.ParameterList(
        torch.nn.Parameter(torch.empty(1 << 20).normal_(generator=gen)) for _ in range(4)
    )
    options = {"options": {"push_probability": 0.0}, "max_weight": 100.0}
    replica = Replica("r", model, segment_bytes=4 << 20, settings=options)
    replica.flat.work = SegmentWork(threads)
    return replica


def test_segments_merged_side_by_side_give_the_same_bits_as_one_after_another() -> None:
    serial, parallel = _four_segment_replica(1), _four_segment_replica(2)
    incoming = [b + torch.linspace(-1.0, 1.0, b.numel()) for b in serial.flat.buffers]
    for replica in (serial, parallel):
        segments = [ReceivedSegment(i, 0.5, v.clone()) for i, v in enumerate(incoming)]
        item = InboundPush("s", 1, 1, segments)
        replica.inbox.put(item)
        replica.idle(0)
        item.reply.result(timeout=5.0)
    for a, b in zip(serial.flat.buffers, parallel.flat.buffers, strict=True):
        assert torch.equal(a, b)
    assert serial.summary.weights == parallel.summary.weights == (1.5,) * 4
    snapshots = serial.flat.snapshot(), parallel.flat.snapshot()
    assert all(torch.equal(snapshots[0][i], snapshots[1][i]) for i in range(4))


def test_side_by_side_work_raises_the_first_error_once_every_call_has_finished() -> None:
    """A refused payload's other segments must not still be written after the refusal."""
    both_running = threading.Barrier(2, timeout=10.0)
    finished: list[int] = []

    def first() -> None:
        both_running.wait()
        raise PayloadOutOfBounds("segment 0")

    def second() -> None:
        both_running.wait()
        finished.append(1)
        raise KeyError("segment 1")

    with pytest.raises(PayloadOutOfBounds, match="segment 0"):
        SegmentWork(2).run([first, second], PARALLEL_MIN_BYTES)
    assert finished == [1]
    assert SegmentWork(2).run([lambda: 1, lambda: 2], PARALLEL_MIN_BYTES) == [1, 2]


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CI and this machine have none)"
)
def test_a_gpu_model_merges_a_host_payload_with_the_textbook_bits() -> None:
    """A GPU site's segments stay on the device: the payload (received into host memory)
    is copied over, its difference and norms taken there, and the add is in place."""
    gen = torch.Generator().manual_seed(6)
    model = torch.nn.ParameterList(
        torch.nn.Parameter(torch.empty(1 << 20).normal_(generator=gen)) for _ in range(4)
    ).cuda()
    options = {"options": {"push_probability": 0.0}, "max_weight": 100.0}
    replica = Replica("r", model, segment_bytes=4 << 20, settings=options)
    own = [b.clone() for b in replica.flat.buffers]
    incoming = [(b + 0.25).cpu() for b in own]
    item = InboundPush(
        "s", 1, 1, [ReceivedSegment(i, 1.0, v.clone()) for i, v in enumerate(incoming)]
    )
    replica.inbox.put(item)
    replica.idle(0)
    item.reply.result(timeout=30.0)
    for b, x, y in zip(replica.flat.buffers, own, incoming, strict=True):
        assert b.is_cuda
        assert torch.equal(b, _textbook(x, y.cuda(), 0.5))
    assert replica.summary.weights == (2.0,) * 4
