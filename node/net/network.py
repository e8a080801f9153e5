"""The network side of a node: gRPC server, peer clients, membership, pushes in flight.

Runs on one asyncio loop and never writes parameters: inbound pushes go to the
trainer's inbox, outbound pushes come from the trainer as snapshots, and
snapshots for PullModel and status are taken under the trainer's lock in a
worker thread so a long step never stalls the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import errno
import logging
import math
import socket
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gossipd.node.errors import (
    Busy,
    ConfigError,
    GossipdError,
    Leaving,
)
from gossipd.node.net import exchange
from gossipd.node.net.admission import server_options
from gossipd.node.net.bulk import BulkServer
from gossipd.node.net.channels import PeerChannels
from gossipd.node.net.cpubudget import SAMPLE_S, CpuBudget
from gossipd.node.net.health import PeerHealth, Retries
from gossipd.node.net.inbound import Inbound
from gossipd.node.net.metrics import NodeMetrics
from gossipd.node.net.outbound import Outbound
from gossipd.node.net.peering import Peering, PeeringSettings
from gossipd.node.net.port import NetworkPort
from gossipd.node.net.pulling import Puller
from gossipd.node.net.refusals import Refusals
from gossipd.node.net.servicer import SERVICE, GossipServicer, add_to_server
from gossipd.node.net.shaping import LinkShaper
from gossipd.node.net.tasks import LoopTasks
from gossipd.node.net.transport import CHANNEL_OPTIONS, Identity
from gossipd.node.net.wire import Limits, ReceivedSegment, SegmentAssembler
from gossipd.node.protocols.base import Pull
from gossipd.node.shared.config import NodeConfig, TlsConfig
from gossipd.node.shared.rejections import RejectionLog
from gossipd.node.shared.tls import Credentials
from gossipd.node.trainer.codec import Codec
from gossipd.node.trainer.messages import OutboundPull
from gossipd.node.trainer.replica import Replica
from gossipd.node.trainer.segments import model_checksum
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb

if TYPE_CHECKING:
    from gossipd.coordinator.client import CoordinatorClient

log = logging.getLogger(__name__)
CHECKSUM_INTERVAL_S = 0.2


class _QuietCancelledHandlers(logging.Filter):
    """Drop grpc.aio's ERROR traceback for a handler it cancelled.

    grpc cancels a servicer coroutine when its client gives up (our own peers do,
    after ``gossip.progress_timeout_s``) or when the server stops while a request
    is arriving; both are expected, and a traceback per cancellation would read
    as a crash to an operator and fill the log under a flood.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, asyncio.CancelledError):
            return False
        return "CancelledError" not in record.getMessage()


logging.getLogger("grpc._cython.cygrpc").addFilter(_QuietCancelledHandlers())


def check_port_free(listen: str) -> None:
    """Refuse a taken ``listen`` address with a clear error, before gRPC tries it.

    gRPC's own bind error does not say why, and its C core prints a line of its
    own. Any other probe error is left to gRPC to judge.
    """
    host, _, port_text = listen.rpartition(":")
    if not int(port_text):
        return
    try:
        addresses = socket.getaddrinfo(host.strip("[]"), int(port_text), type=socket.SOCK_STREAM)
    except OSError:
        return
    for family, kind, proto, _, sockaddr in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(sockaddr)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"listen {listen}: address already in use (another gossipd or program "
                    "holds it); pick another port or stop the other process"
                ) from None


class Network:
    """Implements the servicer's ``Handlers`` and drives pushes and anti-entropy."""

    def __init__(
        self, config: NodeConfig, replica: Replica, metrics: NodeMetrics | None = None
    ) -> None:
        self.config = config
        self.replica = replica
        self.mesh_id = config.mesh_id
        self.node_id = config.node_id
        self.fingerprint = replica.fingerprint
        self.protocol = config.gossip.protocol
        self.incarnation = time.time_ns() // 1000
        self.codec = Codec.parse(config.gossip.codec)
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
        self._serving_pull: str | None = None  # whom a one-pull-at-a-time protocol serves
        self.rejections = RejectionLog(config.limits.rejection_log_interval_s)
        self.refusals = Refusals(self.rejections, self.metrics, replica)
        self.tls = Credentials.from_config(config.tls)
        self.shaper = LinkShaper.from_config(config.link, config.node_id, config.gossip.seed)
        if self.tls.node_id not in (None, self.node_id):
            raise ConfigError(
                f"tls.cert {config.tls.cert} is for node {self.tls.node_id!r}, but node_id is "
                f"{self.node_id!r}; issue one with: gossipd certs issue {self.node_id} --dir CA_DIR"
            )
        self._build_parts(config, replica)
        self._checksum_lock = asyncio.Lock()
        self._checksum_at = -math.inf

    def _build_parts(self, config: NodeConfig, replica: Replica) -> None:
        """The parts, each given the few collaborators it calls, in dependency order:
        nothing below calls back into a part built after it."""
        self.channels = PeerChannels(
            tls=self.tls,
            codec=self.codec,
            chunk_bytes=config.gossip.chunk_bytes,
            shaper=self.shaper,
            bulk=config.bulk,
            tasks=self.tasks,
        )
        self.health = PeerHealth(
            config.node_id, config.membership, replica, self.metrics, Retries()
        )
        self.membership = self.health.membership
        self.budget = CpuBudget(config.gossip.cpu_share)
        self.metrics.gossip_cpu_budget.set(config.gossip.cpu_share)
        self.metrics.gossip_cpu_share.set_function(self.budget.gossip_share)
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
        self.peering = Peering(
            PeeringSettings.from_config(config, self.fingerprint),
            health=self.health,
            channels=self.channels,
            pushes=self.outbound,
            refusals=self.refusals,
            replica=replica,
            metrics=self.metrics,
            tasks=self.tasks,
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
            chunk_bytes=config.gossip.chunk_bytes,
            merge_wait_s=config.limits.merge_wait_s,
            replica=replica,
            metrics=self.metrics,
            codec=self.codec,
            health=self.health,
            departure=self.outbound,
            shaper=self.shaper,
        )
        # The coordinator's client, started with the node once its address is known
        # (None: no coordinator configured, the node schedules alone).
        self.coordinator: CoordinatorClient | None = None

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Bind, serve, start gossiping; on any failure the server is stopped before raising.

        SO_REUSEPORT is off: with gRPC's default (on), a second daemon given a
        taken port binds it too, and the kernel splits connections between two
        nodes that both answer at one address.
        """
        loop = asyncio.get_running_loop()
        listen = self.config.listen
        host = listen.rpartition(":")[0]
        check_port_free(listen)
        ages = server_options(self.config, self.replica.flat.plan)
        server = grpc.aio.server(options=[*CHANNEL_OPTIONS, *ages, ("grpc.so_reuseport", 0)])
        try:
            servicer = GossipServicer(self)
            add_to_server(servicer, server, {"Exchange": exchange.method_handler(servicer)})
            health_servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            reflection.enable_server_reflection(
                (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
            )
            try:
                port = self.tls.add_port(server, listen)
            except RuntimeError:
                raise ConfigError(
                    f"listen {listen}: cannot bind it (in use, or not an address of this "
                    "machine); pick another address or port"
                ) from None
            self.address = self.config.advertise or f"{host}:{port}"
            if self.config.bulk:
                limits = self.config.limits
                self.bulk = BulkServer(
                    self.tls,
                    idle_s=limits.stream_idle_timeout_s,
                    per_peer=limits.max_inbound_pushes_per_peer,
                    total=limits.max_inbound_pushes,
                    on_rejected=self.refusals.refused,
                    metrics=self.metrics,
                )
                await self.bulk.start(host, self.config.bulk_port)
            await server.start()
            await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
            await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
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
        await self._start_coordinator_client()
        self.replica.attach(
            NetworkPort(
                loop=loop,
                replica=self.replica,
                outbound=self.outbound,
                puller=self.puller,
                tasks=self.tasks,
                coordinator=self.coordinator,
            )
        )
        self.tasks.spawn(self.peering.run(), "anti-entropy")
        self.tasks.spawn(self._measure_cpu(), "cpu-budget")
        log.info(
            "node %s serving on %s with %s (fingerprint %s), %s",
            self.node_id,
            self.address,
            "plaintext gRPC" if self.tls.insecure else "mutual TLS",
            self.fingerprint,
            f"bulk lane on port {self.bulk.port}" if self.bulk else "no bulk lane (bulk = false)",
        )
        if self.tls.insecure:
            log.warning(
                "tls.insecure = true: anyone who reaches %s can read the model and speak for "
                "any node id; give [tls] ca, cert and key (gossipd certs) to require certificates",
                self.address,
            )

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

    async def _start_coordinator_client(self) -> None:
        """With ``coordinator`` set: register there and follow its view (its addresses are
        dialled like seeds); the overlap protocol asks it for pulls. It never holds the
        node up: unreachable, the node schedules alone until it answers."""
        if self.config.coordinator is None:
            return
        from gossipd.coordinator.client import CoordinatorClient

        self.coordinator = CoordinatorClient(
            self.config.coordinator,
            mesh_id=self.mesh_id,
            advertise=self.address,
            tls=self.tls,
            on_view=self.peering.heard_view,
        )
        await self.coordinator.start()
        log.info(
            "coordinator %s: registering (until it answers, this node schedules its pulls alone)",
            self.config.coordinator,
        )

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
        """SIGHUP: read the certificate files (and ``tls``: paths, allow-list) again.

        The server hands the new certificate to each new connection. Channels to
        peers are replaced, so this node presents it when dialling too; pushes in
        flight on an old channel end with an unknown outcome and are retried.
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
        self.tasks.spawn(self.peering.drop_disallowed())
        log.info(
            "SIGHUP: reloaded the TLS files; certificate for %s valid until %s",
            material.node_id,
            material.not_after,
        )

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
        await self.outbound.leave_mesh()

    async def wait_for_peers(self, count: int, timeout_s: float) -> bool:
        return await self.peering.wait_for_peers(count, timeout_s)

    # -- Handlers (called by the servicer) ---------------------------------------------
    def new_assembler(self) -> SegmentAssembler:
        """A push's assembler; it gauges each segment against our own as it arrives."""
        return SegmentAssembler(self.replica.flat.plan, self.limits, gauge=self.replica.gauge)

    def on_handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeReply:
        """Answer at once; the claimant becomes a peer only after our own dial to it."""
        if self.leaving:
            raise Leaving(f"node {self.node_id} is leaving the mesh; it takes no new peers")
        self.peering.hear(request.node, direct=True)
        assert self.identity is not None
        return pb.HandshakeReply(
            schema_version=SCHEMA_VERSION,
            node=self.identity.info(),
            fingerprint=self.fingerprint,
            step=self.replica.summary.steps,
            peers=self.peering.known(),
            protocol=self.config.gossip.protocol,
            bulk_port=self.bulk.port if self.bulk is not None else 0,
            bulk_sealed=self.bulk is not None and not self.bulk.tls.insecure,
        )

    def check_sender(self, sender: str, incarnation: int) -> None:
        self.health.check_sender(sender, incarnation)

    async def on_push(
        self, open_: pb.PushOpen, segments: list[ReceivedSegment], deadline_s: float | None
    ) -> pb.PushReply:
        return await self.inbound.on_push(open_, segments, deadline_s)

    def on_pull(
        self, request: pb.PullRequest, whole: bool = False, sealed: bool = False
    ) -> AsyncIterator[pb.SegmentHeader | memoryview]:
        if request.round and self.replica.core.serves_one_pull:
            return self._serve_one_pull(request, whole, sealed)
        return self.inbound.on_pull(request, whole, sealed)

    async def _serve_one_pull(
        self, request: pb.PullRequest, whole: bool, sealed: bool
    ) -> AsyncIterator[pb.SegmentHeader | memoryview]:
        """One protocol pull at a time (a join's bootstrap, round 0, is never refused):
        when several nodes scheduling alone pick this one, it serves one and the others
        hear at once that it is busy and pick another peer (docs/design.md §5)."""
        if self._serving_pull is not None:
            raise Busy(
                f"serving a pull to {self._serving_pull} already; this protocol serves one "
                "pull at a time: pick another peer"
            )
        self._serving_pull = request.requester or "a peer"
        try:
            async for item in self.inbound.on_pull(request, whole, sealed):
                yield item
        finally:
            self._serving_pull = None

    async def on_peer_left(self, request: pb.LeaveRequest, peer: str = "") -> None:
        await self.peering.on_peer_left(
            request.node_id, request.incarnation, peer or request.node_id
        )

    def on_peers(self, request: pb.PeersRequest) -> pb.PeersReply:
        self.peering.hear(request.sender, direct=True)
        for info in request.known[: self.config.membership.max_candidates]:
            self.peering.hear(info)
        assert self.identity is not None
        return pb.PeersReply(peers=[self.identity.info(), *self.peering.known()])

    async def on_status(self, checksum: bool = False) -> pb.StatusReply:
        """Answered from the trainer's published summary: never waits on a step."""
        s = self.replica.summary
        return pb.StatusReply(
            node_id=self.node_id,
            mesh_id=self.mesh_id,
            step=s.steps,
            sum_weights=s.weights,
            live_peers=[p.node_id for p in self.membership.live()],
            fingerprint=self.fingerprint,
            params_checksum=await self._checksum() if checksum else "",
            protocol=s.protocol,
            loss=s.loss,
            pushes_in_flight=s.in_flight,
            training_done=self.replica.training_done,
            pushes_acked=s.pushes_acked,
            pushes_failed=s.pushes_failed,
            pushes_merged=s.pushes_merged,
            peers=self.peering.known(),
            suspected_peers=[p.node_id for p in self.membership.suspected()],
            rejected=dict(self.rejections.counts),
            reserved_weights=s.reserved,
            round=s.round,
            membership_epoch=s.epoch,
            transport_security="insecure" if self.tls.insecure else "mtls",
            exchanged=[
                pb.PeerMass(node_id=peer, **dataclasses.asdict(mass))
                for peer, mass in sorted(s.exchanged.items())
            ],
            mass_inconsistencies=self.outbound.mass_inconsistencies,
            wait_s=s.wait_s,
            wait_fraction=s.wait_fraction,
            scheduling=s.scheduling,
        )

    async def _checksum(self) -> str:
        """A fresh hash of the model, one at a time and at most every CHECKSUM_INTERVAL_S.

        The copy is taken under the trainer's lock (a memcpy); the hashing runs off it.
        """
        async with self._checksum_lock:
            wait_s = self._checksum_at + CHECKSUM_INTERVAL_S - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            self._checksum_at = time.monotonic()

            def compute() -> str:
                with self.replica.lock:
                    copies = [b.detach().cpu().clone() for b in self.replica.flat.buffers]
                return model_checksum(copies)

            return await asyncio.to_thread(compute)

    def on_rejected(self, peer: str, err: GossipdError) -> None:
        self.refusals.refused(peer, err)
