"""One contract, three drivers: the promises of ``node/protocols/base.py``, carried out alike.

A core never does anything itself; a driver carries out what it returns. The daemon
(the replica and the network: real ``grpc.aio`` servers on port 0 with mutual TLS, in
this process), the simulator (through its public step API), and the small reference
driver (tests/contract_reference.py) must do the same thing with the same actions:
given the same script of events (tests/contract_scripts.py: a node's step, then
everything it set off delivered, merged, settled, until nothing is left in flight),
they must end with the same sum-weights and the same models, and keep Σw and Σw·x
exact. The scripts exercise ``Push``, ``Merge``, ``Duplicate`` (the reference answers
every push a second time, as after a lost acknowledgement), ``StartTimer`` (persyn's
bursts), ``OuterStep`` (persyn's outer optimizer) and ``Pull`` (the test-only core of
``tests/pullcore.py``); ``FoldBack`` is the fault path, checked against the daemon by
the mass and liveness tests. Every
registered protocol must have a script: a new one fails here until it has.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from gossipd.node.launch.localmesh import free_ports
from gossipd.node.net.network import Network
from gossipd.node.protocols import PROTOCOLS, keeps_weights
from gossipd.node.protocols.base import Action, GossipProtocol
from gossipd.node.protocols.ledger import SumWeightLedger
from gossipd.node.shared import certs
from gossipd.node.shared.config import parse_config
from gossipd.node.sim import SimSpec, Simulation
from gossipd.node.trainer.replica import Replica
from tests.contract_reference import Reference
from tests.contract_scripts import (
    DIM,
    MAX_IN_FLIGHT,
    MESH,
    SCRIPTS,
    SEGMENTS,
    SETTLE_S,
    Script,
    initial_vectors,
    mass,
    run,
    scripted_protocols,
    settings_for,
)
from tests.pullcore import NAME as PULL
from tests.pullcore import PullEveryRound


@pytest.fixture(autouse=True)
def pull_core(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(PROTOCOLS, PULL, lambda s: PullEveryRound(s.node_id, s.num_segments))
    yield


# -- the simulator ---------------------------------------------------------------------------
class Simulator:
    """The simulator, stepped by the script through its public step API, not by its clock."""

    def __init__(self, script: Script) -> None:
        spec = SimSpec(
            protocol=script.protocol,
            nodes=script.nodes,
            segments=SEGMENTS,
            dim=DIM,
            node_ids=tuple(script.ids),
            mesh_id=MESH,
            initial=tuple(map(tuple, initial_vectors(script.nodes))),
            max_in_flight=MAX_IN_FLIGHT,
            predict=False,
            options=dict(script.settings),
        )
        self.sim = Simulation(spec)
        self.sim.start()

    async def step(self, node: int) -> None:
        self.sim.end_step(node)
        self.sim.settle()

    async def end_training(self) -> None:
        for index in range(len(self.sim.nodes)):
            self.sim.end_training(index)
        self.sim.settle()

    def weights(self) -> np.ndarray:
        return np.array([n.core.status().weights for n in self.sim.nodes])

    def vectors(self) -> np.ndarray:
        return self.sim.payload.x[: len(self.sim.nodes)].copy()

    def cores(self) -> dict[str, GossipProtocol]:
        return {n.id: n.core for n in self.sim.nodes}


# -- the daemon --------------------------------------------------------------------------------
class Daemon:
    """Replicas and networks in this process: real gRPC over loopback with mutual TLS."""

    def __init__(self, script: Script, tmp: Path) -> None:
        self.script = script
        self.tmp = tmp
        self.replicas: list[Replica] = []
        self.networks: list[Network] = []

    async def start(self) -> None:
        pki = self.tmp / "pki"
        certs.init_ca(pki, mesh_id=MESH)
        for n in self.script.ids:
            certs.issue(n, pki)
        ports = free_ports(self.script.nodes)
        vectors = initial_vectors(self.script.nodes)
        per = DIM // SEGMENTS
        for i, n in enumerate(self.script.ids):
            config = parse_config(
                {
                    "mesh_id": MESH,
                    "node_id": n,
                    "listen": f"127.0.0.1:{ports[i]}",
                    "seeds": [f"127.0.0.1:{p}" for p in ports if p != ports[i]],
                    "gossip": {
                        "protocol": self.script.protocol,
                        "segment_bytes": 1024,  # the replica below cuts the plan
                        "max_pushes_in_flight": MAX_IN_FLIGHT,
                        "progress_timeout_s": 5.0,
                    },
                    # A peer the failure detector suspects leaves the core's view: a
                    # ViewChanged no other driver sees, so other pushes (a loaded run once
                    # ended with the same Σw over other weights). Not what this compares.
                    "membership": {"suspect_after_failures": 1000},
                    "metrics": {"listen": None},
                    "tls": {
                        "ca": str(pki / certs.CA_CERT_FILE),
                        "cert": str(pki / f"{n}.pem"),
                        "key": str(pki / f"{n}.key"),
                    },
                },
                "contract test",
            )
            model = torch.nn.Module()
            model.parts = torch.nn.ParameterList(
                torch.nn.Parameter(torch.tensor(vectors[i, s * per : (s + 1) * per]).float())
                for s in range(SEGMENTS)
            )
            replica = Replica(
                n,
                model,
                segment_bytes=per * 4,
                protocol=self.script.protocol,
                settings={
                    k: v
                    for k, v in vars(settings_for(self.script, n)).items()
                    if k not in ("node_id", "num_segments")
                },
            )
            self.replicas.append(replica)
            self.networks.append(Network(config, replica))
        for net in self.networks:
            await net.start()
        for net in self.networks:
            assert await net.wait_for_peers(self.script.nodes - 1, SETTLE_S)
        await self.settle()

    async def close(self) -> None:
        for net in self.networks:
            await net.close(grace_s=0.1)

    async def settle(self) -> None:
        """Until every replica has nothing in flight, queued or due (bounded)."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            for r in self.replicas:
                await asyncio.to_thread(r.idle, 0)
            if all(r.settled() for r in self.replicas):
                return
            assert time.monotonic() < deadline, "the daemon driver did not settle"
            await asyncio.sleep(0.005)

    async def step(self, node: int) -> None:
        await asyncio.to_thread(self.replicas[node].step)
        await self.settle()

    async def end_training(self) -> None:
        for r in self.replicas:
            await asyncio.to_thread(r.finish_training)
        await self.settle()

    def weights(self) -> np.ndarray:
        return np.array([r.summary.weights for r in self.replicas])

    def cores(self) -> dict[str, GossipProtocol]:
        return {r.core.node_id: r.core for r in self.replicas}

    async def deliver_settles(self) -> None:
        """Until no receiver keeps a window its sender closed: settles go over the wire and
        merge at a step boundary, after the pushes they settle (bounded)."""
        deadline = time.monotonic() + SETTLE_S
        while stale := stale_windows(self.cores()):
            assert time.monotonic() < deadline, f"settles never arrived: {stale}"
            for r in self.replicas:
                await asyncio.to_thread(r.idle, 0)
            await asyncio.sleep(0.005)

    def vectors(self) -> np.ndarray:
        return np.array(
            [torch.cat([b.double() for b in r.flat.buffers]).numpy() for r in self.replicas]
        )


@pytest.mark.parametrize("name", sorted(SCRIPTS))
async def test_every_driver_carries_out_the_same_actions_alike(name: str, tmp_path: Path) -> None:
    script = SCRIPTS[name]
    reference = await run(Reference(script), script)
    simulator = await run(Simulator(script), script)
    daemon = Daemon(script, tmp_path)
    try:
        await daemon.start()
        await run(daemon, script)
        await daemon.deliver_settles()
    finally:
        await daemon.close()
    # Every numbering a sender closed is forgotten at its receiver too: the Settle carried.
    assert stale_windows(reference.cores) == []
    assert stale_windows(simulator.cores()) == []
    if script.end_training:  # training over, every numbering closes and is told
        assert reference.settles > 0
    start = initial_vectors(script.nodes)
    assert not np.allclose(reference.vectors(), start), "the script moved nothing"
    w0 = np.full(SEGMENTS, float(script.nodes))
    for driver in (reference, simulator, daemon):
        if name == PULL or not keeps_weights(script.protocol):  # no sum-weights, no mass
            assert driver.weights().shape == (script.nodes, 0)
            continue
        weights, wx = mass(driver)
        np.testing.assert_allclose(weights, w0, rtol=0, atol=1e-12)
        if script.keeps_values:
            np.testing.assert_allclose(wx, start.sum(axis=0), rtol=0, atol=1e-5)
    if script.same_order:
        for driver in (simulator, daemon):
            np.testing.assert_array_equal(driver.weights(), reference.weights())
            np.testing.assert_allclose(driver.vectors(), reference.vectors(), rtol=0, atol=1e-5)


def stale_windows(cores: dict[str, GossipProtocol]) -> list[tuple[str, str, int]]:
    """(receiver, sender, base) of each window a receiver keeps for a numbering its sender
    no longer has open: one a ``Settle`` should have closed."""
    stale = []
    for receiver, core in cores.items():
        if not isinstance(core, SumWeightLedger):
            continue
        for sender, _, base in core.windows:
            sender_core = cores[sender]
            assert isinstance(sender_core, SumWeightLedger)
            if sender_core.numberings.bases.get(receiver) != base:
                stale.append((receiver, sender, base))
    return stale


def test_a_driver_that_skips_an_action_fails_the_contract() -> None:
    """The suite can fail: a reference that drops every Merge ends with other models."""
    script = SCRIPTS["sumweight"]

    class Lazy(Reference):
        def blend(self, node: str, plan: list[Action], values: dict[int, np.ndarray]) -> None:
            return None

    good, lazy = asyncio.run(run(Reference(script), script)), asyncio.run(run(Lazy(script), script))
    assert not np.allclose(good.vectors(), lazy.vectors())


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_every_registered_protocol_has_a_contract_script(protocol: str) -> None:
    """A protocol added to the registry is checked by every driver, or this fails for it."""
    assert protocol in scripted_protocols(), (
        f"protocol {protocol!r} is registered in PROTOCOLS but no script in "
        "tests/contract_scripts.py runs it: add one to SCRIPTS"
    )
