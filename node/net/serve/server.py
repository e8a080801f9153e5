"""The gRPC server of a node: its services, its bind and its log manners.

Kept apart from :mod:`gossipd.node.net.network`, which decides what the node does; this
only opens the door: the gossip servicer, standard health checking and reflection (so
stock gRPC tools work), a bind that fails with a clear error.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gossipd.node.errors import ConfigError
from gossipd.node.model.segments import SegmentPlan
from gossipd.node.net.bulk.lane import BulkServer
from gossipd.node.net.limits.admission import server_options
from gossipd.node.net.serve import exchange
from gossipd.node.net.serve.relaying import relay_handlers
from gossipd.node.net.serve.servicer import SERVICE, GossipServicer, Handlers, add_to_server
from gossipd.node.net.wire.grpc_options import CHANNEL_OPTIONS
from gossipd.node.shared.config import NodeConfig
from gossipd.node.shared.tls import Credentials

log = logging.getLogger(__name__)


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


def new_server(config: NodeConfig, plan: SegmentPlan) -> grpc.aio.Server:
    """A server for ``config.listen`` (checked free first), its limits sized for ``plan``.

    SO_REUSEPORT is off: with gRPC's default (on), a second daemon given a taken port
    binds it too, and the kernel splits connections between two nodes that both answer
    at one address.
    """
    check_port_free(config.listen)
    ages = server_options(config, plan)
    return grpc.aio.server(options=[*CHANNEL_OPTIONS, *ages, ("grpc.so_reuseport", 0)])


def add_services(server: grpc.aio.Server, handlers: Handlers) -> health.aio.HealthServicer:
    """The gossip service (with its Exchange stream and the relay's calls), health checking
    and reflection."""
    servicer = GossipServicer(handlers)
    relaying = relay_handlers(handlers.hub, handlers.reach_checker, handlers.tls, servicer.refused)
    add_to_server(servicer, server, {"Exchange": exchange.method_handler(servicer), **relaying})
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    return health_servicer


def bind(server: grpc.aio.Server, tls: Credentials, listen: str) -> int:
    """Bind ``listen`` (TLS or plaintext, as ``tls`` says); returns the port bound."""
    try:
        return tls.add_port(server, listen)
    except RuntimeError:
        raise ConfigError(
            f"listen {listen}: cannot bind it (in use, or not an address of this "
            "machine); pick another address or port"
        ) from None


async def mark_serving(health_servicer: health.aio.HealthServicer) -> None:
    await health_servicer.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)


def announce(
    node_id: str, address: str, fingerprint: str, tls: Credentials, bulk: BulkServer | None
) -> None:
    """The INFO line an operator reads once a node serves (and a WARNING if in plaintext)."""
    log.info(
        "node %s serving on %s with %s (fingerprint %s), %s",
        node_id,
        address,
        "plaintext gRPC" if tls.insecure else "mutual TLS",
        fingerprint,
        f"bulk lane on port {bulk.port}" if bulk else "no bulk lane (bulk = false)",
    )
    if tls.insecure:
        log.warning(
            "tls.insecure = true: anyone who reaches %s can read the model and speak for "
            "any node id; give [tls] ca, cert and key (gossipd certs) to require certificates",
            address,
        )
