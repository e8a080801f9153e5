"""The contract suite's scripts: which node steps when, for each protocol, and what is compared.

A script is a sequence of steps (which node ends a local step next; after each, everything
it set off is delivered, merged and settled) and, for some, the end of training. Every
driver in tests/test_driver_contract.py runs the same script from the same
:func:`initial_vectors` and must end with the same sum-weights and models. Every
registered protocol (``PROTOCOLS``) needs at least one script here: the suite fails for
one that has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from gossipd.node.protocols import CoreSettings
from gossipd.node.protocols.base import shared_seed
from tests.pullcore import NAME as PULL

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
    # False: the script moves models as training does (an outer step), so Σ w·x is not
    # kept; the drivers must still agree with each other.
    keeps_values: bool = True

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
    # DiLoCo's outer step after each burst (N = 4: sub-rounds at 3, 4; the outer step at 5,
    # which records θ; at 8, a real step): every driver must apply it alike.
    "persyn-outer": Script(
        "persyn",
        4,
        (0, 1, 2, 3) * 9,
        {"average_every_steps": 3, "outer_learning_rate": 0.7, "outer_momentum": 0.9},
        keeps_values=False,
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


def scripted_protocols() -> set[str]:
    """The protocols some script runs."""
    return {script.protocol for script in SCRIPTS.values()}


class Driver(Protocol):
    async def step(self, node: int) -> None: ...
    async def end_training(self) -> None: ...
    def weights(self) -> np.ndarray: ...  # nodes × segments
    def vectors(self) -> np.ndarray: ...  # nodes × DIM


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
