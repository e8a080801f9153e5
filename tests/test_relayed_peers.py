"""A protocol that draws its peers at random counts a relayed peer as a slower link: it
draws one half as often as a direct one (``RELAYED_WEIGHT``), and a view with no relayed
peer draws exactly as before, so meshes without NAT are untouched (same seed, same
peers)."""

from __future__ import annotations

from collections import Counter

from gossipd.node.protocols.base import ViewChanged
from gossipd.node.protocols.sumweight import RELAYED_WEIGHT, SumWeightGossip

PEERS = frozenset({"a", "b", "c", "d"})


def draws(relayed: frozenset[str], n: int = 6_000) -> Counter[str]:
    core = SumWeightGossip("a", 1, push_probability=1.0, seed=7)
    core.handle(ViewChanged(PEERS, relayed))
    return Counter(core.random_candidate() for _ in range(n))


def test_a_relayed_peer_is_drawn_at_half_a_direct_one_s_odds() -> None:
    counts = draws(frozenset({"d"}))
    total = sum(counts.values())
    expected_d = RELAYED_WEIGHT / (2 + RELAYED_WEIGHT)
    assert abs(counts["d"] / total - expected_d) < 0.03, counts
    assert abs(counts["b"] - counts["c"]) / total < 0.04, counts


def test_a_view_without_relayed_peers_draws_as_before() -> None:
    """The odds are uniform and the draws the seed gave before relays existed."""
    counts = draws(frozenset())
    total = sum(counts.values())
    assert all(abs(counts[p] / total - 1 / 3) < 0.03 for p in "bcd"), counts
    plain = SumWeightGossip("a", 1, push_probability=1.0, seed=7)
    plain.handle(ViewChanged(PEERS))
    again = SumWeightGossip("a", 1, push_probability=1.0, seed=7)
    again.handle(ViewChanged(PEERS, frozenset()))
    assert [plain.random_candidate() for _ in range(50)] == [
        again.random_candidate() for _ in range(50)
    ]
