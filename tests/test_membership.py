"""Tests for gossipd.node.net.membership: verified peers, bounded candidates, liveness, departures.

The rule under test (docs/design.md §6): a node is a peer only after this node's own
Handshake to an address was answered by it; everything anyone says about another
node is a claim, kept as a bounded candidate, that never changes a verified entry.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossipd.node.net.membership import Change, Membership, NodeInfo, PeerState, Verdict
from gossipd.node.net.peering import from_wire, to_wire
from gossipd.proto import gossip_pb2 as pb

SELF = "me"
SELF_ADDRESS = "me.example:5000"


def info(node_id: str, incarnation: int = 1, address: str | None = None) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        address=address if address is not None else f"{node_id}.example:5000",
        incarnation=incarnation,
    )


def membership(**kwargs) -> Membership:
    m = Membership(SELF, **kwargs)
    m.self_address = SELF_ADDRESS
    return m


def verify(m: Membership, node_id: str, incarnation: int = 1, address: str | None = None):
    """Our own Handshake to the node's address, answered by the node itself."""
    reply = info(node_id, incarnation, address)
    return m.verified(reply.address, reply)


def live_ids(m: Membership) -> list[str]:
    return [s.node_id for s in m.live()]


def known_triples(m: Membership) -> list[tuple[str, str, int]]:
    return [(i.node_id, i.address, i.incarnation) for i in m.known()]


def peer_table(m: Membership) -> dict[str, tuple]:
    return {
        n: (s.address, s.incarnation, s.live, s.failures, s.suspected_since)
        for n, s in m.peers.items()
    }


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


# ---------------------------------------------------------------------------
# schedules of events (hypothesis)

_IDS = [SELF, "a", "b", "c"]
# dialled addresses include the nodes' usual ones, so one node can answer at another's
_DIALLED = ["h:0", "h:1", "a.example:5000", "b.example:5000", "c.example:5000"]
_ADDRESSES = [*_DIALLED, "h:2", SELF_ADDRESS]  # what claims name
_ids = st.sampled_from(_IDS)
_incarnations = st.sampled_from([0, 1, 2, 3, 2**63 - 1])
_failed = st.tuples(st.just("failed"), _ids)
_events = st.one_of(
    st.tuples(st.just("hear"), _ids, _incarnations, st.sampled_from(_ADDRESSES), st.booleans()),
    st.tuples(st.just("take"), st.integers(0, 3)),
    # our dial to an address; the answer names a node; claim: none / matching / contradicting
    st.tuples(
        st.just("verified"),
        st.sampled_from(_DIALLED),
        _ids,
        _incarnations,
        st.integers(0, 2),
    ),
    # the common case: a node answers at its usual address (weighted up)
    st.tuples(st.just("verified_home"), _ids, st.integers(0, 3)),
    st.tuples(st.just("verified_home"), _ids, st.integers(0, 3)),
    st.tuples(st.just("verified_candidate"), st.sampled_from(["itself", "restarted", "other"])),
    st.tuples(st.just("succeeded"), _ids),
    _failed,
    _failed,
    _failed,
    st.tuples(st.just("departed_now"), _ids),
    st.tuples(st.just("expire"), st.just(0)),
    st.tuples(st.just("expire"), st.integers(1, 6)),  # time passes, then expire()
    st.tuples(st.just("tick"), st.integers(0, 6)),
)


@settings(
    derandomize=True,
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    threshold=st.integers(1, 3),
    drop_after_s=st.integers(1, 4),
    caps=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 2)),
    events=st.lists(_events, min_size=20, max_size=100),
)
def test_schedules_keep_peers_verified_capped_unique_and_the_change_stream_exact(
    threshold: int, drop_after_s: int, caps: tuple[int, int, int], events: list[tuple]
) -> None:
    """After every event: each peer is exactly what the last accepted verified() reply
    naming it said (address, incarnation); known() holds no id that was only heard of;
    tables stay within their caps; a peer's incarnation never decreases while it stays;
    an address holds at most one peer; hear() never touches peers; and folding every
    Change gives exactly live() (what the daemon forwards to the trainer)."""
    max_peers, max_candidates, max_departed = caps
    m = membership(
        suspect_after_failures=threshold,
        drop_after_s=float(drop_after_s),
        max_peers=max_peers,
        max_candidates=max_candidates,
        max_departed=max_departed,
    )
    accepted: dict[str, tuple[str, int]] = {}  # node_id -> what its last accepted reply said
    told: set[str] = set()
    now = 0.0
    for step, event in enumerate(events):
        where = f"after event {step} {event!r}"
        kind = event[0]
        before = peer_table(m)
        changes: list[Change | None] = []
        if kind == "tick":
            now += event[1]
        elif kind == "hear":
            _, node_id, incarnation, address, direct = event
            candidates = dict(m.candidates)
            gone = m.departed.get(node_id, -1) >= incarnation
            added = m.hear(info(node_id, incarnation, address), direct=direct)
            assert peer_table(m) == before, where
            if added:
                assert address not in candidates and m.candidates[address].node_id == node_id
            else:
                assert set(m.candidates) == set(candidates), where
            if gone and not direct:
                assert not added and m.candidates == candidates, where
        elif kind == "take":
            oldest = list(m.candidates.items())[: event[1]]
            assert m.take_candidates(event[1]) == oldest, where
            assert not set(dict(oldest)) & set(m.candidates), where
        elif kind in ("verified", "verified_home", "verified_candidate"):
            if kind == "verified":
                _, address, node_id, incarnation, claim_kind = event
                reply = info(node_id, incarnation, "advertised:1")
                claim = [None, reply, info(node_id, incarnation + 1)][claim_kind]
            elif kind == "verified_home":
                _, node_id, incarnation = event
                address, claim = f"{node_id}.example:5000", None
                reply = info(node_id, incarnation)
            else:  # dial the oldest candidate: who answers there?
                if not m.candidates:
                    continue
                ((address, claim),) = m.take_candidates(1)
                reply = {
                    "itself": info(claim.node_id, claim.incarnation),
                    "restarted": info(claim.node_id, claim.incarnation + 1),
                    "other": info("d" if claim.node_id != "d" else "c", 1),
                }[event[1]]
            verdict = m.verified(address, reply, claim)
            changes.extend(verdict.changes)
            if claim is not None and (claim.node_id, claim.incarnation) != (
                reply.node_id,
                reply.incarnation,
            ):
                assert verdict.refused is not None, where
            if verdict.refused is None:
                accepted[reply.node_id] = (address, reply.incarnation)
                assert m.peers[reply.node_id].live, where
                assert reply.node_id not in m.departed, where
                assert address not in m.candidates, where
            else:
                assert m.peers.get(reply.node_id) is None or (
                    before.get(reply.node_id) == peer_table(m)[reply.node_id]
                ), where
        elif kind == "succeeded":
            changes.append(m.succeeded(event[1]))
        elif kind == "failed":
            changes.append(m.failed(event[1], now))
        elif kind == "departed_now":
            departing = m.peers.get(event[1])
            changes.append(m.departed_now(event[1]))
            if departing is not None:
                assert m.departed[event[1]] == departing.incarnation, where
        else:
            assert kind == "expire"
            now += event[1]
            gone_ids = m.expire(now)
            for node_id in gone_ids:
                assert node_id not in m.peers, where
                assert before[node_id][2] is False, where  # only suspected peers expire
                assert now - before[node_id][4] > drop_after_s, where
            for state in m.peers.values():
                assert state.suspected_since is None or now - state.suspected_since <= (
                    drop_after_s
                ), where
            told.difference_update(gone_ids)
        for change in changes:
            if isinstance(change, Change):
                (told.add if change.live else told.discard)(change.node_id)

        # every peer is what the last accepted reply naming it said
        for node_id, state in m.peers.items():
            assert (state.address, state.incarnation) == accepted[node_id], where
        assert {i.node_id for i in m.known()} <= set(accepted), where
        assert SELF not in m.peers, where
        # caps
        assert len(m.peers) <= max_peers, where
        assert len(m.candidates) <= max_candidates, where
        assert len(m.departed) <= max_departed, where
        # a staying peer's incarnation never decreases; one peer per address
        for node_id, state in m.peers.items():
            if node_id in before:
                assert state.incarnation >= before[node_id][1], where
        addresses = [s.address for s in m.peers.values()]
        assert len(addresses) == len(set(addresses)), where
        assert SELF_ADDRESS not in m.candidates, where
        assert all(m.candidates[a].address == a for a in m.candidates), where
        # the Change stream tracks live(); live and suspected split the table
        assert told == set(live_ids(m)), where
        assert sorted(live_ids(m) + [s.node_id for s in m.suspected()]) == sorted(m.peers), where
        for state in m.peers.values():
            assert state.live == (state.suspected_since is None), where
            assert state.live or state.failures >= threshold, where


@settings(derandomize=True, max_examples=200, deadline=None, database=None)
@given(
    threshold=st.integers(1, 4),
    outcomes=st.lists(st.sampled_from(["ok", "fail", "fail", "reverify"]), max_size=40),
)
def test_a_peer_is_suspected_exactly_after_threshold_consecutive_failures(
    threshold: int, outcomes: list[str]
) -> None:
    """Reference model: live iff fewer than ``threshold`` failures since the last success
    (or verification); suspected_since is the time of the failure that crossed it."""
    m = membership(suspect_after_failures=threshold)
    verify(m, "a")
    streak, since = 0, None
    for t, outcome in enumerate(outcomes):
        if outcome == "ok":
            m.succeeded("a")
            streak, since = 0, None
        elif outcome == "reverify":
            verify(m, "a")
            streak, since = 0, None
        else:
            m.failed("a", float(t))
            streak += 1
            if streak == threshold:
                since = float(t)
        assert m.peers["a"].live == (streak < threshold)
        assert m.peers["a"].suspected_since == since
