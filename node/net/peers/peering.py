"""Membership over the network: verify claims by dialling, check Leaves, anti-entropy.

:class:`~gossipd.node.net.peers.membership.Membership` decides; this module does the I/O
it needs, on the node's event loop. The rules it enforces:

* a node becomes a peer only through this node's own Handshake to the address
  it claims (an inbound Handshake or a relayed list only names candidates);
* candidate dials run at most ``membership.dial_concurrency`` at a time, over
  throwaway channels, so a list of 5,000 fake addresses costs a bounded number
  of refused connections and leaves no channel, fd or thread behind;
* a Leave is believed only after the node itself, asked at its address, is gone
  or says it is leaving: a forged Leave is counted and changes nothing.

Membership speaks plain :class:`~gossipd.node.net.peers.membership.NodeInfo`; the protobuf
``NodeInfo`` is converted here, where claims arrive (:meth:`Peering.hear`, a
Handshake reply) and where the verified list leaves (:meth:`Peering.known`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gossipd.node.errors import ForgedLeave, GossipdError, MeshMismatch
from gossipd.node.model.segments import check_fingerprint, check_protocol
from gossipd.node.net.dial.channels import RPC_TIMEOUT_S
from gossipd.node.net.peers.membership import NodeInfo, PeerState
from gossipd.node.net.wire.lastwords import LastWord, LastWords
from gossipd.node.shared.tls import IdentityMismatch, NotAllowed
from gossipd.node.trainer.messages import RestartNotice
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipd.node.net.dial.channels import PeerChannels
    from gossipd.node.net.peers.health import PeerHealth
    from gossipd.node.net.telemetry.metrics import NodeMetrics
    from gossipd.node.net.telemetry.refusals import Refusals
    from gossipd.node.net.wire.tasks import LoopTasks
    from gossipd.node.protocols.base import Receipts
    from gossipd.node.shared.config import NodeConfig
    from gossipd.node.shared.config_sections import MembershipConfig
    from gossipd.node.trainer.messages import ReplicaLink

log = logging.getLogger(__name__)
LONELY_LOG_INTERVAL_S = 30.0


def from_wire(info: pb.NodeInfo) -> NodeInfo:
    return NodeInfo(info.node_id, info.address, info.incarnation)


def to_wire(info: NodeInfo) -> pb.NodeInfo:
    return pb.NodeInfo(node_id=info.node_id, address=info.address, incarnation=info.incarnation)


class PushSettler(Protocol):
    """What peering needs of this node's pushes: settle those to a peer that leaves, and
    keep its word of what it merged for those still unanswered once it is gone."""

    last_words: LastWords

    async def settle_pushes_to(self, peer: str, timeout_s: float) -> None: ...


@dataclass(frozen=True)
class PeeringSettings:
    """Who this node is and whom it may take as a peer: the parts of its config peering reads."""

    node_id: str
    protocol: str
    fingerprint: str
    seeds: tuple[str, ...]
    membership: MembershipConfig
    seed: int

    @classmethod
    def from_config(cls, config: NodeConfig, fingerprint: str) -> PeeringSettings:
        return cls(
            config.node_id,
            config.gossip.protocol,
            fingerprint,
            tuple(config.seeds),
            config.membership,
            config.gossip.seed,
        )


class Peering:
    def __init__(
        self,
        settings: PeeringSettings,
        *,
        health: PeerHealth,
        channels: PeerChannels,
        pushes: PushSettler,
        refusals: Refusals,
        replica: ReplicaLink,
        metrics: NodeMetrics,
        tasks: LoopTasks,
    ) -> None:
        """``health`` holds the membership view that dials and answers feed; ``channels``
        give and close the channel to a verified peer; ``pushes`` settle what is in flight
        to a peer that leaves; ``refusals`` count forged Leaves and refused peers."""
        self.settings = settings
        self.node_id = settings.node_id
        self.fingerprint = settings.fingerprint
        self.health = health
        self.membership = health.membership
        self.channels = channels
        self.tls = channels.tls
        self.pushes = pushes
        self.refusals = refusals
        self.rejections = refusals.log
        self.replica = replica
        self.metrics = metrics
        self.tasks = tasks
        self.stopping = tasks.stopping
        self.dial_slots = settings.membership.dial_concurrency
        self.rng = random.Random(settings.seed ^ 0xD1A1)
        self._dialing: set[str] = set()
        self._leave_checks: set[str] = set()
        self._round = asyncio.Lock()
        self._lonely_logged_at = -math.inf
        self._last_error: dict[str, str] = {}  # per seed: the last handshake failure

    # -- dialling ---------------------------------------------------------------------
    async def handshake(
        self, address: str, expected: str | None = None
    ) -> tuple[pb.HandshakeReply, str | None]:
        """Our Handshake to ``address``: a verified peer's channel, or a throwaway one.

        Returns the reply and the node id the server's certificate was checked
        against (None: any site of the mesh, or plaintext).
        """
        for p in self.membership.peers.values():
            if p.address == address:
                return await self.channels.client(address, p.node_id).handshake(
                    RPC_TIMEOUT_S
                ), p.node_id
        client = self.channels.throwaway(address, expected)
        try:
            return await client.handshake(RPC_TIMEOUT_S), expected
        finally:
            await client.close()

    async def verify(self, address: str, claim: NodeInfo | None = None) -> bool:
        """Dial ``address``; whoever answers there (and matches ``claim``) is a peer."""
        try:
            reply, checked = await self.handshake(address, claim.node_id if claim else None)
            if not self.tls.insecure and checked != reply.node.node_id:
                # The first dial proved only that a site of this mesh answers there:
                # dial again, checking the node id it claims against its certificate.
                reply, checked = await self.handshake(address, reply.node.node_id)
                if checked != reply.node.node_id:
                    raise IdentityMismatch(
                        f"{address} answered as {reply.node.node_id!r} over a connection "
                        f"whose certificate names {checked!r}"
                    )
            if reply.schema_version != SCHEMA_VERSION:
                raise MeshMismatch(
                    f"{address} speaks schema {reply.schema_version}, we speak {SCHEMA_VERSION}; "
                    "run the same gossipd release on every site"
                )
            check_fingerprint(self.fingerprint, reply.fingerprint, address)
            check_protocol(self.settings.protocol, reply.protocol, address)
            if not self.tls.allows(reply.node.node_id):
                raise NotAllowed(
                    f"{address} is {reply.node.node_id!r}, which tls.allow of this node does "
                    "not list; it is not made a peer"
                )
        except (MeshMismatch, NotAllowed) as err:  # configuration to fix, not a passing failure
            self.metrics.dial_failures.labels("mismatch").inc()
            self.rejections.record(address, type(err).__name__, str(err))
            return False
        except GossipdError as err:
            log.debug("handshake with %s failed: %s", address, err)
            self.metrics.dial_failures.labels(_dial_failure_reason(err)).inc()
            if address in self.settings.seeds:  # kept for seeds only: bounded
                self._last_error[address] = str(err)
            return False
        known = self.membership.peers.get(reply.node.node_id)
        verdict = self.membership.verified(address, from_wire(reply.node), claim)
        for change in verdict.changes:
            self.health.apply(change)
        if verdict.refused is not None:
            self.rejections.record(address, "PeerNotVerified", verdict.refused)
            return False
        if known is not None and known.incarnation != reply.node.incarnation:
            self.replica.post(RestartNotice(reply.node.node_id, reply.node.incarnation))
            if known.address != address:
                self.channels.forget(known.address)
        for info in reply.peers:
            self.hear(info)
        return True

    def hear(self, info: pb.NodeInfo, *, direct: bool = False) -> None:
        """A claim about a node; a node's claim about itself is dialled at once."""
        if self.membership.hear(from_wire(info), direct=direct) and direct:
            self.kick()

    def known(self) -> list[pb.NodeInfo]:
        """The verified peers, as relayed on the wire."""
        return [to_wire(info) for info in self.membership.known()]

    def kick(self) -> None:
        """Start dials to queued candidates while slots are free."""
        while len(self._dialing) < self.dial_slots and self.membership.candidates:
            ((address, claim),) = self.membership.take_candidates(1)
            if address in self._dialing:
                continue  # that address is being asked already; its answer settles this too
            self._dialing.add(address)
            self.tasks.spawn(self._dial(address, claim))

    def hint(self, address: str) -> None:
        """An address a member is said to serve on (the coordinator's view): dialled
        with no claim, so this node's own handshake alone says who answers there."""
        m = self.membership
        if address == m.self_address or address in self._dialing or self.stopping.is_set():
            return
        if any(p.address == address and p.live for p in m.peers.values()):
            return
        self._dialing.add(address)
        self.tasks.spawn(self._dial(address, None))

    def heard_view(self, members: dict[str, str], epoch: int) -> None:
        """The coordinator's view of the mesh (node id to address): every other member's
        address is dialled like a seed's."""
        for node_id, address in sorted(members.items()):
            if node_id != self.node_id:
                self.hint(address)

    def heard_presence(self, node_id: str, address: str, incarnation: int) -> None:
        """A presence heard on MQTT: a claim like a relayed one, dialled soon."""
        self.hear(pb.NodeInfo(node_id=node_id, address=address, incarnation=incarnation))
        self.kick()

    async def _dial(self, address: str, claim: NodeInfo | None) -> None:
        try:
            await self.verify(address, claim)
        finally:
            self._dialing.discard(address)
            if not self.stopping.is_set():
                self.kick()

    # -- departures -------------------------------------------------------------------
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
                reply: pb.HandshakeReply | None = (await self.handshake(state.address))[0]
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

    # -- anti-entropy -----------------------------------------------------------------
    async def run(self) -> None:
        interval = self.settings.membership.anti_entropy_interval_s
        while not self.stopping.is_set():
            await self.round()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), interval)

    async def round(self) -> None:
        async with self._round:
            await self._round_once()

    async def _round_once(self) -> None:
        m = self.membership
        addresses = {p.node_id: p.address for p in m.peers.values()}
        for node_id in m.expire(time.monotonic()):
            log.info(
                "declared %s dead after %.0f s suspected (membership.drop_after_s); "
                "its unacknowledged pushes return to their senders",
                node_id,
                m.drop_after_s,
            )
            self.channels.forget(addresses[node_id])
        known = {s.address for s in m.peers.values()}
        seeds = [a for a in self.settings.seeds if a not in known and a != m.self_address]
        await asyncio.gather(
            *(self._recheck(s) for s in m.suspected()), *(self.verify(a) for a in seeds)
        )
        self.kick()
        live = m.live()
        if not live:
            self._log_lonely(seeds)
            return
        target = self.rng.choice(live)
        try:
            infos = await self.channels.client(target.address, target.node_id).peers(
                self.known(), RPC_TIMEOUT_S
            )
        except GossipdError as err:
            self.health.failed(target.node_id, err)
            return
        self.health.succeeded(target.node_id)
        for info in infos:
            self.hear(info)

    async def _recheck(self, state: PeerState) -> None:
        if not await self.verify(state.address):
            self.health.failed(state.node_id, "handshake failed")

    def _log_lonely(self, seeds: list[str]) -> None:
        now = time.monotonic()
        if now - self._lonely_logged_at < LONELY_LOG_INTERVAL_S:
            return
        self._lonely_logged_at = now
        tried = (
            ", ".join(f"{s} ({self._last_error.get(s, 'not reached yet')})" for s in seeds)
            if seeds
            else "none configured"
        )
        log.info(
            "no live peer; seeds tried: %s. Check that they run, that `seeds` names "
            "their advertised addresses, that firewalls let this node reach them, and "
            "that their certificates come from this mesh's CA (tls.ca)",
            tried,
        )

    async def wait_for_peers(self, count: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while len(self.membership.live()) < count:
            if time.monotonic() > deadline:
                return False
            await self.round()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 0.1)
        return True


def _dial_failure_reason(err: GossipdError) -> str:
    """A bounded label for a failed handshake: what an operator would fix."""
    text = str(err)
    if "ssl" in text.lower() or "handshake" in text.lower() or "certificate" in text.lower():
        return "tls"
    if isinstance(err, IdentityMismatch):
        return "tls"
    if "UNAVAILABLE" in text or "DEADLINE_EXCEEDED" in text:
        return "unreachable"
    return "other"
