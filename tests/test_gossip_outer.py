"""The outer step of the gossip protocols that average by merges (NoLoCo-style, issue 31):
every ``outer_every_steps`` local steps a site takes DiLoCo's Nesterov step on the change
its own steps and its merges made (``[gossip.<protocol>] outer_every_steps``).

The core's schedule for every protocol that has it, the settings, the simulator (which
carries the same action out) and two real daemons.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import LocalMesh, MeshSpec
from gossipd.node.protocols import CoreSettings, build
from gossipd.node.protocols.base import OuterStep, StepEnded, ViewChanged
from gossipd.node.sim import SimSpec
from gossipd.node.sim.driver import Simulation

PROTOCOLS = ("sumweight", "crossover", "pushsum-expgraph", "shuffle-exchange")


def _outer_steps(protocol: str, options: dict[str, object], steps: int) -> list[OuterStep]:
    core = build(protocol, CoreSettings("n0", 2, options=options))
    core.handle(ViewChanged(frozenset({"n0", "n1", "n2", "n3"})))
    return [
        a
        for step in range(steps + 1)
        for a in core.handle(StepEnded(step, float(step)))
        if isinstance(a, OuterStep)
    ]


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_an_outer_step_comes_every_outer_every_steps_steps_and_none_by_default(
    protocol: str,
) -> None:
    assert _outer_steps(protocol, {}, 40) == []  # the default: none
    taken = _outer_steps(protocol, {"outer_every_steps": 10}, 40)
    assert taken == [OuterStep(r, 0.7, 0.9) for r in (1, 2, 3, 4)]  # DiLoCo's defaults
    mine = _outer_steps(
        protocol, {"outer_every_steps": 20, "outer_learning_rate": 0.5, "outer_momentum": 0.0}, 40
    )
    assert mine == [OuterStep(1, 0.5, 0.0), OuterStep(2, 0.5, 0.0)]


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"outer_every_steps": -1}, "outer_every_steps"),
        ({"outer_every_steps": 10, "outer_learning_rate": 0.0}, "outer_learning_rate"),
        ({"outer_every_steps": 10, "outer_momentum": 1.0}, "outer_momentum"),
    ],
)
def test_bad_outer_settings_are_refused_naming_the_key(
    options: dict[str, object], key: str
) -> None:
    with pytest.raises(ValueError, match=key):
        build("sumweight", CoreSettings("n0", 1, options=options))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_the_simulator_carries_the_outer_step_out_and_keeps_the_sum_of_weights(
    protocol: str,
) -> None:
    spec = SimSpec(
        protocol=protocol,
        nodes=4,
        rounds=60,
        predict=False,
        check_invariants=True,
        options={"outer_every_steps": 5},
    )
    sim = Simulation(spec)
    result = sim.run()
    assert sorted(sim.outers) == [0, 1, 2, 3]
    assert all(o.steps >= 10 and len(o.shared) == spec.segments for o in sim.outers.values())
    # The outer step moves values, never weights: the sum of weights stays exact.
    assert result.invariant_mass_error is not None and result.invariant_mass_error <= 1e-12
    assert math.isfinite(result.consensus_error_end)


def test_two_daemons_run_sumweight_with_an_outer_step_and_keep_their_weight(
    tmp_path: Path,
) -> None:
    spec = MeshSpec(
        protocol="sumweight",
        nodes=2,
        job="digits",
        max_steps=200,
        max_steps_per_s=100.0,  # paced, so the two sites' pushes merge within the run
        duration_s=0.0,
        cpu_share=1.0,
        eval_every_steps=100,
        checkpoint_every_steps=0,
        protocol_options={"outer_every_steps": 10},
    )
    with LocalMesh(spec, tmp_path, fork_node) as mesh:
        for i in range(spec.nodes):
            mesh.start(i)
        asyncio.run(mesh.wait_ready())
        states = asyncio.run(mesh.wait_settled(180.0))
        codes = [mesh.stop(i) for i in sorted(mesh.procs)]
    assert codes == [0, 0]
    assert sum(s["sum_weights"][0] for s in states) == pytest.approx(2.0, abs=1e-12)
    logs = [p.read_text() for p in sorted(tmp_path.rglob("node.log"))]
    assert len(logs) == 2
    for text in logs:
        assert "sumweight: outer optimizer on (learning rate 0.7, momentum 0.9)" in text
    # An outer step on every tenth step: evaluated there, as DiLoCo's baseline does (and
    # once more when training ends).
    for history in sorted(tmp_path.rglob("history.jsonl")):
        steps = [json.loads(line)["step"] for line in history.read_text().splitlines()]
        assert steps[0] == 100 and set(steps[1:]) == {200}, history
    for summary in sorted(tmp_path.rglob("summary.json")):
        assert json.loads(summary.read_text())["outer_steps"] == 20, summary
