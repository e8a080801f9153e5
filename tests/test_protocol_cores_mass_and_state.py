"""Every push protocol core keeps the mesh's mass, converges, and checkpoints exactly.

Σw and Σ w·x are conserved under drops, duplicates, reordering and a kill, for every
registered push protocol; with training off every protocol converges to the mean, at
the rate the spectral prediction gives; status reports the protocol and its round;
state_dict round-trips and a restored core carries on; a node restored from a
checkpoint costs the mesh exactly what the checkpoint lacks; a core merges what it
did not expect and refuses only the invalid. The cores run in tests/core_harness.py's
in-test driver.
"""

from __future__ import annotations

import math
import pickle
import random

import numpy as np
import pytest

from gossipd.node.protocols import CoreSettings, build
from gossipd.node.protocols.base import (
    Duplicate,
    Merge,
    PayloadArrived,
    PayloadMerged,
    PullArrived,
    Push,
    Refused,
    StepEnded,
    ViewChanged,
    ranked,
)
from gossipd.node.protocols.topology import (
    second_singular_value,
)
from tests.core_harness import (
    ALL_PROTOCOLS,
    NEW_PROTOCOLS,
    Faults,
    Harness,
    core_settings,
    node_ids,
    settings_for,
)

# ----------------------------------------------------------------------------------
# Mass conservation under faults, every protocol
# ----------------------------------------------------------------------------------
FAULTY = Faults(drop=0.15, duplicate=0.15, hold=0.25, reorder=True)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_mass_and_weighted_mass_conserved_under_drops_duplicates_reordering_and_a_kill(
    protocol: str, seed: int
) -> None:
    n, kill_step = 9, 7
    h = Harness(
        protocol, n, segments=3, dim=2, seed=seed, max_in_flight=4, **settings_for(protocol)
    )
    rng = random.Random(seed)
    victim = h.ids[rng.randrange(n)]
    for step in range(1, 16):
        h.step(step)
        h.check_conservation()
        if step == kill_step:  # mid-round: half of the round's pushes delivered first
            for flight in list(h.flights)[: len(h.flights) // 2]:
                h.deliver(flight)
            h.kill(victim)
            h.check_conservation()
        h.exchange(rng, FAULTY)
    h.end_training(16)
    while h.flights:
        h.exchange(rng, Faults(drop=0.2, duplicate=0.2, reorder=True))
    h.check_conservation()
    assert all(c.status().in_flight == 0 for n_, c in h.cores.items() if n_ in h.live)
    assert all(c.status().reserved == (0.0,) * 3 for n_, c in h.cores.items() if n_ in h.live)
    assert h.duplicates > 0 and h.fold_backs > 0  # the faults really happened
    assert h.gone_weight.sum() > 0


# ----------------------------------------------------------------------------------
# Consensus with training off
# ----------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_consensus_every_protocol_converges_to_the_mean(protocol: str) -> None:
    h = Harness(protocol, 16, segments=2, dim=3, seed=5, **settings_for(protocol))
    start = h.disagreement()
    h.run_sync(range(1, 121))
    assert h.disagreement() < 1e-6 * start
    h.check_conservation()


@pytest.mark.parametrize(("protocol", "n"), [("crossover", 16), ("pushsum-expgraph", 12)])
def test_consensus_decay_matches_the_spectral_prediction(protocol: str, n: int) -> None:
    """One-hot start vectors make the harness's vectors the empirical transfer matrix.

    With synchronous rounds every weight stays exactly 1 (halves of 1 add up exactly
    in binary), so each merge is x ← (x + x_s)/2 with α = 0.5 exactly and the run is
    the product of the cores' (I + P)/2 up to float rounding (~1e-16 per round):
    hence 1e-12 on the matrix and on σ₂. A random start, not the worst one, decays
    more slowly than σ₂ by at most the share of its disagreement along the worst
    direction, roughly 1/√(N − 1) over the whole run; spread over K rounds that is a
    per-round factor (N − 1)^(−1/2K) ≥ 0.95 for K = 30, hence the lower bound.
    """
    rounds = 30
    # The mixing the papers predict: no peer credit cutting a push.
    h = Harness(protocol, n, x0=np.eye(n)[:, None, :], mesh_seed=3, peer_credit=math.inf)
    h.run_sync(range(rounds))
    transfer = np.stack([h.x[node][0] for node in h.ids])  # row i: node i's vector
    product = np.linalg.multi_dot([f[0] for f in reversed(h.flows)])
    np.testing.assert_allclose(transfer, product, atol=1e-12)
    predicted = second_singular_value(f[0] for f in h.flows)
    measured = second_singular_value([transfer])
    assert measured == pytest.approx(predicted, abs=1e-12)
    assert 1e-8 < predicted < 1e-2  # contracting, not exact: the comparison means something

    rng = np.random.default_rng(7)
    start = rng.standard_normal((n, 4))
    start -= start.mean(axis=0)
    ratio = np.linalg.norm(transfer @ start) / np.linalg.norm(start)
    per_round, predicted_per_round = ratio ** (1 / rounds), predicted ** (1 / rounds)
    assert per_round <= predicted_per_round + 1e-12
    assert per_round >= 0.95 * predicted_per_round


# ----------------------------------------------------------------------------------
# Each core: state, refusals, status
# ----------------------------------------------------------------------------------
def expected_round(protocol: str, step: int) -> int:
    if protocol == "persyn":
        return step // settings_for(protocol)["average_every_steps"]
    if protocol == "sumweight":
        return step
    return step // 3  # round_steps = 3 below


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_status_reports_the_protocol_and_its_round(protocol: str) -> None:
    h = Harness(protocol, 4, **{**settings_for(protocol), "round_steps": 3})
    for step in range(1, 13):
        h.step(step)
        for core in h.cores.values():
            status = core.status()
            assert status.protocol == protocol == core.name
            assert status.round == expected_round(protocol, step)
            assert status.epoch == ranked(frozenset(h.ids)).epoch
        h.exchange()


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_state_dict_round_trips_and_a_restored_core_carries_on(protocol: str) -> None:
    h = Harness(protocol, 8, segments=2, **settings_for(protocol))
    h.run_sync(range(1, 8))
    core = h.cores["node-003"]
    state = pickle.loads(pickle.dumps(core.state_dict()))  # plain data: checkpoints pickle it
    restored = build(protocol, core_settings(protocol, "node-003", 2, **settings_for(protocol)))
    restored.load_state_dict(state)

    def without_sequences(state: dict) -> dict:  # a new incarnation numbers pushes from 1
        return {k: v for k, v in state.items() if k != "sequences"}

    assert without_sequences(restored.state_dict()) == without_sequences(core.state_dict())
    assert restored.status().weights == core.status().weights
    assert restored.status().round == core.status().round
    restored.handle(ViewChanged(frozenset(h.ids)))
    # A restored core answers a repeated old payload as a duplicate, as the original would.
    assert state["windows"], "node-003 merged nothing: the case under test did not happen"
    window = state["windows"][0]
    seq, seg = window["order"][-1]
    old = PayloadArrived(window["sender"], 0, seq, 0, {seg: 0.1}, window["base"])
    assert restored.handle(old) == core.handle(old) == [Duplicate(seg)]
    if protocol != "sumweight":  # deterministic cores make the same next move
        a = [p for p in core.handle(StepEnded(8, 2.0)) if isinstance(p, Push)]
        b = [p for p in restored.handle(StepEnded(8, 2.0)) if isinstance(p, Push)]
        assert [(p.peer, p.weights, p.round) for p in a] == [
            (p.peer, p.weights, p.round) for p in b
        ]
    other = "persyn" if protocol != "persyn" else "crossover"
    with pytest.raises(ValueError, match="cannot resume"):
        build(other, CoreSettings("node-003", 2)).load_state_dict(state)


@pytest.mark.parametrize("protocol", ALL_PROTOCOLS)
def test_a_node_restored_from_a_checkpoint_costs_the_mesh_exactly_what_the_checkpoint_lacks(
    protocol: str,
) -> None:
    """The field trial's crash: one node killed with pushes in flight both ways, restarted
    from a checkpoint older than its state. Senders told of the restart used to number
    pushes from 1 again into windows the checkpoint restored, were answered DUPLICATE
    for pushes never merged, and dropped their weight (3 -> 3e-31 in a minute). Now the
    change of Σw is exactly (weight restored - weight held at the crash), no merge is ever
    answered DUPLICATE (``deliver`` asserts it), and Σw, Σ w·x stay exact from then on."""
    h = Harness(protocol, 4, segments=2, **settings_for(protocol))
    h.run_sync(range(1, 8))
    node = "node-001"
    state, x = pickle.loads(pickle.dumps(h.cores[node].state_dict())), h.x[node].copy()
    h.run_sync(range(8, 12))  # it merges and pushes after its checkpoint
    for step in range(12, 40):  # until pushes are in flight to it when it dies
        h.step(step)
        if any(f.push.peer == node for f in h.flights):
            break
        h.exchange()
    else:
        raise AssertionError("no push to the node to crash within 28 steps")
    h.crash_and_restore(node, state, x)
    h.check_conservation()
    h.run_sync(range(step + 1, step + 30))
    assert any(
        mass.sent_before > 0 or mass.received_before > 0
        for other in h.ids
        if other != node
        for peer, mass in h.cores[other].status().exchanged.items()
        if peer == node
    ), "nothing was exchanged with the crashed node's first incarnation"
    merged_since = sum(h.cores[node].status().exchanged[p].received for p in h.ids if p != node)
    assert merged_since > 0, "the restarted node merged nothing: gossip to it stopped"
    h.end_training(step + 30)
    h.check_conservation()


@pytest.mark.parametrize("protocol", NEW_PROTOCOLS)
def test_merges_what_it_did_not_expect_and_refuses_only_the_invalid(protocol: str) -> None:
    core = build(protocol, core_settings(protocol, "node-001", 2, **settings_for(protocol)))
    core.handle(ViewChanged(frozenset(node_ids(4))))
    core.handle(StepEnded(3, 0.75))
    # Another round, a sender outside the view, one segment only: merged by the rule.
    status = core.status()
    held, available = status.weights[1], status.weights[1] - status.reserved[1]
    stranger = PayloadArrived("node-999", 7, 1, 12345, {1: 0.5})
    assert core.handle(stranger) == [Merge(1, 0.5 / (available + 0.5), held + 0.5)]
    assert core.handle(PayloadMerged(stranger)) == []
    assert core.status().weights[1] == held + 0.5
    stale = PayloadArrived("node-002", 0, 1, 0, {0: 0.25, 1: 0.25})
    assert all(isinstance(a, Merge) for a in core.handle(stale))
    for bad in ({2: 0.5}, {0: float("nan")}, {0: -1.0}, {0: 1e9}):
        with pytest.raises(Refused):
            core.handle(PayloadArrived("node-002", 0, 2, 0, bad))
    with pytest.raises(Refused):
        core.handle(PullArrived("node-002", 0, {0: 1.0}))
