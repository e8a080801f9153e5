"""An insider (a 4th member with its own certificate and TLS server) against a 3-site mesh:
the weight sink and weight inflation (issue 12, item 3).

Observed on a live mesh: a member that acknowledged every push and never pushed back
took the honest sites' Σw from 2.47e6 to 8e-14 in 8 s and gossip stopped; 60 pushes
of 1e6, each under the per-message cap, gave node-0 a weight of 6.2e7 and every push
it made afterwards was refused. A second round (issue 32): the sink took 2.997 of 3.0
before the sink score stopped the pushes, and top-ups to just under the cap were merged
until every honest push was refused for the cap (zero acknowledged pushes after).

Here the sink takes at most ``limits.peer_credit`` of each honest site's weight (the
honest sites keep at least two thirds of theirs), every honest site names it, and
the honest sites keep gossiping; it can then bring each site at most what it took
plus the credit plus one founding weight (more is refused, OverCredit); inflating
pushes and top-ups under the cap are refused for the credit before the cap ever bites,
and honest gossip goes on at at least half its rate. What the honest sites hold plus
what the sink took, less what it brought, is their founding weight. Rates are printed
as ratios of the rate before the insider joined (run with ``-s`` for the table).
"""

from __future__ import annotations

import math
import threading
import time

import grpc
import torch

from gossipd.node.model.payload_bound import RADIUS_FLOOR
from gossipd.node.protocols.credit import DEFAULT_CREDIT, FOUNDING_WEIGHT
from gossipd.node.shared.config import LimitsConfig
from gossipd.node.shared.tls import Credentials
from tests.conftest import (
    DaemonHandle,
    status_of,
)
from tests.insider import ack_rate, acked
from tests.insider_weight import WeightInsider, metric, wait_accounted, wait_named
from tests.tls_mesh import Pki, insider_mesh_fixtures

IDS = ["a", "b", "c"]
INSIDER = "sink"
# limits.clip_factor: the default, which this mesh leaves as it is
CLIP_FACTOR = LimitsConfig().clip_factor
CONFIG = {
    "gossip": {"push_probability": 0.5},
    "membership": {"anti_entropy_interval_s": 0.5},
}
PROGRESS = 600  # acknowledged pushes, all honest sites together, per measured window
WINDOW_TIMEOUT_S = 60.0
INFLATE_WEIGHT = 1e6  # what the insider claims per push (the old per-message cap)
# The most one peer can bring a site in a push: what it holds of the site's weight (at most
# the credit) plus the credit plus a founding weight.
MOST_EVER = 2 * DEFAULT_CREDIT + FOUNDING_WEIGHT


pki, mesh = insider_mesh_fixtures(IDS, INSIDER, CONFIG)


def _sink(mesh: list[DaemonHandle], insider: WeightInsider, before: float, founding: float) -> None:
    """Every honest site pushes to the sink until its credit is spent and names it: each
    gave at most the credit per segment, and the honest Σw accounts for all but what the
    sink took, at least two thirds of the founding weight."""
    started = time.monotonic()
    acked_at_join = acked(mesh)
    wait_named(mesh, INSIDER)
    during = (acked(mesh) - acked_at_join) / (time.monotonic() - started)
    after = ack_rate(mesh, PROGRESS, "after the sink was suspected", WINDOW_TIMEOUT_S)
    taken = dict(insider.weight_taken)
    assert set(taken) <= set(IDS)
    segments = founding / len(IDS)
    assert max(taken.values()) <= DEFAULT_CREDIT * segments + 1e-9, taken
    honest = founding - sum(insider.weight_taken.values())
    assert honest >= 2 / 3 * founding
    free, held = wait_accounted(mesh, lambda: founding - sum(insider.weight_taken.values()))
    print(
        f"\nweight sink: before {before:.1f}/s, during {during / before:.2f}x, after "
        f"{after / before:.2f}x; weight taken per site {taken} (credit {DEFAULT_CREDIT:.4f} "
        f"per segment); honest Σw in [{free:.4f}, {held:.4f}] of {founding:g}"
    )
    assert after >= 0.5 * before


def _spend(
    mesh: list[DaemonHandle], insider: WeightInsider, before: float, spent: dict[str, float]
) -> float:
    """The sink spends: to each site, a push of more than any peer may bring is refused
    (OverCredit, nothing merged); one of what it took plus the credit and a founding weight
    is merged, and then no such push again. Returns the weight it brought."""
    brought = 0.0
    for h in mesh:
        took = insider.weight_taken[h.node_id]
        allowed = took + DEFAULT_CREDIT + FOUNDING_WEIGHT - spent[h.node_id]
        # More than any peer can ever bring in one push (honest pushes to it since these
        # reads give it room, but never beyond MOST_EVER).
        over = insider.push(h.address, weight=MOST_EVER * 1.01)
        assert over.code == grpc.StatusCode.INVALID_ARGUMENT, over
        assert "may bring" in over.details and "limits.peer_credit" in over.details, over.details
        within = insider.push(h.address, weight=allowed * 0.999)
        assert within.code == grpc.StatusCode.OK, within
        brought += allowed * 0.999
        # Spent: what honest pushes to it since gave it back is less than MOST_EVER.
        again = insider.push(h.address, weight=MOST_EVER * 1.01)
        assert "limits.peer_credit" in again.details, again.details
    after = ack_rate(mesh, PROGRESS, "after the sink spent its credit", WINDOW_TIMEOUT_S)
    print(f"sink spending: brought {brought:.4f} in all; after {after / before:.2f}x")
    assert after >= 0.5 * before
    return brought


def _rms(t: torch.Tensor) -> float:
    return float(t.norm()) / math.sqrt(t.numel())


def _pull_by(mesh: list[DaemonHandle], insider: WeightInsider) -> dict[str, float]:
    """Values of our own plus 50 (inside the sanity bound of 100 times the scale), at a
    weight the credit admits: each honest model moves by at most the push's share times
    the clip radius (limits.clip_factor times the others' distance, at least 1% of the
    scale, 1.0 here), not its share times 50 (the mean of every honest model went to
    49.8 in 3 s before). Returns the weight brought to each site."""
    weight = 0.1
    models = [torch.cat(insider.pull(h.address)) for h in mesh]
    # The others' distances are those between honest models (converged: learning rate 0);
    # with a margin for the merges between these reads and the push.
    apart = max(_rms(x - y) for x in models for y in models)
    radius = CLIP_FACTOR * max(1.5 * apart, RADIUS_FLOOR * 1.0)  # scale: the floor, 1.0
    moved = []
    for h in mesh:
        before = torch.cat(insider.pull(h.address))
        outcome = insider.push(h.address, weight=weight, values=before + 50.0)
        assert outcome.code == grpc.StatusCode.OK, outcome
        after = torch.cat(insider.pull(h.address))
        moved.append(_rms(after - before))
        # Its share of the merged weight is under 1 (its exact value depends on what the
        # site had in flight when it merged): at most the radius, against at least
        # weight / (weight + cap) times 50 = 0.6 unclipped.
        assert moved[-1] <= radius, (h.node_id, moved[-1], radius)
    print(
        f"in-bound +50 at weight {weight:g}: honest models moved {max(moved):.2e} RMS at most "
        f"(bound: its share times {radius:.3g}; unclipped: its share times 50)"
    )
    return {h.node_id: weight for h in mesh}


def _inflate(
    mesh: list[DaemonHandle],
    insider: WeightInsider,
    before: float,
    founding: float,
    brought: float,
) -> None:
    """Pushes of INFLATE_WEIGHT, and top-ups to just under the cap, while the mesh gossips:
    each refused for the credit, no site over its cap, honest gossip at at least half its
    rate, and the honest Σw still accounted for."""
    outcomes: list[grpc.StatusCode] = []
    stop = threading.Event()

    def inflate() -> None:
        while not stop.is_set() and len(outcomes) < 600:
            for h in mesh:
                # 1e6, then a top-up to just under the cap (8: twice the 4 members seen).
                held = max(status_of(h)["sum_weights"])
                for weight in (INFLATE_WEIGHT, 8.0 - held - 1e-3):
                    if weight <= MOST_EVER * 1.01:
                        continue  # a top-up its credit may admit: not inflation
                    outcome = insider.push(h.address, weight=weight)
                    outcomes.append(outcome.code)
                    assert "limits.peer_credit" in outcome.details, outcome.details

    attacker = threading.Thread(target=inflate)
    attacker.start()
    try:
        inflating = ack_rate(mesh, PROGRESS, "while the insider inflates weight", WINDOW_TIMEOUT_S)
    finally:
        stop.set()
        attacker.join(60.0)
    assert len(outcomes) >= 60
    assert set(outcomes) == {grpc.StatusCode.INVALID_ARGUMENT}
    after_inflation = ack_rate(mesh, PROGRESS, "after the inflation", WINDOW_TIMEOUT_S)
    for h in mesh:
        cap = metric(h, "gossipd_sum_weight_cap")
        assert cap == 8.0  # twice the 4 members it has seen, itself and the insider included
        assert max(status_of(h)["sum_weights"]) <= cap
        rejected = status_of(h)["rejected"]
        assert rejected["OverCredit"] >= 1
        assert rejected.get("WeightOverCap", 0) == 0  # the credit refused first: the cap never bit
    assert after_inflation >= 0.5 * before
    free2, held2 = wait_accounted(
        mesh, lambda: founding - sum(insider.weight_taken.values()) + brought
    )
    print(
        f"weight inflation: before {before:.1f}/s, during {inflating / before:.2f}x, after "
        f"{after_inflation / before:.2f}x; {len(outcomes)} pushes of {INFLATE_WEIGHT:g} or "
        f"under the cap all refused; honest Σw in [{free2:.4f}, {held2:.4f}] of {founding:g}"
    )


def test_one_insider_sinking_spending_and_inflating_weight_moves_at_most_its_credit(
    mesh: list[DaemonHandle], pki: Pki
) -> None:
    segments = len(status_of(mesh[0])["sum_weights"])
    founding = 3.0 * segments  # Σ over segments of the founding weights
    before = ack_rate(mesh, PROGRESS, "before the insider joined", WINDOW_TIMEOUT_S)
    tls = Credentials(ca=pki.ca, cert=pki.pem(INSIDER), key=pki.key(INSIDER))
    with WeightInsider(INSIDER, tls) as insider:
        for h in mesh:
            insider.introduce_to(h.address)
        # -- the sink: every honest site pushes to it until its credit is spent ---------
        _sink(mesh, insider, before, founding)
        # -- values inside the sanity bound, far beyond the others' ----------------------
        spent = _pull_by(mesh, insider)
        # -- then it spends what it took, and no more --------------------------------------
        brought = _spend(mesh, insider, before, spent) + sum(spent.values())
        # -- inflation: pushes of 1e6 and top-ups under the cap, refused for the credit ---
        _inflate(mesh, insider, before, founding, brought)
