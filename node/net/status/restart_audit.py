"""What a restart cost the mesh, read from the peers' own accounts.

A site killed (``kill -9``, power loss) resumes from its last checkpoint as a new
incarnation, and the mesh's total sum-weight changes by exactly what that checkpoint
lacks (:mod:`gossipd.node.protocols.ledger`): minus what the old incarnation merged
after it, plus what it sent after it (or had in flight when it was written) that its
peers merged. The restarted site's own files cannot tell either; its peers can. Each
keeps, per peer, the weight it committed to it and merged from it, and moves both to
``*_before`` when that peer comes back as a new incarnation
(:mod:`gossipd.node.protocols.exchanged`). The checkpoint holds the same accounts as
the old incarnation saw them when it was written, so, peer by peer, the difference is
what happened after it.

After a resume the site asks each peer's Status until that peer has booked the new
incarnation, then logs the figure (WARNING when it is not zero) and exports it as
``gossipd_restart_weight_lost``; ``gossipd status`` shows it. Without that, the weight
a crash cost stayed lost and nothing said so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gossipd.node.errors import GossipdError
from gossipd.node.net.status.query import query_status
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.protocols.base import PeerMass
from gossipd.node.shared.tls import Credentials
from gossipd.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

# How long the audit waits for every peer to book this incarnation: a peer that left
# the mesh for good never will, and the figure is then reported from those that did.
AUDIT_TIMEOUT_S = 120.0
POLL_S = 1.0
STATUS_TIMEOUT_S = 5.0
# Below this (sum-weight per segment) the restart cost nothing worth a WARNING: float64
# rounding of the accounts' sums.
NOTHING_LOST = 1e-9


@dataclass(frozen=True)
class PeerPart:
    """One peer's share of the cost, summed over segments."""

    merged_after: float  # it committed to the old incarnation after the checkpoint: lost
    sent_after: float  # it merged from the old incarnation what the checkpoint still holds


def peer_part(theirs: Mapping[str, float] | None, ours: PeerMass) -> PeerPart:
    """The peer's accounts of the old incarnation (``*_before``) less the checkpoint's of
    the peer; a peer that never booked this site contributes nothing."""
    if theirs is None:
        return PeerPart(0.0, 0.0)
    return PeerPart(
        merged_after=theirs["sent_before"] - ours.received,
        sent_after=theirs["received_before"] - ours.sent,
    )


def has_booked(status: Mapping[str, Any], node_id: str, incarnation: int) -> bool:
    """Whether a peer's status already counts ``incarnation`` of ``node_id`` as new: it
    verified it, and its accounts moved to ``*_before`` (or it never had any)."""
    seen = any(p["node_id"] == node_id and p["incarnation"] == incarnation for p in status["peers"])
    mass = status["exchanged"].get(node_id)
    return seen and (mass is None or mass["incarnation"] == incarnation)


@dataclass(frozen=True)
class AuditResult:
    """The restart's cost, per segment (the figure an operator compares with the mesh's
    Σw, which per segment is the number of founding sites)."""

    checkpoint_step: int
    segments: int
    parts: Mapping[str, PeerPart]
    asked: frozenset[str]

    @property
    def merged_after(self) -> float:
        return sum(p.merged_after for p in self.parts.values()) / self.segments

    @property
    def sent_after(self) -> float:
        return sum(p.sent_after for p in self.parts.values()) / self.segments

    @property
    def weight_lost(self) -> float:
        return self.merged_after - self.sent_after

    def message(self) -> pb.CrashAudit:
        return pb.CrashAudit(
            resumed=True,
            done=True,
            weight_lost=self.weight_lost,
            merged_after=self.merged_after,
            sent_after=self.sent_after,
            peers_answered=len(self.parts),
            peers_asked=len(self.asked),
            checkpoint_step=self.checkpoint_step,
        )

    def log(self) -> None:
        missing = sorted(self.asked - self.parts.keys())
        source = f"from the accounts of {len(self.parts)} of {len(self.asked)} peers"
        if missing:
            source += f" ({', '.join(missing)} did not answer within {AUDIT_TIMEOUT_S:.0f} s)"
        if not self.asked:
            log.info("restart audit: no peer to ask; nothing was exchanged before the restart")
        elif abs(self.weight_lost) < NOTHING_LOST and abs(self.merged_after) < NOTHING_LOST:
            log.info(
                "restart audit: resuming from the checkpoint of step %d cost the mesh no "
                "sum-weight (%s)",
                self.checkpoint_step,
                source,
            )
        else:
            log.warning(
                "restart audit: resuming from the checkpoint of step %d %s the mesh %.6g of "
                "sum-weight per segment: the previous incarnation merged %.6g after that "
                "checkpoint (lost with it) and its peers merged %.6g it sent after it or had "
                "in flight (now held twice), %s. The mesh's total stays off by this much; "
                "checkpoint more often (checkpoint.every_steps) to lose less",
                self.checkpoint_step,
                "cost" if self.weight_lost >= 0 else "added to",
                abs(self.weight_lost),
                self.merged_after,
                self.sent_after,
                source,
            )


class RestartAudit:
    """Polls the peers of a resumed site until each has booked its new incarnation."""

    def __init__(
        self,
        *,
        node_id: str,
        incarnation: int,
        checkpoint_step: int,
        segments: int,
        accounts: Mapping[str, PeerMass],
        peers: Callable[[], Iterable[pb.NodeInfo]],
        tls: Credentials,
        metrics: NodeMetrics,
        publish: Callable[[pb.CrashAudit], None],
    ) -> None:
        """``accounts``: the checkpoint's, per peer; ``peers``: the verified peers now."""
        self.node_id = node_id
        self.incarnation = incarnation
        self.checkpoint_step = checkpoint_step
        self.segments = segments
        self.accounts = dict(accounts)
        self.peers = peers
        self.tls = tls
        self.metrics = metrics
        self.publish = publish

    async def run(self, timeout_s: float = AUDIT_TIMEOUT_S) -> AuditResult:
        deadline = time.monotonic() + timeout_s
        parts: dict[str, PeerPart] = {}
        asked: set[str] = set(self.accounts)
        while True:
            addresses = {p.node_id: p.address for p in self.peers() if p.node_id != self.node_id}
            asked |= addresses.keys()
            # Asked at once: one peer that does not answer must not hold up the others'
            # STATUS_TIMEOUT_S at each poll.
            waiting = sorted(p for p in asked - parts.keys() if p in addresses)
            answers = await asyncio.gather(*(self._ask(p, addresses[p]) for p in waiting))
            parts.update({p: a for p, a in zip(waiting, answers, strict=True) if a is not None})
            self._progress(len(parts), len(asked))
            if (asked and asked <= parts.keys()) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(POLL_S)
        result = AuditResult(self.checkpoint_step, self.segments, parts, frozenset(asked))
        self.metrics.restart_weight_lost.set(result.weight_lost)
        self.publish(result.message())
        result.log()
        return result

    async def _ask(self, peer: str, address: str) -> PeerPart | None:
        try:
            status = await query_status(address, STATUS_TIMEOUT_S, tls=self.tls)
        except GossipdError as err:
            log.debug("restart audit: %s (%s) did not answer: %s", peer, address, err)
            return None
        if status["node_id"] != peer or not has_booked(status, self.node_id, self.incarnation):
            return None
        return peer_part(status["exchanged"].get(self.node_id), self.accounts.get(peer, PeerMass()))

    def _progress(self, answered: int, asked: int) -> None:
        self.metrics.restart_audit_peers.labels("answered").set(answered)
        self.metrics.restart_audit_peers.labels("asked").set(asked)
        self.publish(
            pb.CrashAudit(
                resumed=True,
                peers_answered=answered,
                peers_asked=asked,
                checkpoint_step=self.checkpoint_step,
            )
        )
