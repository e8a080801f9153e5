"""A sum-weight core driven the way a driver drives it: events in through ``handle()``.

The sum-weight tests (tests/test_sumweight_*.py and tests/lossy_mesh.py) talk to
:class:`~gossipd.node.protocols.sumweight.SumWeightGossip` only through
:meth:`~gossipd.node.protocols.base.GossipProtocol.handle`, each helper here naming
the event it hands over: ``StepEnded``, ``PushSettled``, ``HandOff``, ``ViewChanged``,
``PeerRestarted``, and a payload as the replica takes it, ``PayloadArrived`` (what
would merging it do? nothing changes) then ``PayloadMerged`` (commit it). They read
the core's state from its attributes, to check what the events did.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterable, Mapping

from gossipd.node.protocols.base import (
    Duplicate,
    FoldBack,
    HandOff,
    Merge,
    PayloadArrived,
    PayloadMerged,
    PeerRestarted,
    Push,
    PushSettled,
    StepEnded,
    ViewChanged,
)
from gossipd.node.protocols.sumweight import SumWeightGossip


def make(node_id="a", num_segments=2, *, p=1.0, seed=0, peers=("b",), **kwargs) -> SumWeightGossip:
    """A core whose view holds ``peers`` (and itself)."""
    node = SumWeightGossip(
        node_id, num_segments, push_probability=p, rng=random.Random(seed), **kwargs
    )
    view(node, node_id, *peers)
    return node


def snapshot(node: SumWeightGossip) -> dict:
    """Everything a core holds, its rng's state and de-duplication windows included, as a
    deep copy that compares equal exactly when nothing changed."""
    state = {k: v for k, v in vars(node).items() if k not in ("_rng", "_planned")}
    state["rng"] = node.rng.getstate()
    return copy.deepcopy(state)


# -- events --------------------------------------------------------------------------------
def step(node: SumWeightGossip, step: int = 0) -> list[Push]:
    """``StepEnded``: the pushes the core asks for (they carry round ``step``)."""
    actions = node.handle(StepEnded(step, 0.0))
    assert all(isinstance(a, Push) for a in actions), actions
    return actions


def numbered(push: Push, last: dict[str, int]) -> None:
    """Check ``push``'s sequence against the sender's earlier ones and record it (``last``:
    per receiver the last sequence, under "" the highest to anyone): a push continues its
    numbering by one, or opens a numbering above every sequence the sender used."""
    top = last.get("", 0)
    if push.sequence == push.sequence_base:
        assert push.sequence > top, f"a new numbering at {push.sequence}, not above {top}"
    else:
        assert push.sequence == last.get(push.peer, 0) + 1, "a numbering counts on by one"
    last[push.peer] = push.sequence
    last[""] = max(top, push.sequence)


def settle(node: SumWeightGossip, key: tuple[str, int], acked: Iterable[int]) -> list[FoldBack]:
    """``PushSettled`` for the push known by ``key`` (peer, sequence): the fold-backs."""
    peer, sequence = key
    return node.handle(PushSettled(peer, sequence, tuple(acked)))


def hand_off(node: SumWeightGossip, peer: str | None = None) -> Push | None:
    """``HandOff``: the push that hands all available weight over, if any."""
    actions = node.handle(HandOff(peer))
    assert len(actions) <= 1 and all(isinstance(a, Push) for a in actions), actions
    return actions[0] if actions else None


def view(node: SumWeightGossip, *members: str) -> None:
    """``ViewChanged`` to exactly ``members`` (the core adds itself)."""
    assert node.handle(ViewChanged(frozenset(members))) == []


def peer_up(node: SumWeightGossip, peer: str) -> None:
    view(node, *node.view.members, peer)


def peer_down(node: SumWeightGossip, peer: str) -> None:
    view(node, *(m for m in node.view.members if m != peer))


def restarted(node: SumWeightGossip, peer: str, incarnation: int) -> None:
    """``PeerRestarted``: ``peer`` came back as ``incarnation``."""
    assert node.handle(PeerRestarted(peer, incarnation)) == []


# -- payloads ------------------------------------------------------------------------------
def arrival(
    sender: str, incarnation: int, sequence: int, weights: Mapping[int, float], base: int = 1
) -> PayloadArrived:
    return PayloadArrived(sender, incarnation, sequence, 0, weights, base)


def ask(
    node: SumWeightGossip,
    sender: str,
    incarnation: int,
    sequence: int,
    weights: Mapping[int, float],
    base: int = 1,
) -> list[Merge | Duplicate]:
    """``PayloadArrived``: what merging it would do; changes nothing (raises ``Refused``)."""
    return node.handle(arrival(sender, incarnation, sequence, weights, base))


def commit(
    node: SumWeightGossip,
    sender: str,
    incarnation: int,
    sequence: int,
    weights: Mapping[int, float],
    base: int = 1,
) -> None:
    """``PayloadMerged``: the driver applied every merge the core proposed for it."""
    assert node.handle(PayloadMerged(arrival(sender, incarnation, sequence, weights, base))) == []


def receive(
    node: SumWeightGossip, sender: str, incarnation: int, sequence: int, segment: int, weight: float
) -> Merge | Duplicate:
    """One segment of a push, asked then merged, as the replica does (raises ``Refused``)."""
    (action,) = ask(node, sender, incarnation, sequence, {segment: weight})
    commit(node, sender, incarnation, sequence, {segment: weight})
    return action


def deliver(receiver: SumWeightGossip, sender: str, push: Push, incarnation: int = 0) -> list:
    """The receiver's side of one attempt of ``push``: asked, then merged."""
    plan = ask(receiver, sender, incarnation, push.sequence, push.weights, push.sequence_base)
    commit(receiver, sender, incarnation, push.sequence, push.weights, push.sequence_base)
    return plan
