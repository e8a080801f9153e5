"""The per-peer weight credit (:mod:`gossipd.node.protocols.credit`) on the cores themselves.

A member with a valid certificate took 2.997 of a 3-site mesh's 3.0 by acknowledging
every push and returning nothing, and could then push at any weight it liked. With the
credit a site gives one peer at most ``peer_credit`` of its weight, net, per segment,
and merges from it at most what it took plus ``peer_credit`` plus one founding weight.
"""

from __future__ import annotations

import math
import random

import pytest

from gossipd.node.protocols.base import (
    HandOff,
    PayloadArrived,
    PayloadMerged,
    Push,
    PushSettled,
    Settle,
    StepEnded,
    ViewChanged,
)
from gossipd.node.protocols.credit import DEFAULT_CREDIT, CreditExceeded, PeerCredit
from gossipd.node.protocols.ledger import SILENT_PUSHES_PER_PEER
from gossipd.node.protocols.sumweight import SumWeightGossip
from gossipd.node.sim.driver import Simulation
from gossipd.node.sim.spec import SimSpec

SEGMENTS = 2


def _core(node: str, peers: set[str], **settings: float) -> SumWeightGossip:
    core = SumWeightGossip(
        node,
        SEGMENTS,
        rng=random.Random(7),
        push_probability=1.0,
        peer_credit=settings.pop("peer_credit", DEFAULT_CREDIT),
        **settings,
    )
    core.handle(ViewChanged(frozenset(peers | {node})))
    return core


def _arrival(sender: str, sequence: int, weight: float) -> PayloadArrived:
    return PayloadArrived(sender, 1, sequence, 0, {s: weight for s in range(SEGMENTS)})


def _pushes(core: SumWeightGossip, step: int) -> list[Push]:
    """The pushes of ``step``; the rest of what it asks are settles of idle numberings."""
    actions = core.handle(StepEnded(step, float(step)))
    assert all(isinstance(a, Push | Settle) for a in actions), actions
    return [a for a in actions if isinstance(a, Push)]


def test_a_sink_takes_at_most_the_credit_of_each_segment_however_long_it_is_pushed_to() -> None:
    core = _core("a", {"sink"})
    taken = [0.0] * SEGMENTS
    for step in range(200):
        for push in _pushes(core, step):
            for s, w in push.weights.items():
                taken[s] += w
            core.handle(PushSettled(push.peer, push.sequence, tuple(push.weights)))
    assert taken == pytest.approx([DEFAULT_CREDIT] * SEGMENTS, abs=1e-12)
    assert core.weights == pytest.approx([1 - DEFAULT_CREDIT] * SEGMENTS, abs=1e-12)
    assert core.credit.holds_all("sink")


def test_a_net_short_of_the_credit_by_rounding_holds_all_of_it() -> None:
    """Seen in CI: pushes cut to the room left summed to 0.33333333333333326, a rounding
    short of the credit; the site passed the sink over for want of room and, comparing
    exactly, never named it."""
    credit = PeerCredit(DEFAULT_CREDIT, 1)
    credit.sent("sink", 0, 0.33333333333333326)
    assert credit.holds_all("sink")
    credit.received("sink", 0, 1e-6)  # a real gap is not rounding
    assert not credit.holds_all("sink")


def test_a_sink_that_returns_a_crumb_is_still_named_once_it_has_been_passed_over() -> None:
    """A net held short of the credit by more than rounding: the sink gives back 0.01 of
    the third it took, so its room (0.01) is under a tenth of this node's weight and it
    is passed over for good, yet it no longer holds all the credit. Before, the crumb
    cleared it and nothing named it again (its weight stayed bounded; its name was
    missed): now a peer passed over for want of room is counted silent, and a crumb
    back restarts the count instead of clearing it."""
    core = _core("a", {"sink", "b"})
    patience = SILENT_PUSHES_PER_PEER * 2
    to_sink, to_b, crumbed = 0, 0, False
    for step in range(4 * patience):
        for push in _pushes(core, step):
            core.handle(PushSettled(push.peer, push.sequence, tuple(push.weights)))
            if push.peer == "b":  # b is honest: it returns what it took
                to_b += 1
                net = core.credit.net("b", 0)
                core.handle(PayloadMerged(_arrival("b", step + 1, net)))
            else:
                to_sink += 1
        if to_sink and not crumbed:
            assert core.credit.holds_all("sink")
            core.handle(PayloadMerged(_arrival("sink", 1, 0.01)))  # the crumb
            assert not core.credit.holds_all("sink") and not core.credit_leaves_room("sink")
            crumbed, crumbed_at = True, to_b
        if crumbed and to_b - crumbed_at < patience:
            assert not core.suspected_sinks(), (step, to_b)
    assert to_sink == 1  # passed over after its third, crumb or not
    assert to_b - crumbed_at >= patience
    assert core.suspected_sinks() == {"sink"}


def test_a_peer_brings_at_most_what_it_took_plus_the_credit_and_a_founding_weight() -> None:
    core = _core("a", {"b"})
    [push] = core.handle(StepEnded(0, 0.0))
    core.handle(PushSettled(push.peer, push.sequence, tuple(push.weights)))
    took = push.weights[0]  # the first push is cut to the credit
    assert took == pytest.approx(DEFAULT_CREDIT)
    allowed = took + DEFAULT_CREDIT + 1.0
    before = list(core.weights)
    with pytest.raises(CreditExceeded, match=r"limits\.peer_credit"):
        core.handle(_arrival("b", 1, allowed * 1.001))
    assert core.weights == before  # refused whole: nothing merged
    core.handle(PayloadMerged(_arrival("b", 2, allowed)))
    assert core.weights == pytest.approx([w + allowed for w in before])
    with pytest.raises(CreditExceeded):  # spent: nothing more until it takes again
        core.handle(_arrival("b", 3, 1e-6))


def test_an_honest_sender_sizing_by_its_own_book_is_never_refused() -> None:
    """Both ends book an edge alike; in-flight pushes count as sent on both ends."""
    a, b = _core("a", {"b"}), _core("b", {"a"})
    cores = {"a": a, "b": b}
    rng = random.Random(3)
    in_flight: list[tuple[str, Push]] = []
    for step in range(400):
        sender = rng.choice("ab")
        in_flight += [(sender, p) for p in _pushes(cores[sender], step)]
        rng.shuffle(in_flight)
        while in_flight and rng.random() < 0.6:  # pushes land in any order, some later
            origin, push = in_flight.pop()
            arrival = PayloadArrived(origin, 1, push.sequence, 0, push.weights, push.sequence_base)
            cores[push.peer].handle(PayloadMerged(arrival))  # raises if refused
            cores[origin].handle(PushSettled(push.peer, push.sequence, tuple(push.weights)))
    for origin, push in in_flight:
        arrival = PayloadArrived(origin, 1, push.sequence, 0, push.weights, push.sequence_base)
        cores[push.peer].handle(PayloadMerged(arrival))
        cores[origin].handle(PushSettled(push.peer, push.sequence, tuple(push.weights)))
    assert [x + y for x, y in zip(a.weights, b.weights, strict=True)] == pytest.approx([2.0] * 2)
    for s in range(SEGMENTS):
        assert a.credit.net("b", s) == pytest.approx(-b.credit.net("a", s), abs=1e-12)
        assert abs(a.credit.net("b", s)) <= DEFAULT_CREDIT + 1e-12


def test_a_leaving_site_hands_each_heir_what_it_admits_and_the_rest_to_the_next() -> None:
    core = _core("leaver", {"b", "c"})
    core.weights = [1.5] * SEGMENTS  # it merged more than one peer admits from it
    first = core.handle(HandOff("b"))[0]
    assert first.weights == {s: pytest.approx(DEFAULT_CREDIT + 1.0) for s in range(SEGMENTS)}
    core.handle(PushSettled("b", first.sequence, tuple(first.weights)))
    second = core.handle(HandOff("c"))[0]
    core.handle(PushSettled("c", second.sequence, tuple(second.weights)))
    assert core.weights == pytest.approx([0.0] * SEGMENTS, abs=1e-12)
    assert core.handle(HandOff("b")) == []  # nothing left to hand


def test_the_credit_off_is_the_protocol_as_before() -> None:
    core = _core("a", {"sink"}, peer_credit=math.inf)
    [push] = core.handle(StepEnded(0, 0.0))
    assert push.weights == {0: 0.5, 1: 0.5}
    with pytest.raises(ValueError, match="peer credit"):
        PeerCredit(0.0, 1)


@pytest.mark.parametrize("protocol", ["sumweight", "crossover", "shuffle-exchange"])
def test_in_the_simulator_honest_peers_are_never_refused_and_mass_stays_exact(
    protocol: str,
) -> None:
    """Honest peers hit the credit (a net weight is a random walk) and push less or to
    another peer; the receiver never refuses them, whatever the order pushes land in."""
    spec = SimSpec(protocol=protocol, nodes=6, rounds=300, segments=2, dim=4, check_invariants=True)
    result = Simulation(spec).run()
    assert result.refused == 0
    assert result.invariant_mass_error is not None and result.invariant_mass_error <= 1e-12
    assert result.errors[-1] < 1e-6 * result.errors[0]  # it still mixes
