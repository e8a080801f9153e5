"""The side of a site that cannot be dialled: its attachments to relays.

The site keeps ``reach.relays`` attachments, each an ``Attach`` stream it dialled to a
reachable peer. It pings each relay every ``reach.keepalive_s`` and expects to hear
from it as often; a relay silent for ``SILENT_PERIODS`` periods (a crash, a cut link, a
frozen process that keeps its sockets open) is dropped and another peer is attached
in its place. Relays are chosen among peers with a direct address, in an order that
differs from site to site (a hash of both names), so the outbound-only sites of a mesh
spread over its reachable ones instead of all landing on one; a peer that refused or
failed is passed over for ``RETRY_S``.

Each order from a relay is one connection some site dialled: this site opens a
``Take`` stream to that relay and joins it to its own gRPC server on loopback, where
that site's TLS ends. The site's address, ``relay://SITE@RELAYS``, changes with its
attachments; ``on_change`` tells the node so that it advertises the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import grpc

from gossipd.node.net.relay.hub import SILENT_PERIODS
from gossipd.node.net.relay.join import join
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.net.wire.calls import gossip_calls
from gossipd.node.net.wire.grpc_options import CHANNEL_OPTIONS
from gossipd.node.shared.config_reach import ReachConfig
from gossipd.node.shared.relay_address import Relayed, is_relayed
from gossipd.node.shared.tls import Credentials
from gossipd.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)

RETRY_S = 5.0  # a relay that refused or failed is tried again after this
MAX_TAKES = 64  # connections one relay may have this site take at once
LASTED_S = 30.0  # an attachment that lasted this long did not fail: no wait to attach again


class Attachments:
    """This site's relays, kept at ``config.relays`` while there are peers to attach to."""

    def __init__(
        self,
        *,
        node_id: str,
        mesh_id: str,
        tls: Credentials,
        local: str,
        config: ReachConfig,
        metrics: NodeMetrics,
        candidates: Callable[[], list[tuple[str, str]]],
        on_change: Callable[[str], None],
    ) -> None:
        """``local``: this site's own gRPC server, as it dials it; ``candidates``: the
        peers it may attach to, as (node id or "", address)."""
        self.node_id = node_id
        self.mesh_id = mesh_id
        self.tls = tls
        self.local = local
        self.config = config
        self.metrics = metrics
        self.candidates = candidates
        self.on_change = on_change
        self.active: dict[str, str] = {}  # relay address -> its node id ("" if unknown)
        self.leaving: set[str] = set()  # active relays that said they are leaving
        self.trying: set[str] = set()
        self.failed_at: dict[str, float] = {}
        self.wake = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()

    def address(self) -> str:
        """``relay://SITE@RELAYS``: the relays that stay, or all while none other is found."""
        staying = tuple(r for r in self.active if r not in self.leaving)
        return Relayed(self.node_id, staying or tuple(self.active)).address()

    def _relay_leaving(self, relay: str) -> None:
        """``relay`` is leaving: attach to another peer and advertise that one instead. The
        attachment stays until the relay ends it, taking the connections it still joins."""
        if relay in self.leaving:
            return
        before = self.address()
        self.leaving.add(relay)
        log.info("relay %s is leaving the mesh; attaching to another reachable peer", relay)
        if self.address() != before:
            self.on_change(self.address())
        self.wake.set()

    async def run(self) -> None:
        """Attach, and replace lost relays, until cancelled."""
        try:
            while True:
                self._fill()
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self.wake.wait()
        finally:
            for task in list(self.tasks):
                task.cancel()

    def _fill(self) -> None:
        now = asyncio.get_running_loop().time()
        staying = len(self.active.keys() - self.leaving)
        wanted = self.config.relays - staying - len(self.trying)
        if wanted <= 0:
            return
        for node_id, address in self._ranked():
            if wanted <= 0:
                break
            if address in self.active or address in self.trying:
                continue
            if now - self.failed_at.get(address, -RETRY_S) < RETRY_S:
                continue
            self.trying.add(address)
            self._spawn(self._attach(address, node_id))
            wanted -= 1

    def _ranked(self) -> list[tuple[str, str]]:
        seen: dict[str, str] = {}
        for node_id, address in self.candidates():
            if not is_relayed(address) and node_id != self.node_id:
                seen[address] = node_id or seen.get(address, "")

        def rank(address: str) -> bytes:
            return hashlib.sha256(f"{self.node_id}|{address}".encode()).digest()

        return [(seen[a], a) for a in sorted(seen, key=rank)]

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _attach(self, relay: str, relay_id: str) -> None:
        period = self.config.keepalive_s
        channel = self.tls.channel(relay, CHANNEL_OPTIONS, relay_id or None)
        call: Any = gossip_calls(channel).Attach()
        reason = "closed"
        pinger: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()
        since = loop.time()
        try:
            prospective = Relayed(self.node_id, (*self.active, relay)).address()
            await call.write(pb.AttachFrame(mesh_id=self.mesh_id, address=prospective))
            async with asyncio.timeout(SILENT_PERIODS * period + 2.0):
                first = await call.read()
            if first is grpc.aio.EOF:
                raise ConnectionError("the relay ended the attachment")
            self.trying.discard(relay)
            self.active[relay] = relay_id
            self.metrics.relays_attached.set(len(self.active))
            self.on_change(self.address())
            pinger = asyncio.ensure_future(self._ping(call, period))
            await self._orders(call, relay, channel, first)
            reason = "it went silent or closed the attachment"
        except grpc.aio.AioRpcError as err:
            reason = f"{err.code().name.lower()}: {err.details()}"
        except (TimeoutError, ConnectionError) as err:
            reason = str(err) or "no answer"
        finally:
            self.trying.discard(relay)
            self.leaving.discard(relay)
            if loop.time() - since < LASTED_S:
                self.failed_at[relay] = loop.time()  # a relay that served a while (and
                # ended at its connection age, say) may be attached again at once
            if pinger is not None:
                pinger.cancel()
            call.cancel()
            if self.active.pop(relay, None) is not None:
                self.metrics.relays_attached.set(len(self.active))
                log.info("relay %s lost (%s); attaching to another reachable peer", relay, reason)
                self.on_change(self.address())
            else:
                log.debug("could not attach to %s: %s", relay, reason)
            self.wake.set()
            with contextlib.suppress(Exception):
                await channel.close()

    @staticmethod
    async def _ping(call: Any, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            await call.write(pb.AttachFrame(ping=True))

    async def _orders(self, call: Any, relay: str, channel: grpc.aio.Channel, order: Any) -> None:
        """Take the connections the relay orders, until it is silent for too long."""
        silent_s = SILENT_PERIODS * self.config.keepalive_s
        takes: set[asyncio.Task[None]] = set()
        try:
            while order is not grpc.aio.EOF:
                if order.leaving:
                    self._relay_leaving(relay)
                if order.token and len(takes) < MAX_TAKES:
                    task = asyncio.ensure_future(self._take(channel, order.token))
                    takes.add(task)
                    task.add_done_callback(takes.discard)
                async with asyncio.timeout(silent_s):
                    order = await call.read()
        except TimeoutError:
            log.debug("relay %s silent for %.1f s", relay, silent_s)
        finally:
            for task in takes:
                task.cancel()

    async def _take(self, channel: grpc.aio.Channel, token: bytes) -> None:
        call: Any = gossip_calls(channel).Take()
        host, _, port = self.local.rpartition(":")
        try:
            await call.write(pb.RelayFrame(token=token))
            reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        except (grpc.aio.AioRpcError, OSError) as err:
            call.cancel()
            log.debug("could not take a relayed connection: %r", err)
            return
        await join(reader, writer, call)
