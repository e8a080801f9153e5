"""The simulator predicts the daemon: one small scenario run both ways, compared round by round.

Five real daemons run crossover with training off, each step paced to 1 s so
that a round's pushes land well inside the round, as in the simulator's
homogeneous scenario. The simulator then replays that mesh: the same node ids,
the same mesh id (every shared topology is hashed from it), the same initial
models, so both mix with the very same derangements each round.

The simulator's rounds are synchronous; the daemon's step boundaries are a few
milliseconds apart, so a node that reaches a boundary after its predecessor in
the derangement already merges that predecessor's push of the same round, and
information travels two hops in one round. Measured on 2026-11-22 in four runs,
the daemon ran up to three rounds ahead of the simulator by round 8 (0.011
against 0.089 after round 8 and 0.025 after round 10) when the nodes' phases
were spread, and level with it when they were not. So the error the daemon shows
while its nodes are in rounds lo..hi must lie between the simulator's after
round hi + 4 and after round lo − 2, and once settled between its after rounds
R + 4 and R, up to a factor for sampling: never behind the synchronous
prediction, and not ahead by more than phases can explain. A lost merge or a
stalled round falls behind it within a few rounds (errors fall about 2x a round
here).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import LocalMesh, MeshSpec
from gossipd.node.sim import SimSpec, run_sim

NODES = 5
ROUNDS = 8
FACTOR = 2.0  # a sample can catch some nodes' merges of a round done and others not
LEAD = 4  # rounds the daemon may run ahead of the synchronous simulator (see above)
# Crossover as its paper states it, on both sides: the peer credit (limits.peer_credit) cuts
# pushes to peers holding a third of a node's weight, which on 5 nodes holds the error
# level for rounds at a time, and 8 rounds would not show the band.
NO_CREDIT = 1e9


def _error(models: list[torch.Tensor], mean0: torch.Tensor) -> float:
    return max(float((m - mean0).norm() / mean0.norm()) for m in models)


async def _sample(
    mesh: LocalMesh, mean0: torch.Tensor, samples: list[tuple[int, int, float]]
) -> None:
    """Until every node finished: (lowest round, highest round, error) around each pull.

    A pull takes the replica's lock, which the paced step holds while it computes,
    so each pull lands at a step boundary and the samples follow the rounds.
    """
    deadline = time.monotonic() + 180.0
    while time.monotonic() < deadline:
        before = [s["round"] for s in await mesh.statuses()]
        models = await mesh.pull_all()
        after = await mesh.statuses()
        rounds = before + [s["round"] for s in after]
        samples.append((min(rounds), max(rounds), _error(models, mean0)))
        if all(s["training_done"] for s in after):
            return
    raise AssertionError("the mesh did not finish its rounds within 180 s")


def _simulated_errors(mesh_id: str, initial: list[torch.Tensor]) -> list[float]:
    """The simulator's error after each round, replaying the mesh: the same node ids, mesh
    id (so the same derangements) and initial models."""
    sim = run_sim(
        SimSpec(
            protocol="crossover",
            nodes=NODES,
            rounds=ROUNDS + LEAD,
            segments=1,
            dim=len(initial[0]),
            node_ids=tuple(f"node-{i}" for i in range(NODES)),
            mesh_id=mesh_id,
            initial=tuple(tuple(float(v) for v in m) for m in initial),
            peer_credit=NO_CREDIT,
        )
    )
    return sim.errors


def _run_daemons(
    tmp_path: Path,
) -> tuple[list[torch.Tensor], list[tuple[int, int, float]], float, str]:
    """The real mesh, paced one round a second: its initial models, the samples taken
    around each pull, its error once settled, and its mesh id."""
    spec = MeshSpec(
        nodes=NODES,
        job="tests.plugin_jobs:paced_job",
        job_options={"step_time_s": 1.0},
        protocol="crossover",
        max_steps=ROUNDS,
        duration_s=0.0,
        eval_every_steps=0,
        checkpoint_every_steps=0,
        insecure=True,
        limits={"peer_credit": NO_CREDIT},
    )
    samples: list[tuple[int, int, float]] = []
    with LocalMesh(spec, tmp_path, fork_node) as mesh:
        for i in range(NODES):
            mesh.start(i)
        mesh.load_plan()
        asyncio.run(mesh.wait_ready())
        initial = mesh.initial_models()
        mean0 = torch.stack(initial).mean(0)
        asyncio.run(_sample(mesh, mean0, samples))
        asyncio.run(mesh.wait_settled(120.0))
        final = _error(asyncio.run(mesh.pull_all()), mean0)
        mesh_id = mesh.mesh_id
        codes = [mesh.stop(i) for i in sorted(mesh.procs)]
    assert codes == [0] * NODES
    return initial, samples, final, mesh_id


def _check_samples_in_band(samples: list[tuple[int, int, float]], errors: list[float]) -> None:
    """Every sample within FACTOR of the simulator's band for the rounds it spans, and at
    least three rounds compared."""
    compared = set()
    for lo, hi, value in samples:
        # Each pull waits for its node's step boundary (the paced step holds the replica's
        # lock), so a sample spans one boundary on every node; with the nodes' phases spread
        # that is rounds lo..lo + 2 (CI at load: nearly every sample). The band is taken
        # from lo and hi, so such a window widens it by one round, no more.
        if lo < 1 or hi - lo > 2:  # before the first round, or spread over a wide window
            continue
        low, high = errors[min(hi + LEAD, ROUNDS + LEAD)] / FACTOR, errors[max(lo - 2, 0)] * FACTOR
        assert low <= value <= high, (lo, hi, value, errors, samples)
        compared.add(lo)
    assert len(compared) >= 3, f"too few rounds sampled: {samples}"


@pytest.mark.timeout(300)
def test_daemon_consensus_per_round_lies_within_the_simulators_band(tmp_path: Path) -> None:
    initial, samples, final, mesh_id = _run_daemons(tmp_path)
    mean0 = torch.stack(initial).mean(0)

    errors = _simulated_errors(mesh_id, initial)  # errors[r]: after round r; [0]: the start
    assert errors[0] == pytest.approx(_error(initial, mean0), rel=1e-9)
    assert errors[ROUNDS] < errors[0] / 10, errors
    _check_samples_in_band(samples, errors)
    # Settled, every push merged: the daemon ends where the simulator ends, give or take
    # its lead.
    assert errors[ROUNDS + LEAD] / FACTOR <= final <= errors[ROUNDS] * FACTOR, (
        final,
        errors,
        samples,
    )
