"""``gossipd coordinator``: the Coordinator service on grpc.aio, with mutual TLS, health,
reflection, Prometheus metrics and its learned state kept in ``data_dir``.

It serves with the node's own plumbing: :class:`~gossipd.node.shared.tls.Credentials` (a
coordinator certificate of the mesh CA; callers must hold site certificates of the
same CA), the standard gRPC health and reflection services, and a Prometheus registry
served like a node's. Two background tasks: one drops members that stopped sending
heartbeats, one writes ``state.json`` when the scheduler learned something or the
epoch moved (at most once per ``PERSIST_INTERVAL_S``, and at shutdown).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gossipd.coordinator.config import CoordinatorConfig, load_coordinator_config
from gossipd.coordinator.members import Members
from gossipd.coordinator.metrics import CoordinatorMetrics
from gossipd.coordinator.service import SERVICE, CoordinatorServicer
from gossipd.coordinator.state import SavedState, StateError, load_state, save_state
from gossipd.node.errors import ConfigError
from gossipd.node.protocols.base import shared_seed
from gossipd.node.protocols.scheduler import Scheduler
from gossipd.node.shared.tls import Credentials
from gossipd.proto import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger("gossipd.coordinator")
PERSIST_INTERVAL_S = 1.0
INFO_FILE = "coordinator.json"  # the bound addresses, for scripts and tests (port 0)


class CoordinatorServer:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        tls = config.tls
        self.tls = Credentials(
            ca=tls.ca,
            cert=tls.cert,
            key=tls.key,
            allow=frozenset(tls.allow) if tls.allow is not None else None,
            coordinator=True,
        )
        scheduler = Scheduler(
            threshold=config.scheduler.threshold, lease_s=config.scheduler.lease_s
        )
        saved = load_state(config.data_dir, config.mesh_id)
        if saved is not None:
            scheduler.load_state_dict(saved.scheduler)
        self.members = Members(scheduler, saved.epoch if saved else 0)
        self.metrics = CoordinatorMetrics()
        self.metrics.follow(
            members=lambda: len(self.members.addresses),
            epoch=lambda: self.members.epoch,
            estimates=self.members.estimates,
            busy=lambda: len(scheduler.busy()),
            subscribers=lambda: len(self.members.streams),
        )
        self.servicer = CoordinatorServicer(
            mesh_id=config.mesh_id,
            name=self.tls.node_id or "",
            seed=shared_seed(config.mesh_id),
            heartbeat_interval_s=config.heartbeat_interval_s,
            max_members=config.max_members,
            members=self.members,
            tls=self.tls,
            metrics=self.metrics,
        )
        self.server: grpc.aio.Server | None = None
        self.address = config.listen
        self.tasks: list[asyncio.Task[None]] = []
        if saved is not None:
            log.info(
                "reloaded %s: epoch %d, %d learned transfer times",
                config.data_dir / "state.json",
                saved.epoch,
                self.members.estimates(),
            )

    async def start(self) -> None:
        """Bind and serve; on any failure the server is stopped before raising."""
        config = self.config
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", config.max_request_bytes),
            ]
        )
        try:
            pb_grpc.add_CoordinatorServicer_to_server(self.servicer, server)
            health_servicer = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
            reflection.enable_server_reflection(
                (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
            )
            try:
                port = self.tls.add_port(server, config.listen)
            except RuntimeError:
                raise ConfigError(
                    f"listen {config.listen}: cannot bind it (in use, or not an address of this "
                    "machine); pick another address or port"
                ) from None
            await server.start()
            for name in (SERVICE, ""):
                await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
            self.address = f"{config.listen.rpartition(':')[0]}:{port}"
            if config.metrics.listen:
                self.metrics.serve(config.metrics.listen)
        except BaseException:
            await server.stop(None)
            raise
        self.server = server
        self.tasks = [
            asyncio.create_task(self._sweep(), name="coordinator-sweep"),
            asyncio.create_task(self._persist(), name="coordinator-persist"),
        ]
        self._write_info()
        log.info(
            "coordinator %s of mesh %s serving on %s with mutual TLS (epoch %d, metrics on %s)",
            self.tls.node_id,
            config.mesh_id,
            self.address,
            self.members.epoch,
            self.metrics.port,
        )

    async def close(self, grace_s: float = 1.0) -> None:
        """Stop serving, end the background tasks, write the state one last time."""
        try:
            if self.server is not None:
                self.members.end_streams()
                await self.server.stop(grace_s)
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            if self.members.dirty:
                self._write(self._snapshot())
        finally:
            self.metrics.close()

    def _snapshot(self) -> SavedState:
        """What to persist, taken on the loop (the scheduler is not thread-safe)."""
        self.members.dirty = False
        return SavedState(self.members.epoch, self.members.scheduler.state_dict())

    def _write(self, state: SavedState) -> None:
        try:
            save_state(self.config.data_dir, self.config.mesh_id, state)
        except StateError as err:
            self.members.dirty = True  # try again at the next interval
            self.metrics.state_write_failures.inc()
            log.warning("%s", err)

    async def _sweep(self) -> None:
        interval = min(self.config.heartbeat_interval_s, 1.0)
        while True:
            await asyncio.sleep(interval)
            dropped = self.members.sweep(time.monotonic(), self.config.drop_after_s)
            self.metrics.dropped.inc(len(dropped))

    async def _persist(self) -> None:
        while True:
            await asyncio.sleep(PERSIST_INTERVAL_S)
            if self.members.dirty:
                await asyncio.to_thread(self._write, self._snapshot())

    def _write_info(self) -> None:
        info: dict[str, Any] = {
            "address": self.address,
            "metrics_port": self.metrics.port,
            "pid": os.getpid(),
        }
        self.config.data_dir.mkdir(parents=True, exist_ok=True)
        (self.config.data_dir / INFO_FILE).write_text(json.dumps(info))


def run(args: argparse.Namespace) -> int:
    """``gossipd coordinator --config FILE``: serve until SIGTERM or SIGINT."""
    config = load_coordinator_config(args.config)

    async def main() -> None:
        server = CoordinatorServer(config)
        await server.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
            log.info("stopping: state written to %s", config.data_dir / "state.json")
        finally:
            await server.close()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    return 0
