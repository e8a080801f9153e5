"""A node's side of the coordinator: register, heartbeat, follow the view, ask for pulls.

The node's event loop owns one :class:`CoordinatorClient`. It never stalls the node:
:meth:`CoordinatorClient.start` returns at once and keeps trying in the background
(capped exponential backoff); :meth:`start_time` and :meth:`report` have short
deadlines and raise :class:`CoordinatorUnavailable` on any failure, so the caller
schedules on its own at once. :attr:`available` says which mode the node is in: it
turns False after ``missed_heartbeats`` consecutive failed calls (10 s at the
defaults) and True again once the coordinator has the node registered.

The coordinator is dialed expecting ``gossipd-coordinator`` in its certificate
(:data:`gossipd.node.shared.certs.COORDINATOR_DNS_NAME`): a site certificate of the same CA
cannot pose as the coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

import grpc

from gossipd.node.errors import GossipdError
from gossipd.node.shared import certs
from gossipd.node.shared.tls import Credentials
from gossipd.proto import coordinator_pb2 as pb
from gossipd.proto import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger("gossipd.coordinator.client")
OnView = Callable[[dict[str, str], int], None]
FIRST_RETRY_S = 0.1


class CoordinatorUnavailable(GossipdError):
    """The coordinator did not answer (or refused): schedule decentrally for now."""


class CoordinatorClient:
    def __init__(
        self,
        address: str,
        *,
        mesh_id: str,
        advertise: str,
        tls: Credentials,
        on_view: OnView | None = None,
        missed_heartbeats: int = 5,
        heartbeat_interval_s: float = 2.0,
        rpc_timeout_s: float = 1.0,
        retry_max_s: float = 10.0,
    ) -> None:
        """``advertise``: the address other sites dial this node at. ``heartbeat_interval_s``
        is used until the coordinator's Register reply names its own."""
        if missed_heartbeats < 1 or heartbeat_interval_s <= 0 or rpc_timeout_s <= 0:
            raise GossipdError(
                "missed_heartbeats must be >= 1, heartbeat_interval_s and rpc_timeout_s > 0"
            )
        self.address = address
        self.mesh_id = mesh_id
        self.advertise = advertise
        self.on_view = on_view
        self.missed_heartbeats = missed_heartbeats
        self.heartbeat_interval_s = heartbeat_interval_s
        self.rpc_timeout_s = rpc_timeout_s
        self.retry_max_s = retry_max_s
        self.epoch = 0
        self.members: dict[str, str] = {}
        self.seed: int | None = None  # the mesh's shared seed, as the coordinator derives it
        self.coordinator: str | None = None  # the name in the coordinator's certificate
        self._available = False
        self._changed = asyncio.Condition()
        self._misses = 0
        self._reregister = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        backoff_ms = str(int(FIRST_RETRY_S * 1000))
        self._channel = tls.channel(
            address,
            [
                ("grpc.initial_reconnect_backoff_ms", backoff_ms),
                ("grpc.min_reconnect_backoff_ms", backoff_ms),
                ("grpc.max_reconnect_backoff_ms", str(int(retry_max_s * 1000))),
            ],
            expected=certs.COORDINATOR_DNS_NAME,
        )
        self._stub = pb_grpc.CoordinatorStub(self._channel)

    @property
    def available(self) -> bool:
        """True while the coordinator has this node registered and answers its heartbeats."""
        return self._available

    async def wait_available(self, value: bool = True) -> None:
        """Return once :attr:`available` is ``value`` (wrap it in a timeout)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._available == value)

    async def start(self) -> None:
        """Start registering and heartbeating in the background; never raises."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="coordinator-client")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._channel.close()

    # -- the two scheduling calls ---------------------------------------------------------
    async def start_time(self, end_in_s: float) -> tuple[str, float] | None:
        """(peer, start_in_s): pull from ``peer`` starting that many seconds from now, so that
        it lands when this node's period ends in ``end_in_s``; None: no peer free, ask again."""
        reply = await self._call(
            "StartTime", pb.StartTimeRequest(mesh_id=self.mesh_id, end_in_s=end_in_s)
        )
        return (reply.peer, reply.start_in_s) if reply.granted else None

    async def report(self, peer: str, transfer_s: float) -> None:
        """The pull from ``peer`` took ``transfer_s`` (``math.inf``: it failed)."""
        await self._call(
            "ReportTransfer",
            pb.ReportTransferRequest(mesh_id=self.mesh_id, peer=peer, transfer_s=transfer_s),
        )

    async def _call(self, method: str, request: object) -> object:
        if not self._available:
            raise CoordinatorUnavailable(
                f"coordinator {self.address} is not available; schedule on this node"
            )
        try:
            return await getattr(self._stub, method)(request, timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION and "Register" in (
                err.details() or ""
            ):
                self._reregister.set()  # it forgot us (restarted, or dropped us)
            raise CoordinatorUnavailable(
                f"coordinator {self.address} {method}: {err.code().name}: {err.details()}"
            ) from None

    def readvertise(self, address: str) -> None:
        """This node is reached at ``address`` from now on (its relays changed): register
        again with it."""
        if address != self.advertise:
            self.advertise = address
            self._reregister.set()

    # -- background: register, heartbeat, follow the view ---------------------------------
    async def _run(self) -> None:
        retry_s = FIRST_RETRY_S
        while True:
            try:
                reply = await self._stub.Register(
                    pb.RegisterRequest(mesh_id=self.mesh_id, address=self.advertise),
                    timeout=self.rpc_timeout_s,
                )
            except grpc.aio.AioRpcError as err:
                await self._failed("Register", err)
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, self.retry_max_s)
                continue
            retry_s = FIRST_RETRY_S
            self._misses = 0
            self.seed, self.coordinator = reply.shared_seed, reply.coordinator
            if reply.heartbeat_interval_s > 0 and math.isfinite(reply.heartbeat_interval_s):
                self.heartbeat_interval_s = reply.heartbeat_interval_s
            self._view(reply.view)
            await self._set_available(True, "")
            stream = asyncio.create_task(self._follow(), name="coordinator-view")
            try:
                await self._heartbeats(stream)
            finally:
                stream.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stream

    async def _heartbeats(self, stream: asyncio.Task[None]) -> None:
        """Heartbeat until the coordinator forgets this node (then return: register again)."""
        self._reregister.clear()
        due = time.monotonic()
        while True:
            due += self.heartbeat_interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reregister.wait(), max(0.0, due - time.monotonic()))
            if self._reregister.is_set():
                return
            try:
                reply = await self._stub.Heartbeat(
                    pb.HeartbeatRequest(mesh_id=self.mesh_id), timeout=self.rpc_timeout_s
                )
            except grpc.aio.AioRpcError as err:
                if await self._failed("Heartbeat", err):
                    return  # unavailable now: go back to registering, with backoff
                continue
            self._misses = 0
            if not reply.known:
                log.info(
                    "coordinator %s does not know this node (it restarted, or dropped it); "
                    "registering again",
                    self.address,
                )
                return
            if stream.done():  # the view stream broke while heartbeats still pass
                stream = asyncio.create_task(self._follow(), name="coordinator-view")

    async def _follow(self) -> None:
        call = self._stub.Membership(pb.MembershipRequest(mesh_id=self.mesh_id))
        try:
            async for view in call:
                self._view(view)
        except grpc.aio.AioRpcError as err:
            log.debug("coordinator view stream ended: %s", err.details())

    async def _failed(self, method: str, err: grpc.aio.AioRpcError) -> bool:
        """Count one failed call; True once that makes the coordinator unavailable."""
        self._misses += 1
        reason = f"{method}: {err.code().name}: {err.details()}"
        log.debug("coordinator %s %s", self.address, reason)
        if self._misses < self.missed_heartbeats:
            return False
        if self._available:
            await self._set_available(False, reason)
        elif self._misses == self.missed_heartbeats:  # never registered: say so once
            log.warning(
                "coordinator %s unreachable (%d calls failed, last %s); scheduling "
                "decentralized until it answers",
                self.address,
                self._misses,
                reason,
            )
        return True

    async def _set_available(self, value: bool, reason: str) -> None:
        if value == self._available:
            return
        if value:
            log.info(
                "registered with coordinator %s at %s (epoch %d, %d members); pulls are "
                "scheduled through it",
                self.coordinator,
                self.address,
                self.epoch,
                len(self.members),
            )
        else:
            log.warning(
                "coordinator %s unreachable (%d calls failed, last %s); scheduling "
                "decentralized until it returns",
                self.address,
                self._misses,
                reason,
            )
        if value:
            self._misses = 0
        async with self._changed:
            self._available = value
            self._changed.notify_all()

    def _view(self, view: pb.View) -> None:
        members = {m.node_id: m.address for m in view.members}
        if (members, view.epoch) == (self.members, self.epoch):
            return
        self.members, self.epoch = members, view.epoch
        if self.on_view is not None:
            try:
                self.on_view(dict(members), view.epoch)
            except Exception:
                log.exception("on_view callback failed on epoch %d", view.epoch)
