"""PerSyn's epoch-end average (node-based mode): a burst at every multiple of K′ and of E.

The schedule is a pure function of a node's step count, so the tests drive the real
cores (tests/core_harness.py: N cores, their vectors, the network
between them) and check the steps at which they push, to whom, and under which round;
then the simulator, which drives the same cores over a virtual network, and the config,
which checks the setting like every other. Σw is checked after every exchange.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch

from gossipd.node.errors import ConfigError
from gossipd.node.protocols import CoreSettings, build
from gossipd.node.protocols.persyn import PerSyn, burst_position
from gossipd.node.shared.config import parse_config
from gossipd.node.sim import SCENARIOS, SimSpec, run_sim
from gossipd.node.trainer.replica import Replica
from tests.core_harness import Harness

EXACT_BOUND = 1e-12

# K′ = 10, E = 7, N = 4 (R = 2 sub-rounds), steps 1..100. Burst starts: the multiples of
# 10 (10 of them) and of 7 (14), 70 counted once: 23. Each pushes at its start and the
# step after, except where the step after is itself a start (20 → 21, 49 → 50, 90 → 91:
# the new burst restarts at sub-round 0) and 100 + 1, past the end.
BURST_STARTS = [7, 10, 14, 20, 21, 28, 30, 35, 40, 42, 49, 50, 56, 60, 63, 70, 77, 80, 84, 90]
BURST_STARTS += [91, 98, 100]
PUSH_STEPS = [7, 8, 10, 11, 14, 15, 20, 21, 22, 28, 29, 30, 31, 35, 36, 40, 41, 42, 43, 49]
PUSH_STEPS += [50, 51, 56, 57, 60, 61, 63, 64, 70, 71, 77, 78, 80, 81, 84, 85, 90, 91, 92, 98]
PUSH_STEPS += [99, 100]


def pushes_by_step(h: Harness, steps: range) -> dict[int, dict[str, tuple[str, int]]]:
    """Synchronous steps: per step, each sender's (peer, round); Σw checked after each."""
    seen: dict[int, dict[str, tuple[str, int]]] = {}
    for step in steps:
        pushes = h.step(step)
        if pushes:
            seen[step] = {sender: (p.peer, p.round) for sender, p in pushes}
            assert len(seen[step]) == len(pushes), "one push per node per sub-round"
        h.exchange()  # checks Σw and Σ w·x
    return seen


def test_a_burst_starts_at_every_multiple_of_k_prime_and_of_epoch_steps() -> None:
    assert len(BURST_STARTS) == 23 and len(PUSH_STEPS) == 42
    h = Harness("persyn", 4, segments=2, average_every_steps=10, epoch_steps=7)
    seen = pushes_by_step(h, range(1, 101))
    assert sorted(seen) == PUSH_STEPS
    for step, pushes in seen.items():
        assert sorted(pushes) == h.ids, f"step {step}: not every node pushed"
        start = max(s for s in BURST_STARTS if s <= step)
        sub_round = step - start  # a burst that starts mid-burst restarts at 0
        round_of_burst = BURST_STARTS.index(start) + 1
        sign = -1 if round_of_burst % 2 else 1  # bursts of odd rounds go backward
        for sender, (peer, round_) in pushes.items():
            assert peer == h.ids[(h.index[sender] + sign * 2**sub_round) % 4], (step, sender)
            assert round_ == round_of_burst  # the same burst, the same round
    rounds = [next(iter(seen[s].values()))[1] for s in BURST_STARTS]
    assert rounds == list(range(1, 24))  # strictly increasing, one per burst
    assert {c.status().round for c in h.cores.values()} == {23}
    np.testing.assert_allclose(h.total_weight(), [4.0, 4.0], rtol=0, atol=EXACT_BOUND)


def test_epoch_steps_zero_keeps_the_k_prime_schedule() -> None:
    expected = sorted({s for k in range(10, 101, 10) for s in (k, k + 1) if s <= 100})
    runs = [
        Harness("persyn", 4, average_every_steps=10),
        Harness("persyn", 4, average_every_steps=10, epoch_steps=0),
        Harness("persyn", 4, average_every_steps=10, epoch_steps=10),  # E = K′: same bursts
    ]
    seen = [pushes_by_step(h, range(1, 101)) for h in runs]
    assert sorted(seen[0]) == expected
    assert seen[1] == seen[2] == seen[0]
    assert all(round_ == step // 10 for step in seen[0] for _, round_ in seen[0][step].values())
    for node in runs[0].ids:  # the same floats, not close ones
        np.testing.assert_array_equal(runs[1].x[node], runs[0].x[node])
    assert runs[1].cores["node-002"].state_dict() == runs[0].cores["node-002"].state_dict()


def test_the_schedule_is_a_pure_function_of_the_step() -> None:
    assert [burst_position(s, 10) for s in (0, 9, 10, 11, 19, 20)] == [
        (0, 0),
        (0, 9),
        (1, 0),
        (1, 1),
        (1, 9),
        (2, 0),
    ]
    # E divides K′: a multiple of both is one burst, counted once
    assert [burst_position(s, 10, 5) for s in (4, 5, 9, 10, 14, 15)] == [
        (0, 4),
        (1, 0),
        (1, 4),
        (2, 0),
        (2, 4),
        (3, 0),
    ]
    for step in range(0, 500):
        assert burst_position(step, 10, 0) == (step // 10, step % 10)
        before, now = burst_position(step, 10, 7), burst_position(step + 1, 10, 7)
        assert now[0] in (before[0], before[0] + 1)
        assert (now[0] == before[0] + 1) == (now[1] == 0)  # a new round is a new burst


def test_an_epoch_end_burst_is_an_exact_average_for_a_power_of_two() -> None:
    h = Harness("persyn", 8, segments=2, dim=3, average_every_steps=100, epoch_steps=6)
    h.run_sync(range(1, 6))
    assert h.disagreement() > 0.5  # nothing mixed before the epoch ends
    h.run_sync(range(6, 9))  # sub-rounds 0..2 at steps 6, 7, 8: long before K′
    assert h.disagreement() < 1e-12
    assert {c.status().round for c in h.cores.values()} == {1}
    h.check_conservation()


# -- settings ------------------------------------------------------------------------------
def _error(persyn: dict[str, Any]) -> str:
    data = {
        "mesh_id": "test-mesh",
        "node_id": "site-a",
        "tls": {"insecure": True},
        "gossip": {"protocol": "persyn", "persyn": persyn},
    }
    with pytest.raises(ConfigError) as info:
        parse_config(data, "site.toml")
    return str(info.value)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (-1, "Input should be greater than or equal to 0"),
        (2.5, "Input should be a valid integer, got a number with a fractional part"),
        ("seven", "Input should be a valid integer, unable to parse string as an integer"),
    ],
)
def test_a_bad_epoch_steps_is_refused_naming_the_key_and_value(value: object, why: str) -> None:
    assert f"gossip.persyn.epoch_steps = {value!r}: {why}" in _error({"epoch_steps": value})
    with pytest.raises(ValueError, match=re.escape(f"epoch_steps = {value!r}: {why}")):
        build("persyn", CoreSettings("a", 1, options={"epoch_steps": value}))
    message = _error({"epoch_step": 3})
    assert "gossip.persyn.epoch_step: unknown key; did you mean 'epoch_steps'?" in message
    with pytest.raises(ValueError, match=re.escape("epoch_steps must be 0 (off) or more, got -1")):
        PerSyn("a", 1, average_every_steps=5, epoch_steps=-1)


def test_the_epoch_steps_table_reaches_the_core_the_daemon_builds() -> None:
    data = {
        "mesh_id": "test-mesh",
        "node_id": "site-a",
        "tls": {"insecure": True},
        "gossip": {"protocol": "persyn", "persyn": {"average_every_steps": 9, "epoch_steps": 4}},
    }
    core = Replica.from_config(parse_config(data), torch.nn.Linear(2, 1)).core
    assert (core.average_every_steps, core.epoch_steps) == (9, 4)  # type: ignore[attr-defined]
    default = build("persyn", CoreSettings("a", 1))
    assert default.epoch_steps == 0  # type: ignore[attr-defined]


# -- the simulator ------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", ["homogeneous", "lossy"])
def test_the_simulator_averages_at_epoch_ends_and_keeps_the_sum_of_weights(scenario: str) -> None:
    """K′ = 1000 is never reached in 12 rounds: without E nothing mixes; with E = 4 the
    epoch-end bursts alone bring the models together, and Σw stays N (lossy: 5% of
    payloads and acknowledgements lost, retried)."""

    def run(epoch_steps: int) -> Any:
        spec = SimSpec(
            protocol="persyn",
            nodes=16,
            rounds=12,
            scenario=SCENARIOS[scenario],
            check_invariants=True,
            options={"average_every_steps": 1000, "epoch_steps": epoch_steps},
        )
        return run_sim(spec)

    alone, epochs = run(0), run(4)
    assert alone.consensus_error_end == pytest.approx(alone.consensus_error_start, rel=1e-12)
    assert alone.messages == 0
    assert epochs.consensus_error_end < 0.2 * epochs.consensus_error_start
    for result in (alone, epochs):
        assert result.invariant_mass_error is not None and result.invariant_value_error is not None
        assert result.invariant_mass_error <= EXACT_BOUND  # Σw stays 16 per segment
        assert result.invariant_value_error <= EXACT_BOUND
        assert result.mass_lost == 0.0 and result.mass_duplicated == 0.0
    if scenario == "lossy":
        assert epochs.retries > 0
