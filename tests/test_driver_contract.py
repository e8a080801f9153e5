"""One contract, three drivers: the promises of ``node/protocols/base.py``, carried out alike.

A core never does anything itself; a driver carries out what it returns. The daemon
(the replica and the network: real ``grpc.aio`` servers on port 0 with mutual TLS, in
this process), the simulator, and the small reference driver below must do the same
thing with the same actions: given the same script of events (a node's step, then
everything it set off delivered, merged, settled, until nothing is left in flight),
they must end with the same sum-weights and the same models, and keep Σw and Σw·x
exact. The scripts exercise ``Push``, ``Merge``, ``Duplicate`` (the reference answers
every push a second time, as after a lost acknowledgement), ``StartTimer`` (persyn's
bursts) and ``Pull`` (the test-only core of ``tests/pullcore.py``); ``FoldBack`` is
the fault path, checked against the daemon by the mass and liveness tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pytest
import torch

from gossipd.node.launch.localmesh import free_ports
from gossipd.node.net.network import Network
from gossipd.node.protocols import PROTOCOLS, CoreSettings, build, keeps_weights
from gossipd.node.protocols.base import (
    Action,
    Duplicate,
    FoldBack,
    Merge,
    PayloadArrived,
    PayloadMerged,
    Pull,
    PullArrived,
    PullMerged,
    Push,
    PushSettled,
    StartTimer,
    StepEnded,
    TimerFired,
    TrainingEnded,
    ViewChanged,
    shared_seed,
)
from gossipd.node.shared import certs
from gossipd.node.shared.config import parse_config
from gossipd.node.sim import SimSpec, Simulation
from gossipd.node.trainer.replica import Replica
from tests.pullcore import NAME as PULL
from tests.pullcore import PullEveryRound

MESH = "contract-mesh"
SEGMENTS = 2
DIM = 8  # floats per node; DIM // SEGMENTS per segment
MAX_IN_FLIGHT = 4
SETTLE_S = 60.0


@dataclass(frozen=True)
class Script:
    protocol: str
    nodes: int
    steps: tuple[int, ...]  # which node steps next; after each, everything settles
    settings: dict[str, Any] = field(default_factory=dict)
    end_training: bool = False
    # False: timers fire in another order in each driver (the daemon's at its nodes'
    # next boundaries, on the wall clock), so merges interleave differently: mass only.
    same_order: bool = True

    @property
    def ids(self) -> list[str]:
        return [f"node-{i}" for i in range(self.nodes)]


SCRIPTS = {
    "sumweight": Script("sumweight", 2, (0, 1, 0, 0, 1), {"push_probability": 1.0}),
    "crossover": Script("crossover", 4, (0, 1, 2, 3, 0, 1, 2, 3), {"round_steps": 1}),
    "pushsum-expgraph": Script("pushsum-expgraph", 4, (0, 1, 2, 3) * 2, {"round_steps": 1}),
    "shuffle-exchange": Script("shuffle-exchange", 4, (0, 1, 2, 3) * 2, {"round_steps": 1}),
    "persyn": Script(
        "persyn", 4, (0, 1, 2, 3) * 2, {"average_every_steps": 2}, True, same_order=False
    ),
    # Bursts at the epoch ends (3) and at K′ (5): sub-rounds 0, 1, then 0 again at step 5.
    "persyn-epoch": Script(
        "persyn", 4, (0, 1, 2, 3) * 5, {"average_every_steps": 5, "epoch_steps": 3}
    ),
    PULL: Script(PULL, 2, (0, 1, 0, 1)),
    # Pulls merged at their period's last step (held until then), and pulled at the end.
    "overlap": Script("overlap", 3, (0, 1, 2) * 4, {"period_steps": 2}),
    "overlap-none": Script("overlap", 3, (0, 1, 2) * 4, {"period_steps": 2, "mode": "none"}),
}


def initial_vectors(nodes: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    # float32-exact values, so the daemon's float32 parameters start where the others do
    return rng.integers(-64, 64, size=(nodes, DIM)).astype(np.float64) / 8


def settings_for(script: Script, node_id: str) -> CoreSettings:
    return CoreSettings(
        node_id,
        SEGMENTS,
        seed=shared_seed("contract", node_id),
        mesh_seed=shared_seed(MESH),
        max_in_flight=MAX_IN_FLIGHT,
        options=script.settings,
    )


@pytest.fixture(autouse=True)
def pull_core(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(PROTOCOLS, PULL, lambda s: PullEveryRound(s.node_id, s.num_segments))
    yield


class Driver(Protocol):
    async def step(self, node: int) -> None: ...
    async def end_training(self) -> None: ...
    def weights(self) -> np.ndarray: ...  # nodes × segments
    def vectors(self) -> np.ndarray: ...  # nodes × DIM


# -- the reference driver ------------------------------------------------------------------
class Reference:
    """The smallest driver that keeps every promise: a FIFO network, a virtual clock."""

    def __init__(self, script: Script) -> None:
        self.ids = script.ids
        self.cores = {n: build(script.protocol, settings_for(script, n)) for n in self.ids}
        self.x = {n: v.copy() for n, v in zip(self.ids, initial_vectors(script.nodes), strict=True)}
        self.bounds = np.linspace(0, DIM, SEGMENTS + 1).round().astype(int)
        self.now = 0.0
        self.queue: list[tuple[str, Action, dict[int, np.ndarray]]] = []
        self.timers: list[tuple[float, str, str]] = []
        self.steps = dict.fromkeys(self.ids, 0)
        # Pulls that landed before the step they merge at (Pull.merge_at_step).
        self.held: list[tuple[str, PullArrived, dict[int, np.ndarray], int]] = []
        for n in self.ids:
            self.act(n, self.cores[n].handle(ViewChanged(frozenset(self.ids))))

    def seg(self, node: str, s: int) -> np.ndarray:
        return self.x[node][self.bounds[s] : self.bounds[s + 1]]

    def act(self, node: str, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Push | Pull):
                segments = a.weights if isinstance(a, Push) else a.segments
                self.queue.append((node, a, {s: self.seg(node, s).copy() for s in segments}))
            elif isinstance(a, StartTimer):
                self.timers.append((a.at_s, node, a.tag))
            else:
                raise AssertionError(f"{node}: {a!r} outside a payload or a settle")

    def blend(self, node: str, plan: list[Action], values: dict[int, np.ndarray]) -> None:
        for m in plan:
            if isinstance(m, Merge):
                part = self.seg(node, m.segment)
                part[:] = (1 - m.alpha) * part + m.alpha * values[m.segment]

    def settle(self) -> None:
        while self.queue:
            sender, action, snap = self.queue.pop(0)
            if isinstance(action, Push):
                arrival = PayloadArrived(
                    sender, 1, action.sequence, action.round, action.weights, action.sequence_base
                )
                receiver = self.cores[action.peer]
                plan = receiver.handle(arrival)
                self.blend(action.peer, plan, snap)
                receiver.handle(PayloadMerged(arrival))
                # The acknowledgement is lost once: the retry must be answered DUPLICATE.
                again = receiver.handle(arrival)
                assert all(isinstance(a, Duplicate) for a in again), again
                settled = PushSettled(action.peer, action.sequence, tuple(action.weights))
                for fold in self.cores[sender].handle(settled):
                    assert isinstance(fold, FoldBack)
            else:
                peer_weights = self.cores[action.peer].status().weights
                values = {s: self.seg(action.peer, s).copy() for s in action.segments}
                arrival = PullArrived(
                    action.peer,
                    action.round,
                    {s: peer_weights[s] if peer_weights else 0.0 for s in action.segments},
                )
                due = action.merge_at_step or 0
                if due > self.steps[sender]:
                    self.held.append((sender, arrival, values, due))
                else:
                    self.merge_pull(sender, arrival, values)
            self.now += 1e-3

    def merge_pull(self, node: str, arrival: PullArrived, values: dict[int, np.ndarray]) -> None:
        self.blend(node, self.cores[node].handle(arrival), values)
        self.act(node, self.cores[node].handle(PullMerged(arrival)))

    async def step(self, node: int) -> None:
        n = self.ids[node]
        self.steps[n] += 1
        self.now += 0.01
        ready = [h for h in self.held if h[0] == n and h[3] <= self.steps[n]]
        for held in ready:  # merged at this boundary, before the core hears the step ended
            self.held.remove(held)
            self.merge_pull(n, held[1], held[2])
        self.act(n, self.cores[n].handle(StepEnded(self.steps[n], self.now)))
        self.settle()
        self.fire_due()

    def fire_due(self, until: float | None = None) -> None:
        while self.timers and (until is None or min(self.timers)[0] <= until):
            self.timers.sort()
            at_s, n, tag = self.timers.pop(0)
            self.now = max(self.now, at_s)
            self.act(n, self.cores[n].handle(TimerFired(tag, self.now)))
            self.settle()

    async def end_training(self) -> None:
        for n in self.ids:
            self.act(n, self.cores[n].handle(TrainingEnded(self.steps[n], self.now)))
        self.settle()
        self.fire_due()

    def weights(self) -> np.ndarray:
        return np.array([self.cores[n].status().weights for n in self.ids])

    def vectors(self) -> np.ndarray:
        return np.array([self.x[n] for n in self.ids])


# -- the simulator ---------------------------------------------------------------------------
class Simulator:
    """The simulator's own driver, stepped by the script instead of its clock."""

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
        self.sim._set_members(self.sim.members)

    async def step(self, node: int) -> None:
        n = self.sim.nodes[node]
        n.steps += 1
        self.sim._release_held(n)  # as the simulator's own step: held pulls merge first
        self.sim._act(n, n.core.handle(StepEnded(n.steps, self.sim.now)))
        self.sim.env.run()

    async def end_training(self) -> None:
        for n in self.sim.nodes:
            self.sim._act(n, n.core.handle(TrainingEnded(n.steps, self.sim.now)))
        self.sim.env.run()

    def weights(self) -> np.ndarray:
        return np.array([n.core.status().weights for n in self.sim.nodes])

    def vectors(self) -> np.ndarray:
        return self.sim.payload.x[: len(self.sim.nodes)].copy()


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

    def vectors(self) -> np.ndarray:
        return np.array(
            [torch.cat([b.double() for b in r.flat.buffers]).numpy() for r in self.replicas]
        )


async def run(driver: Driver, script: Script) -> Driver:
    for node in script.steps:
        await driver.step(node)
    if script.end_training:
        await driver.end_training()
    return driver


def mass(driver: Driver) -> tuple[np.ndarray, np.ndarray]:
    w, x = driver.weights(), driver.vectors()
    bounds = np.linspace(0, DIM, SEGMENTS + 1).round().astype(int)
    wx = sum(
        np.concatenate([w[i, s] * x[i, bounds[s] : bounds[s + 1]] for s in range(SEGMENTS)])
        for i in range(len(w))
    )
    return w.sum(axis=0), wx


@pytest.mark.parametrize("name", sorted(SCRIPTS))
async def test_every_driver_carries_out_the_same_actions_alike(name: str, tmp_path: Path) -> None:
    script = SCRIPTS[name]
    reference = await run(Reference(script), script)
    simulator = await run(Simulator(script), script)
    daemon = Daemon(script, tmp_path)
    try:
        await daemon.start()
        await run(daemon, script)
    finally:
        await daemon.close()
    start = initial_vectors(script.nodes)
    assert not np.allclose(reference.vectors(), start), "the script moved nothing"
    w0 = np.full(SEGMENTS, float(script.nodes))
    for driver in (reference, simulator, daemon):
        if name == PULL or not keeps_weights(script.protocol):  # no sum-weights, no mass
            assert driver.weights().shape == (script.nodes, 0)
            continue
        weights, wx = mass(driver)
        np.testing.assert_allclose(weights, w0, rtol=0, atol=1e-12)
        np.testing.assert_allclose(wx, start.sum(axis=0), rtol=0, atol=1e-5)
    if script.same_order:
        for driver in (simulator, daemon):
            np.testing.assert_array_equal(driver.weights(), reference.weights())
            np.testing.assert_allclose(driver.vectors(), reference.vectors(), rtol=0, atol=1e-5)


def test_a_driver_that_skips_an_action_fails_the_contract() -> None:
    """The suite can fail: a reference that drops every Merge ends with other models."""
    script = SCRIPTS["sumweight"]

    class Lazy(Reference):
        def blend(self, node: str, plan: list[Action], values: dict[int, np.ndarray]) -> None:
            return None

    good, lazy = asyncio.run(run(Reference(script), script)), asyncio.run(run(Lazy(script), script))
    assert not np.allclose(good.vectors(), lazy.vectors())
