"""The simulator drives the daemon's own cores: invariants, consensus, theory, CLI, determinism.

Every run is small (16-32 nodes, tens of rounds, 64-float vectors) and seeded, so
the whole file takes seconds and gives the same answer each time. Protocols are
taken from the registry, so a protocol added later is tested without edits.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gossipd.node.protocols import PROTOCOLS, CoreSettings, keeps_weights
from gossipd.node.protocols.base import (
    CoreStatus,
    Event,
    GossipProtocol,
    Merge,
    Pull,
    PullArrived,
    PullMerged,
    StepEnded,
    ViewChanged,
    ranked,
)
from gossipd.node.sim import SCENARIOS, SimSpec, Simulation, run_sim
from gossipd.node.sim.scenarios import HOMOGENEOUS, FaultEntry, ScenarioError
from tests.sim_cli import json_line, sim_cli

ALL = sorted(PROTOCOLS)
WEIGHTED = [p for p in ALL if keeps_weights(p)]  # the mass and mixing-matrix checks apply
EXACT_BOUND = 1e-12  # relative drift allowed for quantities that are exact up to rounding


@pytest.mark.parametrize("scenario", ["homogeneous", "lossy", "churn", "wan8"])
@pytest.mark.parametrize("protocol", WEIGHTED)
def test_sum_of_weights_and_weighted_sum_are_conserved(protocol: str, scenario: str) -> None:
    """Σw and Σw·x equal the start at every round and after the drain, counting what a
    crashed node took with it (churn: node 1 crashes with pushes in flight, node 2
    leaves, one joins) and with 5% of payloads and acknowledgements lost (lossy)."""
    spec = SimSpec(
        protocol=protocol, nodes=16, rounds=14, scenario=SCENARIOS[scenario], check_invariants=True
    )
    result = run_sim(spec)
    assert result.invariant_mass_error is not None and result.invariant_value_error is not None
    assert result.invariant_mass_error <= EXACT_BOUND
    assert result.invariant_value_error <= EXACT_BOUND
    assert result.mass_duplicated == 0.0  # retries are answered DUPLICATE, never fold back
    assert result.consensus_error_end < result.consensus_error_start
    if scenario == "churn":
        assert result.live_nodes == 16 - 1 - 1 + 1
        assert result.mass_lost > 0  # the crash destroyed weight; the graceful leave did not
        assert result.mass_lost <= spec.segments * 1.0 + EXACT_BOUND
    else:
        assert result.mass_lost == 0.0
    if scenario == "lossy":
        assert result.retries > 0


@pytest.mark.parametrize("protocol", WEIGHTED)
def test_consensus_reaches_the_initial_mean_at_the_rate_the_mixing_matrices_predict(
    protocol: str,
) -> None:
    """Training off, every node ends within 1e-3 of the mean of the initial vectors.

    Theory (node/sim/spectral.py): deviations evolve as D_k = (P_k − J) D_0, so
    rms_k / rms_0 ≤ σ_k := max over segments of σ₁(P_k − J), exactly, every round.
    For a random start the ratio also stays above about σ_k/√N (the Frobenius norm
    of P_k − J is at least σ_k, and an isotropic D_0 sees all of it), so over a
    window of rounds k1..k2 the measured and predicted per-round log-rates differ
    by at most (log √N + 0.5)/(k2 − k1): the 0.5 allows the random start to see
    e^−0.5 ≈ 0.6 of its expected share, generous for 16 vector entries per segment.
    """
    n = 16
    result = run_sim(SimSpec(protocol=protocol, nodes=n, rounds=300, target_error=1e-3))
    assert result.consensus_error_end <= 1e-3
    assert result.sigmas is not None
    rms = [e / result.rms_errors[0] for e in result.rms_errors]
    for k, (measured, sigma) in enumerate(zip(rms, result.sigmas, strict=True)):
        assert measured <= sigma * (1 + 1e-9) + 1e-14, f"round {k}: {measured} > σ {sigma}"
    window = [k for k in range(1, len(rms)) if rms[k] > 1e-10 and result.sigmas[k] > 1e-10]
    k1, k2 = window[0], window[-1]
    if k2 - k1 >= 2:
        measured_rate = (rms[k2] / rms[k1]) ** (1 / (k2 - k1))
        predicted_rate = (result.sigmas[k2] / result.sigmas[k1]) ** (1 / (k2 - k1))
        tolerance = (math.log(math.sqrt(n)) + 0.5) / (k2 - k1)
        assert abs(math.log(measured_rate / predicted_rate)) <= tolerance


def test_mixing_tracker_reproduces_every_merge_exactly() -> None:
    """P_k applied to the initial vectors gives the current vectors: the tracked product
    is the map the cores' pushes made, not an approximation of it."""
    sim = Simulation(SimSpec(protocol=ALL[0], nodes=24, rounds=6, predict=True))
    payload = sim.payload
    initial = payload.x[:24].copy()  # type: ignore[attr-defined]
    sim.run()
    assert sim.tracker is not None
    for s, part in enumerate(payload.slices):  # type: ignore[attr-defined]
        rebuilt = sim.tracker.p[s] @ initial[:, part]
        np.testing.assert_allclose(rebuilt, payload.x[:24, part], rtol=0, atol=1e-12)  # type: ignore[attr-defined]


def test_delivery_takes_latency_plus_bytes_over_bandwidth() -> None:
    """Round 1 is measured half a step after the round-1 pushes leave: a push that needs
    0.3 s latency + 0.3 s transfer has not landed yet; one that needs 0.1 + 0.3 s has.
    Any merge moves some node (the mean error need not fall: a receiver can move away
    from the mean), nothing landed moves none."""
    bandwidth = 64 * 8 / 0.3  # the whole 64-float model moves in 0.3 s
    for latency, lands in ((0.3, False), (0.1, True)):
        scenario = replace(
            HOMOGENEOUS, latency_s=((latency,),), bandwidth_bytes_per_s=((bandwidth,),)
        )
        errors = run_sim(SimSpec(protocol="sumweight", rounds=1, scenario=scenario)).rms_errors
        assert (errors[1] != errors[0]) is lands


@pytest.mark.parametrize("protocol", ALL)
def test_same_seed_same_run_and_another_seed_another(protocol: str) -> None:
    def run(seed: int) -> dict[str, Any]:
        spec = SimSpec(
            protocol=protocol, nodes=12, rounds=8, seed=seed, scenario=SCENARIOS["lossy"]
        )
        data = run_sim(spec).as_dict()
        measured = ("wall_s", "peak_memory_bytes", "start_memory_bytes", "memory_per_node_bytes")
        for key in measured:  # of the machine, not of the run
            del data[key]
        return data

    first = run(3)
    assert run(3) == first
    other = run(4)
    assert other["errors"] != first["errors"]
    assert other["errors"][0] != first["errors"][0]  # other initial vectors too


def test_cli_prints_a_table_and_one_parsable_json_line(tmp_path: Path) -> None:
    png = tmp_path / "sim.png"
    argv = ["--protocol", ALL[0], "--nodes", "16", "--rounds", "10", "--json", "--plot", str(png)]
    proc = sim_cli(*argv)
    data = json_line(proc)
    for key in (
        "consensus_error_start",
        "consensus_error_end",
        "rounds",
        "virtual_time_s",
        "wall_s",
        "messages",
        "bytes",
        "protocol",
        "nodes",
        "segments",
        "errors",
        "predicted_errors",
    ):
        assert key in data, key
    assert data["protocol"] == ALL[0] and data["nodes"] == 16 and data["segments"] == 4
    assert data["rounds"] == 10 and len(data["errors"]) == 11
    assert data["consensus_error_end"] < data["consensus_error_start"]
    assert data["messages"] > 0 and data["bytes"] > 0
    assert data["virtual_time_s"] == pytest.approx(10.5)
    assert "round" in proc.stderr and "error (max)" in proc.stderr  # the table, on stderr
    assert png.stat().st_size > 0


def test_cli_refuses_a_bad_scenario_with_a_one_line_error() -> None:
    proc = sim_cli("--scenario", "mars", "--nodes", "4", timeout_s=60)
    assert proc.returncode == 2
    assert "unknown scenario 'mars'" in proc.stderr and "homogeneous" in proc.stderr


def test_fault_entries_name_existing_nodes() -> None:
    scenario = HOMOGENEOUS.with_faults((FaultEntry(3.0, "fail", 9),), None)
    with pytest.raises(ScenarioError, match="only 4 nodes"):
        Simulation(SimSpec(nodes=4, scenario=scenario))


def test_digits_payload_trains_real_models_and_averages_them() -> None:
    """Real torch steps on digits shards: accuracy rises from chance and gossip keeps
    the models together (their spread shrinks from the different initial models)."""
    result = run_sim(
        SimSpec(protocol=ALL[0], nodes=4, rounds=30, payload="digits", segments=2, seed=1)
    )
    assert result.accuracy is not None
    assert result.accuracy[-1] > max(0.5, result.accuracy[0] + 0.3)
    assert result.consensus_error_end < result.consensus_error_start


class _PullAverage(GossipProtocol):
    """A test-only core that pulls from the next rank each step and averages with it."""

    name = "test-pull"

    def __init__(self, node_id: str, num_segments: int) -> None:
        self.node_id, self.segments, self.view = node_id, num_segments, ranked(frozenset({node_id}))

    def handle(self, event: Event) -> list[Any]:
        if isinstance(event, ViewChanged):
            self.view = ranked(event.members)
        elif isinstance(event, StepEnded) and len(self.view.members) > 1:
            rank = self.view.rank_of[self.node_id]
            peer = self.view.members[(rank + 1) % len(self.view.members)]
            return [Pull(peer, event.step, tuple(range(self.segments)), event.time_s)]
        elif isinstance(event, PullArrived):
            return [Merge(s, 0.5, 1.0) for s in event.weights]
        elif isinstance(event, PullMerged):
            return []
        return []

    def status(self) -> CoreStatus:
        ones = (1.0,) * self.segments
        return CoreStatus(
            self.name, 0, 0, 0, frozenset(), weights=ones, reserved=(0.0,) * self.segments
        )

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


def test_pulls_are_carried_out_and_merged(monkeypatch: pytest.MonkeyPatch) -> None:
    def factory(s: CoreSettings) -> GossipProtocol:
        return _PullAverage(s.node_id, s.num_segments)

    monkeypatch.setitem(PROTOCOLS, "test-pull", factory)
    result = run_sim(SimSpec(protocol="test-pull", nodes=4, rounds=12))
    assert result.messages == 4 * 12  # one pull per node per step
    assert result.consensus_error_end < 0.1 * result.consensus_error_start


# A period of 8 steps of 0.1 s and a pull of 0.05 s latency + 1 MB at 4 MB/s = 0.30 s.
OVERLAP_LINK = replace(
    HOMOGENEOUS, latency_s=((0.05,),), bandwidth_bytes_per_s=((4e6,),), step_time_s=(0.1,)
)


def _overlap(mode: str, *, coordinator: bool = False) -> Any:
    spec = SimSpec(
        protocol="overlap",
        nodes=8,
        rounds=30,
        round_steps=8,
        scenario=OVERLAP_LINK,
        model_bytes=1_000_000,
        options={"period_steps": 8, "mode": mode},
        coordinator=coordinator,
    )
    return run_sim(spec)


@pytest.mark.parametrize("coordinator", [False, True], ids=["decentralized", "coordinator"])
def test_overlap_hides_the_pull_behind_the_period_where_pulling_after_it_waits(
    coordinator: bool,
) -> None:
    """The paper's claim on the simulator's clock: a pull started at end − c_ij lands as
    the period ends, so the trainer hardly waits, while pulling after the period waits
    about transfer / (period + transfer) = 0.30 / 1.10 every period. Both reach consensus."""
    scheduled = _overlap("scheduled", coordinator=coordinator)
    after = _overlap("none", coordinator=coordinator)
    waited = [sum(r.wait_fractions) / len(r.wait_fractions) for r in (scheduled, after)]
    assert waited[1] > 0.15, f"pulling after the period waited only {waited[1]:.3f}"
    assert waited[0] < 0.05, f"scheduled overlap waited {waited[0]:.3f} of the time"
    for result in (scheduled, after):
        assert result.consensus_error_end < 1e-3 * result.consensus_error_start
        assert result.refused == 0


@pytest.mark.parametrize("protocol", ["sumweight", "pushsum-expgraph"])
def test_weight_cut_at_the_cap_is_booked_so_the_mass_still_closes(protocol: str) -> None:
    """A merge that would lift a weight over the cap merges the part that fits and cuts
    the rest (issue 32: refusing it let an insider stop a mesh); the simulator books what
    was cut as gone, so Σw and Σw·x still close, and no node ends over the cap."""
    sim = Simulation(SimSpec(protocol=protocol, nodes=8, rounds=10, check_invariants=True))
    for node in sim.nodes:
        node.core.cap.max_weight = 1.3  # founding weights are 1: merges meet it at once
    result = sim.run()
    cut = sum(node.core.cut for node in sim.nodes)
    assert cut > 0
    assert result.mass_lost == pytest.approx(cut, rel=1e-9)
    assert result.invariant_mass_error is not None and result.invariant_value_error is not None
    assert result.invariant_mass_error <= EXACT_BOUND
    assert result.invariant_value_error <= EXACT_BOUND
    assert max(w for node in sim.nodes for w in node.core.weights) <= 1.3
