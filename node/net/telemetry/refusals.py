"""Every request this node refuses, counted; the first of each kind per peer and interval
logged and reported to the replica (which lists it in the status)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gossipd.node.errors import GossipdError, Leaving, UnknownPeer
from gossipd.node.shared.rejections import RejectionLog, peer_host
from gossipd.node.trainer.messages import Rejected

if TYPE_CHECKING:
    from gossipd.node.net.telemetry.metrics import NodeMetrics
    from gossipd.node.trainer.messages import ReplicaLink


class Refusals:
    """Counts and reports refused requests for the servicer, the bulk lane and peering."""

    def __init__(self, log: RejectionLog, metrics: NodeMetrics, replica: ReplicaLink) -> None:
        self.log = log
        self.metrics = metrics
        self.replica = replica

    def refused(self, peer: str, err: GossipdError) -> None:
        """Count every refusal; log and report it once per peer and reason per interval."""
        reason = type(err).__name__
        self.metrics.rejected.labels(reason).inc()
        self.metrics.messages.labels("received", "request", "rejected").inc()
        if isinstance(err, Leaving):
            self.log.counts[reason] += 1  # our own refusal while leaving: not news
            return
        # A push from a peer not verified (yet) is the rejoin race: a restarted peer pushes
        # before this node's own Handshake to it completed, and is live a moment later
        # (its push is retried). Counted like any refusal, but not a warning.
        level = logging.INFO if isinstance(err, UnknownPeer) else logging.WARNING
        if self.log.record(peer_host(peer), reason, str(err), level=level):
            self.replica.post(Rejected(peer, reason, str(err)))
