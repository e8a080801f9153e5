"""Outbound pulls: start each at the time its core asked for, deliver the result once.

A protocol that averages with a pulled model (scheduled overlap, docs/design.md §5) asks
for a pull to *start* at ``Pull.at_s`` so that it lands as its local steps end.
The trainer thread may be in the middle of a long step then; the pull does not
wait for it: the loop starts it on the replica's own clock, and what it brings is
merged at the trainer's next step boundary, whole or not at all. Every pull ends
in exactly one result posted to the replica (a model, or the reason it failed),
whatever ends it, cancellation included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from gossipd.node.errors import Busy, GossipdError
from gossipd.node.net.dial.channels import PeerChannels
from gossipd.node.net.peers.health import PeerHealth
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.net.wire.frames import Limits
from gossipd.node.shared.config import GossipConfig
from gossipd.node.trainer.messages import OutboundPull, Pulled, PullOutcome, ReplicaLink

log = logging.getLogger(__name__)


class Puller:
    def __init__(
        self,
        *,
        replica: ReplicaLink,
        health: PeerHealth,
        channels: PeerChannels,
        metrics: NodeMetrics,
        gossip: GossipConfig,
        limits: Limits,
    ) -> None:
        """``health`` is told how the peer answered (a peer that fails pulls is suspected
        like one that fails pushes)."""
        self.replica = replica
        self.health = health
        self.membership = health.membership
        self.channels = channels
        self.metrics = metrics
        self.gossip = gossip
        self.limits = limits
        self._waiting: dict[int, asyncio.Event] = {}  # id(out) -> wakes it before at_s

    def pull(self, out: OutboundPull) -> Coroutine[Any, Any, None]:
        """The task's body: wait for ``at_s`` on the replica's clock, pull, post the result
        exactly once.

        Its hurry signal is registered now, as the loop takes the pull, not when the task
        first runs: a hurry the trainer scheduled right behind the pull (it already waits
        at the step the pull is due) runs before the task does, and must not be lost.
        """
        return self._run(out, self._waiting.setdefault(id(out), asyncio.Event()))

    async def _run(self, out: OutboundPull, hurry: asyncio.Event) -> None:
        pulled: Pulled | None = None
        error: str | None = "the node stopped before the pull ended"
        clock = self.replica.clock
        try:
            delay_s = out.pull.at_s - clock()
            if delay_s > 0:
                # The start time the core chose, unless the trainer reaches the step
                # that merges this pull first (hurry): then now.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(hurry.wait(), delay_s)
            self._waiting.pop(id(out), None)
            pulled, error = await self._pull(out)
        finally:
            self._waiting.pop(id(out), None)
            self.replica.post(PullOutcome(out, pulled, error))

    def hurry(self, out: OutboundPull) -> None:
        """Start ``out`` now if it is still waiting for its start time (on the loop)."""
        waiting = self._waiting.get(id(out))
        if waiting is not None:
            waiting.set()

    async def _pull(self, out: OutboundPull) -> tuple[Pulled | None, str | None]:
        peer = out.pull.peer
        state = self.membership.peers.get(peer)
        if state is None or not state.live:
            self.metrics.messages.labels("received", "pull", "failed").inc()
            return None, f"{peer} is not a live peer; nothing pulled"
        started = self.replica.clock()
        try:
            pulled = await self.channels.client(state.address, peer).pull(
                self.replica.flat.plan,
                self.limits,
                self.gossip.push_timeout_s,
                segments=list(out.pull.segments) or None,
                round=out.pull.round,
                progress_timeout_s=self.gossip.progress_timeout_s,
                gauge=self.replica.gauge,
            )
        except GossipdError as err:
            self.metrics.messages.labels("received", "pull", "failed").inc()
            if not isinstance(err, Busy):  # a busy peer answered: it is alive
                self.health.failed(peer, err)
            log.debug("pull from %s failed: %s", peer, err)
            return None, str(err)
        self.health.succeeded(peer)
        pulled.transfer_s = self.replica.clock() - started
        self.metrics.messages.labels("received", "pull", "ok").inc()
        self.metrics.bytes.labels("received", "pull", "ok").inc(pulled.nbytes)
        return pulled, None
