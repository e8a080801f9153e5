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
from pydantic import BaseModel

from gossipd.coordinator.client import CoordinatorClient, CoordinatorUnavailable
from gossipd.coordinator.config import parse_coordinator_config
from gossipd.coordinator.server import CoordinatorServer
from gossipd.coordinator.state import STATE_FILE, StateError
from gossipd.node.cli import main as cli
from gossipd.node.errors import ConfigError
from gossipd.node.launch.localmesh import free_ports
from gossipd.node.protocols.base import shared_seed
from gossipd.node.shared import certs
from gossipd.node.shared.tls import Credentials
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


async def expect_refused(call: Any, code: grpc.StatusCode, *words: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    assert refused.value.code() == code, refused.value
    for word in words:
        assert word in (refused.value.details() or ""), refused.value.details()


def _bad_requests(stub: pb_grpc.CoordinatorStub) -> list[tuple[Any, str, str]]:
    """Requests from a registered node that the coordinator refuses: each call (started
    here), the status it gets and a word its message names."""
    start = pb.StartTimeRequest
    return [
        (stub.StartTime(start(mesh_id="other", end_in_s=1)), "FAILED_PRECONDITION", "other"),
        (stub.StartTime(start(mesh_id=MESH, end_in_s=-1)), "INVALID_ARGUMENT", "-1"),
        (stub.StartTime(start(mesh_id=MESH, end_in_s=math.nan)), "INVALID_ARGUMENT", "nan"),
        (
            stub.StartTime(start(mesh_id=MESH, end_in_s=1e12)),
            "INVALID_ARGUMENT",
            "1000000000000.0",
        ),
        (
            stub.ReportTransfer(pb.ReportTransferRequest(mesh_id=MESH, peer="a", transfer_s=1)),
            "INVALID_ARGUMENT",
            "itself",
        ),
        (
            stub.ReportTransfer(pb.ReportTransferRequest(mesh_id=MESH, peer="b", transfer_s=1)),
            "FAILED_PRECONDITION",
            "not granted",
        ),
        (
            stub.Register(pb.RegisterRequest(mesh_id=MESH, address="no-port")),
            "INVALID_ARGUMENT",
            "HOST:PORT",
        ),
    ]


async def _strangers_are_refused(pki: Path, address: str) -> None:
    """A site that never registered, and the coordinator's own certificate posing as a
    node, are refused."""
    # Registered nowhere: d holds a valid site certificate but never registered.
    d = pb_grpc.CoordinatorStub(
        creds(pki, "d").channel(address, [], expected=certs.COORDINATOR_DNS_NAME)
    )
    await expect_refused(
        d.StartTime(pb.StartTimeRequest(mesh_id=MESH, end_in_s=1)),
        grpc.StatusCode.FAILED_PRECONDITION,
        "Register",
    )
    # The coordinator's own certificate posing as a node.
    impostor = pb_grpc.CoordinatorStub(
        creds(pki, "coord", coordinator=True).channel(
            address, [], expected=certs.COORDINATOR_DNS_NAME
        )
    )
    await expect_refused(
        impostor.Register(pb.RegisterRequest(mesh_id=MESH, address="127.0.0.1:1")),
        grpc.StatusCode.PERMISSION_DENIED,
        "site certificates",
    )


def _check_refusals_counted(coordinator: CoordinatorServer, failed_reports: int) -> None:
    samples = scrape(coordinator.metrics.port or 0)
    for reason, count in {
        "wrong_mesh": 1,
        "bad_time": 3,
        "self": 1,
        "scheduler": 1,
        "bad_address": 1,
        "unknown_node": 1,
        "not_a_node": 1,
    }.items():
        assert samples[f"gossipd_coordinator_rejected_total{{reason={reason}}}"] == count
    assert samples["gossipd_coordinator_reports_total{result=failed}"] == failed_reports
    assert samples["gossipd_coordinator_busy_peers{}"] == 1
    assert samples["gossipd_coordinator_epoch{}"] == 2


async def test_bad_requests_get_a_clear_status_a_counted_reason_and_service_goes_on(
    pki: Path, coordinator: CoordinatorServer
) -> None:
    address = coordinator.address
    async with Node(pki, "a", address, 7001) as a, Node(pki, "b", address, 7002):
        tls = creds(pki, "a")
        channel = tls.channel(address, [], expected=certs.COORDINATOR_DNS_NAME)
        bad = _bad_requests(pb_grpc.CoordinatorStub(channel))
        for call, code, word in bad:
            await expect_refused(call, grpc.StatusCode[code], word)
            assert await a.start_time(10.0) == ("b", 0.0)  # the next good request is served
            await a.report("b", math.inf)
        await _strangers_are_refused(pki, address)
        assert await a.start_time(10.0) == ("b", 0.0)
        _check_refusals_counted(coordinator, failed_reports=len(bad))
        await channel.close()


async def test_a_site_certificate_cannot_pose_as_the_coordinator(pki: Path, tmp_path: Path) -> None:
    with pytest.raises(certs.CertificateError, match="not a coordinator certificate"):
        CoordinatorServer(
            parse_coordinator_config(
                config(
                    pki,
                    tmp_path,
                    tls={
                        "ca": str(pki / "ca.pem"),
                        "cert": str(pki / "d.pem"),
                        "key": str(pki / "d.key"),
                    },
                )
            )
        )
    # Serve the real service with a site's certificate, as a stolen site key would.
    server = CoordinatorServer(parse_coordinator_config(config(pki, tmp_path)))
    server.tls = server.servicer.tls = creds(pki, "d")
    await server.start()
    try:
        node = Node(pki, "a", server.address, 7001)
        await node.client.start()
        await until(lambda: node.client._misses >= 3, "three refused handshakes")
        assert not node.client.available and not server.members.addresses
        with pytest.raises(CoordinatorUnavailable, match="not available"):
            await node.client.start_time(1.0)
        await node.client.close()
    finally:
        await server.close(0)


def test_config_and_state_errors_name_the_key_or_file(pki: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"heartbeat_intervl_s: unknown key; did you mean"):
        parse_coordinator_config(config(pki, tmp_path, heartbeat_intervl_s=1))
    with pytest.raises(ConfigError, match=r"drop_after_s 1.0 must be longer"):
        parse_coordinator_config(config(pki, tmp_path, heartbeat_interval_s=2))
    (tmp_path / STATE_FILE).write_text("{not json")
    with pytest.raises(StateError, match=rf"{tmp_path / STATE_FILE} is corrupt.*move"):
        CoordinatorServer(parse_coordinator_config(config(pki, tmp_path)))


def test_certs_issue_coordinator_writes_a_certificate_only_the_coordinator_accepts(
    pki: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["certs", "issue", "coord2", "--coordinator", "--dir", str(pki)]) == 0
    assert "mesh coordinator coord2" in capsys.readouterr().out
    pem = (pki / "coord2.pem").read_bytes()
    assert certs.coordinator_name_of(pem) == "coord2" and certs.node_id_of(pem) is None
    assert certs.coordinator_name_of((pki / "a.pem").read_bytes()) is None
    assert certs.describe(pki / "coord2.pem")["dns_names"] == [certs.COORDINATOR_DNS_NAME]


def test_the_docs_document_every_key_and_their_coord_toml_is_valid() -> None:
    import tomllib

    from gossipd.coordinator.config import CoordinatorConfig

    docs = Path(__file__).resolve().parents[1] / "docs"
    page = (docs / "coordinator.md").read_text()
    example = page.split("```toml\n", 1)[1].split("```", 1)[0]
    parsed = parse_coordinator_config(tomllib.loads(example), "docs/coordinator.md coord.toml")
    assert parsed.mesh_id == "lab-mesh"
    reference = (docs / "reference" / "config.md").read_text()
    section = reference.split("\n## Coordinator config\n", 1)[1]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    documented = " ".join(row.split(" | ", 1)[0] for row in rows)
    for name, field in CoordinatorConfig.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            for sub in annotation.model_fields:
                assert f"`{name}.{sub}`" in documented, f"{name}.{sub} missing from the docs"
        else:
            assert f"`{name}`" in documented, f"{name} missing from the docs"
    metrics = (docs / "reference" / "metrics.md").read_text()
    for metric in ("members", "epoch", "grants_total", "rejected_total", "pairings_total"):
        assert f"`gossipd_coordinator_{metric}`" in metrics
