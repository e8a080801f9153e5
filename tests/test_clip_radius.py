"""One member's payload moves a model by at most its weight share times a radius the other
senders set (:mod:`gossipd.node.trainer.clip_radius`, ``limits.clip_factor``).

Observed on a live mesh: a push of the receiver's own values plus 50, at weight 1, was
inside the sanity bound and merged, and within 3 s the mean of all three honest models
went from -1.6e-5 to 49.8. Real torch and a real replica on its trainer-thread path;
the daemon-level attack is in tests/test_insider_weight.py.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.model.payload_bound import RADIUS_FLOOR, PayloadBound
from gossipd.node.shared.config import LimitsConfig
from gossipd.node.trainer.clip_radius import DISTANCES_KEPT, SENDERS_KEPT, RecentDistances
from gossipd.node.trainer.messages import InboundPush, ReceivedSegment
from gossipd.node.trainer.replica import Replica

FACTOR = LimitsConfig().clip_factor  # the default: on, at 10


def test_the_typical_distance_is_the_upper_median_of_the_other_senders() -> None:
    recent = RecentDistances(True)
    assert recent.typical("a", 0) is None  # nobody on record: no radius
    recent.record("a", 0, 1.0)
    assert recent.typical("a", 0) is None  # a sender is never measured against itself
    assert recent.typical("b", 0) == 1.0
    recent.record("b", 0, 3.0)
    recent.record("liar", 0, 1e-9)  # a liar sending our own model back cannot lower it
    assert recent.typical("c", 0) == 1.0
    assert recent.typical("liar", 0) == 3.0  # its own payloads: the others' distances only
    recent.record("liar", 0, 1e-9)  # many pushes, one entry
    assert len(recent.latest) == 3
    for i in range(SENDERS_KEPT + 5):
        recent.record(f"p{i}", 0, 1.0)
    assert len(recent.latest) == SENDERS_KEPT
    assert RecentDistances(False).typical("a", 0) is None


def test_a_senders_entry_is_the_largest_of_its_recent_distances() -> None:
    """Near consensus (learning rate 0), a sender that merges with this node often comes
    ever closer, while one on an edge left idle for a few rounds brings a payload from
    where the mesh was then; measured against the close one's latest distance alone, that
    honest payload was clipped (a 3-site crossover mesh ended 3% off the exact mean)."""
    recent = RecentDistances(True)
    for k in range(10):
        recent.record("near", 0, 0.5**k)  # 1.0 down to 0.002
    assert recent.typical("idle", 0) == 1.0  # the idle sender's 0.3 is inside 10 × 1.0
    for _ in range(DISTANCES_KEPT - 1):
        recent.record("near", 0, 1e-3)
    assert recent.typical("idle", 0) == 0.5**9  # the 1.0 has left the window
    recent.record("near", 0, 1e-3)
    assert recent.typical("idle", 0) == 1e-3


def _replica(limits: LimitsConfig) -> Replica:
    job = build_job(JobSpec("synthetic", seed=3, learning_rate=0.0))
    settings = {"options": {"push_probability": 0.0}, "max_weight": 100.0}
    bound = PayloadBound.from_limits(limits)
    return Replica("r", job.model, segment_bytes=4 << 20, settings=settings, bound=bound)


def _push(replica: Replica, sender: str, weight: float, values: torch.Tensor, gauged: bool) -> None:
    gauge = PayloadBound().gauge(replica.flat.buffers[0], values) if gauged else None
    item = InboundPush(sender, 1, 1, [ReceivedSegment(0, weight, values, gauge)])
    replica.inbox.put(item)
    replica.idle(0)
    item.reply.result(timeout=5.0)


def _rms(t: torch.Tensor) -> float:
    return float(t.norm()) / math.sqrt(t.numel())


@pytest.mark.parametrize("gauged", [True, False], ids=["gauged", "exact"])
def test_a_payload_far_beyond_the_others_moves_the_model_by_its_share_of_the_radius(
    gauged: bool, caplog: pytest.LogCaptureFixture
) -> None:
    replica = _replica(LimitsConfig())  # the defaults
    offset = torch.linspace(-1.0, 1.0, replica.flat.buffers[0].numel())
    honest = 0.05 * offset / _rms(offset)  # RMS 0.05: what the others send
    for sender in ("h1", "h2"):
        own = replica.flat.buffers[0].clone()
        weight = replica.summary.weights[0]
        _push(replica, sender, 0.1, own + honest, gauged)  # merged as it came: not clipped
        merged = replica.flat.buffers[0]
        assert _rms(merged - own) == pytest.approx(0.1 / (weight + 0.1) * 0.05, rel=1e-3)
    own = replica.flat.buffers[0].clone()
    weight = replica.summary.weights[0]
    with caplog.at_level(logging.INFO, logger="gossipd.node.trainer.merging"):
        _push(replica, "insider", 1.0, own + 50.0, gauged)  # inside the sanity bound (100x)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("payload from insider: segment 0 was 50 (RMS)")
    assert "limits.clip_factor" in line
    alpha = 1.0 / (weight + 1.0)
    radius = FACTOR * max(0.05, RADIUS_FLOOR * 1.0)  # scale: payload_scale_floor, 1.0
    moved = _rms(replica.flat.buffers[0] - own)
    assert moved == pytest.approx(alpha * radius, rel=1e-3)  # not alpha * 50
    assert replica.summary.weights[0] == pytest.approx(weight + 1.0)  # weights stay exact


def test_with_the_clip_off_the_same_payload_moves_it_by_its_share_of_50() -> None:
    """``limits.clip_factor = inf``: every payload inside the sanity bound merged exactly,
    as in a mesh whose members are all trusted; nothing is recorded either."""
    replica = _replica(LimitsConfig(clip_factor=math.inf))
    assert replica.merger.recent.on is False
    offset = torch.linspace(-1.0, 1.0, replica.flat.buffers[0].numel())
    for sender in ("h1", "h2"):
        own = replica.flat.buffers[0].clone()
        _push(replica, sender, 0.1, own + 0.05 * offset / _rms(offset), False)
    own = replica.flat.buffers[0].clone()
    weight = replica.summary.weights[0]
    _push(replica, "insider", 1.0, own + 50.0, False)
    assert _rms(replica.flat.buffers[0] - own) == pytest.approx(50.0 / (weight + 1.0), rel=1e-3)
