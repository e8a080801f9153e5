"""DiLoCo over gossip beside a sink, in the simulator: the honest models stay together and
the sum of weights stays exact (docs/protocols/persyn.md, "Outer optimizer").

A sink is a member that takes the pushes made to it and never pushes: in every burst the
honest node whose in-neighbour it is misses that sub-round's push, its burst ends partial
at the deadline, and it takes no outer step on it. These run the very cores and outer
optimizer the daemon runs for a hundred bursts of K′ = 20, training off: the
pseudo-gradient is then nothing but the sites' disagreement, the case where an outer step
on a partial average amplified it.
"""

from __future__ import annotations

import numpy as np
import pytest

from gossipd.node.protocols.persyn import PerSyn
from gossipd.node.sim import SimSpec
from gossipd.node.sim.driver import Simulation
from gossipd.node.sim.scenarios import Scenario

STEPS = 2000  # 10 ms steps: 100 bursts
# The honest mean may move by this much of the honest models' starting spread: the
# outer steps take the first bursts' disagreement once (measured 0.13-0.19).
MOVED = 0.5
OPTIONS = {"average_every_steps": 20, "outer_learning_rate": 0.7, "outer_momentum": 0.9}


def _sink(core: PerSyn) -> None:
    """Make ``core`` a sink: it merges what it is pushed and pushes nothing, ever."""
    core.exchange = lambda sub_round: []  # type: ignore[method-assign]
    core.on_training_ended = lambda event: []  # type: ignore[method-assign]


def _honest(sim: Simulation, honest: int) -> np.ndarray:
    return np.stack(
        [
            np.concatenate([sim.payload.values(i, s) for s in range(sim.segments)])
            for i in range(honest)
        ]
    )


def _spread(x: np.ndarray) -> float:
    """The largest distance of an honest node's vector from the honest nodes' mean."""
    return float(np.linalg.norm(x - x.mean(axis=0), axis=1).max())


@pytest.mark.parametrize(("honest", "latency_s"), [(8, 0.005), (4, 0.12)])
def test_beside_a_sink_the_honest_models_stay_together_and_the_weight_exact(
    honest: int, latency_s: float
) -> None:
    """5 ms links (bursts whole but for the sink's sub-round) and 120 ms links (pushes land
    after their deadlines too: every burst partial). Measured: the spread ends at 9e-6
    of its start (1e-16 over 120 ms), never above it. What the sink costs in outer steps
    is printed: with 8 honest nodes two took none in 100 bursts and four about half
    (0, 49, 98, 49, 48, 98, 48, 0), over 120 ms links none took any. Outer steps on
    partial bursts were tried and lost on real training (docs/protocols/persyn.md)."""
    wan = Scenario(
        name="sink-wan",
        description=f"10 ms steps, {latency_s * 1000:g} ms links",
        step_time_s=(0.01,),
        latency_s=((latency_s,),),
        bandwidth_bytes_per_s=((1.25e9,),),
        timeout_s=1.0,
    )
    spec = SimSpec(
        protocol="persyn",
        nodes=honest + 1,
        rounds=STEPS,
        segments=2,
        scenario=wan,
        predict=False,
        check_invariants=True,
        options=OPTIONS,
    )
    spreads: list[float] = []
    sim = Simulation(spec, on_probe=lambda s, _: spreads.append(_spread(_honest(s, honest))))
    _sink(sim.nodes[honest].core)
    x0 = _honest(sim, honest)
    result = sim.run()
    x = _honest(sim, honest)
    steps = [sim.outers[i].steps if i in sim.outers else 0 for i in range(honest)]
    moved = np.linalg.norm(x.mean(axis=0) - x0.mean(axis=0)) / _spread(x0)
    print(f"{honest} honest, {latency_s * 1000:g} ms: outer steps {steps}, ", end="")
    print(f"spread {_spread(x) / _spread(x0):.2g} of its start, mean moved {moved:.3f} of it")
    # Σw and Σw·x exact over the mesh, the sink's holding included.
    assert result.invariant_mass_error is not None and result.invariant_mass_error <= 1e-12
    assert max(spreads) <= _spread(x0) * (1 + 1e-9), max(spreads)
    assert _spread(x) <= 1e-4 * _spread(x0), _spread(x)
    assert moved <= MOVED, moved
