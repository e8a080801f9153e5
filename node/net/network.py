"""The network side of a node: gRPC server, peer clients, membership, pushes in flight.

Runs on one asyncio loop and never writes parameters: inbound pushes go to the
trainer's inbox, outbound pushes come from the trainer as snapshots, and
snapshots for PullModel and status are taken under the trainer's lock in a
worker thread so a long step never stalls the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING

import grpc

from gossipd.node.compression.codecs import Codec
from gossipd.node.compression.feedback import FeedbackReceiver, FeedbackSender
from gossipd.node.errors import (
    ConfigError,
    GossipdError,
    Leaving,
)
from gossipd.node.net.bulk.lane import BulkServer
from gossipd.node.net.dial.channels import PeerChannels
from gossipd.node.net.dial.client import Identity
from gossipd.node.net.gossip.inbound import Inbound
from gossipd.node.net.gossip.leaving import Leaver
from gossipd.node.net.gossip.outbound import Outbound
from gossipd.node.net.gossip.port import NetworkPort
from gossipd.node.net.gossip.pulls import Puller
from gossipd.node.net.limits.cpu_budget import SAMPLE_S, CpuBudget
from gossipd.node.net.peers.coordinator_view import follow_coordinator
from gossipd.node.net.peers.departures import Departures
from gossipd.node.net.peers.health import PeerHealth, Retries
from gossipd.node.net.peers.peering import Peering, PeeringSettings
from gossipd.node.net.peers.reachability import build_reach
from gossipd.node.net.relay.routes import Routes
from gossipd.node.net.serve.server import add_services, announce, bind, mark_serving, new_server
from gossipd.node.net.status.reply import StatusReplies
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.net.telemetry.refusals import Refusals
from gossipd.node.net.wire.assembly import Limits, SegmentAssembler
from gossipd.node.net.wire.shaping import LinkShaper
from gossipd.node.net.wire.tasks import LoopTasks
from gossipd.node.protocols.base import Pull
from gossipd.node.shared.config import NodeConfig, TlsConfig
from gossipd.node.shared.rejections import RejectionLog
from gossipd.node.shared.relay_address import reach_of
from gossipd.node.shared.tls import Credentials
from gossipd.node.trainer.messages import OutboundPull, ReceivedSegment, ReplicaLink
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipd.coordinator.client import CoordinatorClient

log = logging.getLogger(__name__)


class Network:
    """Implements the servicer's ``Handlers`` and drives pushes and anti-entropy."""

    def __init__(
        self, config: NodeConfig, replica: ReplicaLink, metrics: NodeMetrics | None = None
    ) -> None:
        self.config = config
        self.replica = replica
        self.mesh_id = config.mesh_id
        self.node_id = config.node_id
        self.fingerprint = replica.fingerprint
        self.protocol = config.gossip.protocol
        self.incarnation = time.time_ns() // 1000
        self.codec = Codec.parse(config.gossip.codec)
        # Error feedback: this node's copies of what its peers hold of its segments, and of
        # what it holds of theirs (docs/protocols/index.md, "Compressed gossip").
        gossip = config.gossip
        self.feedback_out: FeedbackSender | None = None
        self.feedback_in: FeedbackReceiver | None = None
        if gossip.error_feedback:
            self.feedback_out = FeedbackSender(self.codec, gossip.feedback_peers)
            self.feedback_in = FeedbackReceiver(gossip.feedback_peers)
        self.limits = Limits(
            config.limits.max_chunk_bytes,
            config.limits.max_segment_bytes,
            config.limits.max_sum_weight or math.inf,  # the core caps the merged result
        )
        self.metrics = metrics or NodeMetrics()
        self.metrics.follow(replica.published)
        self.address = config.advertise or config.listen
        self.identity: Identity | None = None
        self.server: grpc.aio.Server | None = None
        self.bulk: BulkServer | None = None
        self.tasks = LoopTasks()
        self.stopping = self.tasks.stopping
        self.rejections = RejectionLog(config.limits.rejection_log_interval_s)
        self.refusals = Refusals(self.rejections, self.metrics, replica)
        self.tls = Credentials.from_config(config.tls)
        self.shaper = LinkShaper.from_config(config.link, config.node_id, config.gossip.seed)
        if self.tls.node_id not in (None, self.node_id):
            raise ConfigError(
                f"tls.cert {config.tls.cert} is for node {self.tls.node_id!r}, but node_id is "
                f"{self.node_id!r}; issue one with: gossipd certs issue {self.node_id} --dir CA_DIR"
            )
        self.budget = CpuBudget(config.gossip.cpu_share)
        self.metrics.gossip_cpu_budget.set(config.gossip.cpu_share)
        self.metrics.gossip_cpu_share.set_function(self.budget.gossip_share)
        self._build_parts(config, replica)
        self.hub, self.reach_checker, self.reach = build_reach(
            config, self.tls, self.metrics, self.peering, self.tasks, self._readvertise
        )
        self.status = StatusReplies(
            node_id=config.node_id,
            mesh_id=config.mesh_id,
            replica=replica,
            health=self.health,
            peering=self.peering,
            rejections=self.rejections,
            tls=self.tls,
            outbound=self.outbound,
        )

    def _build_parts(self, config: NodeConfig, replica: ReplicaLink) -> None:
        """The parts, each given the few collaborators it calls, in dependency order:
        nothing below calls back into a part built after it."""
        self.channels = PeerChannels(
            tls=self.tls,
            codec=self.codec,
            feedback=self.feedback_out,
            chunk_bytes=config.gossip.chunk_bytes,
            shaper=self.shaper,
            bulk=config.bulk,
            tasks=self.tasks,
            routes=Routes(self.tls, self.metrics),
        )
        self.health = PeerHealth(
            config.node_id, config.membership, replica, self.metrics, Retries()
        )
        self.membership = self.health.membership
        self._build_gossip(config, replica)
        self._build_peering(config, replica)
        # The coordinator's client, started with the node (None: the node schedules alone).
        self.coordinator: CoordinatorClient | None = None
        self.readvertised: list[Callable[[str], None]] = []  # told this node's new address

    def _build_gossip(self, config: NodeConfig, replica: ReplicaLink) -> None:
        """The parts that carry the model: pushes out and in, pulls, and the leave."""
        self.outbound = Outbound(
            gossip=config.gossip,
            shutdown_timeout_s=config.shutdown_timeout_s,
            replica=replica,
            budget=self.budget,
            health=self.health,
            channels=self.channels,
            metrics=self.metrics,
            tasks=self.tasks,
        )
        self.leaver = Leaver(
            outbound=self.outbound,
            replica=replica,
            membership=self.membership,
            channels=self.channels,
            gossip=config.gossip,
            shutdown_timeout_s=config.shutdown_timeout_s,
        )
        self.puller = Puller(
            replica=replica,
            health=self.health,
            channels=self.channels,
            metrics=self.metrics,
            gossip=config.gossip,
            limits=self.limits,
        )
        self.inbound = Inbound(
            node_id=config.node_id,
            incarnation=self.incarnation,
            limits=self.limits,
            chunk_bytes=config.gossip.chunk_bytes,
            merge_wait_s=config.limits.merge_wait_s,
            replica=replica,
            metrics=self.metrics,
            codec=self.codec,
            feedback=self.feedback_in,
            health=self.health,
            departure=self.outbound,
            shaper=self.shaper,
            serves_one_pull=replica.serves_one_pull,
        )

    def _build_peering(self, config: NodeConfig, replica: ReplicaLink) -> None:
        """The parts that keep the view of the mesh: dials, anti-entropy, departures."""
        self.peering = Peering(
            PeeringSettings.from_config(config, self.fingerprint),
            health=self.health,
            channels=self.channels,
            rejections=self.rejections,
            replica=replica,
            metrics=self.metrics,
            tasks=self.tasks,
        )
        self.departures = Departures(
            dialer=self.peering,
            health=self.health,
            channels=self.channels,
            pushes=self.outbound,
            refusals=self.refusals,
            tasks=self.tasks,
            segments=len(replica.flat.plan),
            log_interval_s=config.limits.rejection_log_interval_s,
        )

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Bind, serve, start gossiping; on any failure the server is stopped before raising."""
        listen = self.config.listen
        server = new_server(self.config, self.replica.flat.plan)
        try:
            health_servicer = add_services(server, self)
            port = bind(server, self.tls, listen)
            self.address = self.config.advertise or f"{listen.rpartition(':')[0]}:{port}"
            await self._start_bulk()
            await server.start()
            await mark_serving(health_servicer)
            self._serve_as_identity()
            bound = f"{listen.rpartition(':')[0]}:{port}"
            assert self.identity is not None
            self._readvertise(await self.reach.settle(self.identity, bound))
            if self.config.metrics.listen:
                mhost, _, mport = self.config.metrics.listen.rpartition(":")
                self.metrics.serve(mhost, int(mport))
        except BaseException:
            # An unstopped grpc.aio server schedules its shutdown from __del__, after
            # the loop is gone: "Event loop is closed", "never awaited".
            await server.stop(None)
            if self.bulk is not None:
                await self.bulk.close()
            raise
        self.server = server
        self.metrics.info.labels(self.node_id, self.mesh_id, self.fingerprint, self.protocol).set(1)
        if self.config.coordinator is not None:
            self.coordinator = await follow_coordinator(
                self.config.coordinator, self.mesh_id, self.address, self.tls, self.peering
            )
            self.readvertised.append(self.coordinator.readvertise)
        self.replica.attach(
            NetworkPort(
                loop=asyncio.get_running_loop(),
                replica=self.replica,
                outbound=self.outbound,
                puller=self.puller,
                tasks=self.tasks,
                coordinator=self.coordinator,
            )
        )
        self.tasks.spawn(self.peering.run(), "anti-entropy")
        self.tasks.spawn(self._measure_cpu(), "cpu-budget")
        announce(self.node_id, self.address, self.fingerprint, self.tls, self.bulk)

    async def _start_bulk(self) -> None:
        if not self.config.bulk:
            return
        limits = self.config.limits
        self.bulk = BulkServer(
            self.tls,
            idle_s=limits.stream_idle_timeout_s,
            per_peer=limits.max_inbound_pushes_per_peer,
            total=limits.max_inbound_pushes,
            on_rejected=self.refusals.refused,
            metrics=self.metrics,
        )
        await self.bulk.start(self.config.listen.rpartition(":")[0], self.config.bulk_port)

    def _readvertise(self, address: str) -> None:
        """This node is reached at ``address`` from now on (an outbound-only site's relays)."""
        if self.identity is not None and address == self.identity.address:
            return
        self.address = address
        self._serve_as_identity()
        for tell in self.readvertised:
            tell(address)

    def _serve_as_identity(self) -> None:
        """This node's identity, now that its address is bound, for its dials and replies."""
        self.identity = Identity(
            self.mesh_id,
            self.node_id,
            self.address,
            self.incarnation,
            self.fingerprint,
            self.config.gossip.protocol,
        )
        self.channels.serve_as(self.identity)
        self.membership.self_address = self.address

    async def close(self, grace_s: float = 1.0) -> None:
        """Stop serving and end this node's tasks, so none of it outlives the loop.

        The server stops first: handlers in flight get ``grace_s`` to finish, then
        gRPC cancels them. The loop's owner must still cancel and await what is
        left on the loop (``asyncio.run`` does; ``GossipNode.close`` does).
        """
        # From here a trainer thread still stepping schedules nothing onto a loop about
        # to close: its new pushes are folded back at its next step instead (port.NetworkPort).
        self.stopping.set()
        try:
            await self.close_coordinator()
            if self.server is not None:
                await self.server.stop(grace_s)
            if self.bulk is not None:
                await self.bulk.close()
            await self.tasks.close()
            await self.channels.close()
        finally:
            self.metrics.close()

    async def close_coordinator(self) -> None:
        """Stop heartbeats to the coordinator (first in a shutdown: it stops pointing
        other sites here); the node schedules alone from then on."""
        if self.coordinator is not None:
            await self.coordinator.close()

    async def _measure_cpu(self) -> None:
        """Keep the CPU budget's window filled, pushes or not (its samples are its clock)."""
        while not self.stopping.is_set():
            self.budget.gossip_share()
            await asyncio.sleep(SAMPLE_S)

    def reload_tls(self, tls: TlsConfig | None = None) -> None:
        """SIGHUP: read the certificate files (and ``tls``: paths, allow-list) again."""
        self.departures.reload_tls(tls)

    def live_peers(self) -> int:
        """How many peers are live now (for the progress line)."""
        return len(self.membership.live())

    @property
    def leaving(self) -> bool:
        return self.outbound.leaving

    # -- outbound -------------------------------------------------------------------
    async def bootstrap_from(self, peer: str) -> None:
        """A joiner's first model: a pull of every segment of ``peer``'s, which the trainer
        thread loads; returns once it did, raises with the reason if it could not."""
        segments = tuple(range(len(self.replica.flat.plan)))
        out = OutboundPull(Pull(peer, 0, segments, 0.0), concurrent.futures.Future())
        assert out.adopted is not None
        self.tasks.spawn(self.puller.pull(out), f"bootstrap:{peer}")
        await asyncio.wrap_future(out.adopted)

    async def leave_mesh(self) -> None:
        await self.hub.leave(self.leaver.leave_mesh(), self.config.shutdown_timeout_s / 2)

    async def wait_for_peers(self, count: int, timeout_s: float) -> bool:
        return await self.peering.wait_for_peers(count, timeout_s)

    # -- Handlers (called by the servicer) ---------------------------------------------
    def new_assembler(self) -> SegmentAssembler:
        return self.inbound.new_assembler()

    def on_handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeReply:
        if self.leaving:
            raise Leaving(f"node {self.node_id} is leaving the mesh; it takes no new peers")
        bulk = None if self.reach.relayed else self.bulk  # a relayed lane is not reachable
        sealed = bulk is not None and not bulk.tls.insecure
        reply = self.peering.answer_handshake(request, 0 if bulk is None else bulk.port, sealed)
        reply.relay = self.hub.enabled
        return reply

    def check_sender(self, sender: str, incarnation: int) -> None:
        self.health.check_sender(sender, incarnation)

    def check_addressed(self, sender: str, sequence: int, incarnation: int) -> None:
        self.inbound.check_addressed(sender, sequence, incarnation)

    async def on_push(
        self, open_: pb.PushOpen, segments: list[ReceivedSegment], deadline_s: float | None
    ) -> pb.PushReply:
        return await self.inbound.on_push(open_, segments, deadline_s)

    def on_pull(
        self, request: pb.PullRequest, whole: bool = False, sealed: bool = False
    ) -> AsyncGenerator[pb.SegmentHeader | memoryview, None]:
        return self.inbound.on_pull(request, whole, sealed)

    async def on_peer_left(self, request: pb.LeaveRequest, peer: str = "") -> None:
        await self.departures.heard_leave(request, peer or request.node_id)

    def on_peers(self, request: pb.PeersRequest) -> pb.PeersReply:
        return self.peering.answer_peers(request)

    async def on_status(self, checksum: bool = False, sketch_size: int = 0) -> pb.StatusReply:
        reply = await self.status.reply(checksum, sketch_size)
        reply.reach, reply.relay_bytes = reach_of(self.address), self.hub.forwarded
        return reply

    def on_rejected(self, peer: str, err: GossipdError) -> None:
        self.refusals.refused(peer, err)
