"""The dialling side: a relayed site reached through a loopback port of this node's own.

A channel to ``relay://SITE@R1,R2`` is a channel to ``127.0.0.1:PORT``, where this node
listens for its own gRPC's connections and joins each one to a ``Dial`` stream through
one of the site's relays (the last one that worked first). gRPC's TLS runs inside,
end to end, with the name the channel expects: the site must prove its certificate,
and the relay sees only TLS records. A relay that refuses or does not answer within
``JOIN_S`` is passed over for the next.

A relay that is leaving says so on each connection it joins; the connection's gRPC
channel is then retired (``on_leaving``: its calls finish, then it closes, and the next
call opens a connection through another relay), and the relay is tried last for
``LEAVING_S``. A site whose every relay is leaving is *cut off* (:meth:`Routes.cut_off`):
new pushes to it are refused before a byte goes, so none is left half-answered when
the relay stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import grpc

from gossipd.node.net.relay.join import join
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.net.wire.calls import gossip_calls
from gossipd.node.net.wire.grpc_options import CHANNEL_OPTIONS
from gossipd.node.shared.relay_address import Relayed, parse
from gossipd.node.shared.tls import Credentials
from gossipd.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

JOIN_S = 5.0  # the most a relay may take to join a connection before the next is tried
MAX_ROUTES = 256  # relayed addresses with a loopback port at once (oldest closed first)
LEAVING_S = 30.0  # a relay that said it is leaving is tried last, and cuts off, this long


class Routes:
    """This node's loopback ports to relayed sites, and its channels to their relays."""

    def __init__(self, tls: Credentials, metrics: NodeMetrics | None = None) -> None:
        self.tls = tls
        self.metrics = metrics
        self._ports: dict[str, tuple[int, asyncio.Task[asyncio.Server]]] = {}
        self._relays: dict[str, grpc.aio.Channel] = {}
        self._good: dict[str, str] = {}  # site -> the relay that last joined a connection
        self._leaving: dict[str, float] = {}  # relay -> when it said it is leaving
        self.me = ""  # this node's own address, once it serves (PeerChannels.serve_as)
        # Called with a relayed address whose connection's relay is leaving (PeerChannels
        # retires that address's channel).
        self.on_leaving: Callable[[str], None] | None = None

    def target(self, address: str) -> str:
        """What a channel to ``address`` dials: the address itself, or a loopback port."""
        relayed = parse(address)
        if relayed is None:
            return address
        held = self._ports.get(address)
        if held is None:
            while len(self._ports) >= MAX_ROUTES:
                self._close_port(next(iter(self._ports)))
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sock.listen(64)

            async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                # Routes.close() cancels the connections it holds: their end, not an error.
                with contextlib.suppress(asyncio.CancelledError):
                    await self._forward(address, relayed, reader, writer)

            started = asyncio.get_running_loop().create_task(
                asyncio.start_server(handle, sock=sock)
            )
            held = self._ports[address] = (sock.getsockname()[1], started)
        return f"127.0.0.1:{held[0]}"

    def _close_port(self, address: str) -> None:
        _, started = self._ports.pop(address)
        if started.done() and not started.cancelled() and started.exception() is None:
            started.result().close()
        else:
            started.cancel()

    def order(self, relayed: Relayed) -> list[str]:
        """The relays to try: this node itself if it is one (the connection then crosses no
        other site), then the one that last worked, then an order that differs from dialler
        to dialler (a hash of both names), so the diallers of a site spread over its relays."""
        good = self._good.get(relayed.site)
        leaving = self._leaving_now()

        def rank(relay: str) -> tuple[bool, bool, bool, bytes]:
            spread = hashlib.sha256(f"{self.me}|{relayed.site}|{relay}".encode()).digest()
            return relay in leaving, relay != self.me, relay != good, spread

        return sorted(relayed.relays, key=rank)

    def _leaving_now(self) -> set[str]:
        now = time.monotonic()
        for relay in [r for r, t in self._leaving.items() if now - t > LEAVING_S]:
            del self._leaving[relay]
        return set(self._leaving)

    def cut_off(self, address: str) -> bool:
        """Whether ``address`` is a relayed site whose every relay said it is leaving: a
        connection opened now would cross a relay about to stop."""
        relayed = parse(address)
        return relayed is not None and set(relayed.relays) <= self._leaving_now()

    def _relay_leaving(self, address: str, relayed: Relayed, relay: str) -> None:
        first = relay not in self._leaving_now()
        self._leaving[relay] = time.monotonic()
        if first:
            others = set(relayed.relays) - self._leaving_now()
            log.info(
                "relay %s is leaving: calls through it finish, then their connections close; %s",
                relay,
                f"new ones to {relayed.site} go through {', '.join(sorted(others))}"
                if others
                else f"no push goes to {relayed.site} until it advertises another relay",
            )
        if self.on_leaving is not None:
            self.on_leaving(address)

    def _channel(self, relay: str) -> grpc.aio.Channel:
        channel = self._relays.get(relay)
        if channel is None:
            channel = self._relays[relay] = self.tls.channel(relay, CHANNEL_OPTIONS, None)
        return channel

    def _count(self, result: str) -> None:
        if self.metrics is not None:
            self.metrics.relay_dials.labels(result).inc()

    async def _forward(
        self,
        address: str,
        relayed: Relayed,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        order = self.order(relayed)
        for relay in order:
            call: Any = gossip_calls(self._channel(relay)).Dial()
            try:
                await call.write(pb.RelayFrame(target=relayed.site))
                async with asyncio.timeout(JOIN_S):
                    first = await call.read()
                if first is grpc.aio.EOF:
                    raise ConnectionError("the relay ended the stream")
            except (grpc.aio.AioRpcError, TimeoutError, ConnectionError) as err:
                call.cancel()
                self._count("refused")
                detail = err.details() if isinstance(err, grpc.aio.AioRpcError) else str(err)
                log.debug("relay %s did not join %s: %s", relay, relayed.site, detail)
                continue
            self._count("connected")
            self._good[relayed.site] = relay
            leaving = functools.partial(self._relay_leaving, address, relayed, relay)
            await join(reader, writer, call, leaving)
            return
        self._count("failed")
        log.debug("no relay of %s joined a connection (%s)", relayed.site, ", ".join(order))
        writer.close()

    async def close(self) -> None:
        for address in list(self._ports):
            self._close_port(address)
        for channel in self._relays.values():
            with contextlib.suppress(Exception):
                await channel.close()
        self._relays.clear()
