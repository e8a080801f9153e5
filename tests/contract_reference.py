"""The contract suite's reference driver: the smallest driver that keeps every promise of
``node/protocols/base.py``, with a FIFO network and a virtual clock.

It answers every push a second time, as after a lost acknowledgement, and requires the
core to answer ``Duplicate``; pulls merge at the step boundary they are due at. The
simulator and the daemon must end where it ends (tests/test_driver_contract.py).
"""

from __future__ import annotations

import numpy as np

from gossipd.node.model.outer import OuterNesterov
from gossipd.node.protocols import build
from gossipd.node.protocols.base import (
    Action,
    Duplicate,
    FoldBack,
    Merge,
    OuterStep,
    PayloadArrived,
    PayloadMerged,
    Pull,
    PullArrived,
    PullMerged,
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
from tests.contract_scripts import DIM, SEGMENTS, Script, initial_vectors, settings_for


class Reference:
    """The smallest driver that keeps every promise: a FIFO network, a virtual clock."""

    def __init__(self, script: Script) -> None:
        self.ids = script.ids
        self.cores = {n: build(script.protocol, settings_for(script, n)) for n in self.ids}
        self.x = {n: v.copy() for n, v in zip(self.ids, initial_vectors(script.nodes), strict=True)}
        self.bounds = np.linspace(0, DIM, SEGMENTS + 1).round().astype(int)
        self.now = 0.0
        self.queue: list[tuple[str, Action, dict[int, np.ndarray]]] = []
        self.timers: list[tuple[float, str, str]] = []
        self.steps = dict.fromkeys(self.ids, 0)
        # Pulls that landed before the step they merge at (Pull.merge_at_step).
        self.held: list[tuple[str, PullArrived, dict[int, np.ndarray], int]] = []
        self.outers: dict[str, OuterNesterov] = {}
        self.settles = 0  # Settles delivered
        for n in self.ids:
            self.act(n, self.cores[n].handle(ViewChanged(frozenset(self.ids))))

    def seg(self, node: str, s: int) -> np.ndarray:
        return self.x[node][self.bounds[s] : self.bounds[s + 1]]

    def act(self, node: str, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Push | Pull):
                segments = a.weights if isinstance(a, Push) else a.segments
                self.queue.append((node, a, {s: self.seg(node, s).copy() for s in segments}))
            elif isinstance(a, Settle):
                self.queue.append((node, a, {}))
            elif isinstance(a, StartTimer):
                self.timers.append((a.at_s, node, a.tag))
            elif isinstance(a, OuterStep):
                outer = self.outers.setdefault(node, OuterNesterov(a.learning_rate, a.momentum))
                for s in range(SEGMENTS):
                    self.seg(node, s)[:] = outer.step(s, self.seg(node, s))
            else:
                raise AssertionError(f"{node}: {a!r} outside a payload or a settle")

    def blend(self, node: str, plan: list[Action], values: dict[int, np.ndarray]) -> None:
        for m in plan:
            if isinstance(m, Merge):
                part = self.seg(node, m.segment)
                part[:] = (1 - m.alpha) * part + m.alpha * values[m.segment]

    def settle(self) -> None:
        while self.queue:
            sender, action, snap = self.queue.pop(0)
            if isinstance(action, Settle):  # delivered twice: a settle is idempotent
                self.settles += 1
                arrived = SettleArrived(sender, 1, action.sequence_base, action.up_to)
                for _ in range(2):
                    assert self.cores[action.peer].handle(arrived) == []
            elif isinstance(action, Push):
                arrival = PayloadArrived(
                    sender,
                    1,
                    action.sequence,
                    action.round,
                    action.weights,
                    action.sequence_base,
                    action.settled,
                )
                receiver = self.cores[action.peer]
                plan = receiver.handle(arrival)
                self.blend(action.peer, plan, snap)
                receiver.handle(PayloadMerged(arrival))
                # The acknowledgement is lost once: the retry must be answered DUPLICATE.
                again = receiver.handle(arrival)
                assert all(isinstance(a, Duplicate) for a in again), again
                settled = PushSettled(action.peer, action.sequence, tuple(action.weights))
                for answer in self.cores[sender].handle(settled):
                    if isinstance(answer, Settle):  # training over: the numbering closes now
                        self.act(sender, [answer])
                    else:
                        assert isinstance(answer, FoldBack)
            else:
                peer_weights = self.cores[action.peer].status().weights
                values = {s: self.seg(action.peer, s).copy() for s in action.segments}
                arrival = PullArrived(
                    action.peer,
                    action.round,
                    {s: peer_weights[s] if peer_weights else 0.0 for s in action.segments},
                )
                due = action.merge_at_step or 0
                if due > self.steps[sender]:
                    self.held.append((sender, arrival, values, due))
                else:
                    self.merge_pull(sender, arrival, values)
            self.now += 1e-3

    def merge_pull(self, node: str, arrival: PullArrived, values: dict[int, np.ndarray]) -> None:
        self.blend(node, self.cores[node].handle(arrival), values)
        self.act(node, self.cores[node].handle(PullMerged(arrival)))

    async def step(self, node: int) -> None:
        n = self.ids[node]
        self.steps[n] += 1
        self.now += 0.01
        ready = [h for h in self.held if h[0] == n and h[3] <= self.steps[n]]
        for held in ready:  # merged at this boundary, before the core hears the step ended
            self.held.remove(held)
            self.merge_pull(n, held[1], held[2])
        self.act(n, self.cores[n].handle(StepEnded(self.steps[n], self.now)))
        self.settle()
        self.fire_due()

    def fire_due(self, until: float | None = None) -> None:
        while self.timers and (until is None or min(self.timers)[0] <= until):
            self.timers.sort()
            at_s, n, tag = self.timers.pop(0)
            self.now = max(self.now, at_s)
            self.act(n, self.cores[n].handle(TimerFired(tag, self.now)))
            self.settle()

    async def end_training(self) -> None:
        for n in self.ids:
            self.act(n, self.cores[n].handle(TrainingEnded(self.steps[n], self.now)))
        self.settle()
        self.fire_due()

    def weights(self) -> np.ndarray:
        return np.array([self.cores[n].status().weights for n in self.ids])

    def vectors(self) -> np.ndarray:
        return np.array([self.x[n] for n in self.ids])
