"""Sum-weight gossip (node/protocols/sumweight.py): mass and consensus under faults.

Property tests on N cores over tests/lossy_mesh.py's network: Σw is exact at
quiescence and Σ w·x is conserved under drops, duplicates, reordering, failures and
leaves, checked after every event; with training off every node converges to the
(weight-weighted) mean of the initial models.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.lossy_mesh import ABS, REL, Faults, Mesh, assert_quiescent_mass_conserved

PROPERTY = settings(max_examples=100, derandomize=True, deadline=None, database=None)
CONSENSUS = settings(max_examples=40, derandomize=True, deadline=None, database=None)

probabilities = st.sampled_from([0.0, 0.05, 0.2, 0.5])


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 6),
    num_segments=st.integers(1, 3),
    push_probability=st.sampled_from([0.25, 0.5, 1.0]),
    events=st.integers(0, 250),
    duplicate=probabilities,
    drop=probabilities,
    fail=st.sampled_from([0.0, 0.3, 1.0]),
    leave=st.sampled_from([0.0, 0.3]),
    eager_retry=probabilities,
    max_in_flight=st.sampled_from([1, 2, 8]),
)
def test_sum_of_weights_is_exact_at_quiescence_under_drops_duplicates_reordering_and_failures(
    seed,
    n,
    num_segments,
    push_probability,
    events,
    duplicate,
    drop,
    fail,
    leave,
    eager_retry,
    max_in_flight,
):
    faults = Faults(duplicate, drop, fail, leave, eager_retry)
    mesh = Mesh(
        n,
        num_segments,
        seed=seed,
        push_probability=push_probability,
        faults=faults,
        max_in_flight=max_in_flight,
    )
    for _ in range(events):
        mesh.random_event()
    mesh.drain()
    mesh.check_live_invariants()
    assert_quiescent_mass_conserved(mesh)


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 6),
    num_segments=st.integers(1, 3),
    push_probability=st.sampled_from([0.25, 0.5, 1.0]),
    events=st.integers(0, 250),
    duplicate=probabilities,
    drop=probabilities,
    leave=st.sampled_from([0.0, 0.3]),
    eager_retry=probabilities,
    weights=st.lists(st.floats(0.0, 4.0), min_size=6, max_size=6),
    max_in_flight=st.sampled_from([1, 2, 8]),
    fail=probabilities,
)
def test_sum_of_weight_times_model_is_conserved_even_when_pushes_fail(
    seed,
    n,
    num_segments,
    push_probability,
    events,
    duplicate,
    drop,
    leave,
    eager_retry,
    weights,
    max_in_flight,
    fail,
):
    faults = Faults(duplicate=duplicate, drop=drop, leave=leave, eager_retry=eager_retry, fail=fail)
    mesh = Mesh(
        n,
        num_segments,
        seed=seed,
        push_probability=push_probability,
        faults=faults,
        initial_weights=weights[:n],
        max_in_flight=max_in_flight,
    )
    for _ in range(events):
        mesh.random_event()  # checks Σ avail·x + Σ in-transit w·x_sent after every event
    mesh.drain()
    assert_quiescent_mass_conserved(mesh)
    for s in range(num_segments):
        np.testing.assert_allclose(mesh._sum_wx_settled(s), mesh.total_wx[s], rtol=REL, atol=ABS)


def test_fault_driver_really_exercises_duplicates_retries_failures_and_leaves():
    """Guards the property tests above against a driver that silently injects nothing."""
    faults = Faults(duplicate=0.2, drop=0.2, fail=0.3, leave=0.3, eager_retry=0.2)
    counts = {"merged": 0, "duplicate": 0, "failed": 0, "acked": 0, "pushes": 0}
    leaves = 0
    for seed in range(20):
        mesh = Mesh(5, 2, seed=seed, push_probability=0.5, faults=faults)
        for _ in range(250):
            mesh.random_event()
        mesh.drain()
        assert_quiescent_mass_conserved(mesh)
        leaves += len(mesh.left)
        for k, v in mesh.counts.items():
            counts[k] += v
    assert counts["duplicate"] > 0
    assert counts["failed"] > 0
    assert counts["merged"] > 0
    assert leaves > 0


def _run_to_consensus(mesh: Mesh, max_rounds: int = 400) -> float:
    target = []
    for s in range(mesh.num_segments):
        wx = sum(node.weights[s] * mesh.x[i][s] for i, node in enumerate(mesh.nodes))
        target.append(wx / mesh.total_weight[s])
    distance = math.inf
    for _ in range(max_rounds):
        mesh.round()
        distance = max(
            float(np.max(np.abs(mesh.x[i][s] - target[s])))
            for i in range(len(mesh.nodes))
            for s in range(mesh.num_segments)
        )
        if distance < 1e-6:
            break
    return distance


@CONSENSUS
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 8),
    num_segments=st.integers(1, 3),
    push_probability=st.sampled_from([0.5, 1.0]),
    duplicate=st.sampled_from([0.0, 0.1]),
    drop=st.sampled_from([0.0, 0.1]),
)
def test_without_training_every_node_converges_to_the_mean_of_the_initial_models(
    seed, n, num_segments, push_probability, duplicate, drop
):
    mesh = Mesh(
        n,
        num_segments,
        seed=seed,
        push_probability=push_probability,
        faults=Faults(duplicate=duplicate, drop=drop),
    )
    means = [np.mean([mesh.initial_x[i][s] for i in range(n)], axis=0) for s in range(num_segments)]
    assert _run_to_consensus(mesh) < 1e-6
    for i in range(n):
        for s in range(num_segments):
            assert float(np.max(np.abs(mesh.x[i][s] - means[s]))) < 1e-6
    assert_quiescent_mass_conserved(mesh)


@CONSENSUS
@given(
    seed=st.integers(0, 2**32 - 1),
    weights=st.lists(st.floats(0.25, 4.0), min_size=2, max_size=6),
)
def test_without_training_nodes_converge_to_the_weight_weighted_mean_of_initial_models(
    seed, weights
):
    mesh = Mesh(len(weights), 2, seed=seed, push_probability=1.0, initial_weights=weights)
    expected = [
        sum(w * mesh.initial_x[i][s] for i, w in enumerate(weights)) / math.fsum(weights)
        for s in range(2)
    ]
    assert _run_to_consensus(mesh) < 1e-6
    for i in range(len(weights)):
        for s in range(2):
            assert float(np.max(np.abs(mesh.x[i][s] - expected[s]))) < 1e-6


def test_a_joiner_at_weight_zero_is_pulled_to_the_mesh_mean():
    mesh = Mesh(5, 1, seed=7, push_probability=1.0, initial_weights=[1.0, 1.0, 1.0, 1.0, 0.0])
    mean = np.mean([mesh.initial_x[i][0] for i in range(4)], axis=0)  # the joiner counts 0
    assert _run_to_consensus(mesh) < 1e-6
    assert float(np.max(np.abs(mesh.x[4][0] - mean))) < 1e-6
    assert mesh.nodes[4].weights[0] > 0.0
