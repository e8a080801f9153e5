"""An insider tops every honest site up to just under the weight cap, against ``persyn``
with DiLoCo's outer step (issue 55; tests/test_insider_cap.py is the same attack on
sum-weight).

Why again for ``persyn``: its bursts push half of a site's weight at fixed sub-rounds,
so a site at the cap whose merges were refused would leave every burst that pushes to
it partial, and with them the outer steps of the sites it feeds; a cut that merges what
fits keeps the bursts whole. The credit is off (``limits.peer_credit`` 1e9), as an
operator who trusts the members would set it, so the cap is all that bounds the
insider; it refuses every push made to it, so the honest sites keep what it brought
among themselves.

Measured by progress, as the sum-weight test is: acknowledged pushes over windows of
``PROGRESS`` before the insider joined, once it had joined, while it tops sites up and
after, each held to the floors of ``tests/insider_persyn.py`` (half the pushes per site
step, a tenth per second) of the window once it had joined (a member that refuses
every push costs the pushes sent to it, about a quarter here). The sites that took outer
steps once it had joined must go on taking them while it tops them up. The honest sites'
sum of weights plus what the cap cut must be their founding weight plus what the insider
brought (to 1e-9, bracketed by the pushes in flight). The top-ups carry zeros, as on
sum-weight; how far they moved the honest models is printed (run with ``-s -o
addopts=""``).
"""

from __future__ import annotations

import math
import threading
import time

import grpc
import torch

from gossipd.node.shared.tls import Credentials
from tests.conftest import DaemonHandle, check_alive, status_of, wait_until
from tests.insider_persyn import OPTIONS, Window, check_attack, honest_window, rms
from tests.insider_weight import WeightInsider, metric, wait_accounted
from tests.tls_mesh import Pki, insider_mesh_fixtures

IDS = ["a", "b", "c"]
INSIDER = "inflater"
CONFIG = {
    "gossip": {"protocol": "persyn", "persyn": OPTIONS, "cpu_share": 0.1},
    "membership": {"anti_entropy_interval_s": 0.5},
    "limits": {"peer_credit": 1e9},  # the credit out of the way: the cap is all there is
}
CAP = 8.0  # twice the 4 members each honest site has seen, itself and the insider included
PROGRESS = 100  # acknowledged pushes, all honest sites together, per measured window
WINDOW_TIMEOUT_S = 60.0
MOST_TOP_UPS = 2000


pki, mesh = insider_mesh_fixtures(IDS, INSIDER, CONFIG)


def _window(mesh: list[DaemonHandle], what: str) -> Window:
    return honest_window(mesh, PROGRESS, what, WINDOW_TIMEOUT_S)


def _top_up(
    insider: WeightInsider, mesh: list[DaemonHandle], stop: threading.Event
) -> list[tuple[grpc.StatusCode, float]]:
    """To each site in turn, a push of what lifts its segment 0 to just under the cap, as
    its last status says (it may have merged since), until ``stop``; (code, weight) each."""
    outcomes: list[tuple[grpc.StatusCode, float]] = []
    while not stop.is_set() and len(outcomes) < MOST_TOP_UPS:
        for h in mesh:
            weight = CAP - status_of(h)["sum_weights"][0] - 1e-3
            if weight > 0:
                outcomes.append((insider.push(h.address, weight=weight).code, weight))
    return outcomes


def test_top_ups_to_just_under_the_cap_keep_bursts_and_outer_steps_going(
    mesh: list[DaemonHandle], pki: Pki
) -> None:
    founding = 3.0 * len(status_of(mesh[0])["sum_weights"])
    before = _window(mesh, "before the insider joined")
    tls = Credentials(ca=pki.ca, cert=pki.pem(INSIDER), key=pki.key(INSIDER))
    with WeightInsider(INSIDER, tls, sink=False, protocol="persyn") as insider:
        for h in mesh:
            insider.introduce_to(h.address)
        wait_until(
            lambda: all(metric(h, "gossipd_sum_weight_cap") == CAP for h in mesh),
            "every honest site to count the insider in its view (the cap: twice 4 members)",
            30.0,
        )
        joined = _window(mesh, "once the insider joined")
        start = [torch.cat(insider.pull(h.address)) for h in mesh]
        stop = threading.Event()
        result: list[tuple[grpc.StatusCode, float]] = []
        attacker = threading.Thread(target=lambda: result.extend(_top_up(insider, mesh, stop)))
        attacker.start()
        try:
            during = _window(mesh, "while the insider tops sites up")
        finally:
            stop.set()
            attacker.join(60.0)
        assert not attacker.is_alive()
        stopped = time.monotonic()
        after = _window(mesh, "after the top-ups")
        ended_s = time.monotonic() - stopped
        check_alive(mesh)
        ends = [torch.cat(insider.pull(h.address)) for h in mesh]
        moved = [rms(x - x0) for x, x0 in zip(ends, start, strict=True)]
        codes = {code for code, _ in result}
        brought = sum(w for code, w in result if code == grpc.StatusCode.OK)
        cut = sum(status_of(h)["weight_cut"] for h in mesh)
        free, held = wait_accounted(mesh, lambda: founding + brought)
        print(
            f"top-ups under the cap: {len(result)} merged, {brought:.1f} weight brought, "
            f"{cut:.1f} cut; before the insider joined {before.rate:.1f}/s, once it had "
            f"{joined.rate / before.rate:.2f}x; honest Σw + cut in [{free:.6f}, {held:.6f}]; "
            f"models moved {[round(m, 3) for m in moved]} RMS (zeros pushed)"
        )
        assert len(result) >= 10
        assert codes == {grpc.StatusCode.OK}, result  # under the cap: all merged
        assert cut > 0  # the sites met the cap: what fit was merged, not refused
        for h in mesh:
            s = status_of(h)
            assert max(s["sum_weights"]) <= CAP
            assert s["rejected"].get("WeightOverCap", 0) == 0
        assert all(math.isfinite(m) for m in moved), moved
        check_attack("top-ups under the cap", joined, during, after, ended_s)
