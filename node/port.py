"""The replica's way out to the network: pushes, pulls and timer wake-ups, by the loop.

The trainer thread (and a timer's worker thread) call a :class:`NetworkPort`; every
call only schedules work on the event loop, which starts the push, the pull or the
timer. Once the node leaves, new pushes fold back at the trainer's next step (only
the hand-off leaves a leaving node); once it stops, the loop may be gone, so pushes
fold back and pulls fail there too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from gossipd.node.messages import OutboundPull, OutboundPush, PullOutcome, PushOutcome
from gossipd.node.outbound import Outbound
from gossipd.node.replica import Replica


class NetworkPort:
    """Implements ``messages.LoopPort`` for a node's event loop."""

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        replica: Replica,
        outbound: Outbound,
        start_pull: Callable[[OutboundPull], object],
        spawn: Callable[[Any, str], object],
        stopping: asyncio.Event,
    ) -> None:
        self.loop = loop
        self.replica = replica
        self.outbound = outbound
        self._start_pull = start_pull
        self.spawn = spawn
        self.stopping = stopping

    # -- called on the trainer's (or a timer's) thread ---------------------------------
    def send_push(self, out: OutboundPush) -> None:
        if not self._schedule(self._start_push, out):
            self.replica.post(PushOutcome(out, (), "the node stopped before sending it"))

    def start_pull(self, out: OutboundPull) -> None:
        if not self._schedule(self._start_pull, out):
            self.replica.post(PullOutcome(out, None, "the node stopped before the pull"))

    def wake_at(self, at_s: float) -> None:
        self._schedule(self._wake_at, at_s)

    def _schedule(self, fn: Callable[[Any], object], arg: object) -> bool:
        if self.stopping.is_set():
            return False
        try:
            self.loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop closed meanwhile
            return False
        return True

    # -- on the loop ---------------------------------------------------------------------
    def _start_push(self, out: OutboundPush) -> None:
        if self.outbound.leaving or self.stopping.is_set():
            why = "the node is leaving" if self.outbound.leaving else "the node stopped"
            self.replica.post(PushOutcome(out, (), f"{why} before sending it"))
            return
        self.outbound.start(out)

    def _wake_at(self, at_s: float) -> None:
        """At ``at_s`` on the replica's clock, fire its due timers (off the loop: it may
        wait briefly for a step boundary's bookkeeping, never for a step)."""
        if self.stopping.is_set():
            return
        delay_s = max(0.0, at_s - self.replica.clock())
        self.loop.call_later(delay_s, self._fire)

    def _fire(self) -> None:
        if not self.stopping.is_set():
            self.spawn(asyncio.to_thread(self.replica.fire_due_timers), "timers")
