"""Peers that leave: a Leave checked before it is believed, and peers that tls.allow no
longer lists dropped, each after the pushes in flight to it have settled.

A Leave is believed only after the node itself, asked at its address, is gone or says it
is leaving: a forged Leave is counted and changes nothing. What the leaver says it merged
of this node's pushes (its last word) settles those still unanswered once it is gone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from gossipd.node.errors import ForgedLeave, GossipdError
from gossipd.node.net.dial.channels import RPC_TIMEOUT_S
from gossipd.node.net.wire.lastwords import LastWord, LastWords, from_messages
from gossipd.node.shared.rejections import Throttle
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipd.node.net.dial.channels import PeerChannels
    from gossipd.node.net.peers.health import PeerHealth
    from gossipd.node.net.peers.membership import PeerState
    from gossipd.node.net.telemetry.refusals import Refusals
    from gossipd.node.net.wire.tasks import LoopTasks
    from gossipd.node.protocols.base import Receipts
    from gossipd.node.shared.config_sections import TlsConfig

log = logging.getLogger(__name__)


class Dialer(Protocol):
    """Who asks a node, at its address, who it is (peering's own Handshake)."""

    async def handshake(
        self, address: str, expected: str | None = None
    ) -> tuple[pb.HandshakeReply, str | None]: ...


class PushSettler(Protocol):
    """What departures need of this node's pushes: settle those to a peer that leaves, and
    keep its word of what it merged for those still unanswered once it is gone."""

    last_words: LastWords

    async def settle_pushes_to(self, peer: str, timeout_s: float) -> None: ...


class Departures:
    def __init__(
        self,
        *,
        dialer: Dialer,
        health: PeerHealth,
        channels: PeerChannels,
        pushes: PushSettler,
        refusals: Refusals,
        tasks: LoopTasks,
        segments: int,
        log_interval_s: float,
    ) -> None:
        """``dialer`` asks a leaver whether it is still there; ``health`` holds the view it
        leaves; ``channels`` close its channel; ``pushes`` settle what is in flight to it;
        ``refusals`` count forged Leaves; ``segments``: the model's, which bound what a
        Leave may say was merged; ``log_interval_s``: at most one line per peer per
        interval about Leaves that say too much."""
        self.dialer = dialer
        self.health = health
        self.membership = health.membership
        self.channels = channels
        self.tls = channels.tls
        self.pushes = pushes
        self.refusals = refusals
        self.tasks = tasks
        self.segments = segments
        self._leave_checks: set[str] = set()
        self._bad_words_log = Throttle(log_interval_s)

    async def heard_leave(self, request: pb.LeaveRequest, peer: str) -> None:
        """A Leave from ``peer`` (the connection's, or the node id it names), with what its
        sender says it merged of this node's pushes."""
        merged = from_messages(request.merged, self.segments)
        if merged is None and (count := self._bad_words_log.admit(request.node_id)) is not None:
            log.info(
                "the Leave of %s says it merged more of this node's pushes than a Leave may "
                "name, or segments this model lacks (%d more such Leaves since the last "
                "line): ignored, so pushes to it still unanswered when it is gone fold back",
                request.node_id,
                count,
            )
        await self.on_peer_left(request.node_id, request.incarnation, peer, merged)

    async def on_peer_left(
        self, node_id: str, incarnation: int, peer: str, merged: list[Receipts] | None
    ) -> None:
        """Check a Leave, settling pushes to the leaver while it can still answer.

        The leaver waits for this reply while it still serves, so the check (and
        the last retries of pushes to it) run now, bounded well inside its
        Leave deadline; a check still running then goes on in the background.
        ``merged``: what the leaver says it merged of our pushes (None: it said nothing
        usable); believed once the check confirms it is leaving.
        """
        state = self.membership.peers.get(node_id)
        if state is None or node_id in self._leave_checks:
            return
        if incarnation and incarnation != state.incarnation:
            return  # a goodbye from an incarnation we no longer know
        self._leave_checks.add(node_id)
        check = self.tasks.spawn(self._check_leave(state, peer, merged))
        await asyncio.wait({check}, timeout=RPC_TIMEOUT_S * 0.8)

    async def _check_leave(
        self, state: PeerState, peer: str, merged: list[Receipts] | None
    ) -> None:
        """Believe a Leave only if the node, asked at its address, is gone or leaving."""
        try:
            try:
                reply: pb.HandshakeReply | None = (await self.dialer.handshake(state.address))[0]
            except GossipdError:
                reply = None
            if (
                reply is not None
                and reply.node.node_id == state.node_id
                and reply.node.incarnation == state.incarnation
            ):
                self.refusals.refused(
                    peer,
                    ForgedLeave(
                        f"a Leave for {state.node_id!r} was refused: asked at {state.address}, "
                        "it is still there and not leaving"
                    ),
                )
                return
            if self.membership.is_current(state.node_id, state.incarnation):
                # Retry what is unacknowledged to it once more, now: a leaving node
                # answers DUPLICATE for what it merged, which settles exactly. What is
                # still unanswered once it is gone settles from its word of what it merged.
                if merged is not None:
                    word = LastWord(state.incarnation, tuple(merged))
                    self.pushes.last_words.heard(state.node_id, word)
                await self.pushes.settle_pushes_to(state.node_id, RPC_TIMEOUT_S / 2)
                log.info("peer %s left the mesh", state.node_id)
                self.health.apply(self.membership.departed_now(state.node_id))
                self.channels.forget(state.address)
        finally:
            self._leave_checks.discard(state.node_id)

    async def drop_disallowed(self) -> None:
        """After tls.allow changed: settle what is in flight to peers it no longer lists,
        then stop gossiping with them (they may be admitted again later)."""
        for state in list(self.membership.peers.values()):
            if self.tls.allows(state.node_id):
                continue
            await self.pushes.settle_pushes_to(state.node_id, RPC_TIMEOUT_S / 2)
            log.info("peer %s is not in tls.allow any more; dropped", state.node_id)
            self.health.apply(self.membership.drop(state.node_id))
            self.channels.forget(state.address)

    def reload_tls(self, tls: TlsConfig | None = None) -> None:
        """SIGHUP: read the certificate files (and ``tls``: paths, allow-list) again.

        The server hands the new certificate to each new connection. Channels to
        peers are replaced, so this node presents it when dialling too; pushes in
        flight on an old channel end with an unknown outcome and are retried. Peers the
        new allow-list no longer lists are dropped (:meth:`drop_disallowed`).
        """
        if self.tls.insecure:
            log.warning("SIGHUP: tls.insecure is set, there is no certificate to reload")
            return
        try:
            material = self.tls.reload(tls)
        except GossipdError as err:
            log.warning("SIGHUP: kept the current certificate: %s", err)
            return
        self.channels.replace_all()
        self.tasks.spawn(self.drop_disallowed())
        log.info(
            "SIGHUP: reloaded the TLS files; certificate for %s valid until %s",
            material.node_id,
            material.not_after,
        )
