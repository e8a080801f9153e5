"""The coordinator in-process, over real gRPC and mutual TLS, with real clients.

Each test starts its own ``CoordinatorServer`` on a free loopback port (it starts in
milliseconds) and talks to it with ``CoordinatorClient`` or a raw stub holding a real
certificate of the mesh CA. The coordinator never carries model data, so there is no
sum of weights to check here; the daemons' tests check that.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gossipd.coordinator.client import CoordinatorClient, CoordinatorUnavailable
from gossipd.coordinator.config import parse_coordinator_config
from gossipd.coordinator.server import CoordinatorServer
from gossipd.coordinator.state import STATE_FILE, StateError
from gossipd.node import certs, cli
from gossipd.node.errors import ConfigError
from gossipd.node.mesh import free_ports
from gossipd.node.protocols.base import shared_seed
from gossipd.node.tls import Credentials
from gossipd.proto import coordinator_pb2 as pb
from gossipd.proto import coordinator_pb2_grpc as pb_grpc

MESH = "coord-mesh"
NODES = ("a", "b", "c", "d")
WAIT_S = 30.0


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("pki")
    certs.init_ca(directory, mesh_id=MESH)
    for node in NODES:
        certs.issue(node, directory)
    certs.issue("coord", directory, coordinator=True)
    return directory


def creds(pki: Path, name: str, *, coordinator: bool = False) -> Credentials:
    return Credentials(
        ca=pki / "ca.pem",
        cert=pki / f"{name}.pem",
        key=pki / f"{name}.key",
        coordinator=coordinator,
    )


def config(pki: Path, data_dir: Path, **overrides: Any) -> dict[str, Any]:
    port = free_ports(1)[0]
    return {
        "mesh_id": MESH,
        "listen": f"127.0.0.1:{port}",
        "data_dir": str(data_dir),
        "heartbeat_interval_s": 0.2,
        "drop_after_s": 1.0,
        "tls": {
            "ca": str(pki / "ca.pem"),
            "cert": str(pki / "coord.pem"),
            "key": str(pki / "coord.key"),
        },
        **overrides,
    }


@pytest.fixture
async def coordinator(pki: Path, tmp_path: Path) -> AsyncIterator[CoordinatorServer]:
    server = CoordinatorServer(parse_coordinator_config(config(pki, tmp_path / "coord")))
    await server.start()
    try:
        yield server
    finally:
        await server.close(0)


async def until(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class Node:
    """A client as a node runs it, recording every view it is told of."""

    def __init__(self, pki: Path, name: str, address: str, port: int) -> None:
        self.views: list[tuple[dict[str, str], int]] = []
        self.client = CoordinatorClient(
            address,
            mesh_id=MESH,
            advertise=f"127.0.0.1:{port}",
            tls=creds(pki, name),
            on_view=lambda members, epoch: self.views.append((members, epoch)),
            heartbeat_interval_s=0.2,
        )

    async def __aenter__(self) -> CoordinatorClient:
        await self.client.start()
        await asyncio.wait_for(self.client.wait_available(True), WAIT_S)
        return self.client

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()


def scrape(port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}"] = s.value
    return samples


async def test_two_nodes_pull_from_each_other_and_a_third_is_told_to_wait(
    pki: Path, coordinator: CoordinatorServer
) -> None:
    address = coordinator.address
    na, nb = Node(pki, "a", address, 7001), Node(pki, "b", address, 7002)
    async with na as a, nb as b:
        assert a.seed == shared_seed(MESH) and a.coordinator == "coord"
        await until(lambda: set(a.members) == {"a", "b"}, "a to see b in its view")
        assert a.members == {"a": "127.0.0.1:7001", "b": "127.0.0.1:7002"}
        assert await a.start_time(10.0) == ("b", 0.0)  # c_ab unknown: pull at once
        assert await b.start_time(10.0) == ("a", 0.0)
        async with Node(pki, "c", address, 7003) as c:
            assert await c.start_time(5.0) is None  # a and b are busy; never itself
            await until(lambda: "c" in na.views[-1][0], "the stream to tell a of c")
            assert na.views[-1][1] == coordinator.members.epoch
            await a.report("b", 0.5)
            assert await c.start_time(5.0) == ("b", 0.0)  # c_cb is not learned yet
            await b.report("a", 0.5)
            assert await a.start_time(10.0) == ("c", 0.0)  # the queue's front that is not a
            await a.report("c", 2.0)  # c_ac = c_ca = 2 s, learned
            peer, start_in_s = await c.start_time(5.0)  # c's last pull (from b) never reported
            assert (peer, start_in_s) == ("a", pytest.approx(3.0))
        epochs = [epoch for _, epoch in na.views]
        assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs)
        await until(lambda: "c" not in a.members, "c to be dropped after missed heartbeats")
        assert set(a.members) == {"a", "b"} and a.available and b.available
        samples = scrape(coordinator.metrics.port or 0)
        assert samples["gossipd_coordinator_dropped_total{}"] == 1
        assert samples["gossipd_coordinator_pairings_total{node=c,peer=b}"] == 1
        assert samples["gossipd_coordinator_grants_total{result=wait}"] == 1
        assert samples["gossipd_coordinator_members{}"] == 2
