"""gossipd.node.net.peers.membership under random schedules of every call (hypothesis).

A schedule mixes claims (``hear``), dials of candidates, answers to our own handshakes
(``verified``: matching, contradicting or without a claim, at a node's usual address
or another's), liveness reports, departures, expiries and the passing of time.
:class:`Schedule` plays it against a real :class:`Membership`, one method per kind of
event, remembering what each accepted answer said and which live peers the
``Change`` stream announced; after every event it checks the tables' invariants.
"""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossipd.node.net.peers.membership import Change, Membership, NodeInfo
from tests.membership_tables import (
    SELF,
    SELF_ADDRESS,
    info,
    live_ids,
    membership,
    peer_table,
    verify,
)

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


class Schedule:
    """A Membership and what its invariants are checked against, one event at a time."""

    def __init__(self, m: Membership, threshold: int, drop_after_s: int) -> None:
        self.m = m
        self.threshold = threshold
        self.drop_after_s = drop_after_s
        self.accepted: dict[str, tuple[str, int]] = {}  # node_id -> its last accepted reply
        self.told: set[str] = set()  # live peers, as the Change stream said
        self.now = 0.0
        self.plays: dict[str, Callable[[tuple, dict, str], list[Change | None]]] = {
            "tick": self.tick,
            "hear": self.hear,
            "take": self.take,
            "verified": self.verified,
            "verified_home": self.verified,
            "verified_candidate": self.verified,
            "succeeded": lambda event, before, where: [self.m.succeeded(event[1])],
            "failed": lambda event, before, where: [self.m.failed(event[1], self.now)],
            "departed_now": self.departed_now,
            "expire": self.expire,
        }

    def play(self, event: tuple, where: str) -> None:
        before = peer_table(self.m)
        for change in self.plays[event[0]](event, before, where):
            if isinstance(change, Change):
                (self.told.add if change.live else self.told.discard)(change.node_id)
        self.check(before, where)

    # -- one method per kind of event, each checking what that call promises -------------
    def tick(self, event: tuple, before: dict, where: str) -> list[Change | None]:
        self.now += event[1]
        return []

    def hear(self, event: tuple, before: dict, where: str) -> list[Change | None]:
        _, node_id, incarnation, address, direct = event
        m = self.m
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
        return []

    def take(self, event: tuple, before: dict, where: str) -> list[Change | None]:
        oldest = list(self.m.candidates.items())[: event[1]]
        assert self.m.take_candidates(event[1]) == oldest, where
        assert not set(dict(oldest)) & set(self.m.candidates), where
        return []

    def dialled(self, event: tuple) -> tuple[str, NodeInfo, NodeInfo | None] | None:
        """(address dialled, the answer there, the claim that led there), or None."""
        if event[0] == "verified":
            _, address, node_id, incarnation, claim_kind = event
            reply = info(node_id, incarnation, "advertised:1")
            return address, reply, [None, reply, info(node_id, incarnation + 1)][claim_kind]
        if event[0] == "verified_home":
            _, node_id, incarnation = event
            return f"{node_id}.example:5000", info(node_id, incarnation), None
        if not self.m.candidates:  # dial the oldest candidate: who answers there?
            return None
        ((address, claim),) = self.m.take_candidates(1)
        reply = {
            "itself": info(claim.node_id, claim.incarnation),
            "restarted": info(claim.node_id, claim.incarnation + 1),
            "other": info("d" if claim.node_id != "d" else "c", 1),
        }[event[1]]
        return address, reply, claim

    def verified(self, event: tuple, before: dict, where: str) -> list[Change | None]:
        dial = self.dialled(event)
        if dial is None:
            return []
        address, reply, claim = dial
        m = self.m
        verdict = m.verified(address, reply, claim)
        contradicted = claim is not None and (claim.node_id, claim.incarnation) != (
            reply.node_id,
            reply.incarnation,
        )
        if contradicted:
            assert verdict.refused is not None, where
        if verdict.refused is None:
            self.accepted[reply.node_id] = (address, reply.incarnation)
            assert m.peers[reply.node_id].live, where
            assert reply.node_id not in m.departed, where
            assert address not in m.candidates, where
        else:
            assert m.peers.get(reply.node_id) is None or (
                before.get(reply.node_id) == peer_table(m)[reply.node_id]
            ), where
        return list(verdict.changes)

    def departed_now(self, event: tuple, before: dict, where: str) -> list[Change | None]:
        departing = self.m.peers.get(event[1])
        change = self.m.departed_now(event[1])
        if departing is not None:
            assert self.m.departed[event[1]] == departing.incarnation, where
        return [change]

    def expire(self, event: tuple, before: dict, where: str) -> list[Change | None]:
        self.now += event[1]
        gone_ids = self.m.expire(self.now)
        for node_id in gone_ids:
            assert node_id not in self.m.peers, where
            assert before[node_id][2] is False, where  # only suspected peers expire
            assert self.now - before[node_id][4] > self.drop_after_s, where
        for state in self.m.peers.values():
            assert state.suspected_since is None or (
                self.now - state.suspected_since <= self.drop_after_s
            ), where
        self.told.difference_update(gone_ids)
        return []

    # -- what holds after every event ----------------------------------------------------
    def check(self, before: dict, where: str) -> None:
        m = self.m
        # every peer is what the last accepted reply naming it said
        for node_id, state in m.peers.items():
            assert (state.address, state.incarnation) == self.accepted[node_id], where
        assert {i.node_id for i in m.known()} <= set(self.accepted), where
        assert SELF not in m.peers, where
        # a staying peer's incarnation never decreases; one peer per address
        for node_id, state in m.peers.items():
            if node_id in before:
                assert state.incarnation >= before[node_id][1], where
        addresses = [s.address for s in m.peers.values()]
        assert len(addresses) == len(set(addresses)), where
        assert SELF_ADDRESS not in m.candidates, where
        assert all(m.candidates[a].address == a for a in m.candidates), where
        # the Change stream tracks live(); live and suspected split the table
        assert self.told == set(live_ids(m)), where
        assert sorted(live_ids(m) + [s.node_id for s in m.suspected()]) == sorted(m.peers), where
        for state in m.peers.values():
            assert state.live == (state.suspected_since is None), where
            assert state.live or state.failures >= self.threshold, where


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
    schedule = Schedule(m, threshold, drop_after_s)
    for step, event in enumerate(events):
        where = f"after event {step} {event!r}"
        schedule.play(event, where)
        assert len(m.peers) <= max_peers, where
        assert len(m.candidates) <= max_candidates, where
        assert len(m.departed) <= max_departed, where


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
