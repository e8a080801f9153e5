"""Weight balance: a site's weight does not follow its speed (``gossip.weight_balance``,
on by default: see :mod:`gossipd.node.protocols.weight_balance`).

The policy (docs/protocols/index.md, "Weight shares and site speed"): each site's data
counts alike, whatever its speed. Without the balance a site that pushes 25 times as
often as its peer ends with almost no weight, so its data stops counting; these tests
drive exactly that, in the cores of every protocol with weights (checking Σw and Σw·x
after every exchange), in the simulator, and in two real daemons.
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from gossipd.node.errors import ConfigError
from gossipd.node.protocols.base import HandOff, Push, PushSettled, StepEnded
from gossipd.node.protocols.weight_balance import LEAST_FACTOR, REPORTERS, WeightBalance
from gossipd.node.shared.config import parse_config
from gossipd.node.sim import SCENARIOS, SimSpec, Simulation, run_sim
from gossipd.node.sim.scenarios import FaultEntry, Scenario
from gossipd.node.trainer.report import BalanceLog
from tests.conftest import wait_until
from tests.core_harness import ALL_PROTOCOLS, STEP_S, Harness
from tests.meshes import stop_in_turn

SLOWER = 25  # the slow site steps once for every 25 steps of the fast one
STEPS = 2500  # of the fast site: long enough for the balance to settle (about 100 pushes)


def _two_speeds(protocol: str, balance: bool) -> tuple[Harness, list[float]]:
    """Two nodes, the second stepping 25 times less often; every push lands before the
    next step, and every step may push (persyn: a burst of one push every step, as the
    simulator runs it for two nodes). Returns the harness and the fast node's weight
    after each of its steps."""
    h = Harness(
        protocol,
        2,
        segments=2,
        push_probability=1.0,
        average_every_steps=1,
        weight_balance=balance,
        peer_credit=math.inf,  # the balance alone: a credit also keeps weight from speed
    )
    fast, slow = h.ids
    held, steps = [], {fast: 0, slow: 0}  # each node counts its own steps
    for tick in range(STEPS):
        for node in (fast, slow) if tick % SLOWER == 0 else (fast,):
            step = steps[node]
            h.carry_out(node, h.cores[node].handle(StepEnded(step, tick * STEP_S)))
            steps[node] += 1
        h.exchange()
        held.append(float(h.held(fast).mean()))
    return h, held


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_a_site_25_times_faster_holds_about_its_share_and_without_balance_almost_none(
    protocol: str,
) -> None:
    _, balanced = _two_speeds(protocol, True)
    _, bare = _two_speeds(protocol, False)
    late = balanced[STEPS // 2 :]
    assert 0.75 <= statistics.mean(late) <= 1.25, statistics.mean(late)
    assert statistics.mean(bare[STEPS // 2 :]) < 0.2


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_at_equal_speeds_pushes_carry_the_protocols_share(protocol: str) -> None:
    """The structured protocols keep every weight at 1, so the factor never moves and
    every push is its paper's; sum-weight's weights wander, and stay in the band."""
    h = Harness(protocol, 8, segments=2, max_in_flight=8, push_probability=0.5, weight_balance=True)
    h.run_sync(range(300))
    factors = [f for core in h.cores.values() for f in core.balance.factors]
    if protocol == "sumweight":
        assert statistics.mean(factors) >= 0.9, factors
    else:
        assert factors == [1.0] * len(factors)


def test_the_factor_shrinks_only_outside_the_band_and_never_past_its_least() -> None:
    balance = WeightBalance(1, enabled=True)
    for _ in range(500):
        assert balance.factor(0, 0.9) == 1.0  # within 0.3 of the share: untouched
    for _ in range(5000):
        balance.factor(0, 0.0)
    assert balance.factors[0] == LEAST_FACTOR
    for _ in range(5000):
        balance.factor(0, 2.0)
    assert balance.factors[0] == 1.0  # back, and never over 1
    assert WeightBalance(1, enabled=False).factor(0, 0.0) == 1.0


@pytest.mark.parametrize("crumb", [1e-300, 1e-12])
def test_a_share_of_crumbs_moves_the_factor_as_far_as_its_range_and_no_error(crumb: float) -> None:
    """Peers reporting crumbs (a mesh a sink drained, or liars): the share is about 1e-300
    and the mean held 1, so the factor's exponent was 1e298 and ``math.exp`` raised
    OverflowError in the trainer's push: a pushsum-expgraph site stopped so, before the
    credit, once a sink had drained its mesh. Now the push goes, at the largest factor."""
    balance = WeightBalance(1, enabled=True)
    for peer in range(REPORTERS):
        balance.heard(f"p{peer}", 0, crumb)
    balance.factors[0] = LEAST_FACTOR
    assert balance.factor(0, crumb) == pytest.approx(1.0)  # the mean held, about 1, is far over
    for peer in range(REPORTERS):
        balance.heard(f"p{peer}", 0, 1e300)  # clamped to the lie room: the share stays finite
    assert LEAST_FACTOR <= balance.factor(0, crumb) <= 1.0


def test_a_leaving_node_hands_off_everything_whatever_its_factor() -> None:
    h, _ = _two_speeds("sumweight", True)
    fast, slow = h.ids
    assert h.cores[fast].balance.factors[0] < 0.5
    (push,) = h.cores[fast].handle(HandOff(slow))
    np.testing.assert_allclose(list(push.weights.values()), h.held(fast))


def test_the_config_turns_it_on_or_off_and_refuses_what_is_not_a_boolean() -> None:
    base = {"mesh_id": "m", "node_id": "a", "listen": "127.0.0.1:0", "tls": {"insecure": True}}
    assert parse_config(base, "test").gossip.weight_balance is True
    for value in (True, False):
        chosen = parse_config({**base, "gossip": {"weight_balance": value}}, "test")
        assert chosen.gossip.weight_balance is value
    with pytest.raises(ConfigError, match=r"gossip\.weight_balance = 'sometimes'"):
        parse_config({**base, "gossip": {"weight_balance": "sometimes"}}, "test")


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_it_is_on_by_default_in_every_protocol_with_weights(protocol: str) -> None:
    """The per-peer credit bounds what a peer holds of this node's weight, not how weight
    follows speed across many sites (simulated, 8 sites stepping 1 to 12 s apart, credit
    1/3: shares 0.25-1.94 without the balance, 0.70-1.52 with it), and the directed
    protocols have no credit at all: every protocol balances unless told not to."""
    h = Harness(protocol, 2)
    assert h.cores[h.ids[0]].balance.enabled
    assert SimSpec().weight_balance


def test_what_a_peer_reports_is_its_weight_before_the_push() -> None:
    """A report is the receiver's weight after the merge less what the push brought,
    clamped to the weight cap: 1e30 and inf count as the cap, a negative report as 0,
    NaN as nothing."""
    # The credit off: only this core pushes, so nothing comes back along its edges.
    h = Harness("pushsum-expgraph", 4, segments=1, peer_credit=math.inf)
    core = h.cores[h.ids[0]]
    cap = core.weight_cap
    for step, reported in enumerate((1.5, 1e30, math.inf, -5.0, math.nan)):
        (push,) = [a for a in core.handle(StepEnded(step, step * STEP_S)) if isinstance(a, Push)]
        before = core.balance.reports[0].get(push.peer, math.nan)
        core.handle(PushSettled(push.peer, push.sequence, (0,), (reported,)))
        heard = core.balance.reports[0].get(push.peer, math.nan)
        expected = {1.5: 1.5 - push.weights[0], 1e30: cap, math.inf: cap, -5.0: 0.0}
        if math.isnan(reported):
            assert heard == before or (math.isnan(heard) and math.isnan(before))
        else:
            assert heard == pytest.approx(expected[reported])


@pytest.mark.parametrize("reporters", range(1, REPORTERS + 1))
def test_one_liar_among_any_number_of_reporters_leaves_honest_pushes_whole(
    reporters: int,
) -> None:
    """Honest sites at weight 1 and one peer reporting the cap: the share it makes is
    under 4/3, inside the band, so no honest factor moves, however few peers report (a
    directed protocol hears only from its log2 N out-neighbours). Two such peers among
    three or more reporters can shrink honest pushes: the limit of this defence."""

    def factor_after(liars: int) -> float:
        balance = WeightBalance(1, enabled=True)
        for peer in range(reporters):
            balance.heard(f"p{peer}", 0, 1e6 if peer < liars else 1.0)
        assert balance.share(0, 1.0) < 4 / 3 or liars > 1
        for _ in range(1000):
            balance.factor(0, 1.0)
        return balance.factors[0]

    assert factor_after(1) == 1.0
    if reporters >= 3:
        assert factor_after(2) < 0.5


def test_the_share_averages_the_latest_reporters_only_and_forgets_who_left() -> None:
    balance = WeightBalance(2, enabled=True)
    for peer in range(20):
        balance.heard(f"p{peer}", 0, float(peer))
    assert list(balance.reports[0]) == [f"p{i}" for i in range(20 - REPORTERS, 20)]
    balance.heard("p12", 0, 0.5)  # reporting again makes it the latest
    assert list(balance.reports[0])[-1] == "p12" and len(balance.reports[0]) == REPORTERS
    assert balance.reports[1] == {}
    balance.keep_only({"p13", "p14"})
    assert sorted(balance.reports[0]) == ["p13", "p14"]
    bound = 1.0 + 2 / 3  # three values in the mean: each report moves it by under 1/3
    assert balance.share(0, 1.0) == pytest.approx((1.0 + 2 * bound) / 3)


@pytest.mark.parametrize("protocol", ["pushsum-expgraph", "persyn"])
def test_joiners_thin_the_share_and_the_balance_follows_instead_of_throttling(
    protocol: str,
) -> None:
    """8 founders, then 8 joiners at weight 0: the mesh's weight per site is 1/2. A share
    fixed at a founder's 1 would leave every site under it for good and shrink every push
    to a hundredth (measured: mean factor 0.010); with the share from the peers'
    reports every factor stays 1, and Σw·x stays exact."""
    joins = tuple(FaultEntry(0.5 + 0.01 * i, "join") for i in range(8))
    scenario = replace(SCENARIOS["homogeneous"], name="joiners", events=joins)
    sim = Simulation(
        SimSpec(protocol=protocol, nodes=8, rounds=400, scenario=scenario, check_invariants=True)
    )
    result = sim.run()
    assert len(sim.nodes) == 16
    assert result.invariant_mass_error is not None and result.invariant_mass_error <= 1e-12
    factors = [f for node in sim.nodes for f in node.core.balance.factors]
    assert min(factors) >= 0.9, factors


ONE_SLOW = Scenario(
    name="one-slow",
    description="2 sites, the second 25 times slower",
    step_time_s=(1.0, 25.0),
    latency_s=((0.005, 0.05), (0.05, 0.005)),
    bandwidth_bytes_per_s=((1.25e9, 1.25e8), (1.25e8, 1.25e9)),
)


@pytest.mark.parametrize("protocol", ["sumweight", "pushsum-expgraph"])
def test_simulated_sites_25_times_apart_share_weight_about_evenly(protocol: str) -> None:
    spec = SimSpec(
        protocol=protocol,
        nodes=2,
        rounds=1200,
        scenario=ONE_SLOW,
        check_invariants=True,
        weight_balance=True,
        peer_credit=math.inf,  # the balance alone: a credit also keeps weight from speed
    )
    balanced, bare = run_sim(spec), run_sim(replace(spec, weight_balance=False))
    for result in (balanced, bare):
        assert result.invariant_mass_error is not None and result.invariant_mass_error <= 1e-12
    assert all(s is not None and 0.8 <= s <= 1.2 for s in balanced.weight_shares)
    assert bare.weight_shares[0] is not None and bare.weight_shares[0] < 0.25


def test_simulated_equal_sites_mix_as_fast_with_the_balance_as_without() -> None:
    spec = SimSpec(nodes=16, rounds=30, scenario=SCENARIOS["homogeneous"], weight_balance=True)
    balanced, bare = run_sim(spec), run_sim(replace(spec, weight_balance=False))
    assert balanced.messages >= 0.95 * bare.messages
    assert balanced.errors[-1] <= 1.5 * bare.errors[-1]


FAST_STEPS = 1500  # the fast daemon's steps watched: about 15 s at 100 steps/s


def _share_of(status: dict[str, Any]) -> float:
    return sum(status["sum_weights"]) / len(status["sum_weights"])


def test_two_daemons_25_times_apart_keep_about_their_share_and_lose_no_weight(
    daemons: Any,
) -> None:
    """A site at 100 steps a second beside one at 4, both pushing after every step: the
    fast one's weight, sampled in the second half, averages about 1 (without the balance
    it is drained to almost nothing: the core test above), and Σw is 2 at the end."""
    ports = [next(daemons.ports) for _ in range(2)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    gossip = {"push_probability": 1.0, "weight_balance": True}
    fast = daemons("fast", ports[0], seeds=[addresses[1]], gossip=gossip)
    slow = daemons(
        "slow", ports[1], seeds=[addresses[0]], gossip=gossip, job={"max_steps_per_s": 4.0}
    )
    wait_until(lambda: fast.status()["live_peers"] == ["slow"], "the mesh to form")
    samples: list[tuple[int, float]] = []

    def watched() -> bool:
        status = fast.status()
        samples.append((status["step"], _share_of(status)))
        return status["step"] >= FAST_STEPS

    wait_until(watched, f"{FAST_STEPS} steps of the fast site", 120.0)
    late = [share for step, share in samples if step >= FAST_STEPS // 2]
    assert len(late) >= 10, samples
    assert 0.6 <= statistics.mean(late) <= 1.4, samples
    final = stop_in_turn([fast, slow])
    for segment in range(len(final[0])):
        assert math.isclose(sum(w[segment] for w in final), 2.0, abs_tol=1e-9), final


def test_the_operator_is_told_once_when_pushes_shrink_and_once_when_whole_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    said = BalanceLog()
    with caplog.at_level(logging.INFO, logger="gossipd.node.trainer.report"):
        for factors in [(1.0, 0.6), (1.0, 0.4), (0.3, 0.45), (0.8, 1.0), (0.95, 1.0), (1.0,)]:
            said.update(factors)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "carry 0.40 of their protocol's share" in lines[0]
    assert "gossip.weight_balance" in lines[0] and "gossipd_weight_sinks" in lines[0]
    assert "whole share again" in lines[1]
