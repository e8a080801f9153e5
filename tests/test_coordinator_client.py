"""``gossipd coordinator`` as a real process: SIGKILL it and restart it on its data dir.

Two clients as nodes run them: they see the coordinator go (``available`` turns False
within the missed-heartbeat budget) and come back (they register again by themselves),
and what the coordinator had learned (c_ij and the epoch) survives the kill. The
coordinator carries no model data, so there is no sum of weights to check here.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gossipd.coordinator.client import CoordinatorUnavailable
from gossipd.coordinator.state import STATE_FILE
from gossipd.node.launch.localmesh import free_ports, stop_process
from gossipd.node.shared import certs
from tests.conftest import scrape_metrics, write_config
from tests.test_coordinator import MESH, Node, until

# 5 missed heartbeats at 0.2 s: the clients give the coordinator up within about 1 s.
HEARTBEAT_S = 0.2
WAIT_S = 30.0


class Coordinator:
    def __init__(self, tmp_path: Path, pki: Path) -> None:
        self.port, self.metrics_port = free_ports(2)
        self.data_dir = tmp_path / "coord"
        self.config = tmp_path / "coord.toml"
        self.log = tmp_path / "coord.log"
        tls = {k: str(pki / f) for k, f in (("ca", "ca.pem"), ("cert", "c.pem"), ("key", "c.key"))}
        write_config(
            self.config,
            {
                "mesh_id": MESH,
                "listen": f"127.0.0.1:{self.port}",
                "data_dir": str(self.data_dir),
                "heartbeat_interval_s": HEARTBEAT_S,
                "drop_after_s": 2.0,
                "tls": tls,
                "metrics": {"listen": f"127.0.0.1:{self.metrics_port}"},
            },
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gossipd.node.cli",
                    "coordinator",
                    "--config",
                    str(self.config),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def state(self) -> dict:
        path = self.data_dir / STATE_FILE
        return json.loads(path.read_text()) if path.exists() else {}

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    directory = tmp_path / "pki"
    certs.init_ca(directory, mesh_id=MESH)
    for node in ("a", "b"):
        certs.issue(node, directory)
    certs.issue("c", directory, coordinator=True)
    return directory


@pytest.fixture
def coordinator(tmp_path: Path, pki: Path) -> Iterator[Coordinator]:
    coordinator = Coordinator(tmp_path, pki)
    coordinator.start()
    try:
        yield coordinator
    finally:
        coordinator.stop()


async def test_clients_fail_over_when_the_coordinator_is_killed_and_return_to_what_it_learned(
    pki: Path, coordinator: Coordinator
) -> None:
    address = f"127.0.0.1:{coordinator.port}"
    async with Node(pki, "a", address, 7001) as a, Node(pki, "b", address, 7002) as b:
        assert await a.start_time(10.0) == ("b", 0.0)
        await a.report("b", 0.5)
        await until(lambda: coordinator.state().get("scheduler", {}).get("estimates"), "state")
        saved = coordinator.state()
        assert saved["scheduler"]["estimates"] == [["a", "b", 0.5], ["b", "a", 0.5]]
        metrics = scrape_metrics(coordinator.metrics_port)
        assert metrics['gossipd_coordinator_reports_total{result="ok"}'] == 1
        assert metrics["gossipd_coordinator_estimates"] == 2

        assert coordinator.proc is not None
        coordinator.proc.kill()  # SIGKILL: no goodbye, no last write
        coordinator.proc.wait(timeout=30)
        await asyncio.wait_for(a.wait_available(False), 10.0)
        await asyncio.wait_for(b.wait_available(False), 10.0)
        with pytest.raises(CoordinatorUnavailable, match="not available"):
            await a.start_time(10.0)

        coordinator.start()
        await asyncio.wait_for(a.wait_available(True), WAIT_S)
        await asyncio.wait_for(b.wait_available(True), WAIT_S)
        await until(lambda: set(a.members) == {"a", "b"}, "a's view to hold both again")
        assert a.epoch > saved["epoch"]  # the epoch went on from the saved one
        peer, start_in_s = await a.start_time(10.0)
        assert (peer, start_in_s) == ("b", pytest.approx(9.5))  # c_ab = 0.5 s came back
    assert "reloaded" in coordinator.log.read_text()
