"""The sink watch's book stays bounded without handing a sink its credit back.

A node keeps at most ``rows`` peers' scores (node/protocols/sinks.py; BOOK_ROWS, 1,024,
in the daemon; ROWS here, so the book turns over in a test's time). It used to forget a
peer with score 0 or else the oldest row: in a mesh where a node meets more peers than
that (crossover at scale, churn), a sink that took its fill of weight early and then
stayed quiet was the oldest row, was forgotten, and came back with a clean score to take
as much again. Now the lowest score is forgotten and the book remembers the highest
score it forgot, which any peer without a row is taken to have.
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


def test_no_peer_gains_by_being_forgotten() -> None:
    """Whatever the order of meetings, a peer's score after it was forgotten is never
    below the score it had when forgotten, and the honest peers are never suspected."""
    watch = SinkWatch(BOUND, ALLOWANCE, rows=ROWS)
    rng = random.Random(1)
    had: dict[str, float] = {}
    peers = [f"p{i}" for i in range(3 * ROWS)]
    for _ in range(20 * ROWS):
        peer = rng.choice(peers)
        before = dict(watch.scores)
        _honest_meeting(watch, peer, rng)
        for gone in before.keys() - watch.scores.keys():
            had[gone] = before[gone]
    assert had, "no peer was forgotten: the book never turned over"
    for peer, score in had.items():
        if peer not in watch.scores:
            assert watch.floor >= score, (peer, score, watch.floor)
    assert not any(watch.suspected(p) for p in peers)
    assert watch.floor < BOUND


def test_the_floor_survives_a_checkpoint() -> None:
    watch = SinkWatch(BOUND, ALLOWANCE, rows=ROWS)
    for i in range(ROWS + 1):
        watch.sent(f"p{i}", HALF * (1 + i / ROWS))
    assert watch.floor > 0.0
    again = SinkWatch(BOUND, ALLOWANCE, rows=ROWS)
    again.restore(watch.state())
    assert (again.scores, again.floor) == (watch.scores, watch.floor)
    assert again.scores.get("never-met", again.floor) == watch.floor


def test_a_peer_that_returns_weight_gets_a_row_below_the_floor() -> None:
    watch = SinkWatch(BOUND, ALLOWANCE, floor=1.0)
    watch.received("back", 0.4)  # −(1 + 0.5)·0.4 from the floor
    assert watch.scores["back"] == pytest.approx(1.0 - 0.6)
    watch.received("gone", 2.0)
    assert watch.scores["gone"] == 0.0
    fresh = SinkWatch(BOUND, ALLOWANCE)
    fresh.received("quiet", 0.4)  # nothing to remember below a floor of 0
    assert fresh.scores == {}


def test_a_watch_keeps_at_least_one_row() -> None:
    with pytest.raises(ValueError, match="at least 1 row"):
        SinkWatch(BOUND, ALLOWANCE, rows=0)
