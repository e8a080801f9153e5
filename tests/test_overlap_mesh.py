"""Scheduled overlap on real processes with a local coordinator, which dies and comes back.

Three `gossipd node` processes train digits with the overlap protocol, started before
their coordinator is: they train, scheduling alone, through their seeds. Then a real
`gossipd coordinator` comes up and schedules their pulls over mutual TLS. It is
killed (SIGKILL) mid-run: every node must keep stepping (counted from status, not
timed) and schedule its pulls alone; restarted on its data dir, it must have every
node registered again and scheduling through it. Every node ends at ≥ 0.90 test
accuracy. (The decentralized mesh is in test_mesh_digits, with every protocol.)
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import pytest

from gossipd.node.launch.forked import fork_node
from gossipd.node.launch.localmesh import LocalMesh, MeshSpec
from gossipd.node.net.status.query import render_status
from tests.conftest import wait_until

NODES = 3
STEPS_WHILE_DOWN = 300  # steps every node must take while the coordinator is dead
TIMEOUT_S = 180.0


def _statuses(mesh: LocalMesh) -> list[dict[str, Any]]:
    return asyncio.run(mesh.statuses())


def _wait_statuses(mesh: LocalMesh, ok: Any, what: str) -> list[dict[str, Any]]:
    """Poll every node's status until ``ok(statuses)``; a node that died fails at once."""
    seen: list[list[dict[str, Any]]] = []

    def check() -> bool:
        mesh.check_alive()
        seen.append(_statuses(mesh))
        return bool(ok(seen[-1]))

    wait_until(check, what, TIMEOUT_S)
    return seen[-1]


def _train_without_then_with_the_coordinator(mesh: LocalMesh) -> None:
    """Nodes started before their coordinator train alone, found through their seeds; once
    it is up, it schedules their pulls."""
    for i in range(NODES):  # started while their coordinator is not up yet
        mesh.start(i)
    asyncio.run(mesh.wait_ready())
    _wait_statuses(
        mesh,
        lambda ss: all(s["scheduling"] == "decentralized" and s["step"] > 100 for s in ss),
        "every node training with no coordinator, found through its seeds",
    )
    mesh.start_coordinator()
    scheduled = _wait_statuses(
        mesh,
        lambda ss: all(s["scheduling"] == "coordinator" and s["step"] > 0 for s in ss),
        "every node training with pulls scheduled by the coordinator",
    )
    # `gossipd status` says so in the protocol's terms: pulls and who schedules, no pushes.
    table = render_status(scheduled[0])
    assert re.search(r"^scheduling\s+coordinator; [1-9]\d* periods from the coordinator, "
                     r"[1-9]\d* scheduled alone", table, re.M), table  # fmt: skip
    assert re.search(r"^pulls\s+[1-9]\d* merged, ", table, re.M), table
    assert re.search(r"^waits\s+[\d.]+ s for pulls", table, re.M), table
    assert "acknowledged" not in table, table


def _train_on_while_the_coordinator_is_dead(mesh: LocalMesh) -> None:
    """SIGKILL to the coordinator: every node takes STEPS_WHILE_DOWN more steps, scheduling
    alone, with every peer still live."""
    mesh.kill_coordinator()
    before = {s["node_id"]: s["step"] for s in _statuses(mesh)}
    down = _wait_statuses(
        mesh,
        lambda ss: all(
            s["step"] >= before[s["node_id"]] + STEPS_WHILE_DOWN
            and s["scheduling"] == "decentralized"
            for s in ss
        ),
        f"{STEPS_WHILE_DOWN} more steps on every node, scheduled alone, coordinator dead",
    )
    assert all(len(s["live_peers"]) == NODES - 1 for s in down), down


def _schedule_through_the_restarted_coordinator(mesh: LocalMesh, tmp_path: Path) -> None:
    """Restarted on its data dir, the coordinator has every node registered again and
    writes its state at its next persist interval after they registered."""
    mesh.start_coordinator()
    _wait_statuses(
        mesh,
        lambda ss: all(s["scheduling"] == "coordinator" for s in ss),
        "every node registered again and scheduling through the restarted coordinator",
    )
    saved = tmp_path / "coordinator" / "state.json"
    wait_until(saved.exists, "the restarted coordinator to write its state", 60)
    state = json.loads(saved.read_text())
    assert state, "the coordinator wrote no state"


@pytest.mark.timeout(600)
def test_overlap_trains_through_a_coordinator_that_dies_and_comes_back(tmp_path: Path) -> None:
    spec = MeshSpec(
        nodes=NODES,
        job="digits",
        protocol="overlap",
        coordinator=True,
        duration_s=0.0,  # trains until stopped: the phases below decide how long
        eval_every_steps=100,
    )
    with LocalMesh(spec, tmp_path, fork_node) as mesh:
        _train_without_then_with_the_coordinator(mesh)
        _train_on_while_the_coordinator_is_dead(mesh)
        _schedule_through_the_restarted_coordinator(mesh, tmp_path)
        _wait_statuses(
            mesh,
            lambda ss: all(s["step"] >= 2000 for s in ss),
            "2000 steps on every node",
        )
        codes = [mesh.stop(i) for i in range(NODES)]
    assert codes == [0] * NODES
    for i in range(NODES):
        summary = json.loads((tmp_path / f"node-{i}" / "summary.json").read_text())
        assert summary["test_accuracy"] >= 0.90, summary
        assert 0.0 <= summary["wait_fraction"] < 1.0, summary
