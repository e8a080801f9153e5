"""Tests for gossipd.node.membership: the sans-IO view of who is live, suspected or gone."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gossipd.node.membership import Change, Membership, PeerState
from gossipd.proto import gossip_pb2 as pb

SELF = "me"


def info(node_id: str, incarnation: int = 1, address: str | None = None) -> pb.NodeInfo:
    return pb.NodeInfo(
        node_id=node_id,
        address=address if address is not None else f"{node_id}.example:5000",
        incarnation=incarnation,
    )


def live_ids(m: Membership) -> list[str]:
    return [s.node_id for s in m.live()]


def known_triples(m: Membership) -> list[tuple[str, str, int]]:
    return [(i.node_id, i.address, i.incarnation) for i in m.known()]


# ---------------------------------------------------------------------------
# learn


def test_learn_records_a_new_peer_not_yet_live() -> None:
    m = Membership(SELF)
    state = m.learn(info("a", 1, "10.0.0.1:1"))
    assert state == PeerState("a", "10.0.0.1:1", 1)
    assert state is not None and not state.live
    assert m.peers["a"] is state
    assert m.live() == []
    assert known_triples(m) == [("a", "10.0.0.1:1", 1)]


def test_learn_ignores_self() -> None:
    m = Membership(SELF)
    assert m.learn(info(SELF, 7)) is None
    assert m.peers == {}
    assert m.known() == []


def test_learn_ignores_empty_id_or_address() -> None:
    m = Membership(SELF)
    assert m.learn(pb.NodeInfo(node_id="", address="h:1", incarnation=1)) is None
    assert m.learn(pb.NodeInfo(node_id="a", address="", incarnation=1)) is None
    assert m.peers == {}


def test_learn_ignores_same_or_stale_incarnation() -> None:
    m = Membership(SELF)
    first = m.learn(info("a", 5, "old:1"))
    assert first is not None
    assert m.learn(info("a", 5, "other:1")) is None
    assert m.learn(info("a", 4, "other:1")) is None
    assert m.peers["a"] is first
    assert known_triples(m) == [("a", "old:1", 5)]


def test_learn_does_not_touch_a_live_peer_of_the_same_incarnation() -> None:
    m = Membership(SELF)
    m.introduced(info("a", 2))
    assert m.learn(info("a", 2, "elsewhere:1")) is None
    assert live_ids(m) == ["a"]
    assert m.peers["a"].address == "a.example:5000"


def test_higher_incarnation_replaces_address() -> None:
    m = Membership(SELF)
    m.learn(info("a", 1, "old:1"))
    state = m.learn(info("a", 2, "new:2"))
    assert state == PeerState("a", "new:2", 2)
    assert m.peers["a"] is state
    assert known_triples(m) == [("a", "new:2", 2)]


def test_introduced_with_higher_incarnation_replaces_address() -> None:
    m = Membership(SELF)
    m.introduced(info("a", 1, "old:1"))
    m.introduced(info("a", 3, "new:3"))
    assert known_triples(m) == [("a", "new:3", 3)]
    assert live_ids(m) == ["a"]


# ---------------------------------------------------------------------------
# introduced / failed / succeeded


def test_introduced_makes_live_with_one_change() -> None:
    m = Membership(SELF)
    assert m.introduced(info("a")) == Change("a", True)
    assert m.introduced(info("a")) is None
    assert m.succeeded("a") is None
    assert live_ids(m) == ["a"]


def test_introduced_after_learn_reports_change() -> None:
    m = Membership(SELF)
    m.learn(info("a", 1))
    assert m.introduced(info("a", 1)) == Change("a", True)
    assert m.introduced(info("a", 1)) is None
    assert live_ids(m) == ["a"]


def test_introduced_ignores_self() -> None:
    m = Membership(SELF)
    assert m.introduced(info(SELF)) is None
    assert m.peers == {}
    assert m.live() == []


def test_failures_below_threshold_keep_peer_live() -> None:
    m = Membership(SELF, suspect_after_failures=3)
    m.introduced(info("a"))
    assert m.failed("a", 1.0) is None
    assert m.failed("a", 2.0) is None
    assert live_ids(m) == ["a"]
    assert m.peers["a"].suspected_since is None


def test_failed_suspects_after_threshold_consecutive_failures() -> None:
    m = Membership(SELF, suspect_after_failures=3)
    m.introduced(info("a"))
    assert m.failed("a", 1.0) is None
    assert m.failed("a", 2.0) is None
    assert m.failed("a", 3.0) == Change("a", False)
    assert m.live() == []
    assert m.peers["a"].suspected_since == 3.0
    assert m.failed("a", 4.0) is None  # one Change only
    assert m.peers["a"].suspected_since == 3.0
    assert known_triples(m) == [("a", "a.example:5000", 1)]  # suspected, not forgotten


def test_threshold_of_one_suspects_at_first_failure() -> None:
    m = Membership(SELF, suspect_after_failures=1)
    m.introduced(info("a"))
    assert m.failed("a", 1.0) == Change("a", False)


def test_success_resets_the_consecutive_failure_count() -> None:
    m = Membership(SELF, suspect_after_failures=3)
    m.introduced(info("a"))
    m.failed("a", 1.0)
    m.failed("a", 2.0)
    assert m.succeeded("a") is None
    assert m.peers["a"].failures == 0
    assert m.failed("a", 3.0) is None
    assert m.failed("a", 4.0) is None
    assert live_ids(m) == ["a"]
    assert m.failed("a", 5.0) == Change("a", False)


def test_succeeded_brings_a_suspected_peer_back() -> None:
    m = Membership(SELF, suspect_after_failures=2)
    m.introduced(info("a"))
    m.failed("a", 1.0)
    assert m.failed("a", 2.0) == Change("a", False)
    assert m.succeeded("a") == Change("a", True)
    assert live_ids(m) == ["a"]
    state = m.peers["a"]
    assert (state.failures, state.suspected_since) == (0, None)
    assert m.succeeded("a") is None


def test_introduced_brings_a_suspected_peer_back() -> None:
    m = Membership(SELF, suspect_after_failures=1)
    m.introduced(info("a"))
    m.failed("a", 1.0)
    assert m.introduced(info("a")) == Change("a", True)
    assert live_ids(m) == ["a"]


def test_succeeded_and_failed_ignore_unknown_peers() -> None:
    m = Membership(SELF, suspect_after_failures=1)
    assert m.succeeded("ghost") is None
    assert m.failed("ghost", 1.0) is None
    assert m.departed("ghost") is None
    assert m.peers == {}


def test_failure_of_a_never_live_peer_starts_its_suspicion_clock() -> None:
    m = Membership(SELF, suspect_after_failures=3, drop_after_s=10.0)
    m.learn(info("a"))
    assert m.failed("a", 5.0) is None  # it was never live: no Change
    assert m.peers["a"].suspected_since == 5.0
    assert m.failed("a", 6.0) is None
    assert m.peers["a"].suspected_since == 5.0
    assert m.expire(15.0) == []
    assert m.expire(15.5) == ["a"]


# ---------------------------------------------------------------------------
# expire


def test_expire_drops_only_peers_suspected_longer_than_drop_after() -> None:
    m = Membership(SELF, suspect_after_failures=1, drop_after_s=10.0)
    for node_id in ("a", "b", "c", "d"):
        m.introduced(info(node_id))
    m.learn(info("e"))  # known, never live, never failed
    m.failed("a", 0.0)  # suspected at 0
    m.failed("b", 5.0)  # suspected at 5
    m.failed("c", 0.0)
    m.succeeded("c")  # back
    # d stays live
    assert m.expire(10.0) == []  # exactly drop_after_s: not yet
    assert m.expire(10.5) == ["a"]
    assert sorted(m.peers) == ["b", "c", "d", "e"]
    assert m.expire(15.01) == ["b"]
    assert sorted(m.peers) == ["c", "d", "e"]
    assert live_ids(m) == ["c", "d"]
    assert m.expire(1e9) == []
    assert sorted(m.peers) == ["c", "d", "e"]


def test_expired_peer_can_be_learned_again() -> None:
    m = Membership(SELF, suspect_after_failures=1, drop_after_s=1.0)
    m.introduced(info("a", 4))
    m.failed("a", 0.0)
    assert m.expire(2.0) == ["a"]
    assert m.learn(info("a", 4)) is not None  # forgotten, not banned
    assert m.introduced(info("a", 4)) == Change("a", True)


# ---------------------------------------------------------------------------
# departed


def test_departed_drops_at_once_and_blocks_same_incarnation() -> None:
    m = Membership(SELF)
    m.introduced(info("a", 3, "old:1"))
    m.introduced(info("b", 1))
    assert m.departed("a") == Change("a", False)
    assert "a" not in m.peers
    assert live_ids(m) == ["b"]
    assert m.departed("a") is None  # already gone
    assert m.learn(info("a", 3, "old:1")) is None
    assert m.learn(info("a", 2, "old:1")) is None
    assert "a" not in m.peers
    state = m.learn(info("a", 4, "new:1"))
    assert state == PeerState("a", "new:1", 4)
    assert known_triples(m) == [("a", "new:1", 4), ("b", "b.example:5000", 1)]
    assert live_ids(m) == ["b"]


def test_departed_of_a_peer_that_was_not_live_reports_no_change() -> None:
    m = Membership(SELF)
    m.learn(info("a", 1))
    assert m.departed("a") is None
    assert m.peers == {}
    assert m.learn(info("a", 1)) is None


def test_introduced_after_departed_readmits() -> None:
    m = Membership(SELF)
    m.introduced(info("a", 1))
    m.departed("a")
    assert m.introduced(info("a", 1)) == Change("a", True)
    assert live_ids(m) == ["a"]
    assert m.left == {}


# ---------------------------------------------------------------------------
# live / known


def test_live_is_sorted_by_id_and_known_lists_node_info() -> None:
    m = Membership(SELF)
    for node_id in ("delta", "alpha", "charlie", "bravo"):
        m.introduced(info(node_id, incarnation=len(node_id)))
    m.learn(info("echo", 9, "e:9"))
    assert live_ids(m) == ["alpha", "bravo", "charlie", "delta"]
    assert all(isinstance(s, PeerState) and s.live for s in m.live())
    known = m.known()
    assert all(isinstance(i, pb.NodeInfo) for i in known)
    assert [i.node_id for i in known] == ["alpha", "bravo", "charlie", "delta", "echo"]
    assert known[-1] == pb.NodeInfo(node_id="echo", address="e:9", incarnation=9)
    assert known[0].incarnation == 5


def test_known_round_trips_through_learn() -> None:
    a = Membership("a")
    a.introduced(info("b", 2, "b:2"))
    a.learn(info("c", 3, "c:3"))
    b = Membership("b")
    for node_info in [*a.known(), info("a", 1, "a:1")]:
        b.learn(node_info)
    assert known_triples(b) == [("a", "a:1", 1), ("c", "c:3", 3)]  # self filtered out


# ---------------------------------------------------------------------------
# Change stream vs live(): the daemon forwards each Change to the trainer, which keeps
# its own peer set; a live peer that leaves live() with no Change is never told "down".


def test_learning_a_restart_of_a_live_peer_keeps_it_live_until_it_fails() -> None:
    m = Membership(SELF, suspect_after_failures=1)
    assert m.introduced(info("a", 1, "old:1")) == Change("a", True)
    state = m.learn(info("a", 2, "new:1"))  # gossip says 'a' restarted elsewhere
    assert state is not None and state.address == "new:1" and state.live
    # The trainer was never told 'a' went down, so it must still be live here, and a
    # failure at the new address must report the Change the trainer needs.
    assert [s.node_id for s in m.live()] == ["a"]
    assert m.failed("a", 1.0) == Change("a", False)
    assert m.live() == []


# ---------------------------------------------------------------------------
# property tests


@dataclass
class _Model:
    """Reference model of Membership built from the event history of each peer entry."""

    threshold: int
    drop_after_s: float
    # node_id -> (incarnation, address, [("up", t) | ("fail", t), ...] since the entry was made)
    peers: dict[str, tuple[int, str, list[tuple[str, float]]]] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)

    def is_live(self, node_id: str) -> bool:
        """Live iff some up-event happened and fewer than ``threshold`` failures followed it."""
        if node_id not in self.peers:
            return False
        history = self.peers[node_id][2]
        ups = [i for i, (kind, _) in enumerate(history) if kind == "up"]
        if not ups:
            return False
        fails_after = sum(1 for kind, _ in history[ups[-1] + 1 :] if kind == "fail")
        return fails_after < self.threshold

    def suspected_since(self, node_id: str) -> float | None:
        if self.is_live(node_id):
            return None
        history = self.peers[node_id][2]
        ups = [i for i, (kind, _) in enumerate(history) if kind == "up"]
        fails = [t for kind, t in history[ups[-1] + 1 if ups else 0 :] if kind == "fail"]
        if ups:  # was live: suspected from the failure that crossed the threshold
            return fails[self.threshold - 1]
        return fails[0] if fails else None  # never live: from its first failure

    def live(self) -> list[str]:
        return sorted(n for n in self.peers if self.is_live(n))


_PEERS = ["a", "b", "c"]
_ids = st.sampled_from([SELF, *_PEERS])
_events = st.one_of(
    st.tuples(st.just("learn"), _ids, st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("introduced"), _ids, st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("succeeded"), _ids),
    st.tuples(st.just("failed"), _ids),
    st.tuples(st.just("failed"), _ids),  # failures are common: weight them up
    st.tuples(st.just("departed"), _ids),
    st.tuples(
        st.just("expire"),
    ),
    st.tuples(st.just("tick"), st.integers(0, 6)),
)


def _apply(m: Membership, model: _Model, event: tuple, now: float) -> tuple[object, object, float]:
    """Run ``event`` on both; returns (actual result, expected result, new time)."""
    kind = event[0]
    if kind == "tick":
        return None, None, now + event[1]
    if kind in ("learn", "introduced"):
        _, node_id, incarnation, port = event
        address = f"{node_id}.example:{port}"
        node_info = pb.NodeInfo(node_id=node_id, address=address, incarnation=incarnation)
        known = model.peers.get(node_id)
        if kind == "learn":
            actual = m.learn(node_info)
            if (
                node_id == SELF
                or model.left.get(node_id, -1) >= incarnation
                or (known is not None and known[0] >= incarnation)
            ):
                return actual, None, now
            # A restart of a live peer stays live until it fails at its new address.
            was_live = known is not None and model.is_live(node_id)
            model.peers[node_id] = (incarnation, address, [("up", now)] if was_live else [])
            return actual, PeerState(node_id, address, incarnation, live=was_live), now
        actual = m.introduced(node_info)
        if node_id == SELF:
            return actual, None, now
        model.left.pop(node_id, None)
        if known is None or known[0] <= incarnation:
            # a new entry; it was already live only if the same incarnation was live
            was_live = known is not None and known[0] == incarnation and model.is_live(node_id)
            model.peers[node_id] = (incarnation, address, [("up", now)])
        else:  # an older incarnation's handshake: the newer entry stays, marked live
            was_live = model.is_live(node_id)
            known[2].append(("up", now))
        return actual, None if was_live else Change(node_id, True), now
    if kind == "succeeded":
        node_id = event[1]
        actual = m.succeeded(node_id)
        if node_id not in model.peers:
            return actual, None, now
        was_live = model.is_live(node_id)
        model.peers[node_id][2].append(("up", now))
        return actual, None if was_live else Change(node_id, True), now
    if kind == "failed":
        node_id = event[1]
        actual = m.failed(node_id, now)
        if node_id not in model.peers:
            return actual, None, now
        was_live = model.is_live(node_id)
        model.peers[node_id][2].append(("fail", now))
        went_down = was_live and not model.is_live(node_id)
        return actual, Change(node_id, False) if went_down else None, now
    if kind == "departed":
        node_id = event[1]
        actual = m.departed(node_id)
        if node_id not in model.peers:
            return actual, None, now
        was_live = model.is_live(node_id)
        model.left[node_id] = model.peers.pop(node_id)[0]
        return actual, Change(node_id, False) if was_live else None, now
    assert kind == "expire"
    actual = m.expire(now)
    gone = []
    for node_id in list(model.peers):
        since = model.suspected_since(node_id)
        if since is not None and now - since > model.drop_after_s:
            gone.append(node_id)
            del model.peers[node_id]
    return sorted(actual), sorted(gone), now


@settings(
    derandomize=True,
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    threshold=st.integers(1, 4),
    drop_after_s=st.integers(1, 12),
    events=st.lists(_events, min_size=20, max_size=80),
)
def test_membership_matches_reference_model(
    threshold: int, drop_after_s: int, events: list[tuple]
) -> None:
    m = Membership(SELF, suspect_after_failures=threshold, drop_after_s=float(drop_after_s))
    model = _Model(threshold, float(drop_after_s))
    now = 0.0
    for step, event in enumerate(events):
        actual, expected, now = _apply(m, model, event, now)
        where = f"after event {step} {event!r}"
        assert actual == expected, where
        live = live_ids(m)
        assert SELF not in live, where
        assert SELF not in m.peers, where
        assert live == sorted(live), where
        assert live == model.live(), where
        assert known_triples(m) == [
            (n, model.peers[n][1], model.peers[n][0]) for n in sorted(model.peers)
        ], where
        for node_id, state in m.peers.items():
            assert state.suspected_since == model.suspected_since(node_id), where


@settings(derandomize=True, max_examples=200, deadline=None)
@given(
    threshold=st.integers(1, 4),
    drop_after_s=st.integers(1, 12),
    events=st.lists(_events, min_size=10, max_size=60),
)
def test_change_stream_tracks_live(threshold: int, drop_after_s: int, events: list[tuple]) -> None:
    """Folding every returned Change into a set gives exactly live(), after every event.

    This is what the daemon relies on: it forwards each Change to the trainer's peer set.
    """
    m = Membership(SELF, suspect_after_failures=threshold, drop_after_s=float(drop_after_s))
    told: set[str] = set()
    now = 0.0
    for step, event in enumerate(events):
        kind = event[0]
        result: object = None
        if kind == "tick":
            now += event[1]
        elif kind in ("learn", "introduced"):
            _, node_id, incarnation, port = event
            node_info = pb.NodeInfo(
                node_id=node_id, address=f"{node_id}.example:{port}", incarnation=incarnation
            )
            result = getattr(m, kind)(node_info)
        elif kind == "succeeded":
            result = m.succeeded(event[1])
        elif kind == "failed":
            result = m.failed(event[1], now)
        elif kind == "departed":
            result = m.departed(event[1])
        else:
            told.difference_update(m.expire(now))
        if isinstance(result, Change):
            (told.add if result.live else told.discard)(result.node_id)
        assert told == set(live_ids(m)), f"after event {step} {event!r}"
