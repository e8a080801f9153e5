"""The sink statistic never suspects an honest peer, over thousands of rounds and with churn.

Honest flows of weight between two peers are a zero-drift random walk: a bound on the
net weight (or on a count of unreturned pushes) is crossed sooner or later in a long
run, and an honest peer would be cut off. The score of :mod:`gossipd.node.protocols.sinks`
is a CUSUM over shares of the node's own weight with a drift allowance, a reflected walk
with negative drift for honest peers: this runs the very cores the daemon runs in the
simulator and checks that no honest peer is ever suspected and that the largest score
stays well under the default bound, while a sink would be suspected after a stated
number of pushes.
"""

from __future__ import annotations

import pytest

from gossipd.node.protocols.sinks import SinkWatch
from gossipd.node.sim.driver import Simulation
from gossipd.node.sim.scenarios import HOMOGENEOUS, FaultEntry
from gossipd.node.sim.spec import SimSpec

DEFAULT_BOUND = 6.0  # limits.sink_score_bound
DEFAULT_ALLOWANCE = 0.5  # limits.sink_allowance
ROUNDS = 3000

CHURN = HOMOGENEOUS.with_faults(
    (
        FaultEntry(400.0, "fail", 1),
        FaultEntry(900.0, "leave", 2),
        FaultEntry(1200.0, "join"),
        FaultEntry(1800.0, "join"),
        FaultEntry(2300.0, "leave", 3),
    ),
    None,
)


@pytest.mark.parametrize(
    ("protocol", "nodes", "scenario"),
    [("sumweight", 4, HOMOGENEOUS), ("sumweight", 8, CHURN), ("crossover", 6, CHURN)],
    ids=["sumweight-4", "sumweight-8-churn", "crossover-6-churn"],
)
def test_no_honest_peer_is_suspected_over_thousands_of_rounds(protocol, nodes, scenario):
    highest = {"score": 0.0}
    suspected: list[tuple[int, str, frozenset[str]]] = []

    def probe(sim: Simulation, k: int) -> None:
        for node in sim.nodes:
            if not node.alive:
                continue
            status = node.core.status()
            if status.sinks:
                suspected.append((k, node.id, status.sinks))
            scores = node.core.sinks.scores.values()
            highest["score"] = max(highest["score"], *scores, 0.0)

    spec = SimSpec(
        protocol=protocol, nodes=nodes, rounds=ROUNDS, segments=2, scenario=scenario, dim=8
    )
    result = Simulation(spec, on_probe=probe).run()
    print(
        f"\n{protocol} N={nodes} {scenario.name}: largest honest sink score {highest['score']:.2f}"
    )
    assert result.rounds >= ROUNDS
    assert suspected == []
    assert result.refused == 0  # nor refused by its credit (limits.peer_credit)
    # Between two probes a score moves by at most one round's pushes: keep a margin of 2.
    assert highest["score"] < DEFAULT_BOUND - 2.0


def test_a_sink_is_suspected_after_the_stated_number_of_pushes():
    watch = SinkWatch(DEFAULT_BOUND, DEFAULT_ALLOWANCE)
    stated = watch.pushes_to_suspect(0.5)
    for _ in range(stated - 1):
        watch.sent("sink", 0.5)
    assert not watch.suspected("sink")
    watch.sent("sink", 0.5)
    assert watch.suspected("sink")
    assert watch.sinks() == {"sink"}
