"""An insider sinking weight in a mesh of a protocol of the exponential graph (issue 32):
``pushsum-expgraph`` and ``persyn``, three honest TLS sites and a 4th member with its own
certificate that acknowledges every push and never pushes back.

Before, these protocols pushed along the graph forward only, so an honest out-neighbour
never sent weight back along an edge, and they kept neither the per-peer credit nor the
sink watch: a sink in such a mesh took every push its in-neighbours made, for good (run
on the old code with pushsum-expgraph, this test's sink took 3.0 of the founding 3.0, no
site named it, and one site's trainer stopped on an overflow in the weight balance, since
fixed). Now the direction turns every cycle, weight
comes back along every edge, and both apply as they do to sum-weight: the sink takes at
most ``limits.peer_credit`` of each site's weight per segment (1/2 for these protocols:
their half pushes fit whole), every honest site names it in its INFO log, gossip among
the honest sites goes on at at least half its rate, and the sink can bring back at most
what it took plus the credit and a founding weight. The honest Σw is always the founding
weight less what the sink holds. Run with ``-s`` for the rates.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gossipd.node.protocols.credit import FOUNDING_WEIGHT, HALF_PUSH_CREDIT
from gossipd.node.shared.tls import Credentials
from tests.conftest import DaemonHandle, status_of, stop_all
from tests.insider import ack_rate
from tests.insider_weight import WeightInsider, wait_accounted, wait_named
from tests.tls_mesh import CLIENT, Pki, start_tls_mesh

IDS = ["a", "b", "c"]
INSIDER = "sink"  # ranks a, b, c, sink: every honest site is one of its in-neighbours
OPTIONS = {
    "pushsum-expgraph": {"round_steps": 1},
    # A burst every 4 steps (the trainer is paced to 100 steps a second): about 25 a second.
    "persyn": {"average_every_steps": 4},
}
PROGRESS = 150  # acknowledged pushes, all honest sites together, per measured window
WINDOW_TIMEOUT_S = 60.0
MOST_EVER = 2 * HALF_PUSH_CREDIT + FOUNDING_WEIGHT  # the most a peer can ever bring


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki") / "ca", [*IDS, CLIENT, INSIDER])


@pytest.fixture(params=list(OPTIONS))
def directed(
    request: pytest.FixtureRequest, tmp_path: Path, pki: Pki
) -> Iterator[tuple[str, list[DaemonHandle]]]:
    protocol = request.param
    config = {
        "gossip": {"protocol": protocol, protocol: OPTIONS[protocol]},
        "membership": {"anti_entropy_interval_s": 0.5},
    }
    handles = start_tls_mesh(tmp_path, pki, IDS, **config)
    try:
        yield protocol, handles
    finally:
        stop_all(handles)


def test_a_sink_takes_at_most_the_credit_of_each_site_and_is_named(
    directed: tuple[str, list[DaemonHandle]], pki: Pki
) -> None:
    protocol, mesh = directed
    segments = len(status_of(mesh[0])["sum_weights"])
    founding = len(IDS) * segments
    before = ack_rate(mesh, PROGRESS, "before the insider joined", WINDOW_TIMEOUT_S)
    tls = Credentials(ca=pki.ca, cert=pki.pem(INSIDER), key=pki.key(INSIDER))
    with WeightInsider(INSIDER, tls, protocol=protocol) as insider:
        for h in mesh:
            insider.introduce_to(h.address)
        wait_named(mesh, INSIDER)
        after = ack_rate(mesh, PROGRESS, "after the sink was suspected", WINDOW_TIMEOUT_S)
        taken = dict(insider.weight_taken)
        assert set(taken) == set(IDS), taken  # each site pushed to it: all are in-neighbours
        assert max(taken.values()) <= HALF_PUSH_CREDIT * segments + 1e-9, taken
        held_by_sink = sum(taken.values())
        assert founding - held_by_sink >= founding * (1 - len(IDS) * HALF_PUSH_CREDIT / len(IDS))
        free, held = wait_accounted(mesh, lambda: founding - sum(insider.weight_taken.values()))
        # Then it spends: to each site, more than any peer may bring is refused (nothing
        # merged), what it took plus the credit and a founding weight is merged.
        brought = 0.0
        for h in mesh:
            over = insider.push(h.address, weight=MOST_EVER * 1.01)
            assert over.code == grpc.StatusCode.INVALID_ARGUMENT, over
            assert "limits.peer_credit" in over.details, over.details
            allowed = insider.weight_taken[h.node_id] + HALF_PUSH_CREDIT + FOUNDING_WEIGHT
            within = insider.push(h.address, weight=allowed * 0.999)
            assert within.code == grpc.StatusCode.OK, within
            brought += allowed * 0.999
        free2, held2 = wait_accounted(
            mesh, lambda: founding - sum(insider.weight_taken.values()) + brought
        )
        spent = ack_rate(mesh, PROGRESS, "after the sink spent its credit", WINDOW_TIMEOUT_S)
    print(
        f"\n{protocol} sink: acknowledged pushes after it was named {after / before:.2f}x of "
        f"before, after it spent {spent / before:.2f}x; taken per site {taken} (credit "
        f"{HALF_PUSH_CREDIT:g} a segment); honest Σw in [{free:.4f}, {held:.4f}] of "
        f"{founding:g}, [{free2:.4f}, {held2:.4f}] after it brought {brought:.4f}"
    )
    assert after >= 0.5 * before and spent >= 0.5 * before
