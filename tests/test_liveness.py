"""A hung peer holds no one hostage: real daemons, one of them SIGSTOPped.

SIGSTOP is the hung process of a wide-area mesh: its TCP connections stay open,
nothing it was sent is read or answered. The others must notice by the lack of
progress (gossip.progress_timeout_s), keep at most one push waiting on it, and
go on gossiping among themselves; when it resumes it is a peer again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import (
    DaemonHandle,
    sigstopped,
    start_mesh,
    stop_all,
    wait_counters_grow,
    wait_mesh_live,
)

PROGRESS_TIMEOUT_S = 2.0
CONFIG: dict[str, Any] = {
    "gossip": {"push_probability": 0.5, "progress_timeout_s": PROGRESS_TIMEOUT_S},
    # drop_after_s (its default, stated): the stop below stays well short of it, so the
    # hung node is only suspected, never declared dead, and its pushes are not folded back.
    "membership": {"suspect_after_failures": 2, "drop_after_s": 60.0},
}
# How long the node is already hung before the others are watched: several progress
# timeouts, enough for every push a healthy node started towards it to be stuck.
HUNG_BEFORE_WATCHING_S = 3 * PROGRESS_TIMEOUT_S
MARGIN = 20  # pushes acknowledged and merged by each healthy node while the peer is hung


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonHandle]]:
    handles = start_mesh(tmp_path_factory.mktemp("liveness"), ["a", "b", "c", "d"], **CONFIG)
    try:
        yield handles
    finally:
        stop_all(handles)


def test_hung_peer_does_not_stall_the_others_pushes_and_rejoins_when_resumed(
    mesh: list[DaemonHandle],
) -> None:
    """Observation 1: one site of four SIGSTOPped for ~30 s froze a healthy site's gossip.

    Its acknowledged and received pushes did not move for the whole stop. Here,
    with d hung (and already hung for several progress timeouts), each of a, b, c
    acknowledges MARGIN more outbound pushes and merges MARGIN more inbound ones
    before d is resumed; after SIGCONT, d is live everywhere and its own pushes
    are acknowledged again.
    """
    a, b, c, d = mesh
    healthy = [a, b, c]
    with sigstopped(d):
        # Holding the fault for a while defines it ("hung for several timeouts");
        # nothing waits on this sleep for a result.
        time.sleep(HUNG_BEFORE_WATCHING_S)
        wait_counters_grow(
            healthy,
            ("pushes_acked", "pushes_merged"),
            MARGIN,
            f"a, b and c to keep gossiping while d is hung (+{MARGIN} acked and merged each)",
            timeout_s=20.0,
        )
        assert d.proc.poll() is None, "d exited while stopped"

    wait_mesh_live(mesh, 60.0)
    wait_counters_grow(
        [d], ("pushes_acked", "pushes_merged"), MARGIN, "d to gossip again after SIGCONT", 60.0
    )
