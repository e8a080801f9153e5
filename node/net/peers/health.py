"""How this node's peers have been answering: the membership view and what follows from a
change in it, shared by every part that talks to peers.

Pushes, pulls and dials all report here (:meth:`PeerHealth.succeeded`,
:meth:`PeerHealth.failed`); a peer that fails often enough is suspected, one that answers
again is live, and each change reaches the replica as a ``ViewNotice`` and wakes the
pushes waiting out a backoff (:class:`Retries`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from gossipd.node.errors import UnknownPeer
from gossipd.node.net.peers.membership import Change, Membership
from gossipd.node.shared.relay_address import is_relayed
from gossipd.node.trainer.messages import ViewNotice

if TYPE_CHECKING:
    from gossipd.node.net.telemetry.metrics import NodeMetrics
    from gossipd.node.shared.config_sections import MembershipConfig
    from gossipd.node.trainer.messages import ReplicaLink

log = logging.getLogger(__name__)


class Retries:
    """The signal that cuts short every wait between push retries (a peer came back, or
    this node leaves): waiters started before :meth:`fire` wake, later ones wait anew."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout_s: float) -> None:
        """Wait ``timeout_s`` or until the next :meth:`fire`, whichever comes first."""
        event = self._event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)


class PeerHealth:
    """The membership view, fed by how peers answer."""

    def __init__(
        self,
        node_id: str,
        config: MembershipConfig,
        replica: ReplicaLink,
        metrics: NodeMetrics,
        retries: Retries,
    ) -> None:
        self.node_id = node_id
        self.replica = replica
        self.metrics = metrics
        self.retries = retries
        self.membership = Membership(
            node_id,
            suspect_after_failures=config.suspect_after_failures,
            drop_after_s=config.drop_after_s,
            max_peers=config.max_peers,
            max_candidates=config.max_candidates,
            max_departed=config.max_departed,
        )

    def apply(self, change: Change | None) -> None:
        if change is not None:
            log.info("peer %s is %s", change.node_id, "live" if change.live else "down")
            peers = self.membership.live()
            live = frozenset(p.node_id for p in peers)
            relayed = frozenset(p.node_id for p in peers if is_relayed(p.address))
            self.replica.post(ViewNotice(live | {self.node_id}, relayed))
            if change.live:
                self.retries.fire()  # pushes waiting for it need not wait out a backoff
        self.metrics.live_peers.set(len(self.membership.live()))
        self.metrics.suspected_peers.set(len(self.membership.suspected()))

    def failed(self, node_id: str, why: object) -> None:
        change = self.membership.failed(node_id, time.monotonic())
        if change is not None:
            log.info("suspecting %s: %s", node_id, why)
        self.apply(change)

    def succeeded(self, node_id: str) -> None:
        self.apply(self.membership.succeeded(node_id))

    def check_sender(self, sender: str, incarnation: int) -> None:
        """Raise :class:`UnknownPeer` unless ``sender`` is a verified peer in that incarnation."""
        if not self.membership.is_current(sender, incarnation):
            raise UnknownPeer(
                f"sender {sender!r} (incarnation {incarnation}) is not a verified peer of "
                f"{self.node_id}: it must Handshake and answer this node's Handshake at the "
                "address it advertises (usual for a moment after that peer starts or rejoins; "
                "its push is retried)"
            )
