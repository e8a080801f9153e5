"""An insider (a 4th member with its own certificate and TLS server) against a 3-site mesh:
the weight sink and weight inflation (issue 12, item 3).

Observed on a live mesh: a member that acknowledged every push and never pushed back
took the honest sites' Σw from 2.47e6 to 8e-14 in 8 s and gossip stopped; 60 pushes
of 1e6, each under the per-message cap, gave node-0 a weight of 6.2e7 and every push
it made afterwards was refused. Here the sink must be suspected by every honest site
after at most the stated number of pushes (``SinkWatch.pushes_to_suspect``, plus one
in flight), the honest sites keep gossiping, and what they hold plus what the sink took
is their founding weight, 3; every inflating push is refused (WeightOverCap) and no
honest weight passes the cap. Rates are printed as ratios of the rate before the
insider joined (run with ``-s`` for the table).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from gossipd.node.protocols.sinks import SinkWatch
from gossipd.node.shared.tls import Credentials
from tests.conftest import (
    DaemonHandle,
    check_alive,
    scrape_metrics,
    status_of,
    stop_all,
    wait_until,
)
from tests.insider import ack_rate, acked
from tests.insider_weight import WeightInsider
from tests.tls_mesh import CLIENT, Pki, start_tls_mesh

IDS = ["a", "b", "c"]
INSIDER = "sink"
CONFIG = {
    "gossip": {"push_probability": 0.5},
    "membership": {"anti_entropy_interval_s": 0.5},
}
PROGRESS = 600  # acknowledged pushes, all honest sites together, per measured window
WINDOW_TIMEOUT_S = 60.0
INFLATE_WEIGHT = 1e6  # what the insider claims per push (the old per-message cap)
STATED_PUSHES = SinkWatch(6.0, 0.5).pushes_to_suspect(0.5) + 1  # defaults, plus one in flight
TOLERANCE = 1e-9


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki.create(tmp_path_factory.mktemp("pki") / "ca", [*IDS, CLIENT, INSIDER])


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[list[DaemonHandle]]:
    handles = start_tls_mesh(tmp_path_factory.mktemp("mesh"), pki, IDS, **CONFIG)
    try:
        yield handles
    finally:
        stop_all(handles)


def _mass(mesh: list[DaemonHandle]) -> tuple[float, float]:
    """(Σw less what pushes in flight reserve, Σw) over the honest sites."""
    free = held = 0.0
    for h in mesh:
        s = status_of(h)
        held += sum(s["sum_weights"])
        free += sum(s["sum_weights"]) - sum(s["reserved_weights"])
    return free, held


def _wait_accounted(mesh: list[DaemonHandle], expected: Callable[[], float]) -> tuple[float, float]:
    """The honest sites' (free, held) once ``expected()`` lies between them.

    The sites are read one after another while gossip goes on, so a push that settles
    between two reads can be counted at neither end (under load it was: 1.6e-5 short
    of 4.5e-4); a later read sees it. Weight really lost stays missing, and this fails
    after the timeout with the last reading."""
    seen: list[tuple[float, float, float]] = []

    def accounted() -> bool:
        free, held = _mass(mesh)
        seen.append((free, expected(), held))
        return free - TOLERANCE <= seen[-1][1] <= held + TOLERANCE

    wait_until(accounted, f"the honest Σw to account for the founding weight: {seen[-3:]}", 30.0)
    return seen[-1][0], seen[-1][2]


def _metric(h: DaemonHandle, name: str) -> float:
    return scrape_metrics(h.node_json()["metrics_port"]).get(name, 0.0)


def _sink(mesh: list[DaemonHandle], insider: WeightInsider, before: float, founding: float) -> None:
    """Every honest site pushes to the sink until it suspects it: each gave at most
    STATED_PUSHES, and the honest Σw accounts for all but what the sink took."""
    started = time.monotonic()
    acked_at_join = acked(mesh)
    wait_until(
        lambda: all(_metric(h, "gossipd_weight_sinks") == 1.0 for h in mesh),
        "every honest site to suspect the sink",
        120.0,
        lambda: check_alive(mesh),
    )
    # The operator reads INFO logs: each site names the sink there, whichever path (a
    # settle, a merge, a step boundary) took its score over the bound.
    named = f"peer {INSIDER} took this node's weight and gave none back"
    for h in mesh:
        wait_until(lambda h=h: named in h.log(), f"{h.node_id} to log the sink", 30.0)
    during = (acked(mesh) - acked_at_join) / (time.monotonic() - started)
    after = ack_rate(mesh, PROGRESS, "after the sink was suspected", WINDOW_TIMEOUT_S)
    taken = dict(insider.pushes_taken)
    assert set(taken) <= set(IDS)
    assert max(taken.values()) <= STATED_PUSHES, taken
    free, held = _wait_accounted(mesh, lambda: founding - sum(insider.weight_taken.values()))
    assert free > 0
    print(
        f"\nweight sink: before {before:.1f}/s, during {during / before:.2f}x, after "
        f"{after / before:.2f}x; pushes taken per site {taken} (stated at most "
        f"{STATED_PUSHES}); honest Σw in [{free:.4f}, {held:.4f}] of {founding:g}"
    )


def _inflate(
    mesh: list[DaemonHandle], insider: WeightInsider, before: float, founding: float
) -> None:
    """Pushes of INFLATE_WEIGHT while the mesh gossips: each refused on the weight it would
    leave, no site over its cap, and the honest Σw still accounted for."""
    outcomes: list[grpc.StatusCode] = []
    stop = threading.Event()

    def inflate() -> None:
        while not stop.is_set() and len(outcomes) < 600:
            for h in mesh:
                outcome = insider.push(h.address, weight=INFLATE_WEIGHT)
                outcomes.append(outcome.code)
                assert "WeightOverCap" in outcome.details or "max_sum_weight" in outcome.details

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
        cap = _metric(h, "gossipd_sum_weight_cap")
        assert cap == 8.0  # twice the 4 members it has seen, itself and the insider included
        assert max(status_of(h)["sum_weights"]) <= cap
        assert status_of(h)["rejected"]["WeightOverCap"] >= 1
    free2, held2 = _wait_accounted(mesh, lambda: founding - sum(insider.weight_taken.values()))
    print(
        f"weight inflation: before {before:.1f}/s, during {inflating / before:.2f}x, after "
        f"{after_inflation / before:.2f}x; {len(outcomes)} pushes of {INFLATE_WEIGHT:g} all "
        f"refused; honest Σw in [{free2:.4f}, {held2:.4f}] of {founding:g}"
    )


def test_one_insider_sinking_and_inflating_weight_takes_at_most_the_stated_amount(
    mesh: list[DaemonHandle], pki: Pki
) -> None:
    segments = len(status_of(mesh[0])["sum_weights"])
    founding = 3.0 * segments  # Σ over segments of the founding weights
    before = ack_rate(mesh, PROGRESS, "before the insider joined", WINDOW_TIMEOUT_S)
    tls = Credentials(ca=pki.ca, cert=pki.pem(INSIDER), key=pki.key(INSIDER))
    with WeightInsider(INSIDER, tls) as insider:
        for h in mesh:
            insider.introduce_to(h.address)
        # -- the sink: every honest site pushes to it until it suspects it --------------
        _sink(mesh, insider, before, founding)
        # -- inflation: pushes of 1e6, each refused on the weight it would leave ---------
        _inflate(mesh, insider, before, founding)
