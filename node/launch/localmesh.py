"""A local mesh: N real daemons on loopback, their configs, processes and public RPCs.

:class:`LocalMesh` only does what an operator would: write one config per site,
start ``gossipd node`` processes, and talk to them over their public RPCs
(Status, PullModel). `gossipd mesh up` and `gossipd demo` run one through
:mod:`gossipd.node.launch.launcher`; the tests drive it directly. Consensus distance is
max over nodes of ‖x_i − x̄‖/‖x̄‖, computed from the models the nodes serve.

What it writes is :mod:`gossipd.node.launch.meshconfigs`; how it starts and stops a
process, and finds free ports, :mod:`gossipd.node.launch.processes`.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from pathlib import Path
from typing import Any

import torch

from gossipd.node.baselines import BASELINES
from gossipd.node.errors import GossipdError
from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.meshconfigs import (
    COORDINATOR_ID,
    LAUNCHER_ID,
    coordinator_toml,
    make_mesh_ca,
    node_toml,
)
from gossipd.node.launch.meshspec import MeshSpec
from gossipd.node.launch.processes import (
    NodeProcess,
    Spawner,
    free_ports,
    stop_process,
    stop_processes,
)
from gossipd.node.net.dial.client import Identity, PeerClient
from gossipd.node.net.status.query import query_status
from gossipd.node.net.wire.frames import Limits
from gossipd.node.trainer import checkpoint

STARTUP_TIMEOUT_S = 120.0
SETTLE_TIMEOUT_S = 60.0
STATUS_PATIENCE_S = 60.0


class LocalMesh:
    """Processes of one local mesh; always use as a context manager so every child is reaped."""

    def __init__(self, spec: MeshSpec, root: Path, spawn: Spawner = fork_node) -> None:
        """``spawn`` starts each site's process (and the coordinator's)."""
        self.spec = spec
        self.root = root
        self.spawn = spawn
        self.mesh_id = f"local-{secrets.token_hex(3)}"
        # A baseline's sites meet at one more port, the rendezvous node-0 hosts.
        baseline = spec.protocol in BASELINES
        ports = free_ports(spec.nodes + baseline)
        self.ports = ports[: spec.nodes]
        self.rendezvous = f"127.0.0.1:{ports[-1]}" if baseline else None
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.procs: dict[int, NodeProcess] = {}
        self.configs: list[Path] = []
        self.tls = make_mesh_ca(spec, self.mesh_id, root)
        self.coordinator: NodeProcess | None = None
        self.coordinator_address: str | None = None
        if spec.coordinator:
            if spec.insecure:
                raise GossipdError("--coordinator local needs mutual TLS: drop --insecure")
            self.coordinator_address = f"127.0.0.1:{free_ports(1)[0]}"
            self.coordinator_config = root / f"{COORDINATOR_ID}.toml"
            self.coordinator_config.write_text(
                coordinator_toml(self.mesh_id, self.coordinator_address, root)
            )
        for i in range(spec.nodes):
            path = root / f"node-{i}.toml"
            path.write_text(
                node_toml(
                    spec,
                    self.mesh_id,
                    i,
                    self.ports,
                    root,
                    self.coordinator_address,
                    self.rendezvous,
                )
            )
            self.configs.append(path)

    def node_dir(self, index: int) -> Path:
        return self.root / f"node-{index}"

    @property
    def coordinator_log(self) -> Path:
        return self.root / COORDINATOR_ID / "coordinator.log"

    def start_coordinator(self) -> None:
        """The local coordinator (``spec.coordinator``); started again after a kill, it
        reloads what it learned from its data dir."""
        self.coordinator = self.spawn(
            self.coordinator_config, self.coordinator_log, "coordinator", ()
        )

    def kill_coordinator(self) -> None:
        """SIGKILL, as a crash would."""
        if self.coordinator is not None:
            self.coordinator.kill()
            self.coordinator.wait(timeout=30)
            self.coordinator = None

    def start(self, index: int) -> None:
        extra = ("--ranks", str(self.spec.ranks)) if self.spec.ranks > 1 else ()
        proc = self.spawn(self.configs[index], self.node_dir(index) / "node.log", "node", extra)
        if self.spec.pin_cores:
            cores = sorted(os.sched_getaffinity(0))
            # The child has just started the interpreter: no thread of it exists yet, and
            # every thread it starts inherits this.
            os.sched_setaffinity(proc.pid, {cores[index % len(cores)]})
        self.procs[index] = proc

    def kill(self, index: int) -> None:
        """SIGKILL, as a crash would: no leave, no final checkpoint."""
        proc = self.procs.pop(index)
        proc.kill()
        proc.wait(timeout=30)

    def stop(self, index: int, timeout_s: float = 30.0) -> int:
        return stop_process(self.procs.pop(index), timeout_s)

    def stop_all(self, timeout_s: float = 30.0) -> list[int]:
        """Stop every node at once (:func:`stop_processes`); exit codes in node order."""
        procs = [self.procs.pop(index) for index in sorted(self.procs)]
        return stop_processes(procs, timeout_s)

    def __enter__(self) -> LocalMesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
        if self.coordinator is not None:
            stop_process(self.coordinator)
            self.coordinator = None

    def check_alive(self) -> None:
        for index, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.node_dir(index) / "node.log").read_text()[-2000:]
                raise GossipdError(f"node-{index} exited with {proc.returncode}:\n{tail}")

    async def status(self, index: int, patience_s: float = STATUS_PATIENCE_S) -> dict[str, Any]:
        """A node's status, asked again (while it lives) if one answer is slow or lost.

        On a loaded machine one Status can miss its deadline; that is no reason to
        give up on a mesh whose processes are all alive.
        """
        deadline = time.monotonic() + patience_s
        while True:
            try:
                return await query_status(self.addresses[index], 10.0, tls=self.tls)
            except GossipdError:
                self.check_alive()
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def statuses(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self.status(i) for i in sorted(self.procs))))

    async def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Until every node answers and sees all the others as live."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            try:
                states = await self.statuses()
                if all(len(s["live_peers"]) == len(self.procs) - 1 for s in states):
                    return
            except GossipdError:
                pass
            if time.monotonic() > deadline:
                raise GossipdError(f"mesh not ready after {timeout_s:.0f} s; see {self.root}")
            await asyncio.sleep(0.2)

    def load_plan(self) -> None:
        """Build the job once here too: pulled models are validated against its segment plan."""
        from gossipd.node.jobs.registry import JobSpec, build_job
        from gossipd.node.model.segments import FlatModel

        job = build_job(JobSpec(self.spec.job, options=dict(self.spec.job_options)))
        self.plan = FlatModel(job.model).plan

    async def pull(self, index: int, patience_s: float = STATUS_PATIENCE_S) -> torch.Tensor:
        """A node's model as one flat float64 vector, pulled again (while the node lives)
        if one pull fails.

        On a loaded machine a pull can fail for reasons that pass (a TLS handshake
        that reads ``Endpoint closing``, a deadline); a run must not be thrown away
        for one of them. A node that died is a failure, said at once.
        """
        identity = Identity(self.mesh_id, LAUNCHER_ID, "", 0, self.plan.fingerprint, "")
        deadline = time.monotonic() + patience_s
        while True:
            client = PeerClient(
                self.addresses[index], identity, tls=self.tls, expected=f"node-{index}"
            )
            try:
                segs = (await client.pull(self.plan, Limits(), 60.0)).values
                return as_vector([segs[k] for k in sorted(segs)])
            except GossipdError:
                self.check_alive()
                if time.monotonic() > deadline:
                    raise
            finally:
                await client.close()
            await asyncio.sleep(0.5)

    async def pull_all(self, patience_s: float = STATUS_PATIENCE_S) -> list[torch.Tensor]:
        """Every node's model as one flat float64 vector, pulled over gRPC."""
        # All at once, so the models are as close to one moment as the network allows.
        return list(await asyncio.gather(*(self.pull(i, patience_s) for i in sorted(self.procs))))

    def final_models(self) -> list[torch.Tensor]:
        """Each node's model from the checkpoint it wrote at exit: the result of a run
        whose last pull failed, read once the nodes are stopped."""
        models = []
        for i in range(self.spec.nodes):
            path = self.node_dir(i) / checkpoint.FILENAME
            if not path.exists():
                raise GossipdError(
                    f"the run's result is unknown: node-{i}'s model could not be pulled and it "
                    f"wrote no final checkpoint ({path}); see {self.node_dir(i) / 'node.log'}"
                )
            models.append(
                as_vector(checkpoint.load(path, fingerprint=self.plan.fingerprint).segments)
            )
        return models

    def initial(self) -> list[checkpoint.Checkpoint]:
        """Each node's ``initial.pt``: the model and weights before its first step."""
        return [
            checkpoint.load(self.node_dir(i) / "initial.pt", fingerprint=self.plan.fingerprint)
            for i in range(self.spec.nodes)
        ]

    def initial_models(self) -> list[torch.Tensor]:
        return [as_vector(c.segments) for c in self.initial()]

    async def wait_settled(self, timeout_s: float = SETTLE_TIMEOUT_S) -> list[dict[str, Any]]:
        """Until every node finished training and has no push in flight."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check_alive()
            states = await self.statuses()
            if all(s["training_done"] and s["pushes_in_flight"] == 0 for s in states):
                return states
            if time.monotonic() > deadline:
                raise GossipdError(f"mesh did not settle within {timeout_s:.0f} s")
            await asyncio.sleep(0.2)


def as_vector(segments: list[torch.Tensor]) -> torch.Tensor:
    """A model's segments as one float64 vector, for distances between models."""
    return torch.cat([s.double().flatten() for s in segments])


def consensus_distance(models: list[torch.Tensor]) -> float:
    mean = torch.stack(models).mean(0)
    norm = float(mean.norm()) or 1.0
    return max(float((m - mean).norm()) / norm for m in models)
