"""A site killed with ``kill -9`` and restarted from its checkpoint costs the mesh only
what that checkpoint lacks, for every protocol (real daemons on loopback).

The field trial: three sites, learning rate 0, a checkpoint every 100 steps; one site
killed mid-gossip and restarted. The mesh's Σw fell from 3 to 3.1e-31 within a minute
while pushes kept being acknowledged: senders numbered their pushes to the restarted
site from 1 again, its restored de-duplication windows answered DUPLICATE for pushes it
had never merged, and the senders dropped that weight.

The bound checked here (``protocols/ledger.py``): Σw changes by minus what the crashed
site merged after its checkpoint plus what it sent that its peers merged after it.
Both are read from the peers' own per-peer accounts of the crashed site's previous
incarnation (``exchanged``, ``*_before``) against the same accounts in its checkpoint,
so the test does not need to catch the instant of the kill. The restarted site reads
the same accounts from its peers (``node/net/status/restart_audit.py``): the figure it logs
and reports must be the change the mesh's Σw really shows.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gossipd.node.protocols import PROTOCOLS, keeps_weights
from gossipd.node.protocols.base import PeerMass
from gossipd.node.trainer import checkpoint
from tests.conftest import (
    DaemonHandle,
    kill_hard,
    restart_daemon,
    start_mesh,
    status_of,
    stop_all,
    stop_in_turn,
    wait_counters_grow,
    wait_until,
)

NODES = ["a", "b", "c"]
CONFIG: dict[str, Any] = {
    "gossip": {"push_probability": 0.5, "round_steps": 1, "average_every_steps": 5},
    "checkpoint": {"every_steps": 100},
}
TOLERANCE = 1e-9


def crash_bound(crashed: str, saved: checkpoint.Checkpoint, peers: list[dict[str, Any]]) -> float:
    """What the crashed site exchanged with its peers after its checkpoint (summed over
    segments): the peers' totals for its previous incarnation less the checkpoint's."""
    bound = 0.0
    for status in peers:
        theirs = status["exchanged"][crashed]
        ours = saved.exchanged.get(status["node_id"], PeerMass())
        bound += abs(theirs["sent_before"] - ours.received)
        bound += abs(theirs["received_before"] - ours.sent)
    return bound


@pytest.mark.parametrize("protocol", sorted(p for p in PROTOCOLS if keeps_weights(p)))
def test_kill_9_and_restart_of_one_site_costs_at_most_what_its_checkpoint_lacks(
    tmp_path: Path, protocol: str
) -> None:
    handles = start_mesh(
        tmp_path, NODES, **{**CONFIG, "gossip": {**CONFIG["gossip"], "protocol": protocol}}
    )
    a, b, c = handles
    try:
        wait_counters_grow(handles, ("pushes_acked", "pushes_merged"), 5, "gossip everywhere", 120)
        ckpt_path = c.data_dir / checkpoint.FILENAME
        wait_until(ckpt_path.exists, "c's first periodic checkpoint", 120)
        fingerprint = status_of(c)["fingerprint"]
        peers_before = status_of(a)["peers"]
        kill_hard(c)  # pushes in flight both ways, no hand-off
        saved = checkpoint.load(ckpt_path, fingerprint=fingerprint)
        c = handles[2] = restart_daemon(c)

        def restart_seen() -> bool:
            return all(
                any(p["node_id"] == "c" and p not in peers_before for p in status_of(h)["peers"])
                for h in (a, b)
            )

        wait_until(restart_seen, "a and b to verify c's new incarnation", 120)
        # Its reach check's dial-back tried the address afresh, not through the peers' pooled
        # connection to the killed incarnation (which failed it at once: outbound-only).
        assert status_of(c)["reach"] == "direct", c.log()[-3000:]
        # Gossip to and from the new incarnation, long enough for the defect to show.
        wait_counters_grow(handles, ("pushes_acked", "pushes_merged"), 20, "gossip after", 180)
        survivors = [status_of(h) for h in (a, b)]
        bound = crash_bound("c", saved, survivors)
        wait_until(lambda: c.status()["crash"]["done"], "c's restart audit", 150)
        audit = c.status()["crash"]
        # The operator's one command, once (it reads what every protocol reports alike).
        mesh = mesh_view(a) if protocol == "sumweight" else None
        inconsistencies = {h.node_id: status_of(h)["mass_inconsistencies"] for h in handles}
        weights = stop_in_turn(handles)
    finally:
        stop_all(handles)
    segments = len(weights[0])
    total = sum(sum(w) for w in weights)
    assert inconsistencies == {n: 0 for n in NODES}, inconsistencies
    assert abs(total - len(NODES) * segments) <= bound + TOLERANCE, (
        f"Σw = {total} after one crash, more than {bound} from {len(NODES) * segments}: "
        f"{weights}, survivors' accounts of c: {[s['exchanged'] for s in survivors]}"
    )
    assert (audit["peers_answered"], audit["peers_asked"]) == (2, 2), audit
    assert audit["checkpoint_step"] == saved.step, (audit, saved.step)
    lost = len(NODES) - total / segments
    assert abs(audit["weight_lost"] - lost) <= TOLERANCE, (
        f"c reported a restart cost of {audit['weight_lost']}, the mesh lost {lost}: {audit}"
    )
    said = "restart audit: resuming from the checkpoint of step"
    assert said in c.log(), c.log()[-3000:]
    if mesh is not None:
        # Nothing changes Σw after the restart: the bracket read mid-gossip holds the end's.
        per_segment = total / segments
        assert mesh["sum_weight_low"] - TOLERANCE <= per_segment <= mesh["sum_weight"] + TOLERANCE
        rows = {r["node_id"]: r for r in mesh["sites"]}
        assert sorted(rows) == NODES and not mesh["unreachable"], mesh
        assert rows["c"]["crash"]["weight_lost"] == audit["weight_lost"]
        assert all(math.isfinite(r["distance"]) for r in rows.values()), rows


def mesh_view(entry: DaemonHandle) -> dict[str, Any]:
    """`gossipd status --mesh --json` against one site, as an operator runs it."""
    command = ["status", "--mesh", "--json", "--address", entry.address]
    out = subprocess.run(
        [sys.executable, "-m", "gossipd.node.cli", *command],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)
