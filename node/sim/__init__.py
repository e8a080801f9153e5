"""`gossipd sim`: a discrete-event simulator that drives the daemon's own protocol cores.

One protocol implementation, two drivers (docs/design.md §2): the cores built here by
:func:`gossipd.node.protocols.build` are the objects the daemon runs; only the
clock, the network and the model are simulated. See :mod:`.driver` for what is
modelled, :mod:`.scenarios` for the named networks, :mod:`.spectral` for the
mixing-matrix prediction, and :mod:`.command` for the CLI.
"""

from __future__ import annotations

from collections.abc import Callable

from gossipd.node.sim.driver import SimError, Simulation
from gossipd.node.sim.scenarios import SCENARIOS, FaultEntry, Scenario, load_scenario
from gossipd.node.sim.spec import SimResult, SimSpec


def run_sim(spec: SimSpec, on_probe: Callable[[Simulation, int], None] | None = None) -> SimResult:
    """Run ``spec`` once and return what it measured (deterministic for a given spec)."""
    return Simulation(spec, on_probe).run()


__all__ = [
    "SCENARIOS",
    "FaultEntry",
    "Scenario",
    "SimError",
    "SimResult",
    "SimSpec",
    "Simulation",
    "load_scenario",
    "run_sim",
]
