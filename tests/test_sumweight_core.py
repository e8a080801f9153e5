"""Sum-weight gossip core (node/protocols/sumweight.py): unit and property tests.

The property tests drive N pure cores through a tiny in-test network: a message
queue whose order, duplicates, drops and sender time-outs are chosen by a seeded
``random.Random``. The driver knows the ground truth (which segment of which
push the receiver really merged), so it checks the invariants of DESIGN.md §5
and §8 after every event, not only at the end.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.node.protocols.sumweight import (
    DEDUP_WINDOW,
    Duplicate,
    Merge,
    Push,
    SumWeightGossip,
)

PROPERTY = settings(max_examples=100, derandomize=True, deadline=None, database=None)
CONSENSUS = settings(max_examples=40, derandomize=True, deadline=None, database=None)

REL = 1e-12
ABS = 1e-12
INCARNATION = 0


# ----------------------------------------------------------------------------------
# In-test driver: N cores, a lossy reordering queue, a ground-truth ledger.
# ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Faults:
    duplicate: float = 0.0  # a message is delivered twice (copy re-queued at a random place)
    drop: float = 0.0  # a message (segment or acknowledgement) is lost
    fail: float = 0.0  # on time-out, the sender gives up instead of retrying (if never reached)
    leave: float = 0.0  # a node leaves gracefully, handing over its weight
    eager_retry: float = 0.0  # the sender retries while the first attempt is still in the network


@dataclass
class Flight:
    """One push as the network sees it; ``delivered`` is the receiver-side truth."""

    sender: int
    receiver: int
    push: Push
    snapshot: list[np.ndarray]
    delivered: set[int] = field(default_factory=set)
    resolved: bool = False
    attempts: int = 0


class Mesh:
    def __init__(
        self,
        n: int,
        num_segments: int,
        *,
        seed: int,
        push_probability: float,
        faults: Faults = Faults(),
        initial_weights: list[float] | None = None,
        dim: int = 3,
        max_in_flight: int = 2,
    ) -> None:
        self.rng = random.Random(seed)
        self.num_segments = num_segments
        self.faults = faults
        self.ids = [f"node-{i}" for i in range(n)]
        weights = initial_weights if initial_weights is not None else [1.0] * n
        self.nodes = [
            SumWeightGossip(
                node_id,
                num_segments,
                push_probability=push_probability,
                rng=random.Random(self.rng.getrandbits(64)),
                initial_weight=w,
                max_in_flight=max_in_flight,
            )
            for node_id, w in zip(self.ids, weights, strict=True)
        ]
        for node in self.nodes:
            for peer in self.ids:
                node.on_peer_up(peer)  # includes itself: the core must ignore that
        self.x = [
            [
                np.array([self.rng.uniform(-1.0, 1.0) for _ in range(dim)])
                for _ in range(num_segments)
            ]
            for _ in range(n)
        ]
        self.total_weight = [math.fsum(weights)] * num_segments
        self.total_wx = [self._sum_wx_settled(s) for s in range(num_segments)]
        self.initial_x = [[v.copy() for v in xs] for xs in self.x]
        self.flights: dict[tuple[int, int, int], Flight] = {}
        self.unresolved: set[tuple[int, int, int]] = set()
        self.pending: dict[tuple[int, int, int], int] = {}
        self.queue: list[tuple] = []
        self.progress: dict[tuple[tuple[int, int, int], int], set[int]] = {}
        self.left: set[int] = set()
        self.counts = {"merged": 0, "duplicate": 0, "failed": 0, "acked": 0, "pushes": 0}

    # -- ledger ---------------------------------------------------------------------
    def active(self) -> list[int]:
        return [i for i in range(len(self.nodes)) if i not in self.left]

    def _sum_wx_settled(self, s: int) -> np.ndarray:
        return sum(node.weights[s] * self.x[i][s] for i, node in enumerate(self.nodes))

    def mass_in_transit(self, s: int) -> list[float]:
        return [
            self.flights[k].push.weights[s]
            for k in self.unresolved
            if s not in self.flights[k].delivered
        ]

    def check_live_invariants(self) -> None:
        """Σ available + Σ undelivered in-flight weight is the initial total, at every moment."""
        for k in self.unresolved:
            f = self.flights[k]
            assert f.push.key in self.nodes[f.sender].in_flight
        for s in range(self.num_segments):
            held = [node.available(s) for node in self.nodes]
            total = math.fsum(held + self.mass_in_transit(s))
            assert math.isclose(total, self.total_weight[s], rel_tol=REL, abs_tol=ABS), (s, total)
            assert all(w >= -ABS for w in held), held
            if self.faults.fail == 0.0:
                wx = sum(node.available(s) * self.x[i][s] for i, node in enumerate(self.nodes))
                for k in self.unresolved:
                    f = self.flights[k]
                    if s not in f.delivered:
                        wx = wx + f.push.weights[s] * f.snapshot[s]
                np.testing.assert_allclose(wx, self.total_wx[s], rtol=REL, atol=ABS)

    # -- events ---------------------------------------------------------------------
    def _register(self, sender: int, push: Push) -> None:
        assert push.peer != self.ids[sender], "a node pushed to itself"
        assert set(push.weights) == set(range(self.num_segments))
        receiver = self.ids.index(push.peer)
        key = (sender, receiver, push.sequence)
        assert key not in self.flights, "sequence reused on one edge"
        snapshot = [v.copy() for v in self.x[sender]]  # the sender's model at push time
        self.flights[key] = Flight(sender, receiver, push, snapshot)
        self.unresolved.add(key)
        self.counts["pushes"] += 1
        self._send_attempt(key)

    def _send_attempt(self, key: tuple[int, int, int]) -> None:
        f = self.flights[key]
        f.attempts += 1
        for s in range(self.num_segments):
            self._enqueue(("seg", key, f.attempts, s))

    def _enqueue(self, msg: tuple) -> None:
        self.queue.insert(self.rng.randrange(len(self.queue) + 1), msg)
        self.pending[msg[1]] = self.pending.get(msg[1], 0) + 1

    def step(self, i: int) -> None:
        for push in self.nodes[i].on_step_end():
            self._register(i, push)

    def leave(self, i: int) -> None:
        node = self.nodes[i]
        available = [node.available(s) for s in range(self.num_segments)]
        push = node.on_leave()
        self.left.add(i)
        for j in range(len(self.nodes)):
            if j != i:
                self.nodes[j].on_peer_down(self.ids[i])
        if push is not None:
            assert push.weights == dict(enumerate(available)), "leave must hand over everything"
            self._register(i, push)
            assert all(node.available(s) == 0.0 for s in range(self.num_segments))

    def deliver(self, index: int, faulty: bool = True) -> None:
        msg = self.queue.pop(index)
        self.pending[msg[1]] -= 1
        if faulty and self.rng.random() < self.faults.drop:
            return
        if faulty and self.rng.random() < self.faults.duplicate:
            self._enqueue(msg)
        if msg[0] == "seg":
            self._receive_segment(*msg[1:])
        else:
            self._receive_ack(*msg[1:])

    def _receive_segment(self, key: tuple[int, int, int], attempt: int, s: int) -> None:
        f = self.flights[key]
        node = self.nodes[f.receiver]
        before = (list(node.weights), list(node.reserved))
        action = node.on_message(
            self.ids[f.sender], INCARNATION, f.push.sequence, s, f.push.weights[s]
        )
        if isinstance(action, Merge):
            assert s not in f.delivered, f"segment {s} of push {key} merged twice"
            assert not f.resolved, "a resolved push merged late"
            assert action.segment == s
            assert 0.0 <= action.alpha <= 1.0
            x = self.x[f.receiver][s]
            x[:] = (1.0 - action.alpha) * x + action.alpha * f.snapshot[s]
            assert action.weight_after == node.weights[s]
            self.counts["merged"] += 1
        else:
            assert isinstance(action, Duplicate) and action.segment == s
            assert s in f.delivered, f"segment {s} of push {key} reported duplicate, never merged"
            assert (node.weights, node.reserved) == before, "a duplicate changed the receiver"
            self.counts["duplicate"] += 1
        f.delivered.add(s)
        seen = self.progress.setdefault((key, attempt), set())
        if len(seen) < self.num_segments:
            seen.add(s)
            if len(seen) == self.num_segments:  # the stream ended: the receiver replies once
                self._enqueue(("ack", key, tuple(range(self.num_segments))))

    def _receive_ack(self, key: tuple[int, int, int], segments: tuple[int, ...]) -> None:
        f = self.flights[key]
        node = self.nodes[f.sender]
        before = (list(node.weights), list(node.reserved))
        node.on_push_acked(f.push.key, segments)
        if f.resolved:
            assert (node.weights, node.reserved) == before, "a stale ack changed the sender"
            return
        assert f.push.key not in node.in_flight
        f.resolved = True
        self.unresolved.discard(key)
        self.counts["acked"] += 1

    def time_out(self, key: tuple[int, int, int]) -> None:
        """The sender heard nothing back: give up (only if never reached) or retry."""
        f = self.flights[key]
        assert not f.resolved and self.pending.get(key, 0) == 0
        if not f.delivered and self.rng.random() < self.faults.fail:
            sender = self.nodes[f.sender]
            available = [sender.available(s) for s in range(self.num_segments)]
            for merge in sender.on_push_failed(f.push.key):
                # The returned weight comes back with the snapshot it left with.
                x = self.x[f.sender][merge.segment]
                self.x[f.sender][merge.segment] = (1 - merge.alpha) * x + merge.alpha * f.snapshot[
                    merge.segment
                ]
            for s in range(self.num_segments):
                assert math.isclose(
                    sender.available(s),
                    available[s] + f.push.weights[s],
                    rel_tol=REL,
                    abs_tol=ABS,
                )
            f.resolved = True
            self.unresolved.discard(key)
            self.counts["failed"] += 1
        else:
            self._send_attempt(key)

    # -- schedules --------------------------------------------------------------------
    def random_event(self) -> None:
        r = self.rng.random()
        active = self.active()
        if r < 0.3 and active:
            self.step(self.rng.choice(active))
        elif r < 0.85 and self.queue:
            self.deliver(self.rng.randrange(len(self.queue)))  # any order: reordering
        elif r < 0.95:
            silent = sorted(k for k in self.unresolved if self.pending.get(k, 0) == 0)
            if silent:
                self.time_out(self.rng.choice(silent))
            elif self.unresolved and self.rng.random() < self.faults.eager_retry:
                self._send_attempt(self.rng.choice(sorted(self.unresolved)))
        elif len(active) > 2 and self.rng.random() < self.faults.leave:
            self.leave(self.rng.choice(active))
        self.check_live_invariants()

    def drain(self, faulty: bool = False) -> None:
        """Resolve every push (quiescence), retrying until acknowledged, never giving up.

        ``faulty`` keeps duplicates and drops on (drops are then retried).
        """
        for _ in range(10_000):
            if not self.unresolved and not self.queue:
                return
            while self.queue:
                self.deliver(self.rng.randrange(len(self.queue)), faulty=faulty)
            for key in sorted(self.unresolved):
                if self.pending.get(key, 0) == 0:
                    self._send_attempt(key)
        raise AssertionError("the mesh did not quiesce")

    def round(self) -> None:
        order = self.active()
        self.rng.shuffle(order)
        for i in order:
            self.step(i)
        self.drain(faulty=True)


def assert_quiescent_mass_conserved(mesh: Mesh) -> None:
    for node in mesh.nodes:
        assert node.in_flight == {}
        for s in range(mesh.num_segments):
            assert math.isclose(node.reserved[s], 0.0, abs_tol=ABS)
            assert node.weights[s] >= 0.0
    for s in range(mesh.num_segments):
        total = math.fsum(node.weights[s] for node in mesh.nodes)
        assert math.isclose(total, mesh.total_weight[s], rel_tol=REL), (s, total)


# ----------------------------------------------------------------------------------
# Property tests
# ----------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------
# Unit tests
# ----------------------------------------------------------------------------------
def make(node_id="a", num_segments=2, *, p=1.0, seed=0, peers=("b",), **kwargs) -> SumWeightGossip:
    node = SumWeightGossip(
        node_id, num_segments, push_probability=p, rng=random.Random(seed), **kwargs
    )
    for peer in peers:
        node.on_peer_up(peer)
    return node


def test_push_reserves_half_and_removes_weight_only_when_acknowledged():
    node = make()
    [push] = node.on_step_end()
    assert push == Push("b", 1, {0: 0.5, 1: 0.5})
    assert node.weights == [1.0, 1.0]
    assert node.reserved == [0.5, 0.5]
    assert node.available(0) == node.available(1) == 0.5
    assert node.in_flight == {1: push}
    node.on_push_acked(1, [0, 1])
    assert node.weights == [0.5, 0.5]
    assert node.reserved == [0.0, 0.0]
    assert node.in_flight == {}


def test_second_push_while_first_in_flight_sends_half_of_available_weight():
    node = make(max_in_flight=2)
    [first] = node.on_step_end()
    [second] = node.on_step_end()
    assert second.sequence == first.sequence + 1
    assert second.weights == {0: 0.25, 1: 0.25}
    assert node.reserved == [0.75, 0.75]
    node.on_push_acked(second.key, [0, 1])
    node.on_push_acked(first.key, [0, 1])
    assert node.weights == [0.25, 0.25]
    assert node.reserved == [0.0, 0.0]


def test_partial_ack_commits_acknowledged_segments_and_returns_the_rest():
    node = make(num_segments=3)
    [push] = node.on_step_end()
    node.on_push_acked(push.key, [1])
    assert node.weights == [1.0, 0.5, 1.0]
    assert node.reserved == [0.0, 0.0, 0.0]
    assert node.in_flight == {}


def test_failed_push_returns_the_whole_reservation():
    node = make()
    [push] = node.on_step_end()
    node.on_push_failed(push.key)
    assert node.weights == [1.0, 1.0]
    assert node.reserved == [0.0, 0.0]
    assert node.in_flight == {}
    assert node.available(0) == 1.0


def test_ack_or_failure_of_unknown_or_settled_sequence_changes_nothing():
    node = make()
    [push] = node.on_step_end()
    node.on_push_acked(push.key, [0, 1])
    state = (list(node.weights), list(node.reserved))
    node.on_push_acked(push.key, [0, 1])  # duplicated ack
    node.on_push_failed(push.key)  # late failure report
    node.on_push_acked(999, [0])
    assert (node.weights, node.reserved) == state


def test_merge_adds_weight_with_alpha_equal_to_incoming_share():
    node = make(peers=())
    merge = node.on_message("b", 0, 1, 0, 0.5)
    assert merge == Merge(0, 0.5 / 1.5, 1.5)
    assert node.weights == [1.5, 1.0]


def test_merge_alpha_uses_available_weight_not_reserved_weight():
    node = make()
    node.on_step_end()  # reserves 0.5 of each segment
    merge = node.on_message("b", 0, 1, 0, 0.5)
    assert merge.alpha == 0.5  # 0.5 / (available 0.5 + 0.5)
    assert merge.weight_after == 1.5
    assert node.available(0) == 1.0


def test_duplicate_delivery_returns_duplicate_and_changes_nothing():
    node = make(peers=())
    assert isinstance(node.on_message("b", 0, 7, 1, 0.25), Merge)
    state = (list(node.weights), list(node.reserved))
    dup = node.on_message("b", 0, 7, 1, 0.25)
    assert dup == Duplicate(1)
    assert (node.weights, node.reserved) == state
    # the same sequence with another segment, sender or incarnation is a different message
    assert isinstance(node.on_message("b", 0, 7, 0, 0.25), Merge)
    assert isinstance(node.on_message("c", 0, 7, 1, 0.25), Merge)
    assert isinstance(node.on_message("b", 1, 7, 1, 0.25), Merge)


def test_forget_sender_drops_only_older_incarnations():
    node = make(peers=())
    node.on_message("b", 1, 5, 0, 0.1)
    node.on_message("b", 2, 5, 0, 0.1)
    node.on_message("c", 1, 5, 0, 0.1)
    node.forget_sender("b", keep_incarnation=2)
    assert isinstance(node.on_message("b", 2, 5, 0, 0.1), Duplicate)
    assert isinstance(node.on_message("c", 1, 5, 0, 0.1), Duplicate)
    assert isinstance(node.on_message("b", 1, 5, 0, 0.1), Merge)


def test_retry_within_dedup_window_is_never_merged_twice():
    node = make(num_segments=1, peers=())
    node.on_message("b", 0, 1, 0, 0.5)
    for sequence in range(2, DEDUP_WINDOW + 1):
        node.on_message("b", 0, sequence, 0, 0.0)
    weights = list(node.weights)
    assert isinstance(node.on_message("b", 0, 1, 0, 0.5), Duplicate)
    assert node.weights == weights


def test_retry_older_than_dedup_window_is_treated_as_already_merged():
    """Module docstring of DEDUP_WINDOW: 'a retry older than this is treated as already merged'.

    Merging it again would create mass, which DESIGN.md §5 forbids.
    """
    node = make(num_segments=1, peers=())
    node.on_message("b", 0, 1, 0, 0.5)
    for sequence in range(2, DEDUP_WINDOW + 2):
        node.on_message("b", 0, sequence, 0, 0.0)
    weights = list(node.weights)
    action = node.on_message("b", 0, 1, 0, 0.5)  # the retry of push 1, its ack was lost
    assert isinstance(action, Duplicate), f"old retry merged again: {action}"
    assert node.weights == weights


def test_leave_hands_over_all_available_weight_to_the_chosen_peer():
    node = make(peers=("b", "c"))
    [first] = node.on_step_end()
    push = node.on_leave("c")
    assert push is not None and push.peer == "c"
    assert push.weights == {0: 0.5, 1: 0.5}  # everything not already reserved
    assert [node.available(s) for s in range(2)] == [0.0, 0.0]
    node.on_push_acked(first.key, [0, 1])
    node.on_push_acked(push.key, [0, 1])
    assert node.weights == [0.0, 0.0]
    assert node.reserved == [0.0, 0.0]


def test_leave_without_explicit_peer_picks_a_live_peer_and_none_without_peers():
    node = make(peers=("b", "c"), seed=3)
    push = node.on_leave()
    assert push is not None and push.peer in {"b", "c"}
    assert push.weights == {0: 1.0, 1: 1.0}
    assert make(peers=()).on_leave() is None


def test_leave_with_nothing_available_sends_nothing():
    node = make(initial_weight=0.0)
    assert node.on_leave("b") is None
    assert node.in_flight == {}


def test_node_with_zero_weight_never_pushes():
    node = make(initial_weight=0.0)
    for _ in range(100):
        assert node.on_step_end() == []
    assert node.in_flight == {}
    assert node.reserved == [0.0, 0.0]


def test_node_whose_weight_is_all_reserved_does_not_push():
    node = make()
    node.on_leave("b")
    assert node.on_step_end() == []
    assert len(node.in_flight) == 1


def test_joiner_at_weight_zero_takes_the_incoming_model_whole():
    node = make(initial_weight=0.0, peers=())
    merge = node.on_message("b", 0, 1, 0, 0.25)
    assert merge.alpha == 1.0
    assert merge.weight_after == 0.25
    assert node.weights == [0.25, 0.0]


def test_zero_weight_message_to_zero_weight_node_leaves_model_unchanged():
    node = make(initial_weight=0.0, peers=())
    merge = node.on_message("b", 0, 1, 0, 0.0)
    assert merge.alpha == 0.0
    assert node.weights == [0.0, 0.0]


@pytest.mark.parametrize("weight", [-1e-300, -1.0, math.nan, math.inf, -math.inf])
def test_message_with_invalid_weight_is_refused_with_its_value(weight):
    node = make(peers=())
    with pytest.raises(ValueError, match=str(weight).replace("+", r"\+")):
        node.on_message("b", 0, 1, 0, weight)
    assert node.weights == [1.0, 1.0]
    assert isinstance(node.on_message("b", 0, 1, 0, 0.5), Merge)  # not remembered as seen


@pytest.mark.parametrize("segment", [-1, 2, 100])
def test_message_for_segment_out_of_range_is_refused_with_its_index(segment):
    node = make(peers=())
    with pytest.raises(ValueError, match=rf"segment {segment} out of range 0\.\.1"):
        node.on_message("b", 0, 1, segment, 0.5)
    assert node.weights == [1.0, 1.0]


@pytest.mark.parametrize("p", [-0.1, 1.0000001, math.nan])
def test_push_probability_outside_unit_interval_is_refused(p):
    with pytest.raises(ValueError, match="push_probability"):
        SumWeightGossip("a", 1, push_probability=p, rng=random.Random(0))


@pytest.mark.parametrize("num_segments", [0, -3])
def test_fewer_than_one_segment_is_refused(num_segments):
    with pytest.raises(ValueError, match=f"got {num_segments}"):
        SumWeightGossip("a", num_segments, push_probability=0.5, rng=random.Random(0))


@pytest.mark.parametrize("weight", [-0.5, math.nan, math.inf])
def test_invalid_initial_weight_is_refused(weight):
    with pytest.raises(ValueError, match="initial_weight"):
        SumWeightGossip("a", 1, push_probability=0.5, rng=random.Random(0), initial_weight=weight)


def test_push_probability_zero_never_pushes():
    node = make(p=0.0, peers=("b", "c", "d"))
    for _ in range(2000):
        assert node.on_step_end() == []
    assert node.weights == [1.0, 1.0]


def test_push_probability_one_pushes_after_every_step():
    node = make(p=1.0, peers=("b", "c"))
    for k in range(1, 21):
        [push] = node.on_step_end()
        node.on_push_acked(push.key, [0, 1])
        assert node.weights[0] == 0.5**k


def test_no_self_peer_is_ever_chosen():
    node = make(node_id="a", peers=("a", "b", "c"))
    assert node.peers == {"b", "c"}
    for _ in range(500):
        for push in node.on_step_end():
            assert push.peer != "a"
            node.on_push_failed(push.key)
    alone = make(node_id="a", peers=("a",))
    assert alone.peers == set()
    assert alone.on_step_end() == []
    assert alone.on_leave() is None


def test_pushes_go_only_to_live_peers_and_reach_every_one_of_them():
    node = make(peers=("b", "c", "d"))
    node.on_peer_down("c")
    node.on_peer_down("zzz")  # unknown peer: no error
    targets = set()
    for _ in range(300):
        for push in node.on_step_end():
            targets.add(push.peer)
            node.on_push_failed(push.key)
    assert targets == {"b", "d"}


def test_sequences_start_after_sequence_start_and_strictly_increase():
    node = make(sequence_start=41)
    sequences = []
    for _ in range(5):
        [push] = node.on_step_end()
        sequences.append(push.sequence)
        node.on_push_acked(push.key, [0, 1])
    assert sequences == [42, 43, 44, 45, 46]


def test_node_with_max_in_flight_unacknowledged_pushes_skips_its_turn():
    node = make(max_in_flight=1)
    [push] = node.on_step_end()
    state = (list(node.weights), list(node.reserved))
    for _ in range(10):
        assert node.on_step_end() == []
    assert (node.weights, node.reserved) == state
    node.on_push_acked(push.key, [0, 1])
    [nxt] = node.on_step_end()
    assert nxt.sequence == push.sequence + 1


def test_failed_push_frees_its_in_flight_slot():
    node = make(max_in_flight=2)
    first, second = node.on_step_end()[0], node.on_step_end()[0]
    assert node.on_step_end() == []
    node.on_push_failed(first.key)
    assert len(node.on_step_end()) == 1
    assert second.sequence in node.in_flight


def test_leave_hands_over_weight_even_with_max_in_flight_pushes_outstanding():
    node = make(max_in_flight=1)
    node.on_step_end()
    assert node.on_step_end() == []
    push = node.on_leave("b")
    assert push is not None and push.weights == {0: 0.5, 1: 0.5}


def test_same_rng_seed_gives_the_same_pushes():
    def trace(seed):
        node = make(peers=("b", "c", "d", "e"), p=0.5, seed=seed)
        out = []
        for _ in range(200):
            for push in node.on_step_end():
                out.append((push.peer, push.sequence))
                node.on_push_acked(push.key, [0, 1])
        return out

    assert trace(11) == trace(11)
    assert trace(11) != trace(12)
