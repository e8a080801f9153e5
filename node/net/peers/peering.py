"""Membership over the network: verify claims by dialling, and anti-entropy.

:class:`~gossipd.node.net.peers.membership.Membership` decides; this module does the I/O
it needs, on the node's event loop. The rules it enforces:

* a node becomes a peer only through this node's own Handshake to the address
  it claims (an inbound Handshake or a relayed list only names candidates);
* candidate dials run at most ``membership.dial_concurrency`` at a time, over
  throwaway channels, so a list of 5,000 fake addresses costs a bounded number
  of refused connections and leaves no channel, fd or thread behind;
* a Leave is believed only after the node itself, asked at its address, is gone
  or says it is leaving (:mod:`.departures`).

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
from typing import TYPE_CHECKING

from gossipd.node.errors import GossipdError, MeshMismatch
from gossipd.node.model.segments import check_fingerprint, check_protocol
from gossipd.node.net.dial.channels import RPC_TIMEOUT_S
from gossipd.node.net.peers.membership import NodeInfo, PeerState
from gossipd.node.shared.tls import IdentityMismatch, NotAllowed
from gossipd.node.trainer.messages import RestartNotice
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipd.node.net.dial.channels import PeerChannels
    from gossipd.node.net.peers.health import PeerHealth
    from gossipd.node.net.telemetry.metrics import NodeMetrics
    from gossipd.node.net.wire.tasks import LoopTasks
    from gossipd.node.shared.config import NodeConfig
    from gossipd.node.shared.config_sections import MembershipConfig
    from gossipd.node.shared.rejections import RejectionLog
    from gossipd.node.trainer.messages import ReplicaLink

log = logging.getLogger(__name__)
LONELY_LOG_INTERVAL_S = 30.0


def from_wire(info: pb.NodeInfo) -> NodeInfo:
    return NodeInfo(info.node_id, info.address, info.incarnation)


def to_wire(info: NodeInfo) -> pb.NodeInfo:
    return pb.NodeInfo(node_id=info.node_id, address=info.address, incarnation=info.incarnation)


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
        rejections: RejectionLog,
        replica: ReplicaLink,
        metrics: NodeMetrics,
        tasks: LoopTasks,
    ) -> None:
        """``health`` holds the membership view that dials and answers feed; ``channels``
        give and close the channel to a verified peer; ``rejections`` record the peers refused."""
        self.settings = settings
        self.node_id = settings.node_id
        self.fingerprint = settings.fingerprint
        self.health = health
        self.membership = health.membership
        self.channels = channels
        self.tls = channels.tls
        self.rejections = rejections
        self.replica = replica
        self.metrics = metrics
        self.tasks = tasks
        self.stopping = tasks.stopping
        self.dial_slots = settings.membership.dial_concurrency
        self.rng = random.Random(settings.seed ^ 0xD1A1)
        self._dialing: set[str] = set()
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
        if known is not None and known.address != address:
            self.channels.forget(known.address)  # moved, or a relayed site's relays changed
        for info in reply.peers:
            self.hear(info)
        return True

    def hear(self, info: pb.NodeInfo, *, direct: bool = False) -> None:
        """A claim about a node; a node's claim about itself is dialled at once."""
        if self.membership.hear(from_wire(info), direct=direct) and direct:
            self.kick()

    def answer_handshake(
        self, request: pb.HandshakeRequest, bulk_port: int, bulk_sealed: bool
    ) -> pb.HandshakeReply:
        """Answer at once; the claimant becomes a peer only after our own dial to it.
        ``bulk_port``: this node's bulk lane (0: none), sealed or not."""
        self.hear(request.node, direct=True)
        assert self.channels.identity is not None, "start() the node first"
        return pb.HandshakeReply(
            schema_version=SCHEMA_VERSION,
            node=self.channels.identity.info(),
            fingerprint=self.fingerprint,
            step=self.replica.summary.steps,
            peers=self.known(),
            protocol=self.settings.protocol,
            bulk_port=bulk_port,
            bulk_sealed=bulk_sealed,
        )

    def answer_peers(self, request: pb.PeersRequest) -> pb.PeersReply:
        """A peer's list of the peers it knows: its sender and the first
        ``membership.max_candidates`` it names are heard; the reply is ours, us first."""
        self.hear(request.sender, direct=True)
        for info in request.known[: self.settings.membership.max_candidates]:
            self.hear(info)
        assert self.channels.identity is not None, "start() the node first"
        return pb.PeersReply(peers=[self.channels.identity.info(), *self.known()])

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

    # -- anti-entropy -----------------------------------------------------------------
    async def run(self) -> None:
        interval = self.settings.membership.anti_entropy_interval_s
        while not self.stopping.is_set():
            await self.round()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), interval)

    async def round(self) -> None:
        async with self._round:
            try:
                await self._round_once()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                # A call of this round ended because its channel was closed under it (the
                # peer moved, or a relayed peer's relays changed): the next round asks again.
                log.debug("a call of this membership round was cancelled with its channel")

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
