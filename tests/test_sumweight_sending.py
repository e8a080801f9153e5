"""Sum-weight gossip (node/protocols/sumweight.py): the sender's side, driven by events.

A push reserves its share and removes it only when acknowledged; what is not comes
home folded back with its snapshot; a leaving node hands everything over; sequences
count 1, 2, 3 per edge; one push per peer and ``max_in_flight`` in all are in flight;
reservations settle to exactly zero. Every event reaches the core through
``handle()`` (tests/sumweight_events.py).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.node.protocols.base import FoldBack, Push
from gossipd.node.protocols.sumweight import SumWeightGossip
from tests.sumweight_events import (
    hand_off,
    make,
    numbered,
    peer_down,
    peer_up,
    receive,
    settle,
    snapshot,
    step,
)

PROPERTY = settings(max_examples=100, derandomize=True, deadline=None, database=None)


# -- sending: reserve, commit, return ---------------------------------------------------
def test_push_reserves_half_and_removes_weight_only_when_acknowledged():
    node = make()
    [push] = step(node)
    assert push == Push("b", 1, {0: 0.5, 1: 0.5})
    assert push.key == ("b", 1)
    assert node.weights == [1.0, 1.0]
    assert node.reserved == [0.5, 0.5]
    assert node.available(0) == node.available(1) == 0.5
    assert node.in_flight == {("b", 1): push}
    assert settle(node, push.key, [0, 1]) == []
    assert node.weights == [0.5, 0.5]
    assert node.reserved == [0.0, 0.0]
    assert node.in_flight == {}


def test_second_push_goes_to_the_other_peer_with_half_of_the_remaining_available_weight():
    node = make(peers=("b", "c"), max_in_flight=2)
    [first] = step(node)
    [second] = step(node)
    assert {first.peer, second.peer} == {"b", "c"}
    # Two edges, each the first push of a numbering: above every sequence used before.
    assert (
        (first.sequence, second.sequence) == (first.sequence_base, second.sequence_base) == (1, 2)
    )
    assert second.weights == {0: 0.25, 1: 0.25}
    assert node.reserved == [0.75, 0.75]
    settle(node, second.key, [0, 1])
    settle(node, first.key, [0, 1])
    assert node.weights == [0.25, 0.25]
    assert node.reserved == [0.0, 0.0]


def test_partial_ack_commits_acknowledged_segments_and_returns_the_rest():
    node = make(num_segments=3)
    [push] = step(node)
    merges = settle(node, push.key, [1])
    assert node.weights == [1.0, 0.5, 1.0]
    assert node.reserved == [0.0, 0.0, 0.0]
    assert node.in_flight == {}
    # the unacknowledged halves come home with the snapshot they left with
    assert merges == [FoldBack("b", 1, 0, 0.5), FoldBack("b", 1, 2, 0.5)]


def test_failed_push_returns_the_whole_reservation_with_its_snapshot():
    node = make()
    [push] = step(node)
    merges = settle(node, push.key, ())
    assert merges == [
        FoldBack("b", 1, 0, 0.5),
        FoldBack("b", 1, 1, 0.5),
    ]  # alpha = sent / available
    assert node.weights == [1.0, 1.0]
    assert node.reserved == [0.0, 0.0]
    assert node.in_flight == {}
    assert node.available(0) == 1.0


def test_ack_or_failure_of_an_unknown_or_settled_push_changes_nothing():
    node = make(peers=("b", "c"), max_in_flight=2)
    [first] = step(node)
    [second] = step(node)  # stays in flight throughout
    settle(node, first.key, [0, 1])
    state = snapshot(node)
    assert settle(node, first.key, [0, 1]) == []  # duplicated ack
    assert settle(node, first.key, ()) == []  # late failure report
    assert settle(node, (second.peer, second.sequence + 1), [0]) == []  # not sent yet
    assert settle(node, (first.peer, 999), [0]) == []
    assert settle(node, ("zzz", second.sequence), ()) == []  # right number, wrong peer
    assert snapshot(node) == state
    assert node.in_flight == {second.key: second}


def test_leave_hands_over_all_available_weight_to_the_chosen_peer():
    node = make(peers=("b", "c"))
    [first] = step(node)
    push = hand_off(node, "c" if first.peer == "b" else "b")
    assert push is not None and push.peer != first.peer
    assert push.weights == {0: 0.5, 1: 0.5}  # everything not already reserved
    assert [node.available(s) for s in range(2)] == [0.0, 0.0]
    settle(node, first.key, [0, 1])
    settle(node, push.key, [0, 1])
    assert node.weights == [0.0, 0.0]
    assert node.reserved == [0.0, 0.0]


def test_leave_without_explicit_peer_picks_a_live_peer_and_none_without_peers():
    node = make(peers=("b", "c"), seed=3)
    push = hand_off(node)
    assert push is not None and push.peer in {"b", "c"}
    assert push.weights == {0: 1.0, 1: 1.0}
    assert hand_off(make(peers=())) is None


def test_leave_to_self_is_refused():
    with pytest.raises(ValueError, match="itself"):
        hand_off(make(), "a")


def test_leave_with_nothing_available_sends_nothing():
    node = make(initial_weight=0.0)
    assert hand_off(node, "b") is None
    assert node.in_flight == {}


def test_leave_hands_over_weight_even_to_a_busy_peer_with_max_in_flight_outstanding():
    node = make(max_in_flight=1)
    [first] = step(node)
    assert step(node) == []
    push = hand_off(node, "b")
    assert push is not None and push.weights == {0: 0.5, 1: 0.5}
    assert push.key == ("b", 2)  # the next number on that edge, never a reused key
    assert set(node.in_flight) == {first.key, push.key}


def test_node_with_zero_weight_never_pushes():
    node = make(initial_weight=0.0)
    for _ in range(100):
        assert step(node) == []
    assert node.in_flight == {}
    assert node.reserved == [0.0, 0.0]


def test_node_whose_weight_is_all_reserved_does_not_push_even_to_an_idle_peer():
    node = make(peers=("b", "c"), max_in_flight=8)
    hand_off(node, "b")
    assert node.busy_peers() == {"b"}  # c is idle and a slot is free: only the weight is missing
    for _ in range(20):
        assert step(node) == []
    assert len(node.in_flight) == 1


# -- per-edge sequences, per-peer and total in-flight limits ---------------------------
def test_sequences_count_on_within_a_numbering_and_a_new_one_starts_above_all():
    node = make(peers=("b", "c", "d"), max_in_flight=3, seed=5)
    sent: dict[str, list[int]] = {"b": [], "c": [], "d": []}
    last: dict[str, int] = {}
    for _ in range(60):
        for push in step(node):
            numbered(push, last)
            sent[push.peer].append(push.sequence)
        for key in list(node.in_flight):
            settle(node, key, [0, 1])
    for peer, sequences in sent.items():
        assert sequences == sorted(set(sequences)), peer  # never reused towards a receiver
    assert all(len(sequences) >= 5 for sequences in sent.values()), sent


def test_a_retried_failure_does_not_reuse_the_sequence_of_the_failed_push():
    node = make()
    [first] = step(node)
    settle(node, first.key, ())
    [second] = step(node)
    assert second.key == ("b", 2)


@pytest.mark.parametrize("seed", range(10))
def test_with_one_of_two_peers_busy_the_next_push_goes_to_the_other(seed):
    node = make(peers=("b", "c"), max_in_flight=8, seed=seed)
    [first] = step(node)
    [second] = step(node)
    assert second.peer == ({"b", "c"} - {first.peer}).pop()
    assert node.busy_peers() == {"b", "c"}
    for _ in range(20):
        assert step(node) == []  # every peer busy: none, though slots are free
    settle(node, first.key, [0, 1])
    [third] = step(node)
    assert third.key == (first.peer, 2)


def test_max_in_flight_caps_unacknowledged_pushes_in_total_across_idle_peers():
    node = make(peers=("b", "c", "d", "e", "f"), max_in_flight=2)
    pushes = [push for _ in range(2) for push in step(node)]
    assert len(pushes) == 2
    state = snapshot(node)
    for _ in range(20):
        assert step(node) == []  # three idle peers, no free slot
    assert snapshot(node) == state  # a skipped turn does not even draw from the rng
    settle(node, pushes[0].key, [0, 1])
    [nxt] = step(node)
    assert nxt.peer != pushes[1].peer
    assert len(node.in_flight) == 2


def test_node_with_max_in_flight_unacknowledged_pushes_skips_its_turn():
    node = make(peers=("b", "c", "d"), max_in_flight=1)
    [push] = step(node)
    state = (list(node.weights), list(node.reserved))
    for _ in range(10):
        assert step(node) == []
    assert (node.weights, node.reserved) == state
    settle(node, push.key, [0, 1])
    [nxt] = step(node)
    assert nxt.sequence == (2 if nxt.peer == push.peer else 1)


def test_failed_push_frees_its_in_flight_slot_and_its_peer():
    node = make(peers=("b", "c", "d"), max_in_flight=2)
    [first] = step(node)
    [second] = step(node)
    assert step(node) == []
    settle(node, first.key, ())
    assert first.peer not in node.busy_peers()
    assert len(step(node)) == 1
    assert second.key in node.in_flight


@pytest.mark.parametrize("max_in_flight", [0, -1])
def test_max_in_flight_below_one_is_refused(max_in_flight):
    with pytest.raises(ValueError, match="max_in_flight"):
        make(max_in_flight=max_in_flight)


# -- reservations never strand weight ---------------------------------------------------
@pytest.mark.parametrize("newest_first", [False, True])
def test_rounding_remainders_of_reservations_are_reset_so_tiny_weights_still_push(newest_first):
    """Weight is never stranded in a reservation (docs/design.md §6), not even by float rounding.

    Two overlapping pushes reserve fl(w/2 + w/4); for w = 0.1 releasing w/2 and w/4
    leaves an ulp-sized remainder. Kept, it would outlive the weight as the weight
    shrinks (x1/4 per round) and block every push; the core resets it to 0.0. The
    shadow ledger proves the schedule really produces such a remainder.
    """
    # b and c never push back: with the sink watch on they would rightly be suspected
    # after 25 pushes each (tests/test_sink_statistic_sim.py); this is about rounding.
    node = make(
        num_segments=1, peers=("b", "c"), max_in_flight=2, initial_weight=0.1, sink_bound=math.inf
    )
    shadow = 0.0  # what the reservation would be without the reset
    remainders = 0
    for _ in range(450):
        pushes = [push for _ in range(2) for push in step(node)]
        assert len(pushes) == 2, f"weight {node.weights} could not push"
        for push in pushes:
            shadow += push.weights[0]
        for push in reversed(pushes) if newest_first else pushes:
            settle(node, push.key, [0])
            shadow = max(shadow - push.weights[0], 0.0)
        remainders += shadow != 0.0
        assert node.reserved == [0.0]  # exactly, not approximately
        assert node.in_flight == {}
    assert remainders > 0, "the schedule never produced a rounding remainder"
    assert shadow > node.weights[0] > 0.0  # a kept remainder would now block every push
    assert node.available(0) == node.weights[0]
    assert len(step(node)) == 1


def test_a_failed_push_also_resets_the_reservation_to_exactly_zero():
    node = make(  # one-way pushes, as above: no sink watch
        num_segments=1, peers=("b", "c"), max_in_flight=2, initial_weight=0.3, sink_bound=math.inf
    )
    for _ in range(200):
        pushes = [push for _ in range(2) for push in step(node)]
        settle(node, pushes[0].key, ())
        settle(node, pushes[1].key, [0])
        assert node.reserved == [0.0]
    assert node.weights[0] > 0.0


_sender_ops = st.lists(
    st.one_of(
        st.tuples(st.just("step")),
        st.tuples(st.just("ack"), st.integers(0, 7), st.sets(st.integers(0, 2))),
        st.tuples(st.just("fail"), st.integers(0, 7)),
        st.tuples(st.just("receive"), st.floats(0.0, 3.0), st.integers(0, 2)),
        st.tuples(st.just("down"), st.sampled_from(["b", "c", "d"])),
        st.tuples(st.just("up"), st.sampled_from(["b", "c", "d"])),
    ),
    max_size=120,
)


def assert_reservations_are_the_pushes_in_flight(node: SumWeightGossip, total: list[float]) -> None:
    """The reservation is exactly what the pushes in flight carry, never a clamped guess;
    the weight is ``total``; nothing in flight leaves no reservation, not even a remainder."""
    for s in range(len(total)):
        carried = math.fsum(p.weights[s] for p in node.in_flight.values())
        assert math.isclose(node.reserved[s], carried, rel_tol=1e-9, abs_tol=1e-12), (
            s,
            node.reserved,
            carried,
        )
        assert node.available(s) >= -1e-12
        settled = node.weights[s] - carried
        assert math.isclose(settled, node.available(s), rel_tol=1e-9, abs_tol=1e-12)
        assert math.isclose(node.weights[s], total[s], rel_tol=1e-9, abs_tol=1e-12)
    if not node.in_flight:
        assert node.reserved == [0.0] * len(total)


@PROPERTY
@given(
    ops=_sender_ops,
    max_in_flight=st.integers(1, 4),
    initial_weight=st.floats(0.0, 3.0),
)
def test_every_schedule_of_pushes_acks_and_failures_settles_reservations_to_exactly_zero(
    ops, max_in_flight, initial_weight
):
    """Per-peer and total in-flight limits hold at every step, weight stays accounted for,
    and once nothing is in flight no reservation (not even a remainder) is left."""
    node = make(
        num_segments=3,
        peers=("b", "c", "d"),
        max_in_flight=max_in_flight,
        initial_weight=initial_weight,
    )
    total = [initial_weight] * 3  # Σ weights the node should hold, with its pushes settled
    sequences: dict[str, int] = {}
    received = 0
    for op in ops:
        keys = sorted(node.in_flight)
        if op[0] == "step":
            busy = node.busy_peers()
            for push in step(node):
                assert push.peer in node.peers and push.peer not in busy
                numbered(push, sequences)
        elif op[0] == "ack" and keys:
            push = node.in_flight[keys[op[1] % len(keys)]]
            settle(node, push.key, op[2])
            for s in op[2]:
                total[s] -= push.weights[s]
        elif op[0] == "fail" and keys:
            settle(node, keys[op[1] % len(keys)], ())
        elif op[0] == "receive":
            received += 1
            receive(node, "x", 0, received, op[2], op[1])
            total[op[2]] += op[1]
        elif op[0] == "down":
            peer_down(node, op[1])
        elif op[0] == "up":
            peer_up(node, op[1])
        assert len(node.in_flight) <= max_in_flight
        assert len(node.busy_peers()) == len(node.in_flight)
        assert_reservations_are_the_pushes_in_flight(node, total)
    for key in sorted(node.in_flight):
        settle(node, key, ())
    assert node.reserved == [0.0, 0.0, 0.0]
    for peer in ("b", "c", "d"):
        peer_up(node, peer)
    if max(node.weights) > 1e-300:  # half of a subnormal can round to nothing
        assert len(step(node)) == 1
