"""A local mesh: N real daemons on loopback, their configs, processes and public RPCs.

:class:`LocalMesh` only does what an operator would: write one config per site,
start ``gossipd node`` processes, and talk to them over their public RPCs
(Status, PullModel). `gossipd mesh up` and `gossipd demo` run one through
:mod:`gossipd.node.launch.launcher`; the tests drive it directly. Consensus distance is
max over nodes of ‖x_i − x̄‖/‖x̄‖, computed from the models the nodes serve.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gossipd.node.errors import GossipdError
from gossipd.node.net.status import query_status
from gossipd.node.net.transport import Identity, PeerClient
from gossipd.node.net.wire import Limits
from gossipd.node.protocols import DEFAULT_PROTOCOL, settings_class
from gossipd.node.shared import certs
from gossipd.node.shared.config_ranks import ALLREDUCE
from gossipd.node.shared.tls import Credentials
from gossipd.node.trainer import checkpoint

STARTUP_TIMEOUT_S = 120.0
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
SETTLE_TIMEOUT_S = 60.0
STATUS_PATIENCE_S = 60.0


@dataclass
class MeshSpec:
    nodes: int = 4
    job: str = "digits"
    protocol: str = DEFAULT_PROTOCOL
    round_steps: int = 1
    insecure: bool = False
    duration_s: float = 30.0
    max_steps: int = 0
    push_probability: float | None = None
    cpu_share: float | None = None  # [gossip] cpu_share of every node; None: the default
    # Node i runs on core i (mod the cores this process may use), as if each site had a
    # machine of its own: its gossip then takes CPU from its own trainer, not a neighbour's.
    pin_cores: bool = False
    codec: str = "raw"
    learning_rate: float | None = None
    workdir: Path | None = None
    plot_path: Path | None = None
    seed: int = 0
    quiet: bool = False
    sample_interval_s: float = 2.0
    job_options: dict[str, Any] = field(default_factory=dict)
    eval_every_steps: int = 100
    ranks: int = 1  # processes per site (rank 0 gossips; gloo all-reduce inside)
    collective_timeout_s: float | None = None  # [ranks] collective_timeout_s; None: default
    device: str = "cpu"  # job.device of every site (cuda: a GPU per rank)
    checkpoint_every_steps: int = 200
    link: list[dict[str, float]] = field(default_factory=list)  # node i's [link] table, if any
    # MQTT discovery (`demo --discovery mqtt`): every node's [mqtt] broker, and no seeds.
    mqtt_broker: str | None = None
    # `--coordinator local`: a `gossipd coordinator` process beside the nodes (mutual TLS).
    coordinator: bool = False
    protocol_options: dict[str, Any] = field(default_factory=dict)  # [gossip.<protocol>] keys


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports that are free now, below the ephemeral range.

    A port the kernel hands out for ``bind(0)`` comes from the range it also uses for
    every outgoing connection: between picking it and the node binding it, any gRPC
    client on the machine may take it ("address already in use", seen in the suite).
    Ports below that range are only ever taken by a process that asks for them.
    """
    low, high = _listen_range()
    picker = random.SystemRandom()
    sockets: list[socket.socket] = []
    try:
        for _ in range(64 * count):
            if len(sockets) == count:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", picker.randrange(low, high) if high > low else 0))
            except OSError:
                s.close()
                continue
            sockets.append(s)
        if len(sockets) < count:
            raise GossipdError(f"found only {len(sockets)} of {count} free loopback ports")
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _listen_range() -> tuple[int, int]:
    """[low, high) for listening ports: from 10000 up to the kernel's ephemeral range."""
    try:
        ephemeral_low = int(Path(EPHEMERAL_RANGE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return (0, 0)  # unknown: let the kernel pick
    return (10_000, ephemeral_low) if ephemeral_low > 11_000 else (0, 0)


COORDINATOR_ID = "coordinator"


def node_toml(
    spec: MeshSpec,
    mesh_id: str,
    index: int,
    ports: list[int],
    root: Path,
    coordinator: str | None = None,
    allreduce_master: str | None = None,
) -> str:
    addresses = [f"127.0.0.1:{p}" for p in ports]
    seeds = [] if spec.mqtt_broker else [a for i, a in enumerate(addresses) if i != index]
    job = {
        "name": spec.job,
        "seed": spec.seed + index,
        "shard_index": index,
        "num_shards": spec.nodes,
        "duration_s": spec.duration_s,
        "max_steps": spec.max_steps,
        "eval_every_steps": spec.eval_every_steps,
        "device": spec.device,
    }
    if spec.learning_rate is not None:
        job["learning_rate"] = spec.learning_rate
    gossip: dict[str, Any] = {"protocol": spec.protocol, "codec": spec.codec, "seed": index}
    if spec.cpu_share is not None:
        gossip["cpu_share"] = spec.cpu_share
    wanted = {"round_steps": spec.round_steps, "push_probability": spec.push_probability}
    # [gossip.<protocol>]: what it has (the allreduce baseline is no gossip protocol: none)
    takes = {} if allreduce_master else settings_class(spec.protocol).model_fields
    own = {k: v for k, v in wanted.items() if v is not None and k in takes}
    own.update(spec.protocol_options)
    tls_dir = root / "tls"
    tls = (
        ["insecure = true"]
        if spec.insecure
        else [
            f'ca = "{tls_dir / certs.CA_CERT_FILE}"',
            f'cert = "{tls_dir / f"node-{index}.pem"}"',
            f'key = "{tls_dir / f"node-{index}.key"}"',
        ]
    )
    lines = [
        f'mesh_id = "{mesh_id}"',
        f'node_id = "node-{index}"',
        f'listen = "{addresses[index]}"',
        f"seeds = {json.dumps(seeds)}",
        *([f"coordinator = {json.dumps(coordinator)}"] if coordinator else []),
        f'data_dir = "{root / f"node-{index}"}"',
        "",
        "[job]",
        *(f"{k} = {json.dumps(v)}" for k, v in job.items()),
        "",
        "[job.options]",
        *(f"{k} = {json.dumps(v)}" for k, v in spec.job_options.items()),
        "",
        "[gossip]",
        *(f"{k} = {json.dumps(v)}" for k, v in gossip.items()),
        "",
        *([] if allreduce_master else [f"[gossip.{spec.protocol}]"]),
        *(f"{k} = {json.dumps(v)}" for k, v in own.items()),
        "",
        "[membership]",
        f"start_after_peers = {spec.nodes - 1}",
        "",
        "[checkpoint]",
        f"every_steps = {spec.checkpoint_every_steps}",
        "",
        "[link]",
        *(f"{k} = {json.dumps(v)}" for k, v in (spec.link[index] if spec.link else {}).items()),
        "",
        "[tls]",
        *tls,
    ]
    if spec.collective_timeout_s is not None:
        lines += ["", "[ranks]", f"collective_timeout_s = {spec.collective_timeout_s}"]
    if spec.mqtt_broker:
        lines += ["", "[mqtt]", f"broker = {json.dumps(spec.mqtt_broker)}"]
    if allreduce_master:
        lines += ["", "[allreduce]", f"master = {json.dumps(allreduce_master)}"]
    return "\n".join(lines) + "\n"


LAUNCHER_ID = "launcher"


def make_mesh_ca(spec: MeshSpec, mesh_id: str, root: Path) -> Credentials:
    """A throwaway CA in the work dir, a certificate per node and one for this launcher,
    so a local mesh runs the way a real one should: mutual TLS (unless ``insecure``)."""
    if spec.insecure:
        return Credentials(insecure=True)
    tls_dir = root / "tls"
    if not (tls_dir / certs.CA_CERT_FILE).exists():
        certs.init_ca(tls_dir, mesh_id=mesh_id)
    for node_id in [LAUNCHER_ID, *(f"node-{i}" for i in range(spec.nodes))]:
        if not (tls_dir / f"{node_id}.pem").exists():
            certs.issue(node_id, tls_dir)
    if spec.coordinator and not (tls_dir / f"{COORDINATOR_ID}.pem").exists():
        certs.issue(COORDINATOR_ID, tls_dir, coordinator=True)
    return Credentials(
        ca=tls_dir / certs.CA_CERT_FILE,
        cert=tls_dir / f"{LAUNCHER_ID}.pem",
        key=tls_dir / f"{LAUNCHER_ID}.key",
    )


def coordinator_toml(mesh_id: str, address: str, root: Path) -> str:
    tls_dir = root / "tls"
    return (
        "\n".join(
            [
                f'mesh_id = "{mesh_id}"',
                f'listen = "{address}"',
                f'data_dir = "{root / COORDINATOR_ID}"',
                "",
                "[tls]",
                f'ca = "{tls_dir / certs.CA_CERT_FILE}"',
                f'cert = "{tls_dir / f"{COORDINATOR_ID}.pem"}"',
                f'key = "{tls_dir / f"{COORDINATOR_ID}.key"}"',
            ]
        )
        + "\n"
    )


def spawn_node(
    config: Path, log_path: Path, command: str = "node", extra: tuple[str, ...] = ()
) -> subprocess.Popen[bytes]:
    """`gossipd node --config CONFIG` (or another ``command``: `coordinator`) as a child
    process, output appended to ``log_path``; ``extra``: more arguments (``--ranks R``)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gossipd.node.cli",
                "--log-level",
                "INFO",
                command,
                "--config",
                str(config),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def stop_process(
    proc: subprocess.Popen[bytes], timeout_s: float = 30.0, *, signalled: bool = False
) -> int:
    """SIGTERM (unless ``signalled``: sent already), wait up to ``timeout_s``, then
    SIGKILL: a child is always reaped. SIGTERM goes once: a second one that lands after
    the node's event loop has ended (its handler gone) kills it mid-exit with -15."""
    if not signalled and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        return -9


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> list[int]:
    """SIGTERM every one at once, then reap each (:func:`stop_process`): their shutdowns
    overlap instead of queueing. Exit codes in the order given."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    return [stop_process(proc, timeout_s, signalled=True) for proc in procs]


class LocalMesh:
    """Processes of one local mesh; always use as a context manager so every child is reaped."""

    def __init__(self, spec: MeshSpec, root: Path) -> None:
        self.spec = spec
        self.root = root
        self.mesh_id = f"local-{secrets.token_hex(3)}"
        # The allreduce baseline's sites meet at one more port, the rendezvous node-0 hosts.
        ports = free_ports(spec.nodes + (spec.protocol == ALLREDUCE))
        self.ports = ports[: spec.nodes]
        self.allreduce_master = f"127.0.0.1:{ports[-1]}" if spec.protocol == ALLREDUCE else None
        self.addresses = [f"127.0.0.1:{p}" for p in self.ports]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.configs: list[Path] = []
        self.tls = make_mesh_ca(spec, self.mesh_id, root)
        self.coordinator: subprocess.Popen[bytes] | None = None
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
                    self.allreduce_master,
                )
            )
            self.configs.append(path)

    def node_dir(self, index: int) -> Path:
        return self.root / f"node-{index}"

    def start_coordinator(self) -> None:
        """The local coordinator (``spec.coordinator``); started again after a kill, it
        reloads what it learned from its data dir."""
        self.coordinator = spawn_node(
            self.coordinator_config, self.root / COORDINATOR_ID / "coordinator.log", "coordinator"
        )

    def kill_coordinator(self) -> None:
        """SIGKILL, as a crash would."""
        if self.coordinator is not None:
            self.coordinator.kill()
            self.coordinator.wait(timeout=30)
            self.coordinator = None

    def start(self, index: int) -> None:
        extra = ("--ranks", str(self.spec.ranks)) if self.spec.ranks > 1 else ()
        proc = spawn_node(self.configs[index], self.node_dir(index) / "node.log", extra=extra)
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
        from gossipd.node.trainer.jobs import JobSpec, build_job
        from gossipd.node.trainer.segments import FlatModel

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
