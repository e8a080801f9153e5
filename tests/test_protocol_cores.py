"""Each push protocol core does what its paper says, measured on its own pushes.

Crossover follows the shared derangement and mixes doubly stochastically; push-sum on
the exponential graph pushes half to rank + 2^k and averages exactly in log2 N rounds
for a power of two; shuffle-exchange groups average and talk to √N peers; PerSyn's
bursts average (exactly for a power of two) and its final burst is driven by timers;
and Crossover-SGD's Figure 6 holds for the cores' own mixing matrices. The cores run in
tests/core_harness.py's in-test driver.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gossipd.node.protocols import CoreSettings, build
from gossipd.node.protocols.base import (
    Push,
    StartTimer,
    TimerFired,
    TrainingEnded,
    ViewChanged,
    ranked,
)
from gossipd.node.protocols.persyn import DEFAULT_STEP_TIME_S
from gossipd.node.protocols.topology import (
    ceil_log2,
    derangement,
    second_singular_value,
    shuffled_groups,
)
from tests.core_harness import (
    STEP_S,
    Harness,
)


# ----------------------------------------------------------------------------------
# Crossover: each round's per-segment map is the shared derangement, doubly stochastic
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 7, 16])
def test_crossover_pushes_follow_the_shared_derangement_and_mix_doubly_stochastically(
    n: int,
) -> None:
    segments, mesh_seed = 4, 23
    # The protocol as the paper states it: no peer credit cutting the halves it pushes.
    h = Harness(
        "crossover",
        n,
        segments=segments,
        mesh_seed=mesh_seed,
        max_in_flight=segments,
        peer_credit=math.inf,
    )
    epoch = ranked(frozenset(h.ids)).epoch
    for step in range(6):
        h.step(step)
        for s, flow in enumerate(h.flows[-1]):
            d = derangement(n, mesh_seed, epoch, step, s)
            expected = np.eye(n) / 2
            expected[list(d), list(range(n))] += 0.5  # (I + P)/2, P[d(i), i] = 1
            np.testing.assert_array_equal(flow, expected)
            np.testing.assert_allclose(flow.sum(axis=0), 1.0, atol=1e-15)
            np.testing.assert_allclose(flow.sum(axis=1), 1.0, atol=1e-15)
        h.exchange()
        h.check_conservation()
        for node in h.ids:  # each node sent and received one half of each segment
            np.testing.assert_array_equal(h.held(node), np.ones(segments))


def test_crossover_groups_segments_per_peer_and_skips_busy_destinations() -> None:
    n, segments = 3, 6  # 3 ranks: only two derangements, so segments must share peers
    h = Harness("crossover", n, segments=segments, max_in_flight=4, mesh_seed=5)
    pushes = h.step(0)
    for node in h.ids:
        mine = [p for sender, p in pushes if sender == node]
        peers = [p.peer for p in mine]
        assert len(peers) == len(set(peers)), "segments bound for one peer travel together"
        assert sorted(s for p in mine for s in p.weights) == list(range(segments))
    # Nothing settled: every destination is busy next round, so nothing moves
    # and the weight of those segments stays where it is.
    assert h.step(1) == []
    h.exchange()
    h.check_conservation()


def test_crossover_alone_does_nothing() -> None:
    h = Harness("crossover", 1, segments=3)
    assert h.step(0) == [] and h.step(1) == []
    assert h.cores["node-000"].status().round == 1


def test_crossover_round_steps_push_only_at_round_starts() -> None:
    h = Harness("crossover", 4, mesh_seed=1, round_steps=3)
    for step in range(9):
        pushes = h.step(step)
        assert bool(pushes) == (step % 3 == 0)
        assert {c.status().round for c in h.cores.values()} == {step // 3}
        h.exchange()


# ----------------------------------------------------------------------------------
# Push-sum on the exponential graph; shuffle-exchange groups; PerSyn bursts
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 5, 12, 16, 33])
def test_pushsum_expgraph_pushes_half_to_rank_plus_then_minus_power_of_two(n: int) -> None:
    """Forward in even cycles of m iterations, backward in odd ones, and every half push
    fits the protocol's default credit whole (so the average stays exact)."""
    h = Harness("pushsum-expgraph", n, segments=2)
    m = ceil_log2(n)
    for k in range(4 * m + 1):
        pushes = h.step(k)
        assert len(pushes) == n
        sign = -1 if (k // m) % 2 else 1
        for i, node in enumerate(h.ids):
            (push,) = [p for sender, p in pushes if sender == node]
            assert push.peer == h.ids[(i + sign * 2 ** (k % m)) % n]
            assert push.weights == {0: 0.5, 1: 0.5}
        h.exchange()


def test_pushsum_expgraph_averages_exactly_in_log2_n_rounds_for_a_power_of_two() -> None:
    h = Harness("pushsum-expgraph", 16, segments=2, dim=3)
    h.run_sync(range(4))
    assert h.disagreement() < 1e-12


@pytest.mark.parametrize("n", [2, 3, 10, 16, 64])
def test_shuffle_exchange_groups_average_and_talk_to_sqrt_n_peers(n: int) -> None:
    h = Harness("shuffle-exchange", n, dim=3, mesh_seed=9, max_in_flight=n, peer_credit=math.inf)
    epoch = ranked(frozenset(h.ids)).epoch
    for step in range(3):
        x_before = {node: h.x[node].copy() for node in h.ids}
        pushes = h.step(step)
        grouping = shuffled_groups(n, 9, epoch, step)
        k = max(1, round(n**0.5))
        assert len(grouping.groups) == k
        sizes = sorted(len(g) for g in grouping.groups)
        assert sizes[-1] - sizes[0] <= 1 and sum(sizes) == n
        assert len(pushes) == sum(len(g) * (len(g) - 1) for g in grouping.groups)
        h.exchange()
        h.check_conservation()
        for group in grouping.groups:  # each group ends at its members' average
            members = [h.ids[r] for r in group]
            mean = sum(x_before[m] for m in members) / len(members)
            for m in members:
                np.testing.assert_allclose(h.x[m], mean, atol=1e-12)
                np.testing.assert_allclose(h.held(m), 1.0, atol=1e-12)


def test_shuffle_exchange_with_too_few_slots_keeps_the_unsent_shares() -> None:
    h = Harness("shuffle-exchange", 16, max_in_flight=1)  # groups of 4, one slot
    pushes = h.step(0)
    assert len(pushes) == 16 and all(p.weights == {0: 0.25} for _, p in pushes)
    h.exchange()
    h.check_conservation()


def test_persyn_burst_is_an_exact_average_for_a_power_of_two() -> None:
    h = Harness("persyn", 16, segments=2, dim=3, average_every_steps=6)
    h.run_sync(range(1, 6))
    assert not any(h.flights) and all(c.status().round == 0 for c in h.cores.values())
    assert h.disagreement() > 0.5  # nothing mixed before the burst
    h.run_sync(range(6, 10))  # sub-rounds 0..3 at steps 6, 7, 8, 9
    assert h.disagreement() < 1e-12
    assert all(c.status().round == 1 for c in h.cores.values())
    assert h.step(10) == []  # the burst is over until step 12


def test_persyn_burst_contracts_but_is_not_exact_for_other_n() -> None:
    h = Harness("persyn", 12, dim=3, average_every_steps=6)
    before = h.disagreement()
    h.run_sync(range(6, 10))  # R = 4 sub-rounds
    assert 1e-6 < h.disagreement() < 0.5 * before


def test_persyn_final_burst_is_driven_by_timers_at_the_measured_step_time() -> None:
    h = Harness("persyn", 8, dim=3, average_every_steps=100)
    h.run_sync(range(1, 5))
    assert h.disagreement() > 0.5
    core = h.cores["node-000"]
    actions = core.handle(TrainingEnded(4, 4 * STEP_S))
    timers = [a for a in actions if isinstance(a, StartTimer)]
    assert [t.at_s for t in timers] == pytest.approx([1.0 + STEP_S, 1.0 + 2 * STEP_S])
    assert len([a for a in actions if isinstance(a, Push)]) == 1
    assert core.status().round == 1
    fresh = build("persyn", CoreSettings("node-000", 1, options={"average_every_steps": 100}))
    fresh.handle(ViewChanged(frozenset(h.ids)))
    unmeasured = fresh.handle(TrainingEnded(0, 0.0))
    assert [a.at_s for a in unmeasured if isinstance(a, StartTimer)] == pytest.approx(
        [DEFAULT_STEP_TIME_S, 2 * DEFAULT_STEP_TIME_S]
    )
    assert fresh.handle(TimerFired("something-else:1:1", 1.0)) == []

    h2 = Harness("persyn", 8, segments=2, dim=3, average_every_steps=100)
    h2.run_sync(range(1, 5))
    h2.end_training(4)
    assert h2.disagreement() < 1e-12
    h2.check_conservation()


# ----------------------------------------------------------------------------------
# Crossover-SGD's Figure 6, measured on the cores' own pushes
# ----------------------------------------------------------------------------------
# The issue author's table: (N, k) -> (random topology, mean of 20 draws; exponential graph).
FIGURE6_EXPECTED = {
    (64, 2): (0.905, 0.994),
    (64, 3): (0.745, 0.975),
    (64, 4): (0.578, 0.901),
    (64, 5): (0.442, 0.637),
    (64, 6): (0.333, 0.0),
    (16, 1): (0.995, 0.981),
    (16, 2): (0.847, 0.906),
    (16, 3): (0.659, 0.641),
    (16, 4): (0.487, 0.0),
}
FIGURE6_DRAWS = 20


def core_flows(protocol: str, n: int, rounds: int, mesh_seed: int = 0) -> list[np.ndarray]:
    """One segment's mixing matrices of ``rounds`` synchronous rounds, from the cores' pushes
    (the protocols as their papers state them: no peer credit cutting a push)."""
    h = Harness(protocol, n, dim=1, mesh_seed=mesh_seed, peer_credit=math.inf)
    h.run_sync(range(rounds))
    return [flows[0] for flows in h.flows]


def figure6_table(n: int, ks: list[int], draws: int = FIGURE6_DRAWS) -> dict[int, tuple]:
    """k -> (mean σ₂ over ``draws`` mesh seeds of crossover, its std, σ₂ of the exp graph)."""
    rounds = max(ks)
    random_flows = [core_flows("crossover", n, rounds, mesh_seed=d) for d in range(draws)]
    exp_flows = core_flows("pushsum-expgraph", n, rounds)
    table = {}
    for k in ks:
        values = np.array([second_singular_value(f[:k]) for f in random_flows])
        table[k] = (float(values.mean()), float(values.std()), second_singular_value(exp_flows[:k]))
    return table


@pytest.mark.parametrize("n", [16, 64])
def test_figure6_random_topology_beats_the_exponential_graph_early_not_at_log2_n(n: int) -> None:
    ks = sorted(k for (size, k) in FIGURE6_EXPECTED if size == n)
    table = figure6_table(n, ks)
    for k in ks:
        mean, std, exp = table[k]
        want_random, want_exp = FIGURE6_EXPECTED[(n, k)]
        # The exponential graph is deterministic: only rounding separates us from the table.
        assert exp == pytest.approx(want_exp, abs=5e-4), (n, k, exp)
        # The random mean of 20 draws: its standard error std/√20 is at most 0.01 here
        # (measured std ≤ 0.045). The table is another sample of 20 draws, so the two means
        # differ with a standard error ≤ 0.014: ±0.05 is over 3.5 of those. Seeds are fixed,
        # so this is deterministic; it catches a wrong distribution, not bad luck.
        assert std / FIGURE6_DRAWS**0.5 < 0.011
        assert mean == pytest.approx(want_random, abs=0.05), (n, k, mean)
    below = [k for k in ks if table[k][0] < table[k][2]]
    if n == 64:
        assert below == [2, 3, 4, 5]  # what the paper's figure shows, and no more
    else:  # k = 3 is a near tie in the table (0.659 against 0.641): not asserted
        assert 2 in below and 1 not in below and 4 not in below
    assert table[ceil_log2(n)][2] < 1e-9  # the exponential graph's product is exactly J/N
