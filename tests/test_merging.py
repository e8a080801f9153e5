"""A push's merge written in place: the same bits as the textbook blend, finiteness proven
from the payload bound's norms, and the checked path for models near their dtype's limit.

Real torch and a real replica on its trainer-thread path (``idle``); no daemon.
"""

from __future__ import annotations

import pytest
import torch

from gossipd.node.errors import PayloadOutOfBounds
from gossipd.node.jobs import JobSpec, build_job
from gossipd.node.messages import InboundPush, ReceivedSegment
from gossipd.node.payload_bound import Delta, PayloadBound
from gossipd.node.replica import Replica


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
    delta = Delta(torch.zeros(4), False, own_norm, norm)
    assert delta.blend_is_finite(alpha) is proven
