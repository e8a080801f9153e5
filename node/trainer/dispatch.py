"""Carrying out the core's outgoing actions, and knowing what is still in flight.

Of the actions a core returns (docs/design.md §2), all but the merges leave the replica:
``Push`` (a snapshot of the segments it names, sent now or, when a timer made it
mid-step, at the next step boundary), ``Pull`` (started at its own ``at_s`` by the
network), ``StartTimer`` (a heap here, plus a wake-up asked of the network),
``AskPeer`` and ``ReportTransfer`` (for the coordinator). The :class:`Dispatcher`
hands each to the :class:`~gossipd.node.trainer.messages.LoopPort` and counts what is out,
so the replica can tell when it has :meth:`~gossipd.node.trainer.replica.Replica.settled`.

It holds no lock and decides no timing: the replica calls it under its
``core_lock`` and says whether a call is mid-step.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Sequence

from gossipd.node.errors import GossipdError
from gossipd.node.model.outer import OuterNesterov
from gossipd.node.model.segments import FlatModel
from gossipd.node.protocols.base import (
    Action,
    AskPeer,
    GossipProtocol,
    OuterStep,
    Pull,
    Push,
    ReportTransfer,
    Settle,
    StartTimer,
    TimerFired,
)
from gossipd.node.trainer.duepulls import DuePulls
from gossipd.node.trainer.messages import LoopPort, OutboundPull, OutboundPush

log = logging.getLogger(__name__)


class Dispatcher:
    """Sends ``core``'s pushes and pulls through ``port`` and keeps its timers."""

    def __init__(
        self, core: GossipProtocol, flat: FlatModel, due_pulls: DuePulls, port: LoopPort
    ) -> None:
        self.core = core
        self.flat = flat
        self.due_pulls = due_pulls
        self.port = port
        self.outstanding: set[tuple[str, int]] = set()  # pushes sent, not yet settled
        self.pulls_out = 0  # pulls started, not yet merged or failed
        self.outer: OuterNesterov | None = None  # made at the core's first OuterStep
        self.outer_steps = 0  # OuterSteps carried out, the recording one included
        self.timers: list[tuple[float, str]] = []  # heap of (at_s, tag)
        self.deferred: list[Push] = []  # made by a timer mid-step, sent at the boundary
        self.snapshot_cpu_s = 0.0  # thread CPU spent copying segments for pushes

    def in_flight(self) -> bool:
        """Whether a push or pull is out, or a timer is still to fire."""
        return bool(self.outstanding or self.pulls_out or self.timers)

    def pull_ended(self) -> None:
        """One of the core's pulls landed or failed (a held one is no longer in flight)."""
        self.pulls_out -= 1

    def settle(self, push: Push) -> bool:
        """Mark ``push`` settled; False if it was before (a late duplicate outcome)."""
        if push.key not in self.outstanding:
            return False
        self.outstanding.discard(push.key)
        return True

    def fire_due(self, now: float, *, mid_step: bool) -> None:
        """Fire every timer due at ``now`` and carry out what the core asks."""
        while self.timers and self.timers[0][0] <= now:
            _, tag = heapq.heappop(self.timers)
            self.carry_out(self.core.handle(TimerFired(tag, now)), mid_step=mid_step)

    def send_deferred(self) -> None:
        """Send the pushes timers made mid-step (at a boundary, before anything merges)."""
        deferred, self.deferred = self.deferred, []
        self.send(deferred)

    def send(self, pushes: Sequence[Push]) -> None:
        # One copy of each segment serves every push of this event (a group exchange
        # sends the same model to several peers); snapshots are never written.
        if not pushes:
            return
        cpu0 = time.thread_time()
        snapshot = self.flat.snapshot(sorted({s for p in pushes for s in p.weights}))
        self.snapshot_cpu_s += time.thread_time() - cpu0
        for push in pushes:
            self.port.send_push(OutboundPush(push, {s: snapshot[s] for s in push.weights}))

    def outer_step(self, action: OuterStep) -> None:
        """The protocol's outer optimizer over the whole model, at a step boundary."""
        first = self.outer is None
        if self.outer is None:
            self.outer = OuterNesterov(action.learning_rate, action.momentum)
        for segment in range(len(self.flat.plan)):
            shared = self.outer.step(segment, self.flat.buffers[segment])
            self.flat.load_segment(segment, shared)
        self.outer_steps += 1
        if first:
            log.info(
                "%s: outer optimizer on (learning rate %g, momentum %g): the model after "
                "burst %d is the shared model, and an outer step follows every burst whose "
                "pushes all merged here from now on (%d bytes held for it)",
                self.core.name,
                action.learning_rate,
                action.momentum,
                action.round,
                self.outer.nbytes,
            )

    def carry_out(self, actions: Sequence[Action], *, mid_step: bool = False) -> list[Push]:
        """Carry out ``actions`` (none of them a merge); returns the pushes among them.

        Mid-step the pushes wait in :attr:`deferred`: their snapshot must be taken at
        the step boundary, not while the trainer writes the parameters.
        """
        pushes = [a for a in actions if isinstance(a, Push)]
        for action in actions:
            match action:
                case Push():
                    self.outstanding.add(action.key)
                case StartTimer():
                    heapq.heappush(self.timers, (action.at_s, action.tag))
                    self.port.wake_at(action.at_s)
                case Pull():
                    self.pulls_out += 1
                    out = OutboundPull(action)
                    self.due_pulls.started(out)
                    self.port.start_pull(out)
                case AskPeer():
                    self.port.ask_peer(action)
                case ReportTransfer():
                    self.port.report_transfer(action)
                case Settle():
                    self.port.send_settle(action)
                case OuterStep():
                    self.outer_step(action)
                case _:
                    raise GossipdError(
                        f"protocol {self.core.name} returned {action!r} outside a payload or a "
                        "settle; only a PayloadArrived or PullArrived may be answered by merges"
                    )
        if mid_step:
            self.deferred.extend(pushes)
        else:
            self.send(pushes)
        return pushes
