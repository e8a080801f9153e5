"""Round topologies (node/protocols/topology.py): valid, shared, uniform, cheap to share.

docs/design.md §8: "each round's per-segment map is a derangement; all nodes compute the
same one from the seed". Uniformity is tested by a chi-square test over every
derangement of 4 and 5 ranks; sharing, by recomputing in fresh processes with
different hash seeds; cheapness, by counting what the cache computes when many
cores ask for the same round.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from gossipd.node.protocols import CoreSettings, build
from gossipd.node.protocols.base import StepEnded, ViewChanged, ranked
from gossipd.node.protocols.topology import (
    ceil_log2,
    derangement,
    exponential_neighbours,
    exponential_peer,
    second_singular_value,
    shuffled_groups,
)

PROPERTY = settings(max_examples=60, derandomize=True, deadline=None, database=None)


def is_derangement(d: tuple[int, ...], n: int) -> bool:
    return sorted(d) == list(range(n)) and all(d[i] != i for i in range(n))


def test_derangement_is_a_permutation_without_fixed_points_for_n_2_to_200() -> None:
    for n in range(2, 201):
        for seed in range(8):
            assert is_derangement(derangement(n, seed, 1234, 7, seed % 3), n), (n, seed)


@PROPERTY
@given(
    n=st.integers(2, 64),
    parts=st.tuples(st.integers(0, 2**63), st.integers(0, 2**48), st.integers(0, 10**6)),
)
def test_derangement_is_valid_and_a_pure_function_of_its_parts(
    n: int, parts: tuple[int, int, int]
) -> None:
    first = derangement(n, *parts)
    derangement.cache_clear()  # recomputed from the seed alone, not read back from the cache
    assert derangement(n, *parts) == first
    assert is_derangement(first, n)


def test_derangement_rejects_fewer_than_two_ranks() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        derangement(1, 0)


CHILD = """
import json, sys
from gossipd.node.protocols.topology import derangement, shuffled_groups
print(json.dumps([derangement(37, 5, 123, 4, 2), shuffled_groups(37, 5, 123, 4).groups]))
"""


def test_every_process_computes_the_same_maps_whatever_its_hash_seed() -> None:
    """Nodes are separate processes: string hashing or import order must not matter."""
    outputs = set()
    for hash_seed in ("0", "1", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        run = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(run.stdout.strip())
    here = json.dumps([derangement(37, 5, 123, 4, 2), shuffled_groups(37, 5, 123, 4).groups])
    assert outputs == {here}


@pytest.mark.parametrize(("n", "count", "draws"), [(4, 9, 9 * 400), (5, 44, 44 * 150)])
def test_derangement_is_uniform_over_all_derangements(n: int, count: int, draws: int) -> None:
    """Chi-square over all !n derangements (9 for n = 4, 44 for n = 5), rejected at p < 0.001.

    Seeds are fixed, so the p-value is a fixed number; a sampler that favours single
    cycles (Sattolo) or the greedy roulette's shapes fails this by a wide margin.
    """
    every = [p for p in itertools.permutations(range(n)) if all(p[i] != i for i in range(n))]
    assert len(every) == count
    seen = Counter(derangement(n, "uniformity", r) for r in range(draws))
    assert set(seen) == set(every)
    observed = [seen[p] for p in every]
    assert chisquare(observed).pvalue > 0.001


def test_one_round_is_computed_once_however_many_cores_ask() -> None:
    """A simulator's N cores share the cache: per node per round O(segments), not O(N)."""
    n, segments = 400, 4
    ids = [f"sim-{i:04d}" for i in range(n)]
    members = frozenset(ids)
    cores = [build("crossover", CoreSettings(i, segments, mesh_seed=77)) for i in ids]
    for core in cores:
        core.handle(ViewChanged(members))
    derangement.cache_clear()
    received = {s: Counter() for s in range(segments)}
    for core in cores:
        for push in core.handle(StepEnded(1, 0.0)):
            for s in push.weights:
                received[s][push.peer] += 1
    info = derangement.cache_info()
    assert info.misses == segments and info.hits == (n - 1) * segments
    # Each node receives each segment exactly once: the same derangement everywhere.
    for s in range(segments):
        assert set(received[s]) == members and set(received[s].values()) == {1}


@pytest.mark.parametrize(("n", "m"), [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (16, 4), (17, 5)])
def test_ceil_log2(n: int, m: int) -> None:
    assert ceil_log2(n) == m


def test_exponential_graph_has_no_self_edges_and_is_a_permutation_each_iteration() -> None:
    for n in range(2, 70):
        for k in range(2 * ceil_log2(n)):
            for backward in (False, True):
                targets = [exponential_peer(i, n, k, backward) for i in range(n)]
                assert sorted(targets) == list(range(n))
                assert all(t != i for i, t in enumerate(targets))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 12, 16, 33])
def test_neighbours_are_the_pairs_an_iteration_joins_either_way(n: int) -> None:
    """What a node may expect weight back from: exactly the ranks it pushes to or hears
    from in some iteration, forward or backward, and no other."""
    view = ranked(frozenset(f"r{i:02d}" for i in range(n)))
    edges = {
        frozenset((i, exponential_peer(i, n, k, backward)))
        for i in range(n)
        for k in range(ceil_log2(n))
        for backward in (False, True)
    }
    for i in range(n):
        for j in range(n):
            joined = exponential_neighbours(view, view.members[i], view.members[j])
            assert joined == (frozenset((i, j)) in edges), (i, j)
    assert not exponential_neighbours(view, "r00", "not-a-member")


def test_every_cycle_of_either_direction_averages_exactly() -> None:
    """The m matrices of a cycle multiply to J/N for N a power of two, whichever way each
    iteration goes: why turning the direction every cycle costs no exactness."""
    for n in (2, 4, 8, 16):
        m = ceil_log2(n)
        for signs in itertools.product((False, True), repeat=m):
            mix = np.eye(n)
            for k, backward in enumerate(signs):
                step = np.eye(n) / 2
                for i in range(n):
                    step[exponential_peer(i, n, k, backward), i] += 0.5
                mix = step @ mix
            np.testing.assert_allclose(mix, np.full((n, n), 1 / n), atol=1e-15)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 16, 50, 101])
def test_shuffled_groups_partition_the_ranks_into_round_sqrt_n_near_equal_groups(n: int) -> None:
    grouping = shuffled_groups(n, 3, 99, 5)
    k = max(1, round(n**0.5))
    assert len(grouping.groups) == k
    assert sorted(r for g in grouping.groups for r in g) == list(range(n))
    sizes = [len(g) for g in grouping.groups]
    assert max(sizes) - min(sizes) <= 1
    for j, group in enumerate(grouping.groups):
        assert all(grouping.group_of[r] == j for r in group)
    if n >= 10:  # another round, another grouping
        assert shuffled_groups(n, 3, 99, 6).groups != grouping.groups


def test_second_singular_value_of_known_products() -> None:
    n = 8
    shift = np.roll(np.eye(n), 1, axis=0)  # P e_i = e_{i+1}
    half = (np.eye(n) + shift) / 2
    assert second_singular_value([half]) == pytest.approx(np.cos(np.pi / n))
    exp_graph = [(np.eye(n) + np.linalg.matrix_power(shift, 2**j)) / 2 for j in range(3)]
    assert second_singular_value(exp_graph) < 1e-12  # the product is J/N
    two_cycles = np.eye(n)[[1, 0, 3, 2, 5, 4, 7, 6]]  # four swaps: disconnected
    assert second_singular_value([(np.eye(n) + two_cycles) / 2]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        second_singular_value([])
