"""A relay is a member with more power than others, and must still not be able to read,
alter, replay or forge what crosses it: the end sites' TLS runs through it.

The relay here is the test's own, with a valid certificate, built from the daemon's
relay code and made to lie: it flips a bit, replays a frame, or forges a connection of
its own that claims another site as its origin. The site behind it is a real daemon
(outbound-only), dialled through the relay the way every site dials a relayed one. An
honest pass through the same relay first shows the path works, so each failure after
it is the lie being refused."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gossipd.node.launch.localmesh import free_ports
from gossipd.node.net.relay.hub import RelayHub, _Session
from gossipd.node.net.relay.reach import ReachChecker
from gossipd.node.net.relay.routes import Routes
from gossipd.node.net.serve.relaying import relay_handlers
from gossipd.node.net.serve.servicer import SERVICE
from gossipd.node.net.status.query import query_status
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.net.wire.calls import gossip_calls
from gossipd.node.shared.config_reach import ReachConfig
from gossipd.node.shared.tls import Credentials
from gossipd.proto import SCHEMA_VERSION
from gossipd.proto import gossip_pb2 as pb
from tests.daemons import DaemonHandle, start_daemon, wait_until
from tests.meshes import status_of, stop_all
from tests.outsider import MESH
from tests.tls_mesh import Pki


class LyingHub(RelayHub):
    """A relay that alters the dialler's frames once the TLS handshake is behind them."""

    mode = "honest"

    async def _pump(
        self,
        frames: AsyncIterator[pb.RelayFrame],
        session: _Session,
        queue: asyncio.Queue[bytes],
        direction: str,
    ) -> None:
        mode = self.mode

        async def lied() -> AsyncIterator[pb.RelayFrame]:
            seen = 0
            async for frame in frames:
                seen += 1
                if direction == "to_site" and seen >= 3 and mode == "flip":
                    data = bytearray(frame.data)
                    data[len(data) // 2] ^= 0x01
                    frame = pb.RelayFrame(data=bytes(data))
                yield frame
                if direction == "to_site" and seen >= 3 and mode == "replay":
                    yield frame

        await super()._pump(lied(), session, queue, direction)

    async def forge(self, target: str, tls: Credentials) -> grpc.StatusCode:
        """Open a connection to ``target`` of the relay's own, claiming to come from
        site ``a``, and introduce itself there as ``a``: what the site answers."""
        token = os.urandom(16)
        session = self.sessions[token] = _Session("a", target)
        self.sites[target].orders.put_nowait(pb.RelayOrder(token=token, origin="a"))
        await asyncio.wait_for(session.taken.wait(), 10.0)

        async def bridge(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            async def up() -> None:
                while data := await reader.read(1 << 16):
                    await session.to_site.put(data)

            task = asyncio.ensure_future(up())
            while (data := await session.next(session.to_dialer)) is not None:
                writer.write(data)
                await writer.drain()
            task.cancel()
            writer.close()

        server = await asyncio.start_server(bridge, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        channel = tls.channel(f"127.0.0.1:{port}", [], target)
        try:
            await gossip_calls(channel).Handshake(
                pb.HandshakeRequest(
                    schema_version=SCHEMA_VERSION,
                    mesh_id=MESH,
                    node=pb.NodeInfo(node_id="a", address="127.0.0.1:1", incarnation=1),
                ),
                timeout=10.0,
            )
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as err:
            return err.code()
        finally:
            await channel.close()
            server.close()
            session.done.set()


class LyingRelay:
    """The lying hub served over mutual TLS with certificate ``m``, on a loop of its own."""

    def __init__(self, tls: Credentials) -> None:
        self.tls = tls
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.hub = LyingHub("m", MESH, ReachConfig(), NodeMetrics())
        self.hub.enabled = True
        self.address = self.run(self._start())

    def run(self, coro: Any, timeout_s: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> str:
        self.server = grpc.aio.server()
        handlers = relay_handlers(
            self.hub, ReachChecker(self.tls, MESH), self.tls, lambda peer, err: None
        )
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        port = self.tls.add_port(self.server, "127.0.0.1:0")
        await self.server.start()
        return f"127.0.0.1:{port}"

    def close(self) -> None:
        self.run(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def behind_liar(tmp_path: Path) -> Iterator[tuple[LyingRelay, DaemonHandle, Pki]]:
    pki = Pki.create(tmp_path / "pki", ["a", "c", "m"])
    relay = LyingRelay(pki.creds("m"))
    handles: list[DaemonHandle] = []
    try:
        (port,) = free_ports(1)
        handles.append(
            start_daemon(
                tmp_path,
                "c",
                port,
                client_tls=pki.creds("a"),
                tls=pki.tls_config("c"),
                seeds=[relay.address],
                reach={"reachable": False, "relays": 1},
            )
        )
        wait_until(lambda: "c" in relay.hub.sites, "c to attach to the relay", 30.0)
        yield relay, handles[0], pki
    finally:
        stop_all(handles)
        relay.close()


def status_through(relay: LyingRelay, tls: Credentials) -> grpc.StatusCode | None:
    """Site c's Status asked by ``tls``'s site through the relay (None: it answered)."""

    async def ask() -> grpc.StatusCode | None:
        routes = Routes(tls)
        channel = tls.channel(routes.target(f"relay://c@{relay.address}"), [], "c")
        try:
            await gossip_calls(channel).Status(pb.StatusRequest(checksum=True), timeout=10.0)
            return None
        except grpc.aio.AioRpcError as err:
            return err.code()
        finally:
            await channel.close()
            await routes.close()

    return relay.run(ask())


def test_a_relay_that_flips_or_replays_bytes_breaks_the_connection_not_the_site(
    behind_liar: tuple[LyingRelay, DaemonHandle, Pki],
) -> None:
    relay, site, pki = behind_liar
    a = pki.creds("a")
    assert status_through(relay, a) is None  # honest: the path works
    checksum = status_of(site, checksum=True)["params_checksum"]
    for mode in ("flip", "replay"):
        relay.hub.mode = mode
        assert status_through(relay, a) is not None, f"a relay that {mode}s was not noticed"
    after = status_of(site, checksum=True)
    assert after["params_checksum"] == checksum and after["pushes_merged"] == 0
    relay.hub.mode = "honest"
    assert status_through(relay, a) is None  # the site still serves through the relay


def test_a_relay_cannot_speak_for_another_site(
    behind_liar: tuple[LyingRelay, DaemonHandle, Pki],
) -> None:
    """Its order names ``a`` as the origin, and it introduces itself as ``a``: the site
    believes the certificate (``m``), refuses, and counts the refusal."""
    relay, site, pki = behind_liar
    code = relay.run(relay.hub.forge("c", pki.creds("m")))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert status_of(site)["rejected"].get("IdentityMismatch") == 1
    assert asyncio.run(query_status(site.address, 10.0, tls=pki.creds("a")))["reach"] == (
        f"relayed by {relay.address}"
    )
