"""An in-test driver for every registered push protocol core, driven as base.py says.

The harness runs N pure cores and one small numpy vector per node and segment. It
carries out their actions: a ``Push`` becomes ``PayloadArrived`` → ``PayloadMerged``
at the receiver and ``PushSettled`` back at the sender, with the blends and
fold-backs applied to the vectors exactly as the replica applies them to parameters.
Faults are injected at named moments by a seeded ``random.Random``: drops, duplicated
deliveries, reordering, pushes held across rounds, and a node killed in the middle of
a round. The harness also records, per round and segment, the weight-flow matrix the
cores' own pushes define, so the spectral claims (Crossover-SGD's Figure 6, consensus
rates) are checked on what the cores do, not on a re-implementation of what they
should do. Used by tests/test_protocol_cores.py, tests/test_protocol_cores_mass_and_state.py
and tests/test_persyn_epoch.py.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import numpy as np

from gossipd.node.protocols import PROTOCOLS, CoreSettings, build, keeps_weights, settings_class
from gossipd.node.protocols.base import (
    Duplicate,
    FoldBack,
    GossipProtocol,
    Merge,
    PayloadArrived,
    PayloadMerged,
    PeerRestarted,
    Push,
    PushSettled,
    Settle,
    SettleArrived,
    StartTimer,
    StepEnded,
    TimerFired,
    TrainingEnded,
    ViewChanged,
)

# The push protocols: every test here checks sum-weights (tests/test_overlap.py: the rest).
ALL_PROTOCOLS = sorted(p for p in PROTOCOLS if keeps_weights(p))
NEW_PROTOCOLS = ["crossover", "persyn", "pushsum-expgraph", "shuffle-exchange"]
STEP_S = 0.25  # the harness's step time: the driver's clock advances this much per step
EXACT = 1e-9  # conservation tolerance: float64 rounding over a few thousand merges


def core_settings(protocol: str, node: str, segments: int, **settings: float) -> CoreSettings:
    """``settings`` split into CoreSettings' fields and the protocol's own options (the tests
    give one dict to every protocol: a setting the protocol does not have is left out)."""
    common = {k: v for k, v in settings.items() if k in CoreSettings.__dataclass_fields__}
    takes = settings_class(protocol).model_fields
    options = {k: v for k, v in settings.items() if k in takes}
    return CoreSettings(node, segments, **common, options=options)


def node_ids(n: int) -> list[str]:
    """Zero-padded, so sorted order (the cores' rank order) is index order."""
    return [f"node-{i:03d}" for i in range(n)]


@dataclass(frozen=True)
class Faults:
    drop: float = 0.0  # the push never arrives; the sender is told nothing was acknowledged
    duplicate: float = 0.0  # merged, acknowledgement lost, retried: answered Duplicate
    hold: float = 0.0  # stays in the network past the next step (reordering across rounds)
    reorder: bool = False  # deliveries of one batch in random order


@dataclass(eq=False)
class Flight:
    sender: str
    push: Push
    snapshot: np.ndarray  # the sender's vectors (segments × dim) when the push left


class Harness:
    """N cores, their vectors and the network between them (no clocks, no threads)."""

    def __init__(
        self,
        protocol: str,
        n: int,
        *,
        segments: int = 1,
        dim: int = 2,
        seed: int = 0,
        x0: np.ndarray | None = None,
        **settings: float,
    ) -> None:
        self.ids = node_ids(n)
        self.protocol, self.settings = protocol, settings
        self.index = {node: i for i, node in enumerate(self.ids)}
        self.segments = segments
        self.cores: dict[str, GossipProtocol] = {
            node: build(
                protocol, core_settings(protocol, node, segments, seed=seed * 1000 + i, **settings)
            )
            for i, node in enumerate(self.ids)
        }
        if x0 is None:
            x0 = np.random.default_rng(seed).standard_normal((n, segments, dim))
        dim = x0.shape[2]
        self.x = dict(zip(self.ids, x0.copy(), strict=True))
        self.initial_mass = sum(self.x.values())  # every weight starts at 1
        self.expected_weight = np.full(segments, float(n))  # Σw the mesh must keep
        self.live = set(self.ids)
        self.flights: list[Flight] = []
        self.timers: list[tuple[float, str, str]] = []
        self.gone_weight = np.zeros(segments)  # weight that left with killed nodes
        self.gone_mass = np.zeros((segments, dim))  # and their Σ w·x
        self.flows: list[list[np.ndarray]] = []  # per step, per segment: weight-flow matrix
        self.duplicates = 0
        self.fold_backs = 0
        self.settles = 0  # Settles delivered
        self.set_view(frozenset(self.ids))

    # -- what the cores hold ---------------------------------------------------------
    def held(self, node: str) -> np.ndarray:
        return np.array(self.cores[node].status().weights)

    def available(self, node: str) -> np.ndarray:
        status = self.cores[node].status()
        return np.array(status.weights) - np.array(status.reserved)

    def total_weight(self) -> np.ndarray:
        """Σ held weight per segment (reservations are held until settled) + what left."""
        return sum((self.held(n) for n in self.live), self.gone_weight.copy())

    def total_mass(self) -> np.ndarray:
        """Σ available·x + Σ undelivered pushes' weight·snapshot + what left, per segment."""
        mass = self.gone_mass.copy()
        for node in self.live:
            mass += self.available(node)[:, None] * self.x[node]
        for f in self.flights:
            for s, w in f.push.weights.items():
                mass[s] += w * f.snapshot[s]
        return mass

    def check_conservation(self) -> None:
        np.testing.assert_allclose(self.total_weight(), self.expected_weight, rtol=0, atol=EXACT)
        np.testing.assert_allclose(self.total_mass(), self.initial_mass, rtol=0, atol=EXACT)

    def disagreement(self) -> float:
        """Largest distance of a live node's vectors from the initial mean."""
        mean = self.initial_mass / len(self.ids)
        return max(float(np.abs(self.x[n] - mean).max()) for n in self.live)

    # -- events in, actions carried out ---------------------------------------------
    def set_view(self, members: frozenset[str]) -> None:
        for node in sorted(self.live):
            self.carry_out(node, self.cores[node].handle(ViewChanged(members)))

    def carry_out(self, node: str, actions: list) -> None:
        for action in actions:
            if isinstance(action, Push):
                assert action.peer != node, "self-edge"
                assert action.peer in self.ids, f"push to unknown {action.peer}"
                self.flights.append(Flight(node, action, self.x[node].copy()))
            elif isinstance(action, StartTimer):
                heapq.heappush(self.timers, (action.at_s, node, action.tag))
            elif isinstance(action, Settle):  # weightless: delivered at once, if anyone is there
                if action.peer in self.live:
                    arrived = SettleArrived(node, 0, action.sequence_base, action.up_to)
                    assert self.cores[action.peer].handle(arrived) == []
                    self.settles += 1
            else:
                raise AssertionError(f"{node} asked for {action!r} outside a payload")

    def step(self, step: int) -> list[tuple[str, Push]]:
        """StepEnded at every live node: (sender, push) pairs; records the flow matrices."""
        n = len(self.ids)
        flows = [np.eye(n) for _ in range(self.segments)]
        pushes = []
        for node in sorted(self.live):
            before = self.available(node)
            actions = self.cores[node].handle(StepEnded(step, step * STEP_S))
            col = self.index[node]
            for push in (a for a in actions if isinstance(a, Push)):
                pushes.append((node, push))
                for s, w in push.weights.items():
                    share = w / before[s]
                    flows[s][self.index[push.peer], col] += share
                    flows[s][col, col] -= share
            self.carry_out(node, actions)
        self.flows.append(flows)
        return pushes

    def deliver(self, flight: Flight, *, drop: bool = False, duplicate: bool = False) -> None:
        self.flights.remove(flight)
        receiver = flight.push.peer
        if drop or receiver not in self.live:
            self.settle(flight, ())
            return
        core = self.cores[receiver]
        push = flight.push
        arrival = PayloadArrived(
            flight.sender,
            0,
            push.sequence,
            push.round,
            push.weights,
            push.sequence_base,
            push.settled,
        )
        plan = core.handle(arrival)
        assert all(isinstance(a, Merge) for a in plan), f"{flight.sender} -> {receiver}: {plan}"
        for merge in plan:
            s = merge.segment
            self.x[receiver][s] = (1 - merge.alpha) * self.x[receiver][s] + (
                merge.alpha * flight.snapshot[s]
            )
        core.handle(PayloadMerged(arrival))
        if duplicate:  # the acknowledgement was lost and the sender retried
            again = core.handle(arrival)
            assert again and all(isinstance(a, Duplicate) for a in again), again
            core.handle(PayloadMerged(arrival))
            self.duplicates += 1
        acked, held = tuple(push.weights), self.held(receiver)
        self.settle(flight, acked, tuple(float(held[s]) for s in acked))

    def settle(
        self, flight: Flight, acked: tuple[int, ...], reported: tuple[float, ...] = ()
    ) -> None:
        """``reported``: the receiver's weights after it merged, as its acks say."""
        sender = flight.sender
        settled = PushSettled(flight.push.peer, flight.push.sequence, acked, reported)
        for fold in self.cores[sender].handle(settled):
            if isinstance(fold, Settle):  # the sender's training is over: it closes at once
                self.carry_out(sender, [fold])
                continue
            assert isinstance(fold, FoldBack), fold
            s = fold.segment
            self.x[sender][s] = (1 - fold.alpha) * self.x[sender][s] + fold.alpha * (
                flight.snapshot[s]
            )
            self.fold_backs += 1

    def exchange(self, rng: random.Random | None = None, faults: Faults = Faults()) -> None:
        """Deliver what is in the network now: all in order, or as ``faults`` say."""
        batch = list(self.flights)
        if rng is not None and faults.reorder:
            rng.shuffle(batch)
        for flight in batch:
            if rng is not None and rng.random() < faults.hold:
                continue
            drop = rng is not None and rng.random() < faults.drop
            duplicate = rng is not None and rng.random() < faults.duplicate
            self.deliver(flight, drop=drop, duplicate=duplicate)
            if rng is not None:  # with faults, after every event; otherwise once a batch
                self.check_conservation()
        self.check_conservation()

    def kill(self, node: str) -> None:
        """``node`` dies: its weight and undelivered pushes leave with it; pushes to it fail."""
        self.gone_weight += self.held(node)
        self.gone_mass += self.available(node)[:, None] * self.x[node]
        for f in [f for f in self.flights if f.sender == node]:
            self.flights.remove(f)
            for s, w in f.push.weights.items():
                self.gone_mass[s] += w * f.snapshot[s]
        self.live.discard(node)
        for f in [f for f in self.flights if f.push.peer == node]:
            self.deliver(f)  # the receiver is gone: settled as failed, folded back
        self.set_view(frozenset(self.live))

    def crash_and_restore(self, node: str, state: dict, x: np.ndarray) -> None:
        """``node`` is killed and restarts from a checkpoint (``state``, ``x``).

        Its own pushes in flight die with it (their reservations vanish with its
        weights); pushes in flight to it stay in the network and reach the new
        incarnation, as the daemon retries them; every other node is told it restarted.
        The mesh's Σw and Σ w·x then change by exactly what the checkpoint lacks.
        """
        for f in [f for f in self.flights if f.sender == node]:
            self.flights.remove(f)
        restored = build(
            self.protocol, core_settings(self.protocol, node, self.segments, **self.settings)
        )
        restored.load_state_dict(state)
        restored.handle(ViewChanged(frozenset(self.live)))
        self.expected_weight += self.held_of(restored) - self.held(node)
        self.cores[node], self.x[node] = restored, x.copy()
        for other in sorted(self.live - {node}):
            self.cores[other].handle(PeerRestarted(node, 1))
        self.initial_mass = self.total_mass() - self.gone_mass

    @staticmethod
    def held_of(core: GossipProtocol) -> np.ndarray:
        return np.array(core.status().weights)

    def end_training(self, step: int) -> None:
        """TrainingEnded everywhere, then timers in time order, each batch delivered at once."""
        for node in sorted(self.live):
            self.carry_out(node, self.cores[node].handle(TrainingEnded(step, step * STEP_S)))
        self.exchange()
        while self.timers:
            at_s = self.timers[0][0]
            while self.timers and self.timers[0][0] == at_s:
                _, node, tag = heapq.heappop(self.timers)
                if node in self.live:
                    self.carry_out(node, self.cores[node].handle(TimerFired(tag, at_s)))
            self.exchange()

    def run_sync(self, steps: range) -> None:
        """Synchronous rounds: every push of a step is delivered before the next step."""
        for step in steps:
            self.step(step)
            self.exchange()


def settings_for(protocol: str) -> dict[str, float]:
    """Small periods so that every protocol acts within a few steps."""
    return {"round_steps": 1, "average_every_steps": 5, "mesh_seed": 11}
