"""Sum-weight gossip (node/protocols/sumweight.py): the mass bound under faults, by events.

What the ledger's module docstring promises: a lost acknowledgement and its retry keep
Σw exact (the retry is answered DUPLICATE); only a push merged by a receiver later
declared dead adds its weight, once; a receiver restarted from a checkpoint answers
each push by what its checkpoint holds, senders number their pushes to it anew, and
the weight exchanged with each incarnation is kept apart.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.node.protocols.base import Duplicate, Merge
from gossipd.node.protocols.sequences import NUMBERINGS_KEPT
from gossipd.node.protocols.sumweight import SumWeightGossip
from tests.sumweight_events import (
    deliver,
    make,
    peer_down,
    peer_up,
    receive,
    restarted,
    settle,
    step,
)

PROPERTY = settings(max_examples=100, derandomize=True, deadline=None, database=None)


# -- the mass bound (module docstring) ------------------------------------------------------
def pair() -> tuple[SumWeightGossip, SumWeightGossip]:
    return make("a", 2, peers=("b",)), make("b", 2, peers=("a",))


def test_lost_ack_then_retry_with_same_sequence_is_duplicate_and_keeps_the_sum_exact():
    a, b = pair()
    [push] = step(a)
    assert all(isinstance(x, Merge) for x in deliver(b, "a", push))
    # the acknowledgement is lost; a retries the same push with the same number
    assert deliver(b, "a", push) == [Duplicate(0), Duplicate(1)]
    assert receive(b, "a", 0, push.sequence, 1, push.weights[1]) == Duplicate(1)
    settle(a, push.key, [0, 1])
    assert settle(a, push.key, [0, 1]) == []  # the first attempt's ack, late
    for s in range(2):
        assert a.weights[s] + b.weights[s] == 2.0
        assert (a.weights[s], b.weights[s]) == (0.5, 1.5)


def test_merged_then_declared_dead_exceeds_the_total_by_exactly_that_push():
    """The one error the module allows: b merged, then a declared b dead before the
    acknowledgement and folded the push back. That push's weight then exists twice."""
    a, b = pair()
    a.weights = [0.7, 1.3]
    b.weights = [0.9, 0.2]
    total = [a.weights[s] + b.weights[s] for s in range(2)]
    [push] = step(a)
    deliver(b, "a", push)
    settle(a, push.key, ())  # b declared dead; its acknowledgement never arrives
    assert a.reserved == [0.0, 0.0]
    for s in range(2):
        excess = a.weights[s] + b.weights[s] - total[s]
        assert math.isclose(excess, push.weights[s], rel_tol=1e-15)
        assert a.weights[s] == [0.7, 1.3][s]  # all of it back home
    # b, back, answers a's next push (a new number) with a merge, not a DUPLICATE
    [nxt] = step(a)
    assert nxt.key == ("b", 2)
    assert all(isinstance(x, Merge) for x in deliver(b, "a", nxt))


_outcomes = st.sampled_from(["acked", "ack_lost_then_retry", "refused", "merged_then_dead"])


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    outcomes=st.lists(_outcomes, max_size=60),
    weights=st.lists(st.floats(0.0, 4.0), min_size=3, max_size=3),
)
def test_sum_of_weights_exceeds_the_total_by_exactly_the_pushes_merged_then_declared_dead(
    seed, outcomes, weights
):
    """Acks lost and retried keep Σw exact; a push refused before merging keeps it exact;
    only a push merged by a receiver later declared dead adds its weight, once."""
    rng = random.Random(seed)
    ids = ["a", "b", "c"]
    nodes = {
        i: make(i, 2, peers=[j for j in ids if j != i], max_in_flight=2, initial_weight=w)
        for i, w in zip(ids, weights, strict=True)
    }
    total = [math.fsum(weights)] * 2
    excess = [0.0, 0.0]
    for outcome in outcomes:
        sender = nodes[rng.choice(ids)]
        pushes = step(sender)
        if not pushes:
            continue
        [push] = pushes
        receiver = nodes[push.peer]
        if outcome == "refused":  # e.g. the receiver was busy: it merged nothing
            settle(sender, push.key, ())
        else:
            deliver(receiver, sender.node_id, push)
            if outcome == "ack_lost_then_retry":
                assert all(
                    isinstance(x, Duplicate) for x in deliver(receiver, sender.node_id, push)
                )
            if outcome == "merged_then_dead":
                settle(sender, push.key, ())
                excess = [excess[s] + push.weights[s] for s in range(2)]
            else:
                settle(sender, push.key, list(push.weights))
        for s in range(2):
            held = math.fsum(node.weights[s] for node in nodes.values())
            assert math.isclose(held, total[s] + excess[s], rel_tol=1e-12, abs_tol=1e-12)
    assert all(node.reserved == [0.0, 0.0] for node in nodes.values())


# -- a receiver restarted from a checkpoint ------------------------------------------------
def test_a_restored_receiver_answers_each_push_by_what_its_checkpoint_holds():
    """Before the checkpoint: DUPLICATE (its model holds it); after it: merged again (the
    crash lost that merge); a new push after the restart: merged, in a new numbering."""
    sender, receiver = make("a", 1, peers=("b",)), make("b", 1, peers=("a",))
    [before] = step(sender)  # half of a's weight
    deliver(receiver, "a", before)
    settle(sender, before.key, (0,))
    saved = receiver.state_dict()
    [after] = step(sender)
    deliver(receiver, "a", after)  # merged, then the receiver crashes before acknowledging
    restored = make("b", 1, peers=("a",))
    restored.load_state_dict(saved)
    restarted(sender, "b", 1)
    assert deliver(restored, "a", before) == [Duplicate(0)]
    assert isinstance(deliver(restored, "a", after)[0], Merge)  # the retry lands again
    settle(sender, after.key, (0,))
    [new] = step(sender)
    assert new.sequence == after.sequence + 1 and new.sequence_base == new.sequence
    assert isinstance(deliver(restored, "a", new)[0], Merge)
    settle(sender, new.key, (0,))
    assert sender.weights[0] + restored.weights[0] == pytest.approx(2.0, abs=1e-15)


def test_a_new_numbering_starts_when_the_receiver_leaves_the_view_and_windows_stay_capped():
    sender, receiver = make("a", 1, peers=("b",)), make("b", 1, peers=("a",))
    bases = []
    for _ in range(NUMBERINGS_KEPT + 3):
        [push] = step(sender)
        bases.append(push.sequence_base)
        deliver(receiver, "a", push)
        settle(sender, push.key, (0,))
        peer_down(sender, "b")
        peer_up(sender, "b")
    assert bases == list(range(1, NUMBERINGS_KEPT + 4))
    assert len(receiver.windows) == NUMBERINGS_KEPT
    assert sender.weights[0] + receiver.weights[0] == pytest.approx(2.0, abs=1e-15)


def test_exchanged_accounts_per_peer_and_incarnation():
    sender, receiver = make("a", 2, peers=("b",)), make("b", 2, peers=("a",))
    [push] = step(sender)
    deliver(receiver, "a", push)
    settle(sender, push.key, (0, 1))
    assert sender.status().exchanged["b"].sent == pytest.approx(1.0)
    assert receiver.status().exchanged["a"].received == pytest.approx(1.0)
    restarted(sender, "b", 5)
    mass = sender.status().exchanged["b"]
    assert (mass.sent, mass.sent_before) == (0.0, pytest.approx(1.0))
    restored = make("b", 2, peers=("a",))
    restored.load_state_dict(receiver.state_dict())
    assert restored.status().exchanged == receiver.status().exchanged
