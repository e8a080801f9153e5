"""Settled pushes are forgotten at both ends (node/protocols/sequences.py, docs/design.md §5).

A receiver remembers what it merged, per sender numbering, so that a retried push whose
acknowledgement was lost is answered DUPLICATE instead of merging twice. A sender closes a
numbering once nothing of it is in flight and its receiver has been idle for
``SETTLE_IDLE_STEPS`` steps, and tells the receiver (``Settle``); a push also carries what
of its numbering settled before it. Before this, both ends kept a row for every peer they
ever exchanged with: memory that grew with the mesh's history. These run real cores
against each other, event by event.
"""

from __future__ import annotations

import math
import random

import pytest

from gossipd.node.protocols.base import (
    Duplicate,
    Merge,
    PayloadArrived,
    PayloadMerged,
    Push,
    PushSettled,
    Settle,
    SettleArrived,
    StepEnded,
    ViewChanged,
)
from gossipd.node.protocols.settings import SETTLE_IDLE_STEPS
from gossipd.node.protocols.sumweight import SumWeightGossip

SEGMENTS = 2


def _core(node: str, peers: list[str]) -> SumWeightGossip:
    # No credit: these follow one edge's numbering, pushed along again and again.
    core = SumWeightGossip(node, SEGMENTS, seed=1, push_probability=1.0, peer_credit=math.inf)
    core.handle(ViewChanged(frozenset([node, *peers])))
    return core


def _arrival(sender: str, push: Push) -> PayloadArrived:
    return PayloadArrived(
        sender, 1, push.sequence, push.round, push.weights, push.sequence_base, push.settled
    )


def _deliver(sender: SumWeightGossip, receiver: SumWeightGossip, push: Push) -> None:
    """Merged at the receiver and acknowledged to the sender."""
    arrival = _arrival(sender.node_id, push)
    assert all(isinstance(a, Merge) for a in receiver.handle(arrival))
    receiver.handle(PayloadMerged(arrival))
    sender.handle(PushSettled(push.peer, push.sequence, tuple(push.weights)))


def _step(core: SumWeightGossip, step: int) -> tuple[list[Push], list[Settle]]:
    actions = core.handle(StepEnded(step, float(step)))
    pushes = [a for a in actions if isinstance(a, Push)]
    settles = [a for a in actions if isinstance(a, Settle)]
    assert len(pushes) + len(settles) == len(actions), actions
    return pushes, settles


def _windows(core: SumWeightGossip) -> list[tuple[str, int, int]]:
    return list(core.windows)


def test_an_idle_numbering_is_closed_and_its_receiver_forgets_it() -> None:
    a, b = _core("a", ["b"]), _core("b", ["a"])
    [push], _ = _step(a, 0)
    _deliver(a, b, push)
    assert _windows(b) == [("a", 1, push.sequence_base)]
    weights = (list(a.weights), list(b.weights))
    closed: list[Settle] = []
    for step in range(1, SETTLE_IDLE_STEPS + 1):
        a.push_probability = 0.0  # a stays quiet: its numbering to b goes idle
        closed += _step(a, step)[1]
    assert closed == [Settle("b", push.sequence_base, push.sequence)]
    assert a.numberings.last == {} and a.numberings.bases == {}
    for _ in range(2):  # idempotent: a retried settle changes nothing more
        assert b.handle(SettleArrived("a", 1, closed[0].sequence_base, closed[0].up_to)) == []
        assert _windows(b) == []
    assert (list(a.weights), list(b.weights)) == weights  # a settle moves no weight


def test_the_next_push_opens_a_numbering_above_every_sequence_used_and_merges() -> None:
    a, b = _core("a", ["b"]), _core("b", ["a"])
    [first], _ = _step(a, 0)
    _deliver(a, b, first)
    a.push_probability = 0.0
    [settle] = [s for step in range(1, SETTLE_IDLE_STEPS + 1) for s in _step(a, step)[1]]
    # The settle is lost: b keeps the window of the closed numbering, and that is all.
    a.push_probability = 1.0
    [second], _ = _step(a, 10)
    assert second.sequence_base == second.sequence > first.sequence
    assert second.settled == 0  # nothing of its own numbering settled yet
    plan = b.handle(_arrival("a", second))
    assert plan and all(isinstance(m, Merge) for m in plan), plan
    assert settle.up_to == first.sequence


def test_a_retry_of_a_push_not_yet_acknowledged_is_still_a_duplicate() -> None:
    """The acknowledgement is lost: the push stays in flight, its numbering stays open
    however long the sender is quiet, and the retry is answered DUPLICATE."""
    a, b = _core("a", ["b"]), _core("b", ["a"])
    [push], _ = _step(a, 0)
    arrival = _arrival("a", push)
    b.handle(arrival)
    b.handle(PayloadMerged(arrival))
    a.push_probability = 0.0
    for step in range(1, 4 * SETTLE_IDLE_STEPS):
        assert _step(a, step) == ([], [])
    assert all(isinstance(x, Duplicate) for x in b.handle(arrival))


def test_a_push_carries_what_settled_before_it_and_the_receiver_forgets_that() -> None:
    a, b = _core("a", ["b"]), _core("b", ["a"])
    sequences = []
    for step in range(5):  # a push to b at every step: the numbering never idles
        pushes, settles = _step(a, step)
        assert settles == []
        [push] = pushes
        assert push.settled == (sequences[-1] if sequences else 0)
        _deliver(a, b, push)
        sequences.append(push.sequence)
    [(sender, _, base)] = _windows(b)
    window = b.windows[(sender, 1, base)]
    assert [q for q, _ in window.pairs()] == [sequences[-1]] * SEGMENTS  # the rest forgotten


def test_a_receiver_restored_from_before_a_settle_still_merges_the_new_numbering() -> None:
    """Its checkpoint holds the window of a numbering the sender has closed since: the
    sender's next push is in a numbering of its own, never answered from that window."""
    a, b = _core("a", ["b"]), _core("b", ["a"])
    [first], _ = _step(a, 0)
    _deliver(a, b, first)
    saved = b.state_dict()
    a.push_probability = 0.0
    [settle] = [s for step in range(1, SETTLE_IDLE_STEPS + 1) for s in _step(a, step)[1]]
    b.handle(SettleArrived("a", 1, settle.sequence_base, settle.up_to))
    restored = _core("b", ["a"])
    restored.load_state_dict(saved)
    assert _windows(restored) == [("a", 1, first.sequence_base)]
    a.push_probability = 1.0
    [second], _ = _step(a, 20)
    assert all(isinstance(m, Merge) for m in restored.handle(_arrival("a", second)))


@pytest.mark.parametrize("peers", [10_000])
def test_rows_at_both_ends_are_for_current_peers_not_every_peer_ever_met(peers: int) -> None:
    """One sender meets ``peers`` receivers and one receiver ``peers`` senders, each
    once, everything acknowledged and settled: what either keeps afterwards is a few
    rows, not one per peer (before: 10,000 numberings and 10,000 windows)."""
    rng = random.Random(0)
    ids = [f"p{i}" for i in range(peers)]
    sender = _core("s", ids)
    receiver = _core("r", ["x"])
    pushed = 0
    for step in range(peers):
        for push in _step(sender, step)[0]:
            sender.handle(PushSettled(push.peer, push.sequence, tuple(push.weights)))
            pushed += 1
        # The receiver's side: a sender it never met pushes once and settles later.
        one = _core(f"q{step}", ["r"])
        [push], _ = _step(one, 0)
        _deliver(one, receiver, push)
        one.push_probability = 0.0
        for later in range(1, SETTLE_IDLE_STEPS + 1):
            for settle in _step(one, later)[1]:
                receiver.handle(SettleArrived(one.node_id, 1, settle.sequence_base, settle.up_to))
        assert len(receiver.windows) <= 1
        if rng.random() < 0.001:
            assert len(sender.numberings.last) <= SETTLE_IDLE_STEPS + 1
    assert len(sender.numberings.last) <= SETTLE_IDLE_STEPS + 1
    assert 1000 < sender.numberings.top <= pushed  # one sequence space, never reused
    assert len(receiver.windows) == 0
