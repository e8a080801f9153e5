"""The sink watch's book stays bounded without handing a sink its credit back.

A node keeps at most ``rows`` peers' scores (node/protocols/sinks.py; BOOK_ROWS, 1,024,
in the daemon; ROWS here, so the book turns over in a test's time). It used to forget a
peer with score 0 or else the oldest row: in a mesh where a node meets more peers than
that (crossover at scale, churn), a sink that took its fill of weight early and then
stayed quiet was the oldest row, was forgotten, and came back with a clean score to take
as much again. Now the lowest score is forgotten, and the peers without a row are
watched as one peer whose score, the floor, takes each score forgotten (less what the
floor fell while that row was kept) and falls by what peers without a row return. A
floor raised to the full score forgotten climbed until honest newcomers were suspected.
"""

from __future__ import annotations

import random

import pytest

from gossipd.node.protocols.sinks import SinkWatch

BOUND, ALLOWANCE, HALF = 6.0, 0.5, 0.5  # the defaults; every protocol pushes halves
ROWS = 64


def _honest_meeting(watch: SinkWatch, peer: str, rng: random.Random) -> None:
    """One exchange with an honest peer: a push acknowledged, and most of the time a push
    back of about as much."""
    watch.sent(peer, HALF)
    if rng.random() < 0.7:
        watch.received(peer, rng.uniform(0.3, 0.7))


def test_a_quiet_sink_is_not_forgotten_while_thousands_of_honest_peers_pass() -> None:
    watch = SinkWatch(BOUND, ALLOWANCE, rows=ROWS)
    pushes = int(watch.pushes_to_suspect(HALF)) - 1  # its fill, one push short of suspicion
    for _ in range(pushes):
        watch.sent("sink", HALF)
    taken = watch.scores["sink"]
    assert not watch.suspected("sink")
    rng = random.Random(0)
    for i in range(10 * ROWS):  # each met once: the sink is the oldest row by far
        _honest_meeting(watch, f"honest-{i}", rng)
    assert len(watch.scores) <= ROWS
    assert watch.scores.get("sink", watch.floor) == taken
    watch.sent("sink", HALF)  # the one more push it always was from suspicion
    assert watch.suspected("sink")


def test_no_peer_gains_by_being_forgotten_but_what_peers_without_a_row_returned() -> None:
    """Whatever the order of meetings, a forgotten peer's score (the floor) is never below
    the score it had when forgotten less what the floor fell since its row was made, and
    the honest peers are never suspected."""
    watch = SinkWatch(BOUND, ALLOWANCE, rows=ROWS)
    rng = random.Random(1)
    had: dict[str, float] = {}  # forgotten peer: its score then, less the fall by then
    made: dict[str, float] = {}  # peer with a row: the floor's fall when it was made
    peers = [f"p{i}" for i in range(3 * ROWS)]
    for _ in range(20 * ROWS):
        peer = rng.choice(peers)
        before = dict(watch.scores)
        _honest_meeting(watch, peer, rng)
        for gone in before.keys() - watch.scores.keys():
            had[gone] = before[gone] + made.pop(gone)  # in units of the fall since made
        for new in watch.scores.keys() - before.keys():
            made[new] = watch.fallen
            had.pop(new, None)
        for p, least in had.items():
            assert watch.floor >= least - watch.fallen - 1e-12, (p, least, watch.floor)
    assert had, "no peer was forgotten: the book never turned over"
    assert not any(watch.suspected(p) for p in peers)
    assert watch.floor < BOUND


def test_honest_newcomers_are_not_suspected_however_long_the_book_turns_over() -> None:
    """A node meeting a new peer at nearly every push (crossover at scale): each peer it
    pushes to is met once, and weight comes back from others. Over 100,000 meetings, a
    thousand times the rows, the floor stays where one push puts it."""
    watch = SinkWatch(BOUND, ALLOWANCE, rows=ROWS)
    rng = random.Random(2)
    highest = 0.0
    for i in range(100_000):
        watch.sent(f"to-{i}", HALF)
        watch.received(f"from-{i}", rng.uniform(0.3, 0.7))
        highest = max(highest, watch.floor)
        assert not watch.suspected(f"to-{i}")
    assert highest <= (1 - ALLOWANCE) * HALF + 1e-12, highest


def test_a_sink_pushed_now_and_then_among_newcomers_is_suspected_nearly_as_soon_as_alone() -> None:
    """One push in ten goes to the sink, the rest each to a peer met once: the book turns
    over many times between two pushes to the sink. Once its score stands above a
    once-met peer's it is never in the lowest half forgotten, so it is suspected after
    the pushes it would take alone plus the few it took before (29 here, against 26:
    25 alone and the one in flight)."""
    watch = SinkWatch(BOUND, ALLOWANCE, rows=8)
    rng = random.Random(3)
    pushes = 0
    for i in range(10_000):
        watch.sent(f"to-{i}", HALF)
        watch.received(f"from-{i}", rng.uniform(0.3, 0.7))
        if i % 10 == 0:
            if watch.suspected("sink"):
                break
            watch.sent("sink", HALF)
            pushes += 1
    assert watch.suspected("sink")
    assert pushes <= 1.2 * (watch.pushes_to_suspect(HALF) + 1), pushes


def test_the_floor_survives_a_checkpoint() -> None:
    watch = SinkWatch(BOUND, ALLOWANCE, rows=ROWS)
    for i in range(ROWS + 1):
        watch.sent(f"p{i}", HALF * (1 + i / ROWS))
    assert watch.floor > 0.0
    again = SinkWatch(BOUND, ALLOWANCE, rows=ROWS)
    again.restore(watch.state())
    assert (again.scores, again.floor) == (watch.scores, watch.floor)
    assert again.scores.get("never-met", again.floor) == watch.floor


def test_a_peer_without_a_row_that_returns_weight_lowers_the_floor() -> None:
    watch = SinkWatch(BOUND, ALLOWANCE, floor=1.0)
    watch.received("back", 0.4)  # −(1 + 0.5)·0.4 from the floor, that peer's score
    assert watch.floor == pytest.approx(1.0 - 0.6) and watch.scores == {}
    watch.received("gone", 2.0)
    assert (watch.floor, watch.fallen) == (0.0, pytest.approx(1.0))
    watch.sent("new", HALF)  # a row at the floor plus the push
    assert watch.scores == {"new": pytest.approx((1 - ALLOWANCE) * HALF)}


def test_a_watch_keeps_at_least_one_row() -> None:
    with pytest.raises(ValueError, match="at least 1 row"):
        SinkWatch(BOUND, ALLOWANCE, rows=0)
