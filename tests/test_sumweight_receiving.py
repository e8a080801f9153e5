"""Sum-weight gossip (node/protocols/sumweight.py): the receiver's side, driven by events.

A payload is asked about (``PayloadArrived``: nothing changes) and then merged
(``PayloadMerged``), as the replica does (tests/sumweight_events.py). A merge adds the
sender's weight with alpha its share of the available weight; a segment merged before
is answered DUPLICATE and nothing else is; a retry older than the window, a weight
that is not finite or heavier than the cap on its own, a segment out of range, or a
sequence too far ahead is refused whole and changes nothing. A weight that would lift a
segment over the cap merges the part that fits; the rest is cut.
"""

from __future__ import annotations

import contextlib
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.node.protocols.base import Duplicate, Merge, Push, Refused, WeightCapExceeded
from gossipd.node.protocols.sequences import DEDUP_WINDOW, SEQUENCE_AHEAD
from tests.sumweight_events import (
    ask,
    commit,
    deliver,
    make,
    receive,
    restarted,
    snapshot,
    step,
)

PROPERTY = settings(max_examples=100, derandomize=True, deadline=None, database=None)


# -- receiving: merge, de-duplicate, refuse ---------------------------------------------
def test_merge_adds_weight_with_alpha_equal_to_incoming_share():
    node = make(peers=())
    merge = receive(node, "b", 0, 1, 0, 0.5)
    assert merge == Merge(0, 0.5 / 1.5, 1.5)
    assert node.weights == [1.5, 1.0]


def test_merge_alpha_uses_available_weight_not_reserved_weight():
    node = make()
    step(node)  # reserves 0.5 of each segment
    merge = receive(node, "b", 0, 1, 0, 0.5)
    assert merge.alpha == 0.5  # 0.5 / (available 0.5 + 0.5)
    assert merge.weight_after == 1.5
    assert node.available(0) == 1.0


def test_plan_receive_changes_nothing_until_applied():
    node = make(peers=())
    receive(node, "b", 0, 1, 0, 0.25)
    state = snapshot(node)
    plan = ask(node, "b", 0, 2, {0: 0.5, 1: 0.25})
    assert plan == [Merge(0, 0.5 / 1.75, 1.75), Merge(1, 0.25 / 1.25, 1.25)]
    assert ask(node, "b", 0, 1, {0: 0.25}) == [Duplicate(0)]
    with pytest.raises(Refused):
        ask(node, "b", 0, 2, {0: math.nan})
    assert snapshot(node) == state
    # an abandoned plan (the driver found a non-finite merged value) leaves no trace
    assert ask(node, "b", 0, 2, {0: 0.5, 1: 0.25}) == plan
    commit(node, "b", 0, 2, {0: 0.5, 1: 0.25})
    assert node.weights == [1.75, 1.25]
    assert deliver(node, "b", Push("a", 2, {0: 0.5, 1: 0.25})) == [Duplicate(0), Duplicate(1)]
    assert node.weights == [1.75, 1.25]


def test_a_push_with_one_invalid_segment_is_refused_whole():
    node = make(num_segments=3, peers=())
    state = snapshot(node)
    with pytest.raises(Refused, match="segment 2"):
        ask(node, "b", 0, 1, {0: 0.5, 1: 0.5, 2: math.inf})
    with pytest.raises(Refused, match="segment 7 out of range"):
        ask(node, "b", 0, 1, {0: 0.5, 7: 0.5})
    assert snapshot(node) == state
    assert deliver(node, "b", Push("a", 1, {0: 0.5, 1: 0.5, 2: 0.5})) == [
        Merge(s, 0.5 / 1.5, 1.5) for s in range(3)
    ]


def test_duplicate_delivery_returns_duplicate_and_changes_nothing():
    node = make(peers=())
    assert isinstance(receive(node, "b", 0, 7, 1, 0.25), Merge)
    state = snapshot(node)
    assert receive(node, "b", 0, 7, 1, 0.25) == Duplicate(1)
    assert snapshot(node) == state
    # the same sequence with another segment, sender or incarnation is a different message
    assert isinstance(receive(node, "b", 0, 7, 0, 0.25), Merge)
    assert isinstance(receive(node, "c", 0, 7, 1, 0.25), Merge)
    assert isinstance(receive(node, "b", 1, 7, 1, 0.25), Merge)


def test_forget_sender_drops_only_older_incarnations():
    node = make(peers=())
    receive(node, "b", 1, 5, 0, 0.1)
    receive(node, "b", 2, 5, 0, 0.1)
    receive(node, "c", 1, 5, 0, 0.1)
    restarted(node, "b", 2)  # b came back as incarnation 2
    assert isinstance(receive(node, "b", 2, 5, 0, 0.1), Duplicate)
    assert isinstance(receive(node, "c", 1, 5, 0, 0.1), Duplicate)
    assert isinstance(receive(node, "b", 1, 5, 0, 0.1), Merge)


def test_within_the_window_only_merged_segments_are_duplicates_and_a_late_one_merges():
    """Only a segment this node really merged is answered DUPLICATE: an answer of
    DUPLICATE makes the sender commit, so a false one would destroy weight."""
    node = make(num_segments=1, peers=())
    receive(node, "b", 0, 1, 0, 0.5)
    for sequence in range(3, DEDUP_WINDOW + 1):  # push 2 is still on its way
        receive(node, "b", 0, sequence, 0, 0.0)
    weights = list(node.weights)
    assert receive(node, "b", 0, 1, 0, 0.5) == Duplicate(0)  # retry, its ack was lost
    assert node.weights == weights
    assert receive(node, "b", 0, 2, 0, 0.25) == Merge(0, 0.25 / 1.75, 1.75)


def test_retry_older_than_dedup_window_is_refused_never_merged_again_nor_acknowledged():
    """A retry older than the window is neither merged again (that would create mass)
    nor answered DUPLICATE (the node no longer knows it merged it): it is refused and
    changes nothing. One push in flight per edge means an honest sender never sees this."""
    node = make(num_segments=1, peers=())
    receive(node, "b", 0, 1, 0, 0.5)
    for sequence in range(2, DEDUP_WINDOW + 2):
        receive(node, "b", 0, sequence, 0, 0.0)
    weights = list(node.weights)
    with pytest.raises(Refused, match="older than this node remembers"):
        receive(node, "b", 0, 1, 0, 0.5)  # the retry of push 1, its ack was lost
    assert node.weights == weights


def test_dedup_memory_per_sender_is_bounded_by_the_window_times_segments():
    node = make(num_segments=2, peers=())
    for sequence in range(1, 3 * DEDUP_WINDOW):
        for segment in range(2):
            receive(node, "b", 0, sequence, segment, 0.0)
    window = node.windows[("b", 0, 1)]
    assert window.remembered == 2 * DEDUP_WINDOW
    assert receive(node, "b", 0, 3 * DEDUP_WINDOW - 1, 1, 0.5) == Duplicate(1)


def test_joiner_at_weight_zero_takes_the_incoming_model_whole():
    node = make(initial_weight=0.0, peers=())
    merge = receive(node, "b", 0, 1, 0, 0.25)
    assert merge.alpha == 1.0
    assert merge.weight_after == 0.25
    assert node.weights == [0.25, 0.0]


def test_zero_weight_message_to_zero_weight_node_leaves_model_unchanged():
    node = make(initial_weight=0.0, peers=())
    merge = receive(node, "b", 0, 1, 0, 0.0)
    assert merge.alpha == 0.0
    assert node.weights == [0.0, 0.0]


@pytest.mark.parametrize("weight", [-1e-300, -1.0, math.nan, math.inf, -math.inf, 1e3 + 1e-9])
def test_weight_not_finite_or_lifting_the_result_over_max_weight_is_refused_and_changes_nothing(
    weight,
):
    node = make(max_weight=1e3)
    step(node)  # something reserved: must stay as it is
    receive(node, "b", 0, 1, 0, 0.5)  # a window exists: must stay as it is
    state = snapshot(node)
    with pytest.raises(Refused, match=str(weight).replace("+", r"\+")):
        receive(node, "b", 0, 2, 0, weight)
    with pytest.raises(Refused, match=r"not a finite number|max_sum_weight"):
        ask(node, "b", 0, 2, {1: 0.5, 0: weight})
    assert snapshot(node) == state
    assert isinstance(receive(node, "b", 0, 2, 0, 0.5), Merge)  # not remembered as seen


def test_merge_whose_result_equals_max_weight_is_merged_and_one_above_merges_what_fits():
    """Issue 12: 60 pushes of 1e6, each under the per-message cap, gave a node 6.2e7;
    the cap is on the weight a merge leaves, so the sum of many pushes cannot pass it.
    Issue 32: refusing the push that would pass it stopped a mesh for good once a member
    had topped every site up to just under the cap; the push merges the part that fits,
    with its share of the model at most that part's, and the rest is cut."""
    node = make(max_weight=1e3, peers=())
    assert receive(node, "b", 0, 1, 0, 999.0) == Merge(0, 999.0 / 1000.0, 1000.0)
    at_cap = receive(node, "b", 0, 2, 0, 0.5)
    assert at_cap == Merge(0, 0.0, 1000.0, cut=0.5)  # nothing fits: the model is unmoved
    assert node.weights[0] == 1000.0
    node.weights[0] = 999.75  # as if it had pushed a quarter away
    assert receive(node, "b", 0, 3, 0, 0.5) == Merge(0, 0.25 / 1000.0, 1000.0, cut=0.25)
    assert node.cut == 0.75
    assert node.status().weight_cut == 0.75
    # Booked as received whole: what the sender's books say it sent.
    assert node.exchanged.by_peer["b"].received == pytest.approx(1000.0)
    with pytest.raises(WeightCapExceeded, match="more than any node may hold"):
        receive(node, "b", 0, 4, 0, 1000.5)


@pytest.mark.parametrize("segment", [-1, 2, 100])
def test_message_for_segment_out_of_range_is_refused_with_its_index(segment):
    node = make(peers=())
    with pytest.raises(Refused, match=rf"segment {segment} out of range 0\.\.1"):
        receive(node, "b", 0, 1, segment, 0.5)
    assert node.weights == [1.0, 1.0]


# -- sequences too far ahead --------------------------------------------------------------
def test_sequence_more_than_sequence_ahead_beyond_the_highest_is_refused_without_moving_window():
    node = make(num_segments=1, peers=())
    receive(node, "b", 0, 10, 0, 0.5)
    state = snapshot(node)
    for sequence in (10 + SEQUENCE_AHEAD + 1, 2**62, 2**64 + 5):
        with pytest.raises(Refused, match=f"sequence {sequence} is more than"):
            receive(node, "b", 0, sequence, 0, 0.5)
        with pytest.raises(Refused):
            receive(node, "b", 0, sequence, 0, math.nan)  # refused first for the sequence
    assert snapshot(node) == state
    # the refused numbers were never remembered: later real pushes merge, not DUPLICATE
    assert isinstance(receive(node, "b", 0, 11, 0, 0.5), Merge)
    assert isinstance(receive(node, "b", 0, 11 + SEQUENCE_AHEAD, 0, 0.5), Merge)  # boundary
    assert isinstance(receive(node, "b", 0, 12, 0, 0.5), Merge)  # below highest, unseen
    # other senders and incarnations have windows of their own, which start at 0: a
    # first sequence may be at most SEQUENCE_AHEAD
    assert isinstance(receive(node, "c", 0, SEQUENCE_AHEAD, 0, 0.5), Merge)
    with pytest.raises(Refused, match="more than"):
        receive(node, "d", 0, SEQUENCE_AHEAD + 1, 0, 0.5)


def test_forged_run_of_huge_sequences_cannot_make_later_real_pushes_duplicates():
    """The observed attack: 8,193 pushes as b with sequences 2^62+i, then b's own pushes."""
    node = make(num_segments=1, peers=())
    assert isinstance(receive(node, "b", 0, 1, 0, 0.5), Merge)  # b's real first push
    state = snapshot(node)
    for i in range(2 * DEDUP_WINDOW + 1):
        with pytest.raises(Refused):
            receive(node, "b", 0, 2**62 + i, 0, 0.0)
    assert snapshot(node) == state
    for sequence in range(2, 12):
        assert isinstance(receive(node, "b", 0, sequence, 0, 0.5), Merge), sequence
    assert node.weights[0] == 1.0 + 11 * 0.5


def test_forged_run_of_huge_sequences_before_the_real_first_push_cannot_make_it_a_duplicate():
    node = make(num_segments=1, peers=())
    for i in range(2 * DEDUP_WINDOW + 1):
        with contextlib.suppress(Refused):
            receive(node, "b", 0, 2**62 + i, 0, 0.0)
    weights = list(node.weights)
    action = receive(node, "b", 0, 1, 0, 0.5)  # b's real first push
    assert isinstance(action, Merge), f"never merged, answered {action}: the sender commits"
    assert node.weights[0] == weights[0] + 0.5


def test_forged_sequences_each_within_sequence_ahead_never_make_real_pushes_duplicates():
    node = make(num_segments=1, peers=())
    assert isinstance(receive(node, "b", 0, 1, 0, 0.5), Merge)
    for i in range(1, DEDUP_WINDOW + 2):
        with contextlib.suppress(Refused):
            receive(node, "b", 0, 1 + i * SEQUENCE_AHEAD, 0, 0.0)
    # Without certificates a forger who passes as b can push b's window along; what it
    # must never achieve is a DUPLICATE for a push that was not merged (b would commit
    # weight nobody holds). b's real push is merged or refused (b then folds it back).
    weights = list(node.weights)
    try:
        action = receive(node, "b", 0, 2, 0, 0.5)  # b's real second push
    except Refused:
        assert node.weights == weights
    else:
        assert isinstance(action, Merge), f"never merged, answered {action}: b commits"


_receive_ops = st.lists(
    st.tuples(
        st.sampled_from(["b", "c"]),
        st.integers(0, 1),
        st.one_of(
            st.integers(1, 30),
            st.integers(1, 30).map(lambda k: k + SEQUENCE_AHEAD),
            st.just(2**62),
        ),
        st.dictionaries(
            st.integers(0, 2),
            st.one_of(
                st.sampled_from([0.0, 0.25, 1.5, 8.0]),
                st.sampled_from([8.5, -0.5, math.inf, math.nan]),
            ),
            min_size=1,
            max_size=2,
        ),
        st.sampled_from([True, True, False]),  # the driver applies the plan or abandons it
    ),
    min_size=10,
    max_size=80,
)


@PROPERTY
@given(ops=_receive_ops)
def test_receiver_answers_duplicate_exactly_for_segments_it_merged_before(ops):
    """Reference model: DUPLICATE iff that (sender, incarnation, sequence, segment) was
    merged; Refused iff a weight is negative or heavier than max_weight on its own, or the
    sequence is more than SEQUENCE_AHEAD beyond the highest merged from that sender
    incarnation (0 before the first); a new segment merges what fits under max_weight and
    cuts the rest; a refused or abandoned plan changes nothing."""
    node = make(num_segments=3, peers=(), max_weight=8.0)
    merged: set[tuple[str, int, int, int]] = set()
    highest: dict[tuple[str, int], int] = {}
    for sender, incarnation, sequence, weights, apply in ops:
        state = snapshot(node)
        top = highest.get((sender, incarnation))
        over_cap = any(
            w > 8.0 for s, w in weights.items() if (sender, incarnation, sequence, s) not in merged
        )
        refuse = (
            sequence > (top or 0) + SEQUENCE_AHEAD
            or not all(w >= 0.0 for w in weights.values())
            or over_cap
        )
        if refuse:
            with pytest.raises(Refused):
                ask(node, sender, incarnation, sequence, weights)
            assert snapshot(node) == state
            continue
        plan = ask(node, sender, incarnation, sequence, weights)
        assert snapshot(node) == state
        for action, (segment, w) in zip(plan, weights.items(), strict=True):
            assert action.segment == segment
            if (sender, incarnation, sequence, segment) in merged:
                assert action == Duplicate(segment)
            else:
                assert isinstance(action, Merge)
                fits = min(w, 8.0 - node.weights[segment])
                assert action.weight_after == node.weights[segment] + fits
                assert action.cut == w - fits
        if not apply:
            continue
        before = list(node.weights)
        commit(node, sender, incarnation, sequence, weights)
        for action in plan:
            if isinstance(action, Merge):
                merged.add((sender, incarnation, sequence, action.segment))
                highest[(sender, incarnation)] = max(top or sequence, sequence)
                assert node.weights[action.segment] == action.weight_after
            else:
                assert node.weights[action.segment] == before[action.segment]
