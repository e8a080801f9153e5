"""Mass conservation on real daemons through a hung peer and outsiders' floods.

Sum-weight gossip is only right if the sum over the mesh of each segment's
sum-weight never changes: a lost push loses mass, a doubly counted one creates
it. With training off (learning rate 0) nothing else moves the weights, so after
every node has left with SIGTERM (each hands its weight to a live peer; the
last one keeps it) the final weights in the nodes' summary.json must add up to
the number of nodes, to rounding, whatever happened in between.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import torch

from tests.conftest import (
    DaemonHandle,
    sigstopped,
    start_mesh,
    status_of,
    stop_all,
    stop_in_turn,
    wait_counters_grow,
    wait_mesh_live,
)
from tests.fakepeer import (
    dead_address,
    flood_handshakes,
    flood_pushes,
    leave_as,
    node_info,
    push_as,
    push_frames,
    synthetic_plan,
    true_identity,
)

NODES = ["a", "b", "c", "d"]
PROGRESS_TIMEOUT_S = 2.0
DROP_AFTER_S = 60.0
CONFIG: dict[str, Any] = {
    "gossip": {"push_probability": 0.5, "progress_timeout_s": PROGRESS_TIMEOUT_S},
    "membership": {"suspect_after_failures": 2, "drop_after_s": DROP_AFTER_S},
}
# The hung period (observed: 30 s): many progress timeouts, 5 here (pushes to d are
# abandoned and retried), a sixth of drop_after_s (d is never declared dead, its pushes
# never folded back). The floods run inside it; if they take longer, the stop lasts
# until they end.
HUNG_S = 10.0
DEDUP_FLOOD = 4_200  # more than the 4,096-entry window of the code it was found in
TOLERANCE = 1e-9


def _floods(a: DaemonHandle, c: DaemonHandle, b_id: str, b_incarnation: int) -> dict[str, Any]:
    """The outsiders' part, while d is hung; returns what the targets answered, for messages."""
    numel = synthetic_plan().segments[0].numel
    zeros = torch.zeros(numel, dtype=torch.float32)
    # Observation 7: pushes "from b" with huge sequences, to flush a's de-duplication window.
    window = flood_pushes(
        a.address,
        [
            push_frames(
                sender=b_id,
                incarnation=b_incarnation,
                sequence=2**62 + i,
                weight=1e-12,
                values=zeros,
            )
            for i in range(DEDUP_FLOOD)
        ],
        concurrency=16,
    )
    # Observation 12: forged Leaves for b.
    leaves = [leave_as(t.address, b_id, b_incarnation) for _ in range(20) for t in (a, c)]
    # Observations 9 and 10: made-up members handshake, then each pushes weight 0.25.
    made_up = [node_info(f"made-up-{i}", dead_address(i, 75), 1) for i in range(20)]
    flood_handshakes(a.address, made_up)
    pushes = [
        push_as(
            a.address,
            sender=m.node_id,
            incarnation=m.incarnation,
            sequence=1,
            weight=0.25,
            values=torch.full((numel,), 1e30, dtype=torch.float32),
        )
        for m in made_up
    ]
    return {
        "window flood merged": sum(o.merged for o in window),
        "forged leaves answered OK": sum(code == grpc.StatusCode.OK for code in leaves),
        "made-up pushes merged": sum(o.merged for o in pushes),
    }


def test_sum_of_weights_is_exactly_n_after_hung_peer_floods_and_sigterm_of_all(
    tmp_path: Path,
) -> None:
    """Observation 13: a 4-node mesh through a 30 s SIGSTOP and floods summed to 4.0129.

    It failed in 3 of 5 clean runs (totals 4.14, 4.56, all excess at d) until a
    leaving node answered DUPLICATE for what it had merged: d, resumed, retried a
    push whose acknowledgement its stop had swallowed, the receiver refused it as
    leaving, then left with that push's weight in its hand-off, and d folded the
    same weight back when the receiver was gone.

    Here d is SIGSTOPped for HUNG_S (many progress timeouts, less than
    drop_after_s) while a, b and c gossip and an outsider floods a and c (window
    flush as b, forged Leaves for b, made-up members pushing weight); then d is
    resumed, and all four are stopped with SIGTERM one at a time. Per segment the
    final weights add up to 4 within 1e-9.
    """
    handles = start_mesh(tmp_path, NODES, **CONFIG)
    a, b, c, d = handles
    try:
        b_incarnation = true_identity(b.address).incarnation
        with sigstopped(d):
            hung_at = time.monotonic()
            answered = _floods(a, c, "b", b_incarnation)
            # Hold the fault for the rest of the hung period (this defines it).
            time.sleep(max(0.0, HUNG_S - (time.monotonic() - hung_at)))
        wait_mesh_live(handles, 60.0)
        weights = stop_in_turn(handles)
    finally:
        stop_all(handles)

    per_node = dict(zip(NODES, weights, strict=True))
    totals = [sum(w[s] for w in weights) for s in range(len(weights[0]))]
    assert all(abs(t - len(NODES)) <= TOLERANCE for t in totals), (totals, per_node, answered)


def test_sum_of_weights_is_exact_when_some_streams_of_a_push_are_refused(
    tmp_path: Path,
) -> None:
    """A push is split over several streams; with an inbox of one push, a receiver takes
    one stream and answers the others busy. Folding the whole push back then would keep
    the weight of the segments that were merged on both sides (mass created); retrying
    it with the same sequence commits those as DUPLICATE and the rest when they land."""
    nodes = ["p", "q", "r"]
    handles = start_mesh(
        tmp_path,
        nodes,
        job={"options": {"numel": 20_000}},
        gossip={"push_probability": 1.0, "segment_bytes": 8192, "progress_timeout_s": 5.0},
        limits={"inbox_size": 1},
    )
    try:
        wait_counters_grow(
            handles, ("pushes_acked",), 30, "pushes acknowledged everywhere", timeout_s=120.0
        )
        busy = sum(status_of(h)["rejected"].get("Busy", 0) for h in handles)
        assert busy > 0, "no stream was refused busy: the case under test did not happen"
        weights = stop_in_turn(handles)
    finally:
        stop_all(handles)
    assert len(weights[0]) >= 2, "the model must span several segments, one stream each"
    totals = [sum(w[s] for w in weights) for s in range(len(weights[0]))]
    assert all(abs(t - len(nodes)) <= TOLERANCE for t in totals), totals
