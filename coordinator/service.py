"""The ``Coordinator`` gRPC service: check who asks and what they ask, then keep the books.

Who asks is the node id in the caller's client certificate (``Credentials.peer_id``),
never a field of a message. Every refusal is a gRPC status whose text names the value
and the fix, a count in ``gossipd_coordinator_rejected_total{reason}`` and a
rate-limited log line; the coordinator then serves the next request as before.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc

from gossipd.coordinator.members import Members, View
from gossipd.coordinator.metrics import CoordinatorMetrics
from gossipd.node.errors import GossipdError
from gossipd.node.protocols.scheduler import MAX_TIME_S, SchedulerError
from gossipd.node.shared.rejections import RejectionLog, peer_host
from gossipd.node.shared.relay_address import check_advertised
from gossipd.node.shared.tls import Credentials
from gossipd.proto import coordinator_pb2 as pb
from gossipd.proto import coordinator_pb2_grpc as pb_grpc

SERVICE = "gossipd.coordinator.v1.Coordinator"
MAX_ADDRESS_CHARS = 256
REJECTION_LOG_INTERVAL_S = 60.0
T = TypeVar("T")


class Refused(GossipdError):
    """A request the coordinator answers with ``code`` and this text, counted as ``reason``."""

    def __init__(self, reason: str, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.code = code


def view_message(view: View) -> pb.View:
    return pb.View(
        members=[pb.Member(node_id=n, address=a) for n, a in view.members.items()],
        epoch=view.epoch,
    )


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(
        self,
        *,
        mesh_id: str,
        name: str,
        seed: int,
        heartbeat_interval_s: float,
        max_members: int,
        members: Members,
        tls: Credentials,
        metrics: CoordinatorMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.mesh_id = mesh_id
        self.name = name
        self.seed = seed
        self.heartbeat_interval_s = heartbeat_interval_s
        self.max_members = max_members
        self.members = members
        self.tls = tls
        self.metrics = metrics
        self.clock = clock
        self.rejections = RejectionLog(REJECTION_LOG_INTERVAL_S)

    # -- the five RPCs ------------------------------------------------------------------
    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterReply:
        async with self._checked(context, request.mesh_id) as node:
            address = request.address
            try:
                if len(address) > MAX_ADDRESS_CHARS:
                    raise ValueError(
                        f"{address[:64]!r}... is longer than {MAX_ADDRESS_CHARS} characters"
                    )
                check_advertised(address)
            except ValueError as err:
                raise Refused(
                    "bad_address",
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"address {err}; register the address other sites dial "
                    "(the node's advertise, or listen)",
                ) from None
            if not self.members.known(node) and len(self.members.addresses) >= self.max_members:
                raise Refused(
                    "full",
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the view is full ({self.max_members} members, max_members of the "
                    f"coordinator); {node} is not added: raise max_members or retire a node",
                )
            self.members.register(node, address, self.clock())
            return pb.RegisterReply(
                view=view_message(self.members.view()),
                shared_seed=self.seed,
                heartbeat_interval_s=self.heartbeat_interval_s,
                coordinator=self.name,
            )

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatReply:
        async with self._checked(context, request.mesh_id) as node:
            known = self.members.heartbeat(node, self.clock())
            return pb.HeartbeatReply(known=known, epoch=self.members.epoch)

    async def Membership(
        self, request: pb.MembershipRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.View]:
        async with self._checked(context, request.mesh_id) as node:
            self._member(node)
        queue = self.members.subscribe(node)
        try:
            while (view := await queue.get()) is not None:
                yield view_message(view)
        finally:
            self.members.unsubscribe(node, queue)

    async def StartTime(
        self, request: pb.StartTimeRequest, context: grpc.aio.ServicerContext
    ) -> pb.StartTimeReply:
        async with self._checked(context, request.mesh_id) as node:
            self._member(node)
            end_in_s = request.end_in_s
            _check_seconds("end_in_s", end_in_s, "the time until the caller's period ends")
            now = self.clock()
            grant = self._schedule(lambda: self.members.start_time(node, now + end_in_s, now))
            if grant is None:
                self.metrics.grants.labels("wait").inc()
                return pb.StartTimeReply(granted=False)
            self.metrics.grants.labels("granted").inc()
            self.metrics.pairings.labels(node, grant.peer).inc()
            return pb.StartTimeReply(
                granted=True,
                peer=grant.peer,
                peer_address=self.members.addresses[grant.peer],
                start_in_s=grant.start_s - now,
                estimate_s=grant.estimate_s,
            )

    async def ReportTransfer(
        self, request: pb.ReportTransferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportTransferReply:
        async with self._checked(context, request.mesh_id) as node:
            self._member(node)
            peer, transfer_s = request.peer, request.transfer_s
            if peer == node:
                raise Refused(
                    "self",
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{node} reported a transfer from itself; report the peer StartTime named",
                )
            if transfer_s != math.inf:
                _check_seconds("transfer_s", transfer_s, "the measured pull time (inf: failed)")
            self._schedule(lambda: self.members.report(node, peer, transfer_s))
            self.metrics.reports.labels("failed" if transfer_s == math.inf else "ok").inc()
            return pb.ReportTransferReply()

    # -- checks -------------------------------------------------------------------------
    def _checked(self, context: grpc.aio.ServicerContext, mesh_id: str) -> _Checked:
        return _Checked(self, context, mesh_id)

    def caller(self, context: grpc.aio.ServicerContext) -> str:
        """The node id of the caller's certificate, once it may speak to this coordinator."""
        try:
            node = self.tls.peer_id(context)
        except GossipdError as err:
            raise Refused(
                "not_a_node",
                grpc.StatusCode.PERMISSION_DENIED,
                f"{err}; only site certificates (gossipd certs issue NODE_ID) talk to the "
                "coordinator",
            ) from None
        assert node is not None  # the coordinator always serves with mutual TLS
        return node

    def check_mesh(self, node: str, mesh_id: str) -> None:
        if mesh_id != self.mesh_id:
            raise Refused(
                "wrong_mesh",
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{node} asks for mesh {mesh_id[:64]!r}, this coordinator serves "
                f"{self.mesh_id!r}; point the node at its own mesh's coordinator",
            )

    def _member(self, node: str) -> None:
        if not self.members.known(node):
            raise Refused(
                "unknown_node",
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{node} is not registered with this coordinator (never, or dropped after "
                "missed heartbeats, or the coordinator restarted); call Register first",
            )

    def _schedule(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except SchedulerError as err:
            raise Refused("scheduler", grpc.StatusCode.FAILED_PRECONDITION, str(err)) from None

    def refuse(self, who: str, err: Refused) -> None:
        self.metrics.rejected.labels(err.reason).inc()
        self.rejections.record(who, err.reason, str(err))


class _Checked:
    """``async with servicer._checked(context, mesh_id) as node``: the body runs for a
    vetted caller; a :class:`Refused` anywhere in it becomes a counted gRPC status."""

    def __init__(
        self, servicer: CoordinatorServicer, context: grpc.aio.ServicerContext, mesh_id: str
    ) -> None:
        self.servicer, self.context, self.mesh_id = servicer, context, mesh_id
        self.who = peer_host(context.peer())

    async def __aenter__(self) -> str:
        try:
            self.who = self.servicer.caller(self.context)
            self.servicer.check_mesh(self.who, self.mesh_id)
        except Refused as err:
            await self._abort(err)
        return self.who

    async def __aexit__(self, kind: object, err: BaseException | None, tb: object) -> None:
        if isinstance(err, Refused):
            await self._abort(err)

    async def _abort(self, err: Refused) -> None:
        self.servicer.refuse(self.who, err)
        await self.context.abort(err.code, str(err))


def _check_seconds(name: str, value: float, what: str) -> None:
    if not (math.isfinite(value) and 0.0 <= value <= MAX_TIME_S):
        raise Refused(
            "bad_time",
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{name} {value!r} must be finite seconds between 0 and {MAX_TIME_S:.0f} ({what})",
        )
