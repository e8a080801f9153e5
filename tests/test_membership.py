"""gossipd.node.net.peers.membership: claims become bounded candidates; only our own handshake's
answer makes a peer.

The rule under test (docs/design.md §6): a node is a peer only after this node's own
Handshake to an address was answered by it; everything anyone says about another
node is a claim, kept as a bounded candidate, that never changes a verified entry.
Liveness, departures, views and attacks: tests/test_membership_liveness.py; random
schedules of every call: tests/test_membership_schedules.py.
"""

from __future__ import annotations

from gossipd.node.net.peers.membership import Change, NodeInfo, PeerState, Verdict
from tests.membership_tables import (
    SELF,
    SELF_ADDRESS,
    info,
    known_triples,
    live_ids,
    membership,
    peer_table,
    verify,
)

# ---------------------------------------------------------------------------
# hear: claims become candidates, never peers


def test_hear_makes_a_candidate_never_a_peer() -> None:
    m = membership()
    claim = info("a", 1, "10.0.0.1:1")
    assert m.hear(claim) is True
    assert m.candidates == {"10.0.0.1:1": claim}
    assert m.peers == {}
    assert m.live() == [] and m.suspected() == [] and m.known() == []
    assert not m.is_current("a", 1)


def test_hear_ignores_self_by_id_and_by_address() -> None:
    m = membership()
    assert m.hear(info(SELF, 7)) is False
    assert m.hear(info(SELF, 7), direct=True) is False
    assert m.hear(info("impostor", 1, SELF_ADDRESS)) is False
    assert m.hear(info("impostor", 1, SELF_ADDRESS), direct=True) is False
    assert m.candidates == {}


def test_hear_ignores_empty_id_or_address() -> None:
    m = membership()
    assert m.hear(NodeInfo(node_id="", address="h:1", incarnation=1)) is False
    assert m.hear(NodeInfo(node_id="a", address="", incarnation=1), direct=True) is False
    assert m.candidates == {}


def test_one_candidate_per_address_first_relayed_claim_kept_a_direct_claim_replaces_it() -> None:
    m = membership()
    assert m.hear(info("a", 1, "h:1")) is True
    assert m.hear(info("b", 9, "h:1")) is False  # relayed: the first claim stays
    assert m.candidates["h:1"] == info("a", 1, "h:1")
    assert m.hear(info("c", 2, "h:1"), direct=True) is False  # already queued for a dial
    assert m.candidates == {"h:1": info("c", 2, "h:1")}  # the node's own word wins


def test_candidates_are_capped_and_taken_oldest_first() -> None:
    m = membership(max_candidates=3)
    claims = [info(f"n{i}", 1, f"h:{i}") for i in range(5)]
    assert [m.hear(c) for c in claims] == [True, True, True, False, False]
    assert [m.hear(c, direct=True) for c in claims[3:]] == [False, False]  # direct: capped too
    assert len(m.candidates) == 3
    assert m.take_candidates(0) == []
    assert m.take_candidates(2) == [("h:0", claims[0]), ("h:1", claims[1])]
    assert list(m.candidates) == ["h:2"]
    assert m.hear(claims[3]) is True  # room again
    assert m.take_candidates(10) == [("h:2", claims[2]), ("h:3", claims[3])]
    assert m.take_candidates(1) == []
    assert m.peers == {}


def test_a_claim_that_matches_a_verified_entry_is_not_a_candidate() -> None:
    m = membership()
    verify(m, "a", 3, "h:1")
    assert m.hear(info("a", 3, "h:1")) is False
    assert m.hear(info("a", 2, "h:1"), direct=True) is False  # older, same address
    assert m.candidates == {}


def test_hear_never_changes_a_verified_entry() -> None:
    m = membership(suspect_after_failures=1)
    verify(m, "a", 3, "h:1")
    m.failed("a", 1.0)  # suspected: a claim must not revive it either
    before = peer_table(m)
    claims = [
        info("a", 3, "h:1"),  # exactly the entry
        info("a", 2, "h:1"),
        info("a", 4, "h:1"),  # "a restarted": only a's own answer can say so
        info("a", 9, "elsewhere:1"),
        info("a", 1, "elsewhere:2"),
        info("b", 1, "h:1"),  # another node at a's address
    ]
    for claim in claims:
        m.hear(claim)
        m.hear(claim, direct=True)
    assert peer_table(m) == before
    assert known_triples(m) == [("a", "h:1", 3)]
    assert m.is_current("a", 3)


def test_relayed_claim_about_a_departed_incarnation_is_ignored_and_a_direct_one_is_not() -> None:
    m = membership()
    verify(m, "a", 3, "h:1")
    assert m.departed_now("a") == Change("a", False)
    assert m.departed == {"a": 3}
    assert m.hear(info("a", 3, "h:1")) is False
    assert m.hear(info("a", 2, "h:2")) is False
    assert m.candidates == {}
    assert m.hear(info("a", 4, "h:3")) is True  # a newer incarnation: worth a dial
    assert m.hear(info("a", 3, "h:1"), direct=True) is True  # a itself says it is back
    assert set(m.candidates) == {"h:3", "h:1"}
    assert m.peers == {}


# ---------------------------------------------------------------------------
# verified: our own handshake's answer


def test_verified_makes_a_live_peer_at_the_address_that_answered() -> None:
    m = membership()
    claim = info("a", 2, "10.0.0.1:1")
    m.hear(claim)
    [(address, taken)] = m.take_candidates(1)
    reply = info("a", 2, "a-advertises-this:9")
    assert m.verified(address, reply, taken) == Verdict((Change("a", True),))
    assert m.peers["a"] == PeerState("a", "10.0.0.1:1", 2)
    assert known_triples(m) == [("a", "10.0.0.1:1", 2)]
    assert live_ids(m) == ["a"]
    assert m.is_current("a", 2)
    assert not m.is_current("a", 1)
    assert m.verified(address, reply, taken) == Verdict()  # already live: no change
    assert m.candidates == {}


def test_verified_drops_the_candidate_queued_for_that_address() -> None:
    m = membership()
    m.hear(info("a", 1, "h:1"))
    verify(m, "a", 1, "h:1")  # e.g. a seed dial got there first
    assert m.candidates == {}


def test_verified_refuses_an_answer_that_contradicts_the_claim() -> None:
    m = membership()
    claim = info("a", 2, "h:1")
    for reply in (info("x", 2, "h:1"), info("a", 3, "h:1"), info("a", 1, "h:1")):
        verdict = m.verified("h:1", reply, claim)
        assert verdict.changes == ()
        assert verdict.refused is not None and "was said to be 'a'" in verdict.refused
    assert m.peers == {}
    assert m.known() == []


def test_verified_refuses_an_answer_as_this_node_or_as_nobody() -> None:
    m = membership()
    for reply in (info(SELF, 1, "h:1"), NodeInfo(node_id="", address="h:1", incarnation=1)):
        verdict = m.verified("h:1", reply)
        assert verdict.changes == () and verdict.refused is not None
    assert m.peers == {}


def test_verified_refuses_an_older_incarnation_and_keeps_the_entry() -> None:
    m = membership()
    verify(m, "a", 5, "h:1")
    before = peer_table(m)
    verdict = verify(m, "a", 4, "h:2")
    assert verdict.changes == ()
    assert verdict.refused is not None and "older than the known 5" in verdict.refused
    assert peer_table(m) == before


def test_a_restart_verified_reports_the_old_incarnation_down_then_the_new_one_up() -> None:
    m = membership(suspect_after_failures=1)
    assert verify(m, "a", 1, "old:1") == Verdict((Change("a", True),))
    assert verify(m, "a", 2, "new:1") == Verdict((Change("a", False), Change("a", True)))
    assert known_triples(m) == [("a", "new:1", 2)]
    assert live_ids(m) == ["a"]
    assert m.is_current("a", 2) and not m.is_current("a", 1)
    assert m.failed("a", 1.0) == Change("a", False)


def test_a_peer_that_moved_is_recorded_at_its_new_address_with_no_change() -> None:
    m = membership()
    verify(m, "a", 1, "old:1")
    assert verify(m, "a", 1, "new:1") == Verdict()
    assert known_triples(m) == [("a", "new:1", 1)]


def test_a_different_node_answering_at_an_address_evicts_the_old_one() -> None:
    m = membership(suspect_after_failures=1)
    verify(m, "a", 1, "h:1")
    verify(m, "b", 1, "h:2")
    verdict = m.verified("h:1", info("c", 1, "h:1"))
    assert verdict == Verdict((Change("a", False), Change("c", True)))
    assert known_triples(m) == [("b", "h:2", 1), ("c", "h:1", 1)]
    # a suspected occupant goes with no Change: the trainer was already told it is down
    m.failed("b", 1.0)
    assert m.verified("h:2", info("d", 1, "h:2")) == Verdict((Change("d", True),))
    assert sorted(m.peers) == ["c", "d"]


def test_a_node_moving_onto_an_occupied_address_evicts_the_occupant() -> None:
    m = membership()
    verify(m, "a", 1, "h:1")
    verify(m, "b", 1, "h:2")
    assert verify(m, "b", 2, "h:1") == Verdict(
        (Change("a", False), Change("b", False), Change("b", True))
    )
    assert known_triples(m) == [("b", "h:1", 2)]


def test_peer_table_is_capped_by_max_peers() -> None:
    m = membership(max_peers=2)
    verify(m, "a")
    verify(m, "b")
    verdict = verify(m, "c")
    assert verdict.changes == ()
    assert verdict.refused is not None and "membership.max_peers" in verdict.refused
    assert sorted(m.peers) == ["a", "b"]
    assert verify(m, "b", 2) == Verdict((Change("b", False), Change("b", True)))  # known: fine
    # a different node at a's address replaces a: the table does not grow
    assert m.verified("a.example:5000", info("c", 1, "a.example:5000")).refused is None
    assert sorted(m.peers) == ["b", "c"]
    m.departed_now("b")
    assert verify(m, "d").refused is None


def test_verified_after_departure_readmits_and_clears_the_departure() -> None:
    m = membership()
    verify(m, "a", 1)
    m.departed_now("a")
    assert verify(m, "a", 1) == Verdict((Change("a", True),))
    assert live_ids(m) == ["a"]
    assert m.departed == {}
