"""A test's own end of the relay's streams: a member with a valid certificate that attaches,
dials and takes by hand (tests/test_relay_refusals.py, tests/test_relay_tampering.py), on
a loop of its own so the test's code stays synchronous."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc

from gossipd.node.launch.localmesh import free_ports
from gossipd.node.net.wire.calls import gossip_calls
from gossipd.node.shared.tls import Credentials
from gossipd.proto import gossip_pb2 as pb
from tests.daemons import DaemonHandle, start_daemon
from tests.outsider import MESH
from tests.tls_mesh import Pki

T = TypeVar("T")


class Hand:
    """One member's calls to a relay, made by hand on the member's own loop."""

    def __init__(self, tls: Credentials, relay: str) -> None:
        self.tls = tls
        self.relay = relay
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.channel: grpc.aio.Channel = self.run(self._open())

    async def _open(self) -> grpc.aio.Channel:
        return self.tls.channel(self.relay, [], None)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def calls(self) -> Any:
        return gossip_calls(self.channel)

    def open_stream(self, name: str, first: Any) -> Any:
        """A stream of the relay's (``Attach``, ``Dial``, ``Take``) with its first frame sent."""

        async def go() -> Any:
            call = getattr(self.calls(), name)()
            await call.write(first)
            return call

        return self.run(go())

    def read(self, call: Any, timeout_s: float = 10.0) -> Any:
        """The stream's next frame (grpc.aio.EOF at its end); its error status raised."""

        async def go() -> Any:
            async with asyncio.timeout(timeout_s):
                return await call.read()

        return self.run(go(), timeout_s + 5)

    def write(self, call: Any, frame: Any) -> None:
        self.run(call.write(frame))

    def code(self, call: Any, timeout_s: float = 10.0) -> grpc.StatusCode:
        """How the stream ended: read until its status comes."""
        try:
            while self.read(call, timeout_s) is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as err:
            return err.code()
        return grpc.StatusCode.OK

    def check_reach(self, node: pb.NodeInfo) -> pb.ReachReply:
        async def go() -> pb.ReachReply:
            request = pb.ReachRequest(mesh_id=MESH, node=node)
            return await self.calls().CheckReach(request, timeout=15.0)

        return self.run(go())

    def close(self) -> None:
        self.run(self.channel.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_relay(
    tmp_path: Path, *, reach: dict[str, Any], **config: Any
) -> tuple[DaemonHandle, Pki]:
    """A direct daemon r that relays (``reach`` over ``reachable = true``), with certificates
    for r, an attaching site c and a member m; the test presents m's."""
    pki = Pki.create(tmp_path / "pki", ["r", "c", "m"])
    (port,) = free_ports(1)
    handle = start_daemon(
        tmp_path,
        "r",
        port,
        client_tls=pki.creds("m"),
        tls=pki.tls_config("r"),
        reach={"reachable": True, **reach},
        **config,
    )
    return handle, pki
