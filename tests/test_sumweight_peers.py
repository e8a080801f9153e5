"""Sum-weight gossip (node/protocols/sumweight.py): its settings and whom it pushes to.

The constructor refuses a push probability outside [0, 1], fewer than one segment or
an invalid initial weight; a node pushes with probability p after each step, only to
live peers other than itself, all of them in time, and the same seed gives the same
pushes. Every event reaches the core through ``handle()`` (tests/sumweight_events.py).
"""

from __future__ import annotations

import math
import random

import pytest

from gossipd.node.protocols.sumweight import SumWeightGossip
from tests.sumweight_events import hand_off, make, peer_down, settle, step


# -- constructor and rng ------------------------------------------------------------------
@pytest.mark.parametrize("p", [-0.1, 1.0000001, math.nan])
def test_push_probability_outside_unit_interval_is_refused(p):
    with pytest.raises(ValueError, match="push_probability"):
        SumWeightGossip("a", 1, push_probability=p, rng=random.Random(0))


@pytest.mark.parametrize("num_segments", [0, -3])
def test_fewer_than_one_segment_is_refused(num_segments):
    with pytest.raises(ValueError, match=f"got {num_segments}"):
        SumWeightGossip("a", num_segments, push_probability=0.5, rng=random.Random(0))


@pytest.mark.parametrize("weight", [-0.5, math.nan, math.inf])
def test_invalid_initial_weight_is_refused(weight):
    with pytest.raises(ValueError, match="initial_weight"):
        SumWeightGossip("a", 1, push_probability=0.5, rng=random.Random(0), initial_weight=weight)


def test_push_probability_zero_never_pushes():
    node = make(p=0.0, peers=("b", "c", "d"))
    for _ in range(2000):
        assert step(node) == []
    assert node.weights == [1.0, 1.0]


def test_push_probability_one_pushes_after_every_step():
    node = make(p=1.0, peers=("b", "c"))
    for k in range(1, 21):
        [push] = step(node)
        settle(node, push.key, [0, 1])
        assert node.weights[0] == 0.5**k


def test_push_probability_half_pushes_about_half_of_the_steps():
    node = make(p=0.5, peers=("b", "c"), seed=1)
    pushed = 0
    for _ in range(4000):
        for push in step(node):
            pushed += 1
            settle(node, push.key, ())
    assert 1800 < pushed < 2200


def test_no_self_peer_is_ever_chosen():
    node = make(node_id="a", peers=("a", "b", "c"))
    assert node.peers == {"b", "c"}
    for _ in range(500):
        for push in step(node):
            assert push.peer != "a"
            settle(node, push.key, ())
    alone = make(node_id="a", peers=("a",))
    assert alone.peers == set()
    assert step(alone) == []
    assert hand_off(alone) is None


def test_pushes_go_only_to_live_peers_and_reach_every_one_of_them():
    node = make(peers=("b", "c", "d"))
    peer_down(node, "c")
    peer_down(node, "zzz")  # unknown peer: no error
    targets = set()
    for _ in range(300):
        for push in step(node):
            targets.add(push.peer)
            settle(node, push.key, ())
    assert targets == {"b", "d"}


def test_same_rng_seed_gives_the_same_pushes():
    def trace(seed):
        node = make(peers=("b", "c", "d", "e"), p=0.5, seed=seed)
        out = []
        for _ in range(200):
            for push in step(node):
                out.append((push.peer, push.sequence))
                settle(node, push.key, [0, 1])
        return out

    assert trace(11) == trace(11)
    assert trace(11) != trace(12)
