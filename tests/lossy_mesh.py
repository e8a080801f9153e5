"""N sum-weight cores over a lossy, reordering network, with the ground truth beside them.

The sum-weight property tests (tests/test_sumweight_mass.py) drive N pure cores
through this tiny in-test network: a message queue whose order, duplicates, drops and
sender time-outs are chosen by a seeded ``random.Random``. Every event reaches a core
through ``handle()`` (tests/sumweight_events.py), one segment of a push at a time.
The mesh knows the ground truth (which segment of which push the receiver really
merged), so it checks the invariants of docs/design.md §5 and §8 after every event,
not only at the end.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import numpy as np

from gossipd.node.protocols.base import Duplicate, Merge, Push
from gossipd.node.protocols.sumweight import SumWeightGossip
from tests.sumweight_events import hand_off, numbered, peer_down, receive, settle, step, view

REL = 1e-12
ABS = 1e-12
INCARNATION = 0


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
            view(node, *self.ids)  # includes itself, as a driver's view does
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
        self.sequences: dict[int, dict[str, int]] = {}  # per sender: sumweight_events.numbered

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
        for push in step(node):
            assert push.peer not in busy, "a second push to a peer that had one in flight"
            numbered(push, self.sequences.setdefault(i, {}))
            self._register(i, push)
        assert len(node.in_flight) <= node.max_in_flight
        assert len(node.busy_peers()) == len(node.in_flight), "two pushes in flight to one peer"

    def leave(self, i: int) -> None:
        node = self.nodes[i]
        available = [node.available(s) for s in range(self.num_segments)]
        push = hand_off(node)
        self.left.add(i)
        for j in range(len(self.nodes)):
            if j != i:
                peer_down(self.nodes[j], self.ids[i])
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
        action = receive(
            node, self.ids[f.sender], INCARNATION, f.push.sequence, s, f.push.weights[s]
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
        settle(node, f.push.key, segments)
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
            for merge in settle(sender, f.push.key, ()):
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
