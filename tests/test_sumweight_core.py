"""Sum-weight gossip core (node/protocols/sumweight.py): unit and property tests.

The property tests drive N pure cores through a tiny in-test network: a message
queue whose order, duplicates, drops and sender time-outs are chosen by a seeded
``random.Random``. The driver knows the ground truth (which segment of which
push the receiver really merged), so it checks the invariants of docs/design.md §5
and §8 after every event, not only at the end.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.node.protocols.base import Duplicate, FoldBack, Merge, Push, Refused, WeightCapExceeded
from gossipd.node.protocols.ledger import DEDUP_WINDOW, SEQUENCE_AHEAD
from gossipd.node.protocols.sumweight import SumWeightGossip

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
        node = self.nodes[i]
        busy = node.busy_peers()
        for push in node.on_step_end():
            assert push.peer not in busy, "a second push to a peer that had one in flight"
            edge = [k for k in self.flights if k[:2] == (i, self.ids.index(push.peer))]
            assert push.sequence == len(edge) + 1, "per-edge sequences must count 1, 2, 3..."
            self._register(i, push)
        assert len(node.in_flight) <= node.max_in_flight
        assert len(node.busy_peers()) == len(node.in_flight), "two pushes in flight to one peer"

    def leave(self, i: int) -> None:
        node = self.nodes[i]
        available = [node.available(s) for s in range(self.num_segments)]
        push = node.hand_off()
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
        node.settle(f.push.key, segments)
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
            for merge in sender.settle(f.push.key, ()):
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


def snapshot(node: SumWeightGossip) -> dict:
    """Everything a core holds except its rng, de-duplication windows included, as plain data."""
    state = {k: v for k, v in vars(node).items() if k not in ("rng", "_seen")}
    state["_seen"] = {key: dict(vars(window)) for key, window in node._seen.items()}
    state["rng"] = node.rng.getstate()
    return copy.deepcopy(state)


def deliver(receiver: SumWeightGossip, sender: str, push: Push, incarnation: int = 0) -> list:
    """The receiver's side of one attempt of ``push``: plan, then apply (what the trainer does)."""
    base = push.sequence_base
    plan = receiver.plan_receive(sender, incarnation, push.sequence, push.weights, base)
    receiver.apply_receive(sender, incarnation, push.sequence, plan, base)
    return plan


# -- sending: reserve, commit, return ---------------------------------------------------
def test_push_reserves_half_and_removes_weight_only_when_acknowledged():
    node = make()
    [push] = node.on_step_end()
    assert push == Push("b", 1, {0: 0.5, 1: 0.5})
    assert push.key == ("b", 1)
    assert node.weights == [1.0, 1.0]
    assert node.reserved == [0.5, 0.5]
    assert node.available(0) == node.available(1) == 0.5
    assert node.in_flight == {("b", 1): push}
    assert node.settle(push.key, [0, 1]) == []
    assert node.weights == [0.5, 0.5]
    assert node.reserved == [0.0, 0.0]
    assert node.in_flight == {}


def test_second_push_goes_to_the_other_peer_with_half_of_the_remaining_available_weight():
    node = make(peers=("b", "c"), max_in_flight=2)
    [first] = node.on_step_end()
    [second] = node.on_step_end()
    assert {first.peer, second.peer} == {"b", "c"}
    assert first.sequence == second.sequence == 1  # two edges, each at its first push
    assert second.weights == {0: 0.25, 1: 0.25}
    assert node.reserved == [0.75, 0.75]
    node.settle(second.key, [0, 1])
    node.settle(first.key, [0, 1])
    assert node.weights == [0.25, 0.25]
    assert node.reserved == [0.0, 0.0]


def test_partial_ack_commits_acknowledged_segments_and_returns_the_rest():
    node = make(num_segments=3)
    [push] = node.on_step_end()
    merges = node.settle(push.key, [1])
    assert node.weights == [1.0, 0.5, 1.0]
    assert node.reserved == [0.0, 0.0, 0.0]
    assert node.in_flight == {}
    # the unacknowledged halves come home with the snapshot they left with
    assert merges == [FoldBack("b", 1, 0, 0.5), FoldBack("b", 1, 2, 0.5)]


def test_failed_push_returns_the_whole_reservation_with_its_snapshot():
    node = make()
    [push] = node.on_step_end()
    merges = node.settle(push.key, ())
    assert merges == [
        FoldBack("b", 1, 0, 0.5),
        FoldBack("b", 1, 1, 0.5),
    ]  # alpha = sent / available
    assert node.weights == [1.0, 1.0]
    assert node.reserved == [0.0, 0.0]
    assert node.in_flight == {}
    assert node.available(0) == 1.0


def test_ack_or_failure_of_an_unknown_or_settled_push_changes_nothing():
    node = make(peers=("b", "c"), max_in_flight=2)
    [first] = node.on_step_end()
    [second] = node.on_step_end()  # stays in flight throughout
    node.settle(first.key, [0, 1])
    state = snapshot(node)
    assert node.settle(first.key, [0, 1]) == []  # duplicated ack
    assert node.settle(first.key, ()) == []  # late failure report
    assert node.settle((second.peer, second.sequence + 1), [0]) == []  # not sent yet
    assert node.settle((first.peer, 999), [0]) == []
    assert node.settle(("zzz", second.sequence), ()) == []  # right number, wrong peer
    assert snapshot(node) == state
    assert node.in_flight == {second.key: second}


def test_leave_hands_over_all_available_weight_to_the_chosen_peer():
    node = make(peers=("b", "c"))
    [first] = node.on_step_end()
    push = node.hand_off("c" if first.peer == "b" else "b")
    assert push is not None and push.peer != first.peer
    assert push.weights == {0: 0.5, 1: 0.5}  # everything not already reserved
    assert [node.available(s) for s in range(2)] == [0.0, 0.0]
    node.settle(first.key, [0, 1])
    node.settle(push.key, [0, 1])
    assert node.weights == [0.0, 0.0]
    assert node.reserved == [0.0, 0.0]


def test_leave_without_explicit_peer_picks_a_live_peer_and_none_without_peers():
    node = make(peers=("b", "c"), seed=3)
    push = node.hand_off()
    assert push is not None and push.peer in {"b", "c"}
    assert push.weights == {0: 1.0, 1: 1.0}
    assert make(peers=()).hand_off() is None


def test_leave_to_self_is_refused():
    with pytest.raises(ValueError, match="itself"):
        make().hand_off("a")


def test_leave_with_nothing_available_sends_nothing():
    node = make(initial_weight=0.0)
    assert node.hand_off("b") is None
    assert node.in_flight == {}


def test_leave_hands_over_weight_even_to_a_busy_peer_with_max_in_flight_outstanding():
    node = make(max_in_flight=1)
    [first] = node.on_step_end()
    assert node.on_step_end() == []
    push = node.hand_off("b")
    assert push is not None and push.weights == {0: 0.5, 1: 0.5}
    assert push.key == ("b", 2)  # the next number on that edge, never a reused key
    assert set(node.in_flight) == {first.key, push.key}


def test_node_with_zero_weight_never_pushes():
    node = make(initial_weight=0.0)
    for _ in range(100):
        assert node.on_step_end() == []
    assert node.in_flight == {}
    assert node.reserved == [0.0, 0.0]


def test_node_whose_weight_is_all_reserved_does_not_push_even_to_an_idle_peer():
    node = make(peers=("b", "c"), max_in_flight=8)
    node.hand_off("b")
    assert node.busy_peers() == {"b"}  # c is idle and a slot is free: only the weight is missing
    for _ in range(20):
        assert node.on_step_end() == []
    assert len(node.in_flight) == 1


# -- per-edge sequences, per-peer and total in-flight limits ---------------------------
def test_sequences_are_per_edge_and_count_1_2_3_for_each_receiver():
    node = make(peers=("b", "c", "d"), max_in_flight=3, seed=5)
    sent: dict[str, list[int]] = {"b": [], "c": [], "d": []}
    for _ in range(60):
        for push in node.on_step_end():
            sent[push.peer].append(push.sequence)
        for key in list(node.in_flight):
            node.settle(key, [0, 1])
    for peer, sequences in sent.items():
        assert sequences == list(range(1, len(sequences) + 1)), peer
    assert all(len(sequences) >= 5 for sequences in sent.values()), sent


def test_a_retried_failure_does_not_reuse_the_sequence_of_the_failed_push():
    node = make()
    [first] = node.on_step_end()
    node.settle(first.key, ())
    [second] = node.on_step_end()
    assert second.key == ("b", 2)


@pytest.mark.parametrize("seed", range(10))
def test_with_one_of_two_peers_busy_the_next_push_goes_to_the_other(seed):
    node = make(peers=("b", "c"), max_in_flight=8, seed=seed)
    [first] = node.on_step_end()
    [second] = node.on_step_end()
    assert second.peer == ({"b", "c"} - {first.peer}).pop()
    assert node.busy_peers() == {"b", "c"}
    for _ in range(20):
        assert node.on_step_end() == []  # every peer busy: none, though slots are free
    node.settle(first.key, [0, 1])
    [third] = node.on_step_end()
    assert third.key == (first.peer, 2)


def test_max_in_flight_caps_unacknowledged_pushes_in_total_across_idle_peers():
    node = make(peers=("b", "c", "d", "e", "f"), max_in_flight=2)
    pushes = [push for _ in range(2) for push in node.on_step_end()]
    assert len(pushes) == 2
    state = snapshot(node)
    for _ in range(20):
        assert node.on_step_end() == []  # three idle peers, no free slot
    assert snapshot(node) == state  # a skipped turn does not even draw from the rng
    node.settle(pushes[0].key, [0, 1])
    [nxt] = node.on_step_end()
    assert nxt.peer != pushes[1].peer
    assert len(node.in_flight) == 2


def test_node_with_max_in_flight_unacknowledged_pushes_skips_its_turn():
    node = make(peers=("b", "c", "d"), max_in_flight=1)
    [push] = node.on_step_end()
    state = (list(node.weights), list(node.reserved))
    for _ in range(10):
        assert node.on_step_end() == []
    assert (node.weights, node.reserved) == state
    node.settle(push.key, [0, 1])
    [nxt] = node.on_step_end()
    assert nxt.sequence == (2 if nxt.peer == push.peer else 1)


def test_failed_push_frees_its_in_flight_slot_and_its_peer():
    node = make(peers=("b", "c", "d"), max_in_flight=2)
    [first] = node.on_step_end()
    [second] = node.on_step_end()
    assert node.on_step_end() == []
    node.settle(first.key, ())
    assert first.peer not in node.busy_peers()
    assert len(node.on_step_end()) == 1
    assert second.key in node.in_flight


@pytest.mark.parametrize("max_in_flight", [0, -1])
def test_max_in_flight_below_one_is_refused(max_in_flight):
    with pytest.raises(ValueError, match="max_in_flight"):
        make(max_in_flight=max_in_flight)


# -- reservations never strand weight ---------------------------------------------------
@pytest.mark.parametrize("newest_first", [False, True])
def test_rounding_remainders_of_reservations_are_reset_so_tiny_weights_still_push(newest_first):
    """Weight is never stranded in a reservation (docs/design.md §6), not even by float rounding.

    Two overlapping pushes reserve fl(w/2 + w/4); for w = 0.1 releasing w/2 and w/4
    leaves an ulp-sized remainder. Kept, it would outlive the weight as the weight
    shrinks (x1/4 per round) and block every push; the core resets it to 0.0. The
    shadow ledger proves the schedule really produces such a remainder.
    """
    # b and c never push back: with the sink watch on they would rightly be suspected
    # after 25 pushes each (tests/test_sink_statistic_sim.py); this is about rounding.
    node = make(
        num_segments=1, peers=("b", "c"), max_in_flight=2, initial_weight=0.1, sink_bound=math.inf
    )
    shadow = 0.0  # what the reservation would be without the reset
    remainders = 0
    for _ in range(450):
        pushes = [push for _ in range(2) for push in node.on_step_end()]
        assert len(pushes) == 2, f"weight {node.weights} could not push"
        for push in pushes:
            shadow += push.weights[0]
        for push in reversed(pushes) if newest_first else pushes:
            node.settle(push.key, [0])
            shadow = max(shadow - push.weights[0], 0.0)
        remainders += shadow != 0.0
        assert node.reserved == [0.0]  # exactly, not approximately
        assert node.in_flight == {}
    assert remainders > 0, "the schedule never produced a rounding remainder"
    assert shadow > node.weights[0] > 0.0  # a kept remainder would now block every push
    assert node.available(0) == node.weights[0]
    assert len(node.on_step_end()) == 1


def test_a_failed_push_also_resets_the_reservation_to_exactly_zero():
    node = make(  # one-way pushes, as above: no sink watch
        num_segments=1, peers=("b", "c"), max_in_flight=2, initial_weight=0.3, sink_bound=math.inf
    )
    for _ in range(200):
        pushes = [push for _ in range(2) for push in node.on_step_end()]
        node.settle(pushes[0].key, ())
        node.settle(pushes[1].key, [0])
        assert node.reserved == [0.0]
    assert node.weights[0] > 0.0


_sender_ops = st.lists(
    st.one_of(
        st.tuples(st.just("step")),
        st.tuples(st.just("ack"), st.integers(0, 7), st.sets(st.integers(0, 2))),
        st.tuples(st.just("fail"), st.integers(0, 7)),
        st.tuples(st.just("receive"), st.floats(0.0, 3.0), st.integers(0, 2)),
        st.tuples(st.just("down"), st.sampled_from(["b", "c", "d"])),
        st.tuples(st.just("up"), st.sampled_from(["b", "c", "d"])),
    ),
    max_size=120,
)


@PROPERTY
@given(
    ops=_sender_ops,
    max_in_flight=st.integers(1, 4),
    initial_weight=st.floats(0.0, 3.0),
)
def test_every_schedule_of_pushes_acks_and_failures_settles_reservations_to_exactly_zero(
    ops, max_in_flight, initial_weight
):
    """Per-peer and total in-flight limits hold at every step, weight stays accounted for,
    and once nothing is in flight no reservation (not even a remainder) is left."""
    node = make(
        num_segments=3,
        peers=("b", "c", "d"),
        max_in_flight=max_in_flight,
        initial_weight=initial_weight,
    )
    total = [initial_weight] * 3  # Σ weights the node should hold, with its pushes settled
    sequences: dict[str, int] = {}
    received = 0
    for op in ops:
        keys = sorted(node.in_flight)
        if op[0] == "step":
            busy = node.busy_peers()
            for push in node.on_step_end():
                assert push.peer in node.peers and push.peer not in busy
                assert push.sequence == sequences.get(push.peer, 0) + 1
                sequences[push.peer] = push.sequence
        elif op[0] == "ack" and keys:
            push = node.in_flight[keys[op[1] % len(keys)]]
            node.settle(push.key, op[2])
            for s in op[2]:
                total[s] -= push.weights[s]
        elif op[0] == "fail" and keys:
            node.settle(keys[op[1] % len(keys)], ())
        elif op[0] == "receive":
            received += 1
            node.on_message("x", 0, received, op[2], op[1])
            total[op[2]] += op[1]
        elif op[0] == "down":
            node.on_peer_down(op[1])
        elif op[0] == "up":
            node.on_peer_up(op[1])
        assert len(node.in_flight) <= max_in_flight
        assert len(node.busy_peers()) == len(node.in_flight)
        for s in range(3):
            # the reservation is exactly what the pushes in flight carry, never a clamped guess
            carried = math.fsum(p.weights[s] for p in node.in_flight.values())
            assert math.isclose(node.reserved[s], carried, rel_tol=1e-9, abs_tol=1e-12), (
                s,
                node.reserved,
                carried,
            )
            assert node.available(s) >= -1e-12
            settled = node.weights[s] - math.fsum(p.weights[s] for p in node.in_flight.values())
            assert math.isclose(settled, node.available(s), rel_tol=1e-9, abs_tol=1e-12)
            assert math.isclose(node.weights[s], total[s], rel_tol=1e-9, abs_tol=1e-12)
        if not node.in_flight:
            assert node.reserved == [0.0, 0.0, 0.0]
    for key in sorted(node.in_flight):
        node.settle(key, ())
    assert node.reserved == [0.0, 0.0, 0.0]
    for peer in ("b", "c", "d"):
        node.on_peer_up(peer)
    if max(node.weights) > 1e-300:  # half of a subnormal can round to nothing
        assert len(node.on_step_end()) == 1


# -- receiving: merge, de-duplicate, refuse ---------------------------------------------
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


def test_plan_receive_changes_nothing_until_applied():
    node = make(peers=())
    node.on_message("b", 0, 1, 0, 0.25)
    state = snapshot(node)
    plan = node.plan_receive("b", 0, 2, {0: 0.5, 1: 0.25})
    assert plan == [Merge(0, 0.5 / 1.75, 1.75), Merge(1, 0.25 / 1.25, 1.25)]
    assert node.plan_receive("b", 0, 1, {0: 0.25}) == [Duplicate(0)]
    with pytest.raises(Refused):
        node.plan_receive("b", 0, 2, {0: math.nan})
    assert snapshot(node) == state
    # an abandoned plan (the driver found a non-finite merged value) leaves no trace
    assert node.plan_receive("b", 0, 2, {0: 0.5, 1: 0.25}) == plan
    node.apply_receive("b", 0, 2, plan)
    assert node.weights == [1.75, 1.25]
    assert deliver(node, "b", Push("a", 2, {0: 0.5, 1: 0.25})) == [Duplicate(0), Duplicate(1)]
    assert node.weights == [1.75, 1.25]


def test_a_push_with_one_invalid_segment_is_refused_whole():
    node = make(num_segments=3, peers=())
    state = snapshot(node)
    with pytest.raises(Refused, match="segment 2"):
        node.plan_receive("b", 0, 1, {0: 0.5, 1: 0.5, 2: math.inf})
    with pytest.raises(Refused, match="segment 7 out of range"):
        node.plan_receive("b", 0, 1, {0: 0.5, 7: 0.5})
    assert snapshot(node) == state
    assert deliver(node, "b", Push("a", 1, {0: 0.5, 1: 0.5, 2: 0.5})) == [
        Merge(s, 0.5 / 1.5, 1.5) for s in range(3)
    ]


def test_duplicate_delivery_returns_duplicate_and_changes_nothing():
    node = make(peers=())
    assert isinstance(node.on_message("b", 0, 7, 1, 0.25), Merge)
    state = snapshot(node)
    assert node.on_message("b", 0, 7, 1, 0.25) == Duplicate(1)
    assert snapshot(node) == state
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


def test_within_the_window_only_merged_segments_are_duplicates_and_a_late_one_merges():
    """Only a segment this node really merged is answered DUPLICATE: an answer of
    DUPLICATE makes the sender commit, so a false one would destroy weight."""
    node = make(num_segments=1, peers=())
    node.on_message("b", 0, 1, 0, 0.5)
    for sequence in range(3, DEDUP_WINDOW + 1):  # push 2 is still on its way
        node.on_message("b", 0, sequence, 0, 0.0)
    weights = list(node.weights)
    assert node.on_message("b", 0, 1, 0, 0.5) == Duplicate(0)  # retry, its ack was lost
    assert node.weights == weights
    assert node.on_message("b", 0, 2, 0, 0.25) == Merge(0, 0.25 / 1.75, 1.75)


def test_retry_older_than_dedup_window_is_refused_never_merged_again_nor_acknowledged():
    """A retry older than the window is neither merged again (that would create mass)
    nor answered DUPLICATE (the node no longer knows it merged it): it is refused and
    changes nothing. One push in flight per edge means an honest sender never sees this."""
    node = make(num_segments=1, peers=())
    node.on_message("b", 0, 1, 0, 0.5)
    for sequence in range(2, DEDUP_WINDOW + 2):
        node.on_message("b", 0, sequence, 0, 0.0)
    weights = list(node.weights)
    with pytest.raises(Refused, match="older than this node remembers"):
        node.on_message("b", 0, 1, 0, 0.5)  # the retry of push 1, its ack was lost
    assert node.weights == weights


def test_dedup_memory_per_sender_is_bounded_by_the_window_times_segments():
    node = make(num_segments=2, peers=())
    for sequence in range(1, 3 * DEDUP_WINDOW):
        for segment in range(2):
            node.on_message("b", 0, sequence, segment, 0.0)
    window = node._seen[("b", 0, 1)]
    assert len(window.seen) == len(window.order) == 2 * DEDUP_WINDOW
    assert node.on_message("b", 0, 3 * DEDUP_WINDOW - 1, 1, 0.5) == Duplicate(1)


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


@pytest.mark.parametrize("weight", [-1e-300, -1.0, math.nan, math.inf, -math.inf, 1e3 + 1e-9])
def test_weight_not_finite_or_lifting_the_result_over_max_weight_is_refused_and_changes_nothing(
    weight,
):
    node = make(max_weight=1e3)
    node.on_step_end()  # something reserved: must stay as it is
    node.on_message("b", 0, 1, 0, 0.5)  # a window exists: must stay as it is
    state = snapshot(node)
    with pytest.raises(Refused, match=str(weight).replace("+", r"\+")):
        node.on_message("b", 0, 2, 0, weight)
    with pytest.raises(Refused, match=r"not a finite number|max_sum_weight"):
        node.plan_receive("b", 0, 2, {1: 0.5, 0: weight})
    assert snapshot(node) == state
    assert isinstance(node.on_message("b", 0, 2, 0, 0.5), Merge)  # not remembered as seen


def test_merge_whose_result_equals_max_weight_is_merged_and_one_above_is_refused():
    """Issue 12: 60 pushes of 1e6, each under the per-message cap, gave a node 6.2e7;
    the cap is on the weight a merge leaves, so the sum of many pushes cannot pass it."""
    node = make(max_weight=1e3, peers=())
    assert node.on_message("b", 0, 1, 0, 999.0) == Merge(0, 999.0 / 1000.0, 1000.0)
    with pytest.raises(WeightCapExceeded, match="max_sum_weight"):
        node.on_message("b", 0, 2, 0, 1e-9)
    assert node.weights[0] == 1000.0


@pytest.mark.parametrize("segment", [-1, 2, 100])
def test_message_for_segment_out_of_range_is_refused_with_its_index(segment):
    node = make(peers=())
    with pytest.raises(Refused, match=rf"segment {segment} out of range 0\.\.1"):
        node.on_message("b", 0, 1, segment, 0.5)
    assert node.weights == [1.0, 1.0]


# -- sequences too far ahead --------------------------------------------------------------
def test_sequence_more_than_sequence_ahead_beyond_the_highest_is_refused_without_moving_window():
    node = make(num_segments=1, peers=())
    node.on_message("b", 0, 10, 0, 0.5)
    state = snapshot(node)
    for sequence in (10 + SEQUENCE_AHEAD + 1, 2**62, 2**64 + 5):
        with pytest.raises(Refused, match=f"sequence {sequence} is more than"):
            node.on_message("b", 0, sequence, 0, 0.5)
        with pytest.raises(Refused):
            node.on_message("b", 0, sequence, 0, math.nan)  # refused first for the sequence
    assert snapshot(node) == state
    # the refused numbers were never remembered: later real pushes merge, not DUPLICATE
    assert isinstance(node.on_message("b", 0, 11, 0, 0.5), Merge)
    assert isinstance(node.on_message("b", 0, 11 + SEQUENCE_AHEAD, 0, 0.5), Merge)  # boundary
    assert isinstance(node.on_message("b", 0, 12, 0, 0.5), Merge)  # below highest, unseen
    # other senders and incarnations have windows of their own, which start at 0: a
    # first sequence may be at most SEQUENCE_AHEAD
    assert isinstance(node.on_message("c", 0, SEQUENCE_AHEAD, 0, 0.5), Merge)
    with pytest.raises(Refused, match="more than"):
        node.on_message("d", 0, SEQUENCE_AHEAD + 1, 0, 0.5)


def test_forged_run_of_huge_sequences_cannot_make_later_real_pushes_duplicates():
    """The observed attack: 8,193 pushes as b with sequences 2^62+i, then b's own pushes."""
    node = make(num_segments=1, peers=())
    assert isinstance(node.on_message("b", 0, 1, 0, 0.5), Merge)  # b's real first push
    state = snapshot(node)
    for i in range(2 * DEDUP_WINDOW + 1):
        with pytest.raises(Refused):
            node.on_message("b", 0, 2**62 + i, 0, 0.0)
    assert snapshot(node) == state
    for sequence in range(2, 12):
        assert isinstance(node.on_message("b", 0, sequence, 0, 0.5), Merge), sequence
    assert node.weights[0] == 1.0 + 11 * 0.5


def test_forged_run_of_huge_sequences_before_the_real_first_push_cannot_make_it_a_duplicate():
    node = make(num_segments=1, peers=())
    for i in range(2 * DEDUP_WINDOW + 1):
        with contextlib.suppress(Refused):
            node.on_message("b", 0, 2**62 + i, 0, 0.0)
    weights = list(node.weights)
    action = node.on_message("b", 0, 1, 0, 0.5)  # b's real first push
    assert isinstance(action, Merge), f"never merged, answered {action}: the sender commits"
    assert node.weights[0] == weights[0] + 0.5


def test_forged_sequences_each_within_sequence_ahead_never_make_real_pushes_duplicates():
    node = make(num_segments=1, peers=())
    assert isinstance(node.on_message("b", 0, 1, 0, 0.5), Merge)
    for i in range(1, DEDUP_WINDOW + 2):
        with contextlib.suppress(Refused):
            node.on_message("b", 0, 1 + i * SEQUENCE_AHEAD, 0, 0.0)
    # Without certificates a forger who passes as b can push b's window along; what it
    # must never achieve is a DUPLICATE for a push that was not merged (b would commit
    # weight nobody holds). b's real push is merged or refused (b then folds it back).
    weights = list(node.weights)
    try:
        action = node.on_message("b", 0, 2, 0, 0.5)  # b's real second push
    except Refused:
        assert node.weights == weights
    else:
        assert isinstance(action, Merge), f"never merged, answered {action}: b commits"


_receive_ops = st.lists(
    st.tuples(
        st.sampled_from(["b", "c"]),
        st.integers(0, 1),
        st.one_of(
            st.integers(1, 30),
            st.integers(1, 30).map(lambda k: k + SEQUENCE_AHEAD),
            st.just(2**62),
        ),
        st.dictionaries(
            st.integers(0, 2),
            st.one_of(
                st.sampled_from([0.0, 0.25, 1.5, 8.0]),
                st.sampled_from([8.5, -0.5, math.inf, math.nan]),
            ),
            min_size=1,
            max_size=2,
        ),
        st.sampled_from([True, True, False]),  # the driver applies the plan or abandons it
    ),
    min_size=10,
    max_size=80,
)


@PROPERTY
@given(ops=_receive_ops)
def test_receiver_answers_duplicate_exactly_for_segments_it_merged_before(ops):
    """Reference model: DUPLICATE iff that (sender, incarnation, sequence, segment) was
    merged; Refused iff a weight is negative, or merging a new segment would lift its weight
    over max_weight (the cap is on the result, not the message), or the sequence is more than
    SEQUENCE_AHEAD beyond the highest merged from that sender incarnation (0 before the
    first); a refused or abandoned plan changes nothing."""
    node = make(num_segments=3, peers=(), max_weight=8.0)
    merged: set[tuple[str, int, int, int]] = set()
    highest: dict[tuple[str, int], int] = {}
    for sender, incarnation, sequence, weights, apply in ops:
        state = snapshot(node)
        top = highest.get((sender, incarnation))
        over_cap = any(
            node.weights[s] + w > 8.0
            for s, w in weights.items()
            if (sender, incarnation, sequence, s) not in merged
        )
        refuse = (
            sequence > (top or 0) + SEQUENCE_AHEAD
            or not all(w >= 0.0 for w in weights.values())
            or over_cap
        )
        if refuse:
            with pytest.raises(Refused):
                node.plan_receive(sender, incarnation, sequence, weights)
            assert snapshot(node) == state
            continue
        plan = node.plan_receive(sender, incarnation, sequence, weights)
        assert snapshot(node) == state
        for action, (segment, w) in zip(plan, weights.items(), strict=True):
            assert action.segment == segment
            if (sender, incarnation, sequence, segment) in merged:
                assert action == Duplicate(segment)
            else:
                assert isinstance(action, Merge)
                assert action.weight_after == node.weights[segment] + w
        if not apply:
            continue
        before = list(node.weights)
        node.apply_receive(sender, incarnation, sequence, plan)
        for action in plan:
            if isinstance(action, Merge):
                merged.add((sender, incarnation, sequence, action.segment))
                highest[(sender, incarnation)] = max(top or sequence, sequence)
                assert node.weights[action.segment] == action.weight_after
            else:
                assert node.weights[action.segment] == before[action.segment]


# -- the mass bound (module docstring) ------------------------------------------------------
def pair() -> tuple[SumWeightGossip, SumWeightGossip]:
    return make("a", 2, peers=("b",)), make("b", 2, peers=("a",))


def test_lost_ack_then_retry_with_same_sequence_is_duplicate_and_keeps_the_sum_exact():
    a, b = pair()
    [push] = a.on_step_end()
    assert all(isinstance(x, Merge) for x in deliver(b, "a", push))
    # the acknowledgement is lost; a retries the same push with the same number
    assert deliver(b, "a", push) == [Duplicate(0), Duplicate(1)]
    assert b.on_message("a", 0, push.sequence, 1, push.weights[1]) == Duplicate(1)
    a.settle(push.key, [0, 1])
    assert a.settle(push.key, [0, 1]) == []  # the first attempt's ack, late
    for s in range(2):
        assert a.weights[s] + b.weights[s] == 2.0
        assert (a.weights[s], b.weights[s]) == (0.5, 1.5)


def test_merged_then_declared_dead_exceeds_the_total_by_exactly_that_push():
    """The one error the module allows: b merged, then a declared b dead before the
    acknowledgement and folded the push back. That push's weight then exists twice."""
    a, b = pair()
    a.weights = [0.7, 1.3]
    b.weights = [0.9, 0.2]
    total = [a.weights[s] + b.weights[s] for s in range(2)]
    [push] = a.on_step_end()
    deliver(b, "a", push)
    a.settle(push.key, ())  # b declared dead; its acknowledgement never arrives
    assert a.reserved == [0.0, 0.0]
    for s in range(2):
        excess = a.weights[s] + b.weights[s] - total[s]
        assert math.isclose(excess, push.weights[s], rel_tol=1e-15)
        assert a.weights[s] == [0.7, 1.3][s]  # all of it back home
    # b, back, answers a's next push (a new number) with a merge, not a DUPLICATE
    [nxt] = a.on_step_end()
    assert nxt.key == ("b", 2)
    assert all(isinstance(x, Merge) for x in deliver(b, "a", nxt))


_outcomes = st.sampled_from(["acked", "ack_lost_then_retry", "refused", "merged_then_dead"])


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    outcomes=st.lists(_outcomes, max_size=60),
    weights=st.lists(st.floats(0.0, 4.0), min_size=3, max_size=3),
)
def test_sum_of_weights_exceeds_the_total_by_exactly_the_pushes_merged_then_declared_dead(
    seed, outcomes, weights
):
    """Acks lost and retried keep Σw exact; a push refused before merging keeps it exact;
    only a push merged by a receiver later declared dead adds its weight, once."""
    rng = random.Random(seed)
    ids = ["a", "b", "c"]
    nodes = {
        i: make(i, 2, peers=[j for j in ids if j != i], max_in_flight=2, initial_weight=w)
        for i, w in zip(ids, weights, strict=True)
    }
    total = [math.fsum(weights)] * 2
    excess = [0.0, 0.0]
    for outcome in outcomes:
        sender = nodes[rng.choice(ids)]
        pushes = sender.on_step_end()
        if not pushes:
            continue
        [push] = pushes
        receiver = nodes[push.peer]
        if outcome == "refused":  # e.g. the receiver was busy: it merged nothing
            sender.settle(push.key, ())
        else:
            deliver(receiver, sender.node_id, push)
            if outcome == "ack_lost_then_retry":
                assert all(
                    isinstance(x, Duplicate) for x in deliver(receiver, sender.node_id, push)
                )
            if outcome == "merged_then_dead":
                sender.settle(push.key, ())
                excess = [excess[s] + push.weights[s] for s in range(2)]
            else:
                sender.settle(push.key, list(push.weights))
        for s in range(2):
            held = math.fsum(node.weights[s] for node in nodes.values())
            assert math.isclose(held, total[s] + excess[s], rel_tol=1e-12, abs_tol=1e-12)
    assert all(node.reserved == [0.0, 0.0] for node in nodes.values())


# -- constructor and rng ------------------------------------------------------------------
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
        node.settle(push.key, [0, 1])
        assert node.weights[0] == 0.5**k


def test_push_probability_half_pushes_about_half_of_the_steps():
    node = make(p=0.5, peers=("b", "c"), seed=1)
    pushed = 0
    for _ in range(4000):
        for push in node.on_step_end():
            pushed += 1
            node.settle(push.key, ())
    assert 1800 < pushed < 2200


def test_no_self_peer_is_ever_chosen():
    node = make(node_id="a", peers=("a", "b", "c"))
    assert node.peers == {"b", "c"}
    for _ in range(500):
        for push in node.on_step_end():
            assert push.peer != "a"
            node.settle(push.key, ())
    alone = make(node_id="a", peers=("a",))
    assert alone.peers == set()
    assert alone.on_step_end() == []
    assert alone.hand_off() is None


def test_pushes_go_only_to_live_peers_and_reach_every_one_of_them():
    node = make(peers=("b", "c", "d"))
    node.on_peer_down("c")
    node.on_peer_down("zzz")  # unknown peer: no error
    targets = set()
    for _ in range(300):
        for push in node.on_step_end():
            targets.add(push.peer)
            node.settle(push.key, ())
    assert targets == {"b", "d"}


def test_same_rng_seed_gives_the_same_pushes():
    def trace(seed):
        node = make(peers=("b", "c", "d", "e"), p=0.5, seed=seed)
        out = []
        for _ in range(200):
            for push in node.on_step_end():
                out.append((push.peer, push.sequence))
                node.settle(push.key, [0, 1])
        return out

    assert trace(11) == trace(11)
    assert trace(11) != trace(12)


# -- a receiver restarted from a checkpoint ------------------------------------------------
def test_a_restored_receiver_answers_each_push_by_what_its_checkpoint_holds():
    """Before the checkpoint: DUPLICATE (its model holds it); after it: merged again (the
    crash lost that merge); a new push after the restart: merged, in a new numbering."""
    sender, receiver = make("a", 1, peers=("b",)), make("b", 1, peers=("a",))
    before = sender.push_share("b", 0.5)
    deliver(receiver, "a", before)
    sender.settle(before.key, (0,))
    saved = receiver.state_dict()
    after = sender.push_share("b", 0.5)
    deliver(receiver, "a", after)  # merged, then the receiver crashes before acknowledging
    restored = make("b", 1, peers=("a",))
    restored.load_state_dict(saved)
    sender.on_peer_restarted("b", 1)
    assert deliver(restored, "a", before) == [Duplicate(0)]
    assert isinstance(deliver(restored, "a", after)[0], Merge)  # the retry lands again
    sender.settle(after.key, (0,))
    new = sender.push_share("b", 0.5)
    assert new.sequence == after.sequence + 1 and new.sequence_base == new.sequence
    assert isinstance(deliver(restored, "a", new)[0], Merge)
    sender.settle(new.key, (0,))
    assert sender.weights[0] + restored.weights[0] == pytest.approx(2.0, abs=1e-15)


def test_a_new_numbering_starts_when_the_receiver_leaves_the_view_and_windows_stay_capped():
    from gossipd.node.protocols.ledger import NUMBERINGS_KEPT

    sender, receiver = make("a", 1, peers=("b",)), make("b", 1, peers=("a",))
    bases = []
    for _ in range(NUMBERINGS_KEPT + 3):
        push = sender.push_share("b", 0.5)
        bases.append(push.sequence_base)
        deliver(receiver, "a", push)
        sender.settle(push.key, (0,))
        sender.on_peer_down("b")
        sender.on_peer_up("b")
    assert bases == list(range(1, NUMBERINGS_KEPT + 4))
    assert len(receiver._seen) == NUMBERINGS_KEPT
    assert sender.weights[0] + receiver.weights[0] == pytest.approx(2.0, abs=1e-15)


def test_exchanged_accounts_per_peer_and_incarnation():
    sender, receiver = make("a", 2, peers=("b",)), make("b", 2, peers=("a",))
    push = sender.push_share("b", 0.5)
    deliver(receiver, "a", push)
    sender.settle(push.key, (0, 1))
    assert sender.status().exchanged["b"].sent == pytest.approx(1.0)
    assert receiver.status().exchanged["a"].received == pytest.approx(1.0)
    sender.on_peer_restarted("b", 5)
    mass = sender.status().exchanged["b"]
    assert (mass.sent, mass.sent_before) == (0.0, pytest.approx(1.0))
    restored = make("b", 2, peers=("a",))
    restored.load_state_dict(receiver.state_dict())
    assert restored.status().exchanged == receiver.status().exchanged
