"""The parts of `gossipd status --mesh` and of the restart audit that need no network:
the model sketch's distances, the mesh's bracketed sum, the table, and the audit's
arithmetic. Real daemons run them in tests/test_crash_one_site.py (kill -9, restart,
then the audit's figure against the mesh's real Σw, and the CLI against the mesh)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from gossipd.node.model.sketch import MAX_SKETCH_SIZE, sketch
from gossipd.node.net.status.mesh import mesh_figures, render_mesh
from gossipd.node.net.status.restart_audit import AuditResult, PeerPart, has_booked, peer_part
from gossipd.node.protocols.base import PeerMass


def test_sketch_distances_estimate_model_distances_within_a_few_percent() -> None:
    """Two models of 3 segments (one over a chunk long), 4,096 buckets: the sketched
    distance is within 10 % of the real one (its spread is about 2 %), and a sketch is
    linear, so the same model gives the same sketch on every site."""
    gen = torch.Generator().manual_seed(0)
    shapes = (70_000, 1_100_000, 300)
    x = [torch.randn(n, generator=gen, dtype=torch.float32) for n in shapes]
    y = [t + 0.1 * torch.randn(t.shape, generator=gen) for t in x]
    sx, sy = sketch(x, 4096), sketch(y, 4096)
    assert sx == sketch([t.clone() for t in x], 4096)
    real = float(torch.cat([(a - b).double() for a, b in zip(x, y, strict=True)]).norm())
    est = math.dist(sx, sy)
    assert abs(est - real) / real < 0.1, (est, real)
    both = sketch([a + b for a, b in zip(x, y, strict=True)], 4096)
    assert max(abs(s - (p + q)) for s, p, q in zip(both, sx, sy, strict=True)) < 1e-3


@pytest.mark.parametrize("size", [0, MAX_SKETCH_SIZE + 1])
def test_sketch_size_out_of_range_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="sketch size"):
        sketch([torch.zeros(4)], size)


def _site(node_id: str, weights: list[float], reserved: list[float], **over: Any) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "sum_weights": weights,
        "reserved_weights": reserved,
        "model_sketch": over.pop("model_sketch", [1.0, 0.0]),
        "round": 10,
        "step": 100,
        "loss": 0.5,
        "eval": {"test_accuracy": 0.9},
        "eval_step": 100,
        "protocol": "sumweight",
        "ranks": 1,
        "pushes_acked": 7,
        "pushes_merged": 6,
        "pulls": {},
        "wait_fraction": 0.0,
        "scheduling": "",
        "crash": {"resumed": False, "done": False},
        "fingerprint": "f",
        "live_peers": ["x"],
        "suspected_peers": [],
        **over,
    }


def test_mesh_sum_is_bracketed_by_what_is_in_flight_and_shares_add_to_one() -> None:
    """a has 0.5 of its 1.5 in flight to b, which may already have merged it: the true
    Σw is 2 or 2.5 at that instant, so the bracket is [2, 2.5]."""
    sites = {
        "a": _site("a", [1.5, 1.5], [0.5, 0.5], model_sketch=[1.0, 0.0]),
        "b": _site("b", [1.0, 1.0], [0.0, 0.0], model_sketch=[3.0, 0.0], round=7),
    }
    mesh = mesh_figures(sites)
    assert (mesh["sum_weight_low"], mesh["sum_weight"]) == (2.0, 2.5)
    rows = {r["node_id"]: r for r in mesh["sites"]}
    assert rows["a"]["share"] + rows["b"]["share"] == pytest.approx(1.0)
    assert rows["b"]["rounds_behind"] == 3 and rows["a"]["rounds_behind"] == 0
    # Mean sketch (2, 0): each is 1 away, over a norm of 2.
    assert rows["a"]["distance"] == pytest.approx(0.5) and mesh["consensus_distance"] == 0.5


def test_mesh_table_says_the_bracket_the_crash_and_who_did_not_answer() -> None:
    crashed = {
        "resumed": True,
        "done": True,
        "weight_lost": 0.082,
        "checkpoint_step": 800,
        "peers_answered": 2,
        "peers_asked": 2,
    }
    sites = {
        "a": _site("a", [1.5], [0.5], ranks=2),
        "c": _site("c", [1.0], [0.0], crash=crashed, pulls={"merged": 4}, wait_fraction=0.25),
    }
    mesh = {
        **mesh_figures(sites),
        "read_within_s": 0.012,
        "unreachable": {"d": {"address": "127.0.0.1:1", "error": "no status"}},
    }
    text = render_mesh(mesh)
    assert "sum-weight (per segment): 2.000000 to 2.500000" in text
    assert "read within 12 ms" in text
    assert "a (2 ranks)" in text and "0.900" in text
    assert "4 pulls merged, wait 25%" in text
    assert "c restarted from its checkpoint of step 800: cost the mesh 0.082" in text
    assert "unreachable: d at 127.0.0.1:1: no status" in text


def test_audit_counts_what_each_peer_booked_after_the_checkpoint() -> None:
    """The checkpoint saw 1.0 received from b and 0.5 sent to it; b's accounts of the old
    incarnation say it committed 1.75 and merged 0.5 + 0.25: 0.75 merged after the
    checkpoint (lost), 0.25 sent after it (held twice). A peer that never booked this
    site contributes nothing."""
    ours = PeerMass(sent=0.5, received=1.0)
    part = peer_part({"sent_before": 1.75, "received_before": 0.75}, ours)
    assert part == PeerPart(merged_after=0.75, sent_after=0.25)
    assert peer_part(None, ours) == PeerPart(0.0, 0.0)
    result = AuditResult(
        checkpoint_step=100, segments=2, parts={"b": part}, asked=frozenset({"b", "e"})
    )
    assert result.weight_lost == pytest.approx(0.25)  # (0.75 - 0.25) over 2 segments
    message = result.message()
    assert (message.peers_answered, message.peers_asked, message.done) == (1, 2, True)


def test_audit_waits_until_the_peer_moved_its_accounts_to_the_new_incarnation() -> None:
    status = {
        "peers": [{"node_id": "c", "incarnation": 7}],
        "exchanged": {"c": {"incarnation": 0}},
    }
    assert not has_booked(status, "c", 7)  # verified, but its accounts are still the old
    status["exchanged"]["c"]["incarnation"] = 7
    assert has_booked(status, "c", 7)
    assert not has_booked({"peers": [], "exchanged": {}}, "c", 7)  # not verified yet
    assert has_booked({"peers": [{"node_id": "c", "incarnation": 7}], "exchanged": {}}, "c", 7)
