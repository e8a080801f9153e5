"""Every site killed with ``kill -9`` at once and restarted: the mesh resumes with exactly
the weight its checkpoints hold, for every protocol (real daemons on loopback).

Each site's checkpoint counts the weight of its pushes in flight as held, and every
restarted site is a new incarnation, so nothing of the old pushes can arrive or be
acknowledged any more: from the restart on, Σw is the sum of the checkpoints' weights
(3.72 for three sites in the field trial, whose checkpoints were taken at different
moments), and gossip among the new incarnations keeps it exact.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from gossipd.node.protocols import PROTOCOLS, keeps_weights
from gossipd.node.trainer import checkpoint
from tests.conftest import (
    kill_hard,
    restart_daemon,
    start_mesh,
    status_of,
    stop_all,
    stop_in_turn,
    wait_counters_grow,
    wait_mesh_live,
    wait_until,
)

NODES = ["a", "b", "c"]
GOSSIP: dict[str, Any] = {"push_probability": 0.5, "round_steps": 1, "average_every_steps": 5}
TOLERANCE = 1e-9


@pytest.mark.parametrize("protocol", sorted(p for p in PROTOCOLS if keeps_weights(p)))
def test_kill_9_of_every_site_resumes_with_exactly_the_checkpoints_weight(
    tmp_path: Path, protocol: str
) -> None:
    handles = start_mesh(
        tmp_path,
        NODES,
        gossip={**GOSSIP, "protocol": protocol},
        checkpoint={"every_steps": 100},
    )
    try:
        wait_counters_grow(handles, ("pushes_acked", "pushes_merged"), 5, "gossip everywhere", 120)
        paths = [h.data_dir / checkpoint.FILENAME for h in handles]
        wait_until(lambda: all(p.exists() for p in paths), "every site's checkpoint", 120)
        fingerprint = status_of(handles[0])["fingerprint"]
        for h in handles:
            kill_hard(h)
        saved = [checkpoint.load(p, fingerprint=fingerprint).weights for p in paths]
        with ThreadPoolExecutor(len(handles)) as pool:
            handles[:] = list(pool.map(restart_daemon, handles))
        wait_mesh_live(handles, 120)
        wait_counters_grow(handles, ("pushes_acked", "pushes_merged"), 20, "gossip after", 180)
        inconsistencies = {h.node_id: status_of(h)["mass_inconsistencies"] for h in handles}
        weights = stop_in_turn(handles)
    finally:
        stop_all(handles)
    expected = [sum(w[s] for w in saved) for s in range(len(saved[0]))]
    totals = [sum(w[s] for w in weights) for s in range(len(weights[0]))]
    assert inconsistencies == {n: 0 for n in NODES}, inconsistencies
    assert all(abs(t - e) <= TOLERANCE for t, e in zip(totals, expected, strict=True)), (
        f"Σw per segment {totals}, the checkpoints held {expected}: {weights} vs {saved}"
    )
