"""Fixtures that start real daemons as subprocesses on free loopback ports and always reap them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from gossipd.node.errors import GossipdError
from gossipd.node.mesh import free_ports, spawn_node, stop_process
from gossipd.node.status import query_status

torch.set_num_threads(1)
START_TIMEOUT_S = 120.0


@dataclass
class DaemonHandle:
    node_id: str
    address: str
    data_dir: Path
    config_path: Path
    proc: subprocess.Popen[bytes]

    def status(self, *, checksum: bool = False) -> dict[str, Any]:
        return asyncio.run(query_status(self.address, 10.0, checksum=checksum))

    def log(self) -> str:
        path = self.data_dir / "node.log"
        return path.read_text() if path.exists() else ""

    def node_json(self) -> dict[str, Any]:
        return json.loads((self.data_dir / "node.json").read_text())

    def stop(self, timeout_s: float = 60.0) -> int:
        return stop_process(self.proc, timeout_s)


def wait_until(
    check: Callable[[], bool],
    what: str,
    timeout_s: float = 120.0,
    also: Callable[[], None] = lambda: None,
) -> None:
    """Poll ``check`` until it holds; ``also`` runs each round (e.g. raise if a child died)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        also()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def toml_value(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def write_config(path: Path, config: dict[str, Any]) -> None:
    top = [f"{k} = {toml_value(v)}" for k, v in config.items() if not isinstance(v, dict)]
    sections = [
        f"[{k}]\n" + "\n".join(f"{kk} = {toml_value(vv)}" for kk, vv in v.items())
        for k, v in config.items()
        if isinstance(v, dict)
    ]
    path.write_text("\n".join(top) + "\n\n" + "\n\n".join(sections) + "\n")


def start_daemon(tmp_path: Path, node_id: str, port: int, **config: Any) -> DaemonHandle:
    data_dir = tmp_path / node_id
    data_dir.mkdir(parents=True, exist_ok=True)
    full: dict[str, Any] = {
        "mesh_id": "test-mesh",
        "node_id": node_id,
        "listen": f"127.0.0.1:{port}",
        "data_dir": str(data_dir),
        "job": {"name": "synthetic", "learning_rate": 0.0, "eval_every_steps": 0},
        "gossip": {"push_probability": 0.0},
        "checkpoint": {"every_steps": 0},
    }
    for key, value in config.items():
        if isinstance(value, dict) and isinstance(full.get(key), dict):
            full[key] = {**full[key], **value}
        else:
            full[key] = value
    config_path = tmp_path / f"{node_id}.toml"
    write_config(config_path, full)
    proc = spawn_node(config_path, data_dir / "node.log")
    handle = DaemonHandle(node_id, f"127.0.0.1:{port}", data_dir, config_path, proc)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{node_id} exited with {proc.returncode}:\n{handle.log()}")
        try:
            handle.status()
            return handle
        except GossipdError:
            if time.monotonic() > deadline:
                handle.stop()
                raise RuntimeError(f"{node_id} did not answer Status:\n{handle.log()}") from None
            time.sleep(0.2)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[Any]:
    """Factory: ``daemons(node_id, **config)`` starts a daemon; all are stopped at teardown."""
    started: list[DaemonHandle] = []
    ports = iter(free_ports(16))

    def start(node_id: str, port: int | None = None, **config: Any) -> DaemonHandle:
        handle = start_daemon(tmp_path, node_id, port or next(ports), **config)
        started.append(handle)
        return handle

    start.ports = ports  # type: ignore[attr-defined]
    yield start
    for handle in started:
        handle.stop()
