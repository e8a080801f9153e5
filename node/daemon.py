"""The network side of a node: gRPC server, peer clients, membership, pushes in flight.

Runs on one asyncio loop and never writes parameters: inbound pushes go to the
trainer's inbox, outbound pushes come from the trainer as snapshots, and
snapshots for PullModel and status are taken under the trainer's lock in a
worker thread so a long step never stalls the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gossipd.node.codec import Codec
from gossipd.node.config import NodeConfig
from gossipd.node.errors import Busy, GossipdError, PeerUnreachable, UnknownPeer
from gossipd.node.membership import Change, Membership
from gossipd.node.metrics import NodeMetrics
from gossipd.node.rejections import RejectionLog, peer_host
from gossipd.node.servicer import SERVICE, GossipServicer, add_to_server
from gossipd.node.trainer import GossipTrainer, InboundPush, OutboundPush
from gossipd.node.transport import CHANNEL_OPTIONS, Identity, PeerClient
from gossipd.node.wire import Limits, ReceivedSegment, SegmentAssembler, segment_frames
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)
RPC_TIMEOUT_S = 5.0


class Node:
    """Implements the servicer's ``Handlers`` and drives pushes and anti-entropy."""

    def __init__(
        self, config: NodeConfig, trainer: GossipTrainer, metrics: NodeMetrics | None = None
    ) -> None:
        self.config = config
        self.trainer = trainer
        self.mesh_id = config.mesh_id
        self.node_id = config.node_id
        self.fingerprint = trainer.fingerprint
        self.incarnation = time.time_ns() // 1000
        self.codec = Codec.parse(config.gossip.codec)
        self.limits = Limits(config.limits.max_chunk_bytes, config.limits.max_segment_bytes)
        self.metrics = metrics or NodeMetrics()
        self.membership = Membership(
            config.node_id,
            suspect_after_failures=config.membership.suspect_after_failures,
            drop_after_s=config.membership.drop_after_s,
        )
        self.rng = random.Random(config.gossip.seed ^ 0x5EED)
        self.address = config.advertise or config.listen
        self.identity: Identity | None = None
        self.server: grpc.aio.Server | None = None
        self.clients: dict[str, PeerClient] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.stopping = asyncio.Event()
        self._membership_round = asyncio.Lock()
        self.rejections = RejectionLog(config.limits.rejection_log_interval_s)

    # -- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        add_to_server(GossipServicer(self), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        port = server.add_insecure_port(self.config.listen)
        host = self.config.listen.rpartition(":")[0]
        self.address = self.config.advertise or f"{host}:{port}"
        await server.start()
        await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        self.server = server
        self.identity = Identity(
            self.mesh_id, self.node_id, self.address, self.incarnation, self.fingerprint
        )
        if self.config.metrics.listen:
            mhost, _, mport = self.config.metrics.listen.rpartition(":")
            self.metrics.serve(mhost, int(mport))
        self.metrics.info.labels(self.node_id, self.mesh_id, self.fingerprint).set(1)
        self.trainer.send = lambda out: loop.call_soon_threadsafe(self._spawn, self._push(out))
        self._spawn(self._anti_entropy(), "anti-entropy")
        log.info(
            "node %s serving on %s (fingerprint %s)", self.node_id, self.address, self.fingerprint
        )

    async def close(self, grace_s: float = 1.0) -> None:
        self.stopping.set()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for client in self.clients.values():
            await client.close()
        if self.server is not None:
            await self.server.stop(grace_s)
        self.metrics.close()

    def _spawn(self, coro: object, name: str | None = None) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        if name:
            task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def client(self, address: str) -> PeerClient:
        assert self.identity is not None, "start() the node first"
        if address not in self.clients:
            self.clients[address] = PeerClient(
                address,
                self.identity,
                codec=self.codec,
                chunk_bytes=self.config.gossip.chunk_bytes,
            )
        return self.clients[address]

    def _apply(self, change: Change | None) -> None:
        if change is not None:
            log.info("peer %s is %s", change.node_id, "live" if change.live else "down")
            self.trainer.post_peer(change.node_id, change.live)
        self.metrics.live_peers.set(len(self.membership.live()))

    # -- outbound -------------------------------------------------------------------
    async def _push(self, out: OutboundPush) -> None:
        peer = self.membership.peers.get(out.push.peer)
        nbytes = sum(t.numel() * t.element_size() for t in out.snapshot.values())
        if peer is None:
            self.trainer.post_push_result(out, [], f"peer {out.push.peer} left the view")
            return
        try:
            acks = await self.client(peer.address).push(out, self.config.gossip.push_timeout_s)
        except GossipdError as err:
            self.metrics.messages.labels("sent", "failed").inc()
            self.metrics.bytes.labels("sent", "failed").inc(nbytes)
            self.trainer.post_push_result(out, [], str(err))
            if isinstance(err, PeerUnreachable):
                self._failed(peer.node_id, err)
            return
        self.metrics.messages.labels("sent", "ok").inc()
        self.metrics.bytes.labels("sent", "ok").inc(nbytes)
        self.trainer.post_push_result(out, acks, None)
        self._apply(self.membership.succeeded(peer.node_id))

    async def push_now(self, out: OutboundPush) -> list[pb.SegmentAck]:
        """Push outside the trainer's schedule (graceful leave); raises on failure."""
        peer = self.membership.peers[out.push.peer]
        return await self.client(peer.address).push(out, self.config.gossip.push_timeout_s)

    async def leave_mesh(self) -> None:
        """Settle pushes in flight, hand all weight to a live peer, then tell every peer.

        Call only once the trainer thread has stopped stepping.
        """
        pushes = [t for t in self.tasks if t.get_name() != "anti-entropy"]
        if pushes:
            await asyncio.wait(pushes, timeout=self.config.gossip.push_timeout_s)
        self.trainer.idle(0)
        live = {s.node_id for s in self.membership.live()}
        candidates = sorted(live & self.trainer.core.peers)
        out = self.trainer.leave(self.rng.choice(candidates)) if candidates else None
        if out is not None:
            try:
                acks = await self.push_now(out)
            except GossipdError as err:
                self.trainer.settle_push(out, [], str(err))
                log.warning("weight hand-off to %s failed: %s", out.push.peer, err)
            else:
                self.trainer.settle_push(out, acks, None)
                log.info("handed weight to %s", out.push.peer)
            self.trainer.summary.update(self.trainer)
        clients = [self.client(s.address) for s in self.membership.live()]
        results = await asyncio.gather(
            *(c.leave(RPC_TIMEOUT_S) for c in clients), return_exceptions=True
        )
        for client, result in zip(clients, results, strict=True):
            if isinstance(result, BaseException):
                log.debug("Leave to %s failed: %s", client.address, result)

    async def introduce(self, address: str) -> pb.NodeInfo | None:
        """Handshake with ``address``; on success the peer is live and its peers are learned."""
        try:
            reply = await self.client(address).handshake(RPC_TIMEOUT_S)
        except GossipdError as err:
            log.debug("handshake with %s failed: %s", address, err)
            return None
        self._apply(self.membership.introduced(reply.node))
        for info in reply.peers:
            self.membership.learn(info)
        return reply.node

    async def _anti_entropy(self) -> None:
        interval = self.config.membership.anti_entropy_interval_s
        while not self.stopping.is_set():
            await self._gossip_membership()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), interval)

    async def _gossip_membership(self) -> None:
        async with self._membership_round:
            await self._membership_round_once()

    async def _membership_round_once(self) -> None:
        now = time.monotonic()
        for node_id in self.membership.expire(now):
            log.info("dropped %s after %.0f s suspected", node_id, self.membership.drop_after_s)
        pending = [s for s in self.membership.peers.values() if not s.live]
        known = {s.address for s in self.membership.peers.values()}
        seeds = [a for a in self.config.seeds if a not in known and a != self.address]
        await asyncio.gather(
            *(self._retry(s.node_id, s.address) for s in pending),
            *(self.introduce(a) for a in seeds),
        )
        live = self.membership.live()
        if not live:
            return
        target = self.rng.choice(live)
        try:
            infos = await self.client(target.address).peers(self.membership.known(), RPC_TIMEOUT_S)
        except GossipdError as err:
            self._failed(target.node_id, err)
            return
        self._apply(self.membership.succeeded(target.node_id))
        for info in infos:
            self.membership.learn(info)

    async def _retry(self, node_id: str, address: str) -> None:
        if await self.introduce(address) is None:
            self._failed(node_id, "handshake failed")

    def _failed(self, node_id: str, why: object) -> None:
        change = self.membership.failed(node_id, time.monotonic())
        if change is not None:
            log.info("suspecting %s: %s", node_id, why)
        self._apply(change)

    async def wait_for_peers(self, count: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while len(self.membership.live()) < count:
            if time.monotonic() > deadline:
                return False
            await self._gossip_membership()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), 0.1)
        return True

    # -- Handlers (called by the servicer) ---------------------------------------------
    def new_assembler(self) -> SegmentAssembler:
        return SegmentAssembler(self.trainer.flat.plan, self.limits)

    def on_handshake(self, request: pb.HandshakeRequest) -> pb.HandshakeReply:
        node = request.node
        self._apply(self.membership.introduced(node))
        self.trainer.post(lambda _: self.trainer.core.forget_sender(node.node_id, node.incarnation))
        assert self.identity is not None
        return pb.HandshakeReply(
            schema_version=SCHEMA_VERSION,
            node=self.identity.info(),
            fingerprint=self.fingerprint,
            step=self.trainer.summary.steps,
            peers=self.membership.known(),
        )

    def check_sender(self, sender: str, incarnation: int) -> None:
        state = self.membership.peers.get(sender)
        if state is None or state.incarnation != incarnation:
            raise UnknownPeer(
                f"sender {sender!r} (incarnation {incarnation}) has not completed a Handshake "
                "with this node; handshake first"
            )

    async def on_push(
        self, open_: pb.PushOpen, segments: list[ReceivedSegment], deadline_s: float | None
    ) -> pb.PushReply:
        item = InboundPush(open_.sender, open_.incarnation, open_.sequence, segments)
        nbytes = sum(s.values.numel() * s.values.element_size() for s in segments)
        self.trainer.inbox.put(item)
        wait_s = max(0.1, (deadline_s or self.config.gossip.push_timeout_s) * 0.8)
        future = asyncio.wrap_future(item.reply)
        try:
            acks = await asyncio.wait_for(asyncio.shield(future), wait_s)
        except TimeoutError:
            if item.reply.cancel():
                raise Busy(
                    f"trainer did not reach a step boundary within {wait_s:.1f} s; "
                    "the push was not merged, retry later"
                ) from None
            acks = await future
        self.metrics.messages.labels("received", "ok").inc()
        self.metrics.bytes.labels("received", "ok").inc(nbytes)
        self._apply(self.membership.succeeded(open_.sender))
        return pb.PushReply(acks=acks)

    async def on_pull(self, request: pb.PullRequest) -> AsyncIterator[pb.PullFrame]:
        snapshot, weights = await asyncio.to_thread(self._snapshot)
        codec = Codec(request.codec) if request.codec in iter(Codec) else self.codec
        for index, flat in snapshot.items():
            for frame in segment_frames(
                sender=self.node_id,
                sequence=0,
                segment=index,
                sum_weight=weights[index],
                flat=flat,
                codec=codec,
                chunk_bytes=self.config.gossip.chunk_bytes,
            ):
                if isinstance(frame, bytes):
                    yield pb.PullFrame(chunk=frame)
                else:
                    yield pb.PullFrame(header=frame)
        self.metrics.messages.labels("sent", "pull").inc()

    def _snapshot(self) -> tuple[dict[int, object], list[float]]:
        with self.trainer.lock:
            return self.trainer.flat.snapshot(), list(self.trainer.core.weights)

    def on_leave(self, request: pb.LeaveRequest) -> None:
        self._apply(self.membership.departed(request.node_id))

    def on_peers(self, request: pb.PeersRequest) -> pb.PeersReply:
        for info in request.known:
            self.membership.learn(info)
        assert self.identity is not None
        return pb.PeersReply(peers=[self.identity.info(), *self.membership.known()])

    async def on_status(self) -> pb.StatusReply:
        def read() -> tuple[str, int, list[float], float, int]:
            with self.trainer.lock:
                t = self.trainer
                weights = list(t.core.weights)
                return t.flat.checksum(), t.steps, weights, t.last_loss, len(t.core.in_flight)

        checksum, steps, weights, loss, in_flight = await asyncio.to_thread(read)
        return pb.StatusReply(
            node_id=self.node_id,
            mesh_id=self.mesh_id,
            step=steps,
            sum_weights=weights,
            live_peers=[s.node_id for s in self.membership.live()],
            fingerprint=self.fingerprint,
            params_checksum=checksum,
            protocol=self.config.gossip.protocol,
            loss=loss,
            pushes_in_flight=in_flight,
            training_done=self.trainer.training_done,
        )

    def on_rejected(self, peer: str, err: GossipdError) -> None:
        """Count every refusal; log and report it once per peer and reason per interval."""
        reason = type(err).__name__
        self.metrics.rejected.labels(reason).inc()
        self.metrics.messages.labels("received", "rejected").inc()
        if self.rejections.record(peer_host(peer), reason, str(err)):
            self.trainer.post_rejection(peer, reason, str(err))
