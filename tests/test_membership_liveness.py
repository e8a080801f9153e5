"""gossipd.node.net.peers.membership: liveness, departures, views, and attacks on the tables.

A verified peer is suspected after ``suspect_after_failures`` consecutive failures and
live again after a success or a new verification; a peer suspected longer than
``drop_after_s`` expires and departs; views are sorted and list verified peers only,
and what crosses the wire is plain values; forged claims, thousands of them, change
no verified entry (docs/design.md §6).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gossipd.node.net.peers.membership import Change, Membership, NodeInfo, PeerState, Verdict
from gossipd.node.net.peers.peering import from_wire, to_wire
from gossipd.proto import gossip_pb2 as pb
from tests.membership_tables import (
    info,
    known_triples,
    live_ids,
    membership,
    peer_table,
    verify,
)

# ---------------------------------------------------------------------------
# failed / succeeded


def test_failures_below_threshold_keep_peer_live() -> None:
    m = membership(suspect_after_failures=3)
    verify(m, "a")
    assert m.failed("a", 1.0) is None
    assert m.failed("a", 2.0) is None
    assert live_ids(m) == ["a"]
    assert m.peers["a"].suspected_since is None


def test_failed_suspects_after_threshold_consecutive_failures() -> None:
    m = membership(suspect_after_failures=3)
    verify(m, "a")
    assert m.failed("a", 1.0) is None
    assert m.failed("a", 2.0) is None
    assert m.failed("a", 3.0) == Change("a", False)
    assert m.live() == []
    assert [s.node_id for s in m.suspected()] == ["a"]
    assert m.peers["a"].suspected_since == 3.0
    assert m.failed("a", 4.0) is None  # one Change only
    assert m.peers["a"].suspected_since == 3.0
    assert known_triples(m) == [("a", "a.example:5000", 1)]  # suspected, not forgotten
    assert m.is_current("a", 1)


def test_threshold_of_one_suspects_at_first_failure() -> None:
    m = membership(suspect_after_failures=1)
    verify(m, "a")
    assert m.failed("a", 1.0) == Change("a", False)


def test_success_resets_the_consecutive_failure_count() -> None:
    m = membership(suspect_after_failures=3)
    verify(m, "a")
    m.failed("a", 1.0)
    m.failed("a", 2.0)
    assert m.succeeded("a") is None
    assert m.peers["a"].failures == 0
    assert m.failed("a", 3.0) is None
    assert m.failed("a", 4.0) is None
    assert live_ids(m) == ["a"]
    assert m.failed("a", 5.0) == Change("a", False)


def test_succeeded_brings_a_suspected_peer_back() -> None:
    m = membership(suspect_after_failures=2)
    verify(m, "a")
    m.failed("a", 1.0)
    assert m.failed("a", 2.0) == Change("a", False)
    assert m.succeeded("a") == Change("a", True)
    assert live_ids(m) == ["a"]
    state = m.peers["a"]
    assert (state.failures, state.suspected_since) == (0, None)
    assert m.succeeded("a") is None


def test_verified_brings_a_suspected_peer_back() -> None:
    m = membership(suspect_after_failures=1)
    verify(m, "a")
    m.failed("a", 1.0)
    assert verify(m, "a") == Verdict((Change("a", True),))
    assert live_ids(m) == ["a"]
    assert (m.peers["a"].failures, m.peers["a"].suspected_since) == (0, None)


def test_liveness_calls_ignore_nodes_that_are_only_claims() -> None:
    m = membership(suspect_after_failures=1)
    m.hear(info("ghost"))
    assert m.succeeded("ghost") is None
    assert m.failed("ghost", 1.0) is None
    assert m.departed_now("ghost") is None
    assert m.peers == {}
    assert m.departed == {}
    assert m.live() == [] and m.known() == []


# ---------------------------------------------------------------------------
# expire / departed_now


def test_expire_drops_only_peers_suspected_longer_than_drop_after() -> None:
    m = membership(suspect_after_failures=1, drop_after_s=10.0)
    for node_id in ("a", "b", "c", "d"):
        verify(m, node_id)
    m.failed("a", 0.0)  # suspected at 0
    m.failed("b", 5.0)  # suspected at 5
    m.failed("c", 0.0)
    m.succeeded("c")  # back
    # d stays live
    assert m.expire(10.0) == []  # exactly drop_after_s: not yet
    assert m.expire(10.5) == ["a"]
    assert sorted(m.peers) == ["b", "c", "d"]
    assert m.expire(15.01) == ["b"]
    assert sorted(m.peers) == ["c", "d"]
    assert live_ids(m) == ["c", "d"]
    assert m.expire(1e9) == []
    assert sorted(m.peers) == ["c", "d"]
    assert m.departed == {"a": 1, "b": 1}


def test_an_expired_peer_is_departed_only_its_own_claim_or_a_newer_incarnation_brings_it_back() -> (
    None
):
    m = membership(suspect_after_failures=1, drop_after_s=1.0)
    verify(m, "a", 4)
    m.failed("a", 0.0)
    assert m.expire(2.0) == ["a"]
    assert m.hear(info("a", 4)) is False  # a relayed rumour of the dead incarnation
    assert m.hear(info("a", 4), direct=True) is True  # a itself
    [(address, claim)] = m.take_candidates(1)
    assert m.verified(address, info("a", 4), claim) == Verdict((Change("a", True),))


def test_departed_now_drops_at_once_and_reports_a_change_only_for_a_live_peer() -> None:
    m = membership(suspect_after_failures=1)
    verify(m, "a", 3)
    verify(m, "b", 1)
    assert m.departed_now("a") == Change("a", False)
    assert "a" not in m.peers
    assert live_ids(m) == ["b"]
    assert m.departed_now("a") is None  # already gone
    m.failed("b", 1.0)
    assert m.departed_now("b") is None  # already reported down
    assert m.departed == {"a": 3, "b": 1}
    assert m.peers == {}


def test_departed_is_capped_and_forgets_the_oldest_first() -> None:
    m = membership(max_departed=2)
    for node_id in ("a", "b", "c"):
        verify(m, node_id)
    m.departed_now("a")
    m.departed_now("b")
    verify(m, "a", 2)
    m.departed_now("a")  # a departs again: now the newest
    m.departed_now("c")
    assert list(m.departed.items()) == [("a", 2), ("c", 1)]


# ---------------------------------------------------------------------------
# views


def test_live_and_suspected_are_sorted_by_id_and_known_lists_verified_peers_only() -> None:
    m = membership(suspect_after_failures=1)
    for node_id in ("delta", "alpha", "charlie", "bravo"):
        verify(m, node_id, incarnation=len(node_id))
    m.failed("charlie", 1.0)
    m.hear(info("echo", 9, "e:9"))
    assert live_ids(m) == ["alpha", "bravo", "delta"]
    assert all(isinstance(s, PeerState) and s.live for s in m.live())
    assert [s.node_id for s in m.suspected()] == ["charlie"]
    known = m.known()
    assert all(type(i) is NodeInfo for i in known)  # plain values: no wire type in here
    assert [i.node_id for i in known] == ["alpha", "bravo", "charlie", "delta"]  # no echo
    assert known[0] == NodeInfo(node_id="alpha", address="alpha.example:5000", incarnation=5)


@given(
    st.text(max_size=20),
    st.text(max_size=40),
    st.integers(min_value=0, max_value=2**64 - 1),
)
def test_node_info_crosses_the_wire_unchanged(node_id: str, address: str, incarnation: int) -> None:
    plain = NodeInfo(node_id, address, incarnation)
    wire = to_wire(plain)
    assert isinstance(wire, pb.NodeInfo)
    assert (wire.node_id, wire.address, wire.incarnation) == (node_id, address, incarnation)
    assert from_wire(pb.NodeInfo.FromString(wire.SerializeToString())) == plain


def test_a_relayed_peer_list_only_gives_candidates_to_the_receiver() -> None:
    a = Membership("a")
    verify(a, "b", 2, "b:2")
    verify(a, "c", 3, "c:3")
    b = Membership("b")
    b.self_address = "b:2"
    for node_info in [*a.known(), info("a", 1, "a:1")]:
        b.hear(node_info)
    assert b.known() == []
    assert b.live() == []
    assert list(b.candidates) == ["c:3", "a:1"]  # itself filtered out


# ---------------------------------------------------------------------------
# attacks (docs/design.md §6, "Faults and adversaries")


def test_identity_takeover_claim_with_max_incarnation_and_a_dead_address_changes_nothing() -> None:
    m = membership()
    verify(m, "b", 1, "b:1")
    before = peer_table(m)
    forged = info("b", 2**63 - 1, "10.255.255.1:9")
    m.hear(forged)
    m.hear(forged, direct=True)
    assert peer_table(m) == before
    assert m.is_current("b", 1) and not m.is_current("b", 2**63 - 1)
    assert live_ids(m) == ["b"]
    assert known_triples(m) == [("b", "b:1", 1)]  # the forgery is never relayed
    # the dial to the dead address fails (nothing to record); if something else
    # answers there, the claim does not match and is refused
    [(address, claim)] = m.take_candidates(1)
    verdict = m.verified(address, info("mallory", 1, address), claim)
    assert verdict.refused is not None
    assert peer_table(m) == before


def test_five_thousand_relayed_fakes_fill_at_most_max_candidates_and_none_is_known() -> None:
    m = membership(max_candidates=64)
    verify(m, "real")
    accepted = sum(m.hear(info(f"fake{i}", i, f"10.{i // 250}.{i % 250}.1:1")) for i in range(5000))
    assert accepted == 64
    assert len(m.candidates) == 64
    assert [i.node_id for i in m.known()] == ["real"]
    assert live_ids(m) == ["real"]


def test_a_thousand_direct_fake_claims_make_no_peer_live_without_verified() -> None:
    m = membership(max_candidates=64)
    for i in range(1000):
        m.hear(info(f"fake{i}", 1, f"10.0.{i // 250}.{i % 250}:1"), direct=True)
    assert len(m.candidates) <= 64
    assert m.peers == {}
    assert m.live() == [] and m.known() == []
    assert not any(m.is_current(f"fake{i}", 1) for i in range(1000))
    for _ in range(1000):  # nor do liveness calls about them
        assert m.succeeded("fake1") is None
