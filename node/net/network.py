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
import random
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gossipd.node.errors import (
    Busy,
    ConfigError,
    GossipdError,
    Leaving,
    UnknownPeer,
)
from gossipd.node.net import exchange
from gossipd.node.net.admission import server_options
from gossipd.node.net.bulk import BulkServer
from gossipd.node.net.cpubudget import SAMPLE_S, CpuBudget
from gossipd.node.net.inbound import Inbound
from gossipd.node.net.metrics import NodeMetrics
from gossipd.node.net.outbound import Outbound
from gossipd.node.net.peering import Peering
from gossipd.node.net.port import NetworkPort, PeerScheduler
from gossipd.node.net.pulling import Puller
from gossipd.node.net.servicer import SERVICE, GossipServicer, add_to_server
from gossipd.node.net.shaping import LinkShaper
from gossipd.node.net.transport import CHANNEL_OPTIONS, Identity, PeerClient
from gossipd.node.net.wire import Limits, ReceivedSegment, SegmentAssembler
from gossipd.node.protocols.base import Pull
from gossipd.node.shared.config import NodeConfig, TlsConfig
from gossipd.node.shared.rejections import RejectionLog, peer_host
from gossipd.node.shared.tls import Credentials
from gossipd.node.trainer.codec import Codec
from gossipd.node.trainer.messages import (
    OutboundPull,
    Rejected,
)
from gossipd.node.trainer.replica import Replica
from gossipd.node.trainer.segments import model_checksum
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb

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
        self.metrics.follow(lambda: self.replica.summary)
        self.rng = random.Random(config.gossip.seed ^ 0x5EED)
        self.address = config.advertise or config.listen
        self.identity: Identity | None = None
        self.server: grpc.aio.Server | None = None
        self.bulk: BulkServer | None = None
        self.clients: dict[str, PeerClient] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = asyncio.Event()
        # The coordinator client, once the site starts one (None: decentralized).
        self.coordinator: PeerScheduler | None = None
        self._serving_pull: str | None = None  # whom a one-pull-at-a-time protocol serves
        self.rejections = RejectionLog(config.limits.rejection_log_interval_s)
        self.tls = Credentials.from_config(config.tls)
        self.shaper = LinkShaper.from_config(config.link, config.node_id, config.gossip.seed)
        if self.tls.node_id not in (None, self.node_id):
            raise ConfigError(
                f"tls.cert {config.tls.cert} is for node {self.tls.node_id!r}, but node_id is "
                f"{self.node_id!r}; issue one with: gossipd certs issue {self.node_id} --dir CA_DIR"
            )
        self.peering = Peering(
            config=config,
            replica=replica,
            fingerprint=self.fingerprint,
            tls=self.tls,
            identity=lambda: self.identity,
            client=self.client,
            forget_client=self.forget_client,
            rejections=self.rejections,
            on_rejected=self.on_rejected,
            settle_pushes_to=lambda peer, timeout_s: self.outbound.settle_pushes_to(
                peer, timeout_s
            ),
            retry_now=lambda: self.outbound.retry_now(),
            metrics=self.metrics,
            spawn=self.spawn,
            stopping=self.stopping,
        )
        self.budget = CpuBudget(config.gossip.cpu_share)
        self.metrics.gossip_cpu_budget.set(config.gossip.cpu_share)
        self.metrics.gossip_cpu_share.set_function(self.budget.gossip_share)
        self.outbound = Outbound(
            config=config,
            replica=replica,
            budget=self.budget,
            membership=self.peering.membership,
            client=self.client,
            metrics=self.metrics,
            succeeded=self.peering.succeeded,
            failed=self.peering.failed,
            spawn=self.spawn,
            stopping=self.stopping,
            rng=self.rng,
        )
        self.membership = self.peering.membership
        self.puller = Puller(
            replica=replica,
            membership=self.membership,
            client=self.client,
            metrics=self.metrics,
            gossip=config.gossip,
            limits=self.limits,
            succeeded=self.peering.succeeded,
            failed=self.peering.failed,
        )
        self.inbound = Inbound(
            config=config,
            replica=replica,
            metrics=self.metrics,
            codec=self.codec,
            check_sender=self.check_sender,
            succeeded=self.peering.succeeded,
            leaving=lambda: self.outbound.leaving,
            shaper=self.shaper,
        )
        self._checksum_lock = asyncio.Lock()
        self._checksum_at = -math.inf

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
                    on_rejected=self.on_rejected,
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
        self.replica.attach(
            NetworkPort(
                loop=loop,
                replica=self.replica,
                outbound=self.outbound,
                start_pull=lambda out: self.spawn(self.puller.pull(out), f"pull:{out.pull.peer}"),
                hurry_pull=self.puller.hurry,
                coordinator=lambda: self.coordinator,
                spawn=self.spawn,
                stopping=self.stopping,
            )
        )
        self.spawn(self.peering.run(), "anti-entropy")
        self.spawn(self._measure_cpu(), "cpu-budget")
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
            if self.server is not None:
                await self.server.stop(grace_s)
            if self.bulk is not None:
                await self.bulk.close()
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            for client in list(self.clients.values()):
                await client.close()
        finally:
            self.metrics.close()

    async def _measure_cpu(self) -> None:
        """Keep the CPU budget's window filled, pushes or not (its samples are its clock)."""
        while not self.stopping.is_set():
            self.budget.gossip_share()
            await asyncio.sleep(SAMPLE_S)

    def spawn(self, coro: object, name: str | None = None) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        if name:
            task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def client(self, address: str, node_id: str) -> PeerClient:
        """The channel to verified peer ``node_id`` (whose certificate must name it)."""
        assert self.identity is not None, "start() the node first"
        client = self.clients.get(address)
        if client is None or client.expected != node_id:
            if client is not None:
                self.spawn(client.close())
            client = self.clients[address] = PeerClient(
                address,
                self.identity,
                codec=self.codec,
                chunk_bytes=self.config.gossip.chunk_bytes,
                tls=self.tls,
                expected=node_id,
                shaper=self.shaper,
                bulk=self.config.bulk,
            )
        return client

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
        old, self.clients = self.clients, {}
        for client in old.values():
            self.spawn(client.close())
        self.spawn(self.peering.drop_disallowed())
        log.info(
            "SIGHUP: reloaded the TLS files; certificate for %s valid until %s",
            material.node_id,
            material.not_after,
        )

    def forget_client(self, address: str) -> None:
        """Close the channel to an address no verified peer holds any more."""
        client = self.clients.pop(address, None)
        if client is not None:
            self.spawn(client.close())

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
        self.spawn(self.puller.pull(out), f"bootstrap:{peer}")
        await asyncio.wrap_future(out.adopted)

    def retry_now(self) -> None:
        self.outbound.retry_now()

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
        if not self.membership.is_current(sender, incarnation):
            raise UnknownPeer(
                f"sender {sender!r} (incarnation {incarnation}) is not a verified peer of "
                f"{self.node_id}: it must Handshake and answer this node's Handshake at the "
                "address it advertises (usual for a moment after that peer starts or rejoins; "
                "its push is retried)"
            )

    async def on_push(
        self, open_: pb.PushOpen, segments: list[ReceivedSegment], deadline_s: float | None
    ) -> pb.PushReply:
        return await self.inbound.on_push(open_, segments, deadline_s)

    def on_pull(
        self, request: pb.PullRequest, whole: bool = False, sealed: bool = False
    ) -> AsyncIterator[pb.SegmentHeader | memoryview]:
        if request.round and getattr(self.replica.core, "serves_one_pull", False):
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
        """Count every refusal; log and report it once per peer and reason per interval."""
        reason = type(err).__name__
        self.metrics.rejected.labels(reason).inc()
        self.metrics.messages.labels("received", "request", "rejected").inc()
        if isinstance(err, Leaving):
            self.rejections.counts[reason] += 1  # our own refusal while leaving: not news
            return
        # A push from a peer not verified (yet) is the rejoin race: a restarted peer pushes
        # before this node's own Handshake to it completed, and is live a moment later
        # (its push is retried). Counted like any refusal, but not a warning.
        level = logging.INFO if isinstance(err, UnknownPeer) else logging.WARNING
        if self.rejections.record(peer_host(peer), reason, str(err), level=level):
            self.replica.post(Rejected(peer, reason, str(err)))
