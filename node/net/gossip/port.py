"""The replica's way out to the network: pushes, pulls and timer wake-ups, by the loop.

The trainer thread (and a timer's worker thread) call a :class:`NetworkPort`; every
call only schedules work on the event loop, which starts the push, the pull or the
timer. Once the node leaves, new pushes fold back at the trainer's next step (only
the hand-off leaves a leaving node); once it stops, the loop may be gone, so pushes
fold back and pulls fail there too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from gossipd.node.errors import GossipdError
from gossipd.node.net.gossip.outbound import Outbound
from gossipd.node.net.gossip.pulls import Puller
from gossipd.node.net.wire.tasks import LoopTasks
from gossipd.node.protocols.base import AskPeer, PeerGranted, ReportTransfer, Settle
from gossipd.node.trainer.messages import (
    OutboundPull,
    OutboundPush,
    PullOutcome,
    PushOutcome,
    ReplicaLink,
)

log = logging.getLogger(__name__)


class PeerScheduler(Protocol):
    """A coordinator as the node sees it (``coordinator.client.CoordinatorClient``).

    Times are relative (seconds from now), so node and coordinator clocks never
    need to agree.
    """

    @property
    def available(self) -> bool: ...

    async def start_time(self, end_in_s: float) -> tuple[str, float] | None: ...

    async def report(self, peer: str, transfer_s: float) -> None: ...


class NetworkPort:
    """Implements ``messages.LoopPort`` for a node's event loop."""

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        replica: ReplicaLink,
        outbound: Outbound,
        puller: Puller,
        tasks: LoopTasks,
        coordinator: PeerScheduler | None = None,
    ) -> None:
        """``coordinator``: the node's coordinator client (None: it schedules alone)."""
        self.loop = loop
        self.replica = replica
        self.outbound = outbound
        self.puller = puller
        self.coordinator = coordinator
        # One coordinator call at a time, in order: a report must reach it before the
        # next ask (an ask frees the asker's previous grant, and its late report is refused).
        self._calls: asyncio.Lock | None = None
        self.tasks = tasks
        self.stopping = tasks.stopping

    # -- called on the trainer's (or a timer's) thread ---------------------------------
    def send_push(self, out: OutboundPush) -> None:
        if not self._schedule(self._start_push, out):
            self.replica.post(PushOutcome(out, (), "the node stopped before sending it"))

    def send_settle(self, settle: Settle) -> None:
        self._schedule(self._start_settle, settle)  # stopped: the peer keeps a spare window

    def start_pull(self, out: OutboundPull) -> None:
        if not self._schedule(self._start_pull, out):
            self.replica.post(PullOutcome(out, None, "the node stopped before the pull"))

    def wake_at(self, at_s: float) -> None:
        self._schedule(self._wake_at, at_s)

    def hurry_pull(self, out: OutboundPull) -> None:
        self._schedule(self.puller.hurry, out)

    def ask_peer(self, ask: AskPeer) -> None:
        if not self._schedule(self._ask, ask):
            self.replica.grant(PeerGranted(ask.round, None, self.replica.clock(), "stopped"))

    def report_transfer(self, report: ReportTransfer) -> None:
        self._schedule(self._report, report)

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

    def _start_settle(self, settle: Settle) -> None:
        if not self.stopping.is_set():
            self.outbound.start_settle(settle)

    def _start_pull(self, out: OutboundPull) -> None:
        self.tasks.spawn(self.puller.pull(out), f"pull:{out.pull.peer}")

    def _wake_at(self, at_s: float) -> None:
        """At ``at_s`` on the replica's clock, fire its due timers (off the loop: it may
        wait briefly for a step boundary's bookkeeping, never for a step)."""
        if self.stopping.is_set():
            return
        delay_s = max(0.0, at_s - self.replica.clock())
        self.loop.call_later(delay_s, self._fire)

    def _ask(self, ask: AskPeer) -> None:
        self.tasks.spawn(self._ask_coordinator(ask), "coordinator:ask")

    async def _ask_coordinator(self, ask: AskPeer) -> None:
        """Exactly one answer: the coordinator's, or an error that makes the core
        schedule this period alone (no coordinator, unreachable, or it refused)."""
        clock = self.replica.clock
        client = self.coordinator
        answer = PeerGranted(ask.round, None, clock(), "no coordinator is reachable")
        try:
            async with self._in_order():
                answer = await self._granted(ask, client, answer)
        finally:
            await asyncio.to_thread(self.replica.grant, answer)

    def _in_order(self) -> asyncio.Lock:
        if self._calls is None:
            self._calls = asyncio.Lock()
        return self._calls

    async def _granted(
        self, ask: AskPeer, client: PeerScheduler | None, answer: PeerGranted
    ) -> PeerGranted:
        clock = self.replica.clock
        try:
            if client is not None and client.available:
                granted = await client.start_time(max(ask.end_s - clock(), 0.0))
                if granted is None:
                    answer = PeerGranted(ask.round, None, clock())
                else:
                    peer, start_in_s = granted
                    answer = PeerGranted(ask.round, peer, clock() + start_in_s)
        except GossipdError as err:
            log.debug("coordinator: no start time for round %d: %s", ask.round, err)
            answer = PeerGranted(ask.round, None, clock(), str(err))
        return answer

    def _report(self, report: ReportTransfer) -> None:
        client = self.coordinator
        if client is not None and client.available:
            self.tasks.spawn(self._report_to(client, report), "coordinator:report")

    async def _report_to(self, client: PeerScheduler, report: ReportTransfer) -> None:
        try:
            async with self._in_order():
                await client.report(report.peer, report.transfer_s)
        except GossipdError as err:  # its lease frees the peer in the end
            log.debug("coordinator: report on %s lost: %s", report.peer, err)

    def _fire(self) -> None:
        if not self.stopping.is_set():
            self.tasks.spawn(asyncio.to_thread(self.replica.fire_due_timers), "timers")
