"""The admission limits a daemon's servicer enforces, without a daemon: a pending-bytes
budget below the largest segment is refused at start, the budget is charged before a
segment's buffer exists and released however a stream ends, and slots refuse one more
at once. The floods that exercise them on a real daemon are
``tests/test_resource_budgets.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gossipd.node.errors import Busy, ConfigError, InvalidFrame
from gossipd.node.net.limits.admission import ByteBudget, Slots
from gossipd.node.net.serve.servicer import GossipServicer
from gossipd.node.net.wire.frames import Limits, SegmentAssembler
from gossipd.node.shared.config import NodeConfig
from gossipd.proto import gossip_pb2 as pb
from tests.flood_frames import (
    PLAN,
    SEGMENT_BYTES,
    stalling_head,
)
from tests.outsider import MESH


def test_budget_below_the_largest_segment_is_refused_when_the_servicer_is_built() -> None:
    """Nothing could ever be received, so the node refuses to start and names the key."""
    limits = {"max_pending_bytes": SEGMENT_BYTES - 1}
    node = SimpleNamespace(
        config=NodeConfig(mesh_id=MESH, node_id="tight", limits=limits, tls={"insecure": True}),
        new_assembler=lambda: SegmentAssembler(PLAN, Limits()),
    )
    with pytest.raises(ConfigError, match=r"limits\.max_pending_bytes = \d+ is below the largest"):
        GossipServicer(node)


def test_budget_is_charged_before_the_buffer_and_released_however_the_stream_ends() -> None:
    budget = ByteBudget(2 * SEGMENT_BYTES, "limits.max_pending_bytes")
    header = pb.PushFrame.FromString(stalling_head(1)[1]).header
    with pytest.raises(RuntimeError), budget.hold() as first, budget.hold() as second:
        SegmentAssembler(PLAN, Limits(), first.reserve).header(header)
        SegmentAssembler(PLAN, Limits(), second.reserve).header(header)
        third = SegmentAssembler(PLAN, Limits(), budget.hold().reserve)
        with pytest.raises(Busy, match=r"limits\.max_pending_bytes"):
            third.header(header)
        with pytest.raises(InvalidFrame, match="no segment header"):
            third.chunk(b"\0")  # refused before its buffer existed
        assert budget.in_use == 2 * SEGMENT_BYTES
        raise RuntimeError("the stream failed")
    assert budget.in_use == 0


def test_slots_refuse_one_more_at_once_and_free_on_release() -> None:
    slots = Slots(2, "inbound push streams", "limits.max_inbound_pushes")
    with slots.take(), slots.take(), pytest.raises(Busy, match=r"limits\.max_inbound_pushes = 2"):
        slots.take()
    slot = slots.take()
    slot.release()
    slot.release()  # every exit path may release; only the first counts
    assert slots.in_use == 0
