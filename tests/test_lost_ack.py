"""A receiver merged a push and its acknowledgement was lost: the two ways it can end.

Driven at the protocol core's event interface (node/protocols/base.py), the way the
replica drives it: ``PayloadArrived`` asks for a plan, the driver blends the
``Merge`` segments into its model and reports ``PayloadMerged``; every push ends in
one ``PushSettled`` whose ``FoldBack`` actions the sender blends back in. Each site
here keeps a float64 model per segment so Σ w·x can be checked as well as Σ w.

The sender takes a local training step while its push is in flight, so a fold-back
blends a snapshot that differs from the model it comes home to. The quantity the
protocol conserves is then Σ available·x + Σ in-flight weight·snapshot, measured
once the push is sent and the step is taken.

(a) The sender retries with the same sequence: the receiver answers Duplicate and
    changes nothing, the sender commits, and both sums are exactly what they were.
(b) The sender gives up (the receiver was declared dead; settled with no segment
    acknowledged): the ledger's documented mass bound. The push's weight now exists
    twice, so Σ w is exactly N + the pushed weight and Σ w·x exceeds its initial
    value by exactly pushed weight · the snapshot that was sent, no more.
(c) The receiver left gracefully and said, with its Leave, what it merged of the
    sender's pushes (its receipts, node/net/wire/lastwords.py): the sender settles from
    them and both sums are exact again, for a merged push and for one it never merged.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from gossipd.node.net.wire.lastwords import LastWord
from gossipd.node.protocols.base import (
    Duplicate,
    FoldBack,
    Merge,
    PayloadArrived,
    PayloadMerged,
    Push,
    PushSettled,
    Receipts,
    StepEnded,
)
from gossipd.node.protocols.sumweight import SumWeightGossip

IDS = ("a", "b", "c")
SEGMENTS = 2
DIM = 4
INCARNATION = 5


class Site:
    """One core and the model it drives: what the replica does, without threads or torch."""

    def __init__(self, node_id: str, rng: random.Random) -> None:
        self.core = SumWeightGossip(
            node_id, SEGMENTS, push_probability=1.0, rng=random.Random(rng.getrandbits(64))
        )
        self.core.on_peer_up("b" if node_id == "a" else "a")  # a and b gossip; c looks on
        self.x = [np.array([rng.uniform(-1.0, 1.0) for _ in range(DIM)]) for _ in range(SEGMENTS)]
        self.sent: dict[tuple[str, int], list[np.ndarray]] = {}

    def step(self, step: int) -> Push:
        [push] = self.core.handle(StepEnded(step, float(step)))
        assert isinstance(push, Push)
        self.sent[push.key] = [v.copy() for v in self.x]  # the snapshot that goes on the wire
        return push

    def train(self, rng: random.Random) -> None:
        """A local optimizer step: the model moves, the weights do not."""
        for s in range(SEGMENTS):
            self.x[s] = self.x[s] + np.array([rng.uniform(-0.5, 0.5) for _ in range(DIM)])

    def receive(self, sender: Site, push: Push) -> list[Merge | Duplicate]:
        """One delivery attempt of ``push``: plan, blend, commit. Returns the plan (the acks)."""
        arrival = PayloadArrived(
            sender.core.node_id, INCARNATION, push.sequence, push.round, push.weights
        )
        plan = self.core.handle(arrival)
        values = sender.sent[push.key]
        blends = {
            a.segment: (1 - a.alpha) * self.x[a.segment] + a.alpha * values[a.segment]
            for a in plan
            if isinstance(a, Merge)
        }
        assert self.core.handle(PayloadMerged(arrival)) == []
        for segment, blended in blends.items():
            self.x[segment] = blended
        return plan

    def settle(self, push: Push, acked: tuple[int, ...]) -> list[FoldBack]:
        folds = self.core.handle(PushSettled(push.peer, push.sequence, acked))
        for fold in folds:
            snapshot = self.sent[(fold.peer, fold.sequence)][fold.segment]
            self.x[fold.segment] = (1 - fold.alpha) * self.x[fold.segment] + fold.alpha * snapshot
        return folds


def _mesh(seed: int) -> dict[str, Site]:
    rng = random.Random(seed)
    return {node_id: Site(node_id, rng) for node_id in IDS}


def _sum_w(sites: dict[str, Site], s: int) -> float:
    return math.fsum(site.core.weights[s] for site in sites.values())


def _sum_wx(sites: dict[str, Site], s: int) -> np.ndarray:
    return sum(site.core.weights[s] * site.x[s] for site in sites.values())


def _conserved_wx(sites: dict[str, Site], s: int) -> np.ndarray:
    """Σ available·x plus every undelivered push's weight times its snapshot."""
    held = sum(site.core.available(s) * site.x[s] for site in sites.values())
    flying = [
        push.weights[s] * site.sent[key][s]
        for site in sites.values()
        for key, push in site.core.in_flight.items()
    ]
    return held + sum(flying)


def _settled(sites: dict[str, Site]) -> None:
    for site in sites.values():
        assert site.core.reserved == [0.0] * SEGMENTS
        assert not site.core.in_flight


def _a_pushed_then_trained(seed: int) -> tuple[dict[str, Site], Push, list[np.ndarray]]:
    """The mesh after a's first push to b and a local step of a's: the sites, the push,
    and the conserved Σ w·x per segment at that moment."""
    sites = _mesh(seed)
    push = sites["a"].step(1)
    sites["a"].train(random.Random(seed + 100))
    return sites, push, [_conserved_wx(sites, s) for s in range(SEGMENTS)]


def _assert_exact(sites: dict[str, Site], wx0: list[np.ndarray]) -> None:
    for s in range(SEGMENTS):
        assert _sum_w(sites, s) == len(sites)
        np.testing.assert_allclose(_sum_wx(sites, s), wx0[s], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merged_ack_lost_sender_retries_same_sequence_duplicate_then_commit_sums_exact(
    seed: int,
) -> None:
    sites, push, wx0 = _a_pushed_then_trained(seed)
    a, b = sites["a"], sites["b"]
    assert push.peer == "b" and push.weights == {0: 0.5, 1: 0.5}
    first = b.receive(a, push)
    assert [type(p) for p in first] == [Merge] * SEGMENTS
    merged_x = [v.copy() for v in b.x]
    # The acknowledgement is lost. a's push is unsettled, so a's next step sends nothing
    # new to b (one push per edge): it retries the same push with the same sequence.
    assert a.core.handle(StepEnded(2, 2.0)) == []
    retry = b.receive(a, push)
    assert retry == [Duplicate(0), Duplicate(1)]
    assert b.core.weights == [1.5, 1.5]  # not merged twice
    for s in range(SEGMENTS):
        assert np.array_equal(b.x[s], merged_x[s])
    acked = tuple(d.segment for d in retry)
    assert a.settle(push, acked) == []  # the retry's ack commits; nothing comes home
    assert a.settle(push, acked) == []  # the first attempt's ack, arriving late
    _settled(sites)
    assert a.core.weights == [0.5, 0.5]
    _assert_exact(sites, wx0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merged_ack_lost_sender_gives_up_creates_exactly_the_pushed_weight(seed: int) -> None:
    sites, push, wx0 = _a_pushed_then_trained(seed)
    a, b = sites["a"], sites["b"]
    n = len(sites)
    assert [type(p) for p in b.receive(a, push)] == [Merge] * SEGMENTS
    # The acknowledgement is lost and a declares b dead: it settles with nothing
    # acknowledged, so every segment's share folds back into a with the snapshot sent.
    folds = a.settle(push, ())
    assert sorted(f.segment for f in folds) == list(range(SEGMENTS))
    _settled(sites)
    assert a.core.weights == [1.0, 1.0]  # all of it back home
    assert b.core.weights == [1.5, 1.5]  # and b keeps what it merged
    for s in range(SEGMENTS):
        pushed = push.weights[s]
        # The documented bound: the mass created is the push's weight, exactly.
        assert _sum_w(sites, s) == n + pushed
        np.testing.assert_allclose(
            _sum_wx(sites, s), wx0[s] + pushed * a.sent[push.key][s], rtol=1e-12, atol=1e-12
        )
    # b, back, merges a's next push (a new sequence) rather than calling it a duplicate.
    nxt = a.step(3)
    assert nxt.key == ("b", push.sequence + 1)
    assert [type(p) for p in b.receive(a, nxt)] == [Merge] * SEGMENTS


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merged_ack_lost_receiver_left_and_its_receipts_settle_the_push_exactly(
    seed: int,
) -> None:
    sites, push, wx0 = _a_pushed_then_trained(seed)
    a, b = sites["a"], sites["b"]
    n = len(sites)
    b.receive(a, push)  # merged; the acknowledgement is lost, and b leaves
    word = LastWord(incarnation=1, receipts=tuple(b.core.receipts("a")))
    assert word.merged(INCARNATION, push.sequence_base, push.sequence, range(SEGMENTS)) == [0, 1]
    assert a.settle(push, (0, 1)) == []  # committed: nothing folds back
    _settled(sites)
    _assert_exact(sites, wx0)

    # The next push never reached b: its receipts say so, and it folds back whole.
    nxt = a.step(3)
    assert word.merged(INCARNATION, nxt.sequence_base, nxt.sequence, range(SEGMENTS)) == []
    assert sorted(f.segment for f in a.settle(nxt, ())) == list(range(SEGMENTS))
    for s in range(SEGMENTS):
        assert _sum_w(sites, s) == n


def test_receipts_say_nothing_of_what_the_receiver_no_longer_remembers() -> None:
    """A sequence the window forgot, or a numbering whose window a later one replaced,
    is not known either way: such a push settles as before (the documented bound)."""
    core = SumWeightGossip("b", SEGMENTS, push_probability=0.0, rng=random.Random(0))
    core.on_peer_up("a")
    for sequence in (1, 2):
        arrival = PayloadArrived("a", INCARNATION, sequence, 0, {0: 0.25}, 1)
        core.handle(arrival)
        core.handle(PayloadMerged(arrival))
    [window] = core.receipts("a")
    assert window.pairs == {(1, 0), (2, 0)} and window.forgotten_up_to == -1
    word = LastWord(1, (window,))
    assert word.merged(INCARNATION, 1, 2, [0, 1]) == [0]
    assert word.merged(INCARNATION + 1, 1, 2, [0]) == []  # another incarnation's numbering
    forgot = LastWord(1, (Receipts(INCARNATION, 1, 2, frozenset({(3, 0)})),))
    assert forgot.merged(INCARNATION, 1, 2, [0]) is None
    replaced = LastWord(1, (Receipts(INCARNATION, 5, -1, frozenset({(5, 0)})),))
    assert replaced.merged(INCARNATION, 1, 2, [0]) is None
