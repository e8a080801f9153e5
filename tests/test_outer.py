"""The outer optimizer of ``persyn`` (node/model/outer.py): DiLoCo's outer Nesterov step
after each burst of averaging (docs/protocols/persyn.md, "Outer optimizer").

The arithmetic against torch's own SGD, on tensors and numpy vectors alike; the core's
schedule (each sub-round once the last one's push merged, one OuterStep after the burst's
last merge, none with the defaults); the settings;
the simulator and two real daemons, which carry the same action out.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gossipd.node.errors import ConfigError
from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import LocalMesh, MeshSpec
from gossipd.node.model.outer import OuterNesterov
from gossipd.node.protocols import CoreSettings, build
from gossipd.node.protocols.base import (
    OuterStep,
    PayloadArrived,
    PayloadMerged,
    PushSettled,
    Settle,
    StepEnded,
    ViewChanged,
)
from gossipd.node.protocols.persyn import MAX_ROUND
from gossipd.node.shared.config import parse_config
from gossipd.node.sim import SimResult, SimSpec
from gossipd.node.sim.driver import Simulation
from gossipd.node.sim.scenarios import Scenario
from tests.daemons import scrape_metrics

ENDED_AT_200 = "training ended at step 200: evaluating the shared model of the outer step"


def _averages(n: int, dim: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(dim, generator=g, dtype=torch.float64) for _ in range(n)]


@pytest.mark.parametrize(("lr", "momentum"), [(0.7, 0.9), (1.0, 0.5), (0.3, 0.0)])
def test_the_outer_step_is_torch_sgd_with_nesterov_on_the_pseudo_gradient(
    lr: float, momentum: float
) -> None:
    first, *rest = _averages(6)
    shared = torch.nn.Parameter(first.clone())
    sgd = torch.optim.SGD([shared], lr=lr, momentum=momentum, nesterov=momentum > 0)
    ours, on_numpy = OuterNesterov(lr, momentum), OuterNesterov(lr, momentum)
    assert torch.equal(ours.step(0, first), first)  # the first only records the model
    on_numpy.step(0, first.numpy())
    for averaged in rest:
        shared.grad = shared.detach() - averaged
        sgd.step()
        torch.testing.assert_close(ours.step(0, averaged), shared.detach(), rtol=0, atol=1e-12)
        np.testing.assert_allclose(on_numpy.step(0, averaged.numpy()), shared.detach().numpy())
    assert ours.nbytes == 7 * 8 * (2 if momentum else 1)


def test_learning_rate_one_without_momentum_is_the_average_itself() -> None:
    outer = OuterNesterov(1.0, 0.0)
    for averaged in _averages(4):  # θ − 1·(θ − x̄): x̄ up to rounding
        torch.testing.assert_close(outer.step(0, averaged), averaged, rtol=0, atol=1e-12)


def test_a_recorded_model_is_a_copy_the_caller_cannot_change() -> None:
    x = torch.ones(3)
    outer = OuterNesterov(0.5, 0.0)
    outer.step(0, x)
    x += 1  # training goes on in place
    assert torch.equal(outer.step(0, torch.zeros(3)), torch.full((3,), 0.5))


@pytest.mark.parametrize(("lr", "momentum"), [(0.0, 0.9), (-1.0, 0.0), (0.7, 1.0), (0.7, -0.1)])
def test_bad_outer_settings_are_refused(lr: float, momentum: float) -> None:
    with pytest.raises(ValueError, match="outer learning rate"):
        OuterNesterov(lr, momentum)
    data = {
        "mesh_id": "m",
        "node_id": "a",
        "tls": {"insecure": True},
        "gossip": {
            "protocol": "persyn",
            "persyn": {"outer_learning_rate": lr, "outer_momentum": momentum},
        },
    }
    with pytest.raises(ConfigError, match=r"gossip\.persyn\.outer_"):
        parse_config(data, "site.toml")


def _burst(nodes: int, heard: dict[int, str] | None = None, steps: int = 40) -> list[tuple]:
    """n0's pushes and outer steps over ``steps`` steps, K′ = 10; ``heard`` maps a step to
    the peer whose push of the burst under way merges at n0 right after that step."""
    options = {"average_every_steps": 10, "outer_learning_rate": 0.7, "outer_momentum": 0.9}
    core = build("persyn", CoreSettings("n0", 2, options=options))
    core.handle(ViewChanged(frozenset(f"n{i}" for i in range(nodes))))
    done = []
    for step in range(1, steps + 1):
        for action in core.handle(StepEnded(step, float(step))):
            if isinstance(action, Settle):  # a numbering idle since its push settled
                continue
            if isinstance(action, OuterStep):
                assert action == OuterStep(step // 10, 0.7, 0.9)
                done.append((step, "outer"))
            else:
                done.append((step, action.peer))
                core.handle(PushSettled(action.peer, action.sequence, (0, 1)))
        sender = (heard or {}).get(step)
        if sender is not None:
            arrival = PayloadArrived(sender, 1, step, step // 10, {0: 0.5, 1: 0.5})
            core.handle(arrival)
            core.handle(PayloadMerged(arrival))
    return done


def test_each_sub_round_goes_once_the_last_one_merged_and_the_outer_step_after() -> None:
    # N = 4, n0 of rank 0. Burst 1 (odd: backward) sends sub-round 0 to n3 at step 10 and
    # sub-round 1 to n2 the step after n1's sub-round-0 push merged, the outer step the
    # step after n2's merged; burst 2 (forward) the same to n1 and n2, paced by n3 and n2.
    heard = {12: "n1", 15: "n2", 23: "n3", 24: "n2"}
    assert _burst(4, heard, steps=39) == [
        (10, "n3"),
        (13, "n2"),
        (16, "outer"),
        (20, "n1"),
        (24, "n2"),
        (25, "outer"),
        (30, "n3"),
        (34, "n2"),  # nothing merged: each sub-round waits W = ⌊(K′ − 1)/R⌋ = 4 steps,
    ]  # and no outer step on a burst whose pushes did not all merge here: a plain average
    # In a backward burst n3 pushes to n2 and n1, never to n0: its pushes pace no sub-round.
    assert _burst(4, {11: "n3", 12: "n3"}, steps=19) == [(10, "n3"), (14, "n2")]
    # N = 8: R = 3 sub-rounds of W = 3 steps at most; the outer step once all merged.
    assert _burst(8, steps=19) == [(10, "n7"), (13, "n6"), (16, "n4")]
    assert _burst(8, {10: "n1", 11: "n2", 12: "n4"}, steps=19) == [
        (10, "n7"),
        (11, "n6"),
        (12, "n4"),
        (13, "outer"),
    ]


def _persyn_over_wan(
    nodes: int,
    latency_s: float,
    rounds: int,
    options: dict[str, Any],
    step_time_s: tuple[float, ...] = (0.01,),
) -> tuple[Simulation, SimResult]:
    """``nodes`` persyn nodes over links of ``latency_s`` one way, node i stepping every
    ``step_time_s[i % len(step_time_s)]``; the sum of weights checked after every event."""
    k = len(step_time_s)
    wan = Scenario(
        name=f"wan{latency_s * 1000:g}",
        description=f"{step_time_s} s steps, {latency_s * 1000:g} ms links",
        step_time_s=step_time_s,
        latency_s=((latency_s,) * k,) * k,
        bandwidth_bytes_per_s=((1.25e9,) * k,) * k,
        timeout_s=1.0,
    )
    spec = SimSpec(
        protocol="persyn",
        nodes=nodes,
        rounds=rounds,
        segments=2,
        scenario=wan,
        predict=False,
        check_invariants=True,
        options=options,
    )
    sim = Simulation(spec)
    result = sim.run()
    assert result.invariant_mass_error is not None and result.invariant_mass_error <= 1e-12
    return sim, result


@pytest.mark.parametrize("nodes", [4, 8])
def test_over_links_slower_than_a_step_a_burst_still_ends_at_the_exact_average(
    nodes: int,
) -> None:
    """10 ms steps, 50 ms one way: a push lands 5 steps after it leaves. Paced by arrivals
    the burst at step 50 leaves every vector at the mean; with sub-rounds a step apart
    (before) they ended 0.40-0.52 of their start from it."""
    _, result = _persyn_over_wan(nodes, 0.05, 70, {"average_every_steps": 50})
    assert result.consensus_error_end <= 1e-12 * result.consensus_error_start


@pytest.mark.parametrize("nodes", [4, 8])
def test_over_links_too_slow_for_a_burst_the_outer_step_never_amplifies_disagreement(
    nodes: int,
) -> None:
    """10 ms steps, 120 ms links, a burst every 20 steps: pushes land after their
    sub-round's deadline, so bursts are partial averages. An outer step on one (before)
    took the sites' disagreement for a pseudo-gradient and the momentum amplified it:
    the consensus error grew from 0.98 to 4.2 (4 nodes) and 1.06 to 6.8 (8) in 400
    steps, as mnist1d sites over 80 ms links diverged to 1e13. Now it never grows."""
    options = {"average_every_steps": 20, "outer_learning_rate": 0.7, "outer_momentum": 0.9}
    _, result = _persyn_over_wan(nodes, 0.12, 400, options)
    assert max(result.errors) <= result.consensus_error_start * (1 + 1e-9), result.errors[-1]


def test_a_site_that_merges_a_later_burst_catches_up_and_keeps_its_own_period_after() -> None:
    """n0 at step 23 of round 2 (K′ = 10) merges n3's sub-round-0 push of round 5: its
    burst 2 first sends its last sub-round (at its deadline, step 24), then burst 5 starts
    at the next step, its own next one K′ steps after that; a round past MAX_ROUND (a
    member's lie, which would overflow the uint64 round) moves nothing."""
    core = build("persyn", CoreSettings("n0", 2, options={"average_every_steps": 10}))
    core.handle(ViewChanged(frozenset(f"n{i}" for i in range(4))))
    pushes = {}
    for step in range(1, 46):
        for action in core.handle(StepEnded(step, float(step))):
            if isinstance(action, Settle):
                continue
            pushes[step] = (action.peer, core.round)
            core.handle(PushSettled(action.peer, action.sequence, (0, 1)))
        if step in (23, 30):
            late = 5 if step == 23 else MAX_ROUND + 1
            arrival = PayloadArrived("n3", 1, step, late, {0: 0.5, 1: 0.5})
            core.handle(arrival)
            core.handle(PayloadMerged(arrival))
    assert pushes[24] == ("n2", 2)  # burst 2's sub-round 1, not cut off by the catch-up
    # Sub-round 0 goes to n3 in a burst of odd round (backward), to n1 in an even one.
    assert [(s, p) for s, p in pushes.items() if p[0] != "n2"] == [
        (10, ("n3", 1)),
        (20, ("n1", 2)),
        (25, ("n3", 5)),  # caught up: sub-round 0 of burst 5 once burst 2 was done
        (35, ("n1", 6)),  # then every K′ steps from there, as n3 does
        (45, ("n3", 7)),
    ]


@pytest.mark.parametrize("times", [(1, 2, 3, 4), (1, 1.5, 2, 3, 4, 6, 8, 12)])
def test_slow_sites_send_every_sub_round_and_keep_a_share_of_the_weight(
    times: tuple[float, ...],
) -> None:
    """Bursts back to back (K′ = ⌈log2 N⌉) and sites 4-12 times slower than the fastest:
    a slow site is caught up with a later burst at nearly every step. Cut off there, it
    sent sub-round 0 only, in the direction its faster neighbours reach it in, and two
    slow neighbours pushed only to each other: they held nearly all the weight (shares
    0.01-1.81 and 0.02-2.72 of fair). Its burst now sends its sub-rounds first."""
    n = len(times)
    scenario = Scenario(
        name="ladder",
        description="sites of different speeds",
        step_time_s=times,
        latency_s=((0.005,) * n,) * n,
        bandwidth_bytes_per_s=((1.25e9,) * n,) * n,
    )
    spec = SimSpec(protocol="persyn", nodes=n, rounds=1200, segments=4, scenario=scenario)
    result = Simulation(spec).run()
    shares = result.weight_shares
    assert min(shares) > 0.5 and max(shares) < 2.0, shares  # measured 0.72-1.44 at worst


def test_a_slower_site_takes_every_outer_step_the_fast_ones_take() -> None:
    """One site of four steps three times slower. By its own step count it started a
    burst every third of theirs, and the bursts met by chance: before, three of the sites
    took 15 outer steps of the 48 the fourth took (7-23 with four speeds). Caught up,
    every site takes all 48 and the disagreement never grows."""
    options = {"average_every_steps": 20, "outer_learning_rate": 0.7, "outer_momentum": 0.9}
    sim, result = _persyn_over_wan(4, 0.005, 1000, options, (0.003, 0.003, 0.003, 0.009))
    assert [sim.outers[i].steps for i in range(4)] == [48] * 4
    assert max(result.errors) <= result.consensus_error_start * (1 + 1e-9)


def test_the_defaults_take_no_outer_step() -> None:
    core = build("persyn", CoreSettings("n0", 2, options={"average_every_steps": 10}))
    core.handle(ViewChanged(frozenset({"n0", "n1"})))
    for step in range(1, 41):  # no outer step, plain averaging
        assert not any(isinstance(a, OuterStep) for a in core.handle(StepEnded(step, 1.0)))


def test_the_simulator_carries_the_outer_step_out_and_keeps_the_sum_of_weights() -> None:
    spec = SimSpec(
        protocol="persyn",
        nodes=4,
        rounds=60,
        predict=False,
        check_invariants=True,
        options={"average_every_steps": 10, "outer_learning_rate": 0.7, "outer_momentum": 0.9},
    )
    sim = Simulation(spec)
    result = sim.run()
    assert sorted(sim.outers) == [0, 1, 2, 3]
    # Without latency every burst is whole: an outer step after each but the first.
    assert all(o.steps >= 4 and len(o.shared) == spec.segments for o in sim.outers.values())
    assert result.invariant_mass_error is not None and result.invariant_mass_error <= 1e-12
    # Training off: the bursts still bring the vectors together.
    assert result.consensus_error_end < 0.1 * result.consensus_error_start


def test_two_daemons_run_persyn_with_an_outer_step_and_keep_their_weight(tmp_path: Path) -> None:
    spec = MeshSpec(
        protocol="persyn",
        nodes=2,
        job="digits",
        max_steps=200,
        # Paced: unpaced, 200 digits steps took under 0.1 s on a fast machine, the run ended
        # before the two sites' pushes merged in any burst, and no burst was whole.
        max_steps_per_s=100.0,
        duration_s=0.0,
        cpu_share=1.0,
        eval_every_steps=100,
        checkpoint_every_steps=0,
        protocol_options={
            "average_every_steps": 10,
            "outer_learning_rate": 0.7,
            "outer_momentum": 0.9,
        },
    )
    with LocalMesh(spec, tmp_path, fork_node) as mesh:
        for i in range(spec.nodes):
            mesh.start(i)
        asyncio.run(mesh.wait_ready())
        states = asyncio.run(mesh.wait_settled(180.0))
        # What an operator watches for the outer steps (summary.json has them only at exit).
        outer = [
            scrape_metrics(json.loads(p.read_text())["metrics_port"])["gossipd_outer_steps_total"]
            for p in sorted(tmp_path.rglob("node.json"))
        ]
        codes = [mesh.stop(i) for i in sorted(mesh.procs)]
    assert codes == [0, 0]
    assert len(outer) == 2 and min(outer) >= 2, outer
    assert sum(s["sum_weights"][0] for s in states) == pytest.approx(2.0, abs=1e-12)
    logs = [p.read_text() for p in sorted(tmp_path.rglob("node.log"))]
    assert len(logs) == 2
    for text in logs:
        assert "persyn: outer optimizer on (learning rate 0.7, momentum 0.9)" in text
    # The shared model exists at outer steps (2 nodes: 1 to 9 steps after each burst, once
    # the peer's push merged): evaluated at the first one at or past step 100, as DiLoCo's
    # baseline does, and at the end. A node a step behind its peer catches up with the
    # peer's burst, so its outer step can fall on step 100 (or 200) itself.
    for history in sorted(tmp_path.rglob("history.jsonl")):
        steps = [json.loads(line)["step"] for line in history.read_text().splitlines()]
        assert 100 <= steps[0] <= 109 and set(steps[1:]) == {200}, history
    # At step 200 a node's own model is some inner steps past its last outer step: the
    # last evaluation is of that outer step's shared model, said at INFO. A node that never
    # caught up with its peer cannot take an outer step at 200 (the burst begun there drops
    # the one before it); one that did can, so the line is asked of one node at least.
    ended = [re.search(rf"{ENDED_AT_200} at step (\d+), not", text) for text in logs]
    assert any(ended), [text[-2000:] for text in logs]
    assert all(100 <= int(m.group(1)) < 200 for m in ended if m), ended
    for summary in sorted(tmp_path.rglob("summary.json")):
        # The recording burst and at least one outer step by step 109, where it evaluated.
        assert json.loads(summary.read_text())["outer_steps"] >= 2, summary
