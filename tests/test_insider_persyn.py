"""The insider attacks of issue 32, run against ``persyn`` with DiLoCo's outer step (issue 55):
stalled and trickling push streams, a push of 1e30, a push of values inside the sanity
bound but far from the honest models, and a weight sink, one after another against one
3-site TLS mesh with a 4th member that misbehaves (``tests/insider_persyn.py``); the
top-ups under the cap need the credit off, and their own mesh
(``tests/test_insider_persyn_cap.py``).

Why again for ``persyn``: its pushes come only in bursts (two sub-rounds every K′ = 8
steps here), each must merge within a few steps for the burst to be whole, and only a
whole burst takes an outer step, so an attack that merely delays pushes can stop the
outer optimizer while sum-weight gossip would hardly notice. And the outer step is a
Nesterov step on the burst's average: whatever an insider's push moves an average by,
the momentum carries further on later outer steps (in all up to ``lr / (1 − momentum)``
times the move, 7 here; measured 1-4.5 times the merges' own moves), so the clip radius
that bounds one merge under sum-weight does not bound where a model ends up. The
in-bound test holds the honest models to seven radii instead, which still separates the
clip from no clip (+50 merged unclipped moves the average some 45 radii at once).

The insider is a member of the butterfly (ranks a, b, c, mallory): honest sites push to
it in some sub-rounds and it refuses them, and it never pushes, so in every burst one or
two sites miss a sub-round's push. Site b, two ranks after it, misses one in every burst
and takes no outer step at all while it is a member; a and c take theirs on the bursts
of the other direction. That is the state "before" each attack (the insider joins first),
and each attack must leave it so: the sites that took outer steps before go on taking
them during the attack.

Each attack is measured by progress: the pushes the honest sites acknowledged among
themselves must grow by ``PROGRESS`` before, during and after it (each wait bounded, no
sleep). The issue's goal is half the rate before during an attack and 0.9 of it within
5 s after. Per second, that held at a moderate load but not beside heavier work (two
windows in a row with no attack differed 2.4 times), so each window is held to half the
pushes per honest site step it had before (bursts come every K′ steps: a machine slowed
by other work slows both) and to a tenth of the pushes per second, which still fails an
attack that stops gossip (stalled streams took sum-weight to 0.01);
``tests/insider_persyn.py`` has both floors and what they stand on. The rates, per
second and per step, and when the window after ended (it starts as the attack ends) are
printed: run with ``-s -o addopts=""`` for the table. The last test stops the sites one
at a time and checks that their final sum of weights is exactly the founding weight
plus what the insider's pushes brought less what it sank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest
import torch

from gossipd.node.model.payload_bound import RADIUS_FLOOR
from gossipd.node.protocols.credit import HALF_PUSH_CREDIT
from gossipd.node.shared.config import LimitsConfig
from tests.conftest import DaemonHandle, check_alive, status_of, stop_in_turn, wait_until
from tests.insider_persyn import (
    OPTIONS,
    PersynInsider,
    Window,
    check_attack,
    honest_window,
    models,
    rms,
)
from tests.insider_weight import wait_accounted, wait_named
from tests.tls_mesh import Pki, insider_mesh_fixtures

IDS = ["a", "b", "c"]
INSIDER = "mallory"  # rank 3 of 4: every honest site pushes to it in some sub-round
# What outer steps make of one move of an average, in all: the Nesterov step's gain.
OUTER_GAIN = OPTIONS["outer_learning_rate"] / (1 - OPTIONS["outer_momentum"])
MAX_BACKOFF_S = 2.0  # as tests/test_insider_streams.py: out of its back-off soon after
CONFIG = {
    "gossip": {
        "protocol": "persyn",
        "persyn": OPTIONS,
        "progress_timeout_s": 2.0,
        "cpu_share": 0.1,  # on, as on a real site: a held push leaves its burst partial too
    },
    "membership": {"anti_entropy_interval_s": 0.5},
    "limits": {"max_open_backoff_s": MAX_BACKOFF_S},
}
PROGRESS = 100  # acknowledged honest pushes per window: about 2.2 s on an idle machine
WINDOW_TIMEOUT_S = 60.0
STALLED, TRICKLING, TRICKLE_EVERY_S = 160, 140, 8.0  # as observed against sum-weight
CLIP_FACTOR = LimitsConfig().clip_factor
IN_BOUND = 50.0  # the in-bound push: the honest model plus this (the sanity bound is 100)
IN_BOUND_WEIGHT = 0.1
SCALE_FLOOR = LimitsConfig().payload_scale_floor  # a segment's scale: max(its RMS, this)
# The poisoned pushes may not grow the honest models' largest value more than this many
# times (or past it, from under 1): merged, 1e30 at weight 1e-3 would make it about 1e27.
# Relative: with training off, the outer steps left the sites' common model anywhere from
# RMS 0.05 to 8.5 in 15 runs, from starting models of RMS 0.09 whose mean is 0.046 (plain
# persyn keeps that mean), so no fixed bound fits every run.
GROWTH = 10.0
TOLERANCE = 1e-9
ROWS: dict[str, str] = {}
BROUGHT = dict.fromkeys(IDS, 0.0)  # weight the insider's pushes merged, by honest site


pki, mesh = insider_mesh_fixtures(IDS, INSIDER, CONFIG)


@pytest.fixture(scope="module")
def insider(pki: Pki, mesh: list[DaemonHandle]) -> Iterator[PersynInsider]:
    """The 4th member, introduced to every honest site, which dials it back and admits it."""
    with PersynInsider(INSIDER, pki.creds(INSIDER)) as member:
        member.join(mesh)
        yield member


def _window(mesh: list[DaemonHandle], insider: PersynInsider, what: str) -> Window:
    return honest_window(mesh, PROGRESS, what, WINDOW_TIMEOUT_S, lambda: insider.sunk)


@pytest.mark.parametrize(
    ("name", "streams", "every_s"),
    [("stalled", STALLED, None), ("trickling", TRICKLING, TRICKLE_EVERY_S)],
)
def test_an_insider_holding_push_streams_never_stops_bursts_or_outer_steps(
    mesh: list[DaemonHandle],
    insider: PersynInsider,
    name: str,
    streams: int,
    every_s: float | None,
) -> None:
    """Stalled (or trickling) streams took sum-weight to 1% of its pushes; under persyn a
    held slot that delays one sub-round's push leaves the burst partial, with no outer
    step."""
    check_alive(mesh)
    before = _window(mesh, insider, "before the attack")
    refused_before = insider.ended["RESOURCE_EXHAUSTED"]
    insider.start_attack([h.address for h in mesh], streams, every_s)
    try:
        wait_until(
            lambda: insider.ended["RESOURCE_EXHAUSTED"] - refused_before >= len(mesh),
            "the honest sites to refuse some of the insider's streams",
            60.0,
            lambda: check_alive(mesh),
        )
        during = _window(mesh, insider, "during the attack")
    finally:
        insider.stop_attack()
    stopped = time.monotonic()
    after = _window(mesh, insider, "after the attack")
    ROWS[name] = check_attack(name, before, during, after, time.monotonic() - stopped)


def test_a_push_of_1e30_is_refused_and_no_honest_model_leaves_its_bound(
    mesh: list[DaemonHandle], insider: PersynInsider
) -> None:
    """One push of 1e30 at weight 1 left every sum-weight model at 2.6e29. Refused whole
    here too, so no outer step ever sees it: every value of every honest model stays
    finite, and their largest stays within ``GROWTH`` times what it was (at least 1),
    while the bursts go on."""
    before = _window(mesh, insider, "before the poisoned pushes")
    largest_before = max(float(x.abs().max()) for x in models(insider, mesh))
    outcomes = [
        insider.push(h.address, weight=w, values=torch.full((insider.numel,), 1e30))
        for h in mesh
        for w in (1.0, 1e-3)
    ]
    stopped = time.monotonic()
    after = _window(mesh, insider, "after the poisoned pushes")
    ended_s = time.monotonic() - stopped
    largest = max(float(x.abs().max()) for x in models(insider, mesh))
    ROWS["poison"] = check_attack("poison 1e30", before, after, after, ended_s)
    print(f"poison 1e30: largest honest value {largest_before:.4g} before, {largest:.4g} after")
    assert not any(o.merged for o in outcomes), outcomes
    bound = GROWTH * max(largest_before, 1.0)
    assert math.isfinite(largest) and largest <= bound, (largest_before, largest)
    refused = [status_of(h)["rejected"] for h in mesh]
    assert all(r.get("PayloadOutOfBounds", 0) >= 2 for r in refused), (refused, outcomes)


def test_an_in_bound_push_moves_no_honest_model_beyond_the_outer_gain_of_the_clip(
    mesh: list[DaemonHandle], insider: PersynInsider
) -> None:
    """The honest model plus 50 (inside the sanity bound of 100 scales) at a weight the
    credit admits, to each site. The clip pulls each in to its radius (limits.clip_factor
    times the honest senders' distances, at least 1% of the scale), so its merge moves
    its site by its share (under 1) of the radius, as under sum-weight; averaging spreads
    those moves and the outer steps carry a move of the average at most ``OUTER_GAIN``
    times as far, so no honest model may end a window later more than ``OUTER_GAIN``
    radii from where it stood. Merged unclipped, the three would move the average about
    50 x 0.3 / 3.3 = 4.5 scales before any outer step."""
    before = _window(mesh, insider, "before the in-bound pushes")
    start = models(insider, mesh)
    apart = max(rms(x - y) for x in start for y in start)  # converged: learning rate 0
    scale = max(max(rms(x) for x in start), SCALE_FLOOR)
    radius = CLIP_FACTOR * max(1.5 * apart, RADIUS_FLOOR * scale)
    merged = []
    for h in mesh:
        own = torch.cat(insider.pull(h.address))
        outcome = insider.push(h.address, weight=IN_BOUND_WEIGHT, values=own + IN_BOUND)
        assert outcome.merged, outcome
        BROUGHT[h.node_id] += IN_BOUND_WEIGHT
        merged.append(rms(torch.cat(insider.pull(h.address)) - own))
    stopped = time.monotonic()
    after = _window(mesh, insider, "after the in-bound pushes")
    ended_s = time.monotonic() - stopped
    moved = [rms(x - x0) for x, x0 in zip(models(insider, mesh), start, strict=True)]
    ROWS["in-bound"] = check_attack("in-bound +50", before, after, after, ended_s)
    print(
        f"in-bound +{IN_BOUND:g} at weight {IN_BOUND_WEIGHT:g}: scale {scale:.3g}, clip radius "
        f"{radius:.3g}; moved by the merges {[round(m / radius, 3) for m in merged]} radii, "
        f"by the window's end {[round(m / radius, 3) for m in moved]} (bound {OUTER_GAIN:g})"
    )
    assert max(merged) <= radius, (merged, radius)  # as under sum-weight, at its merge
    assert all(m <= OUTER_GAIN * radius for m in moved), (moved, radius)


def test_a_sink_takes_at_most_the_credit_of_each_site_and_outer_steps_go_on(
    mesh: list[DaemonHandle], insider: PersynInsider
) -> None:
    """The insider acknowledges every push and never pushes back: each site gives it at
    most ``limits.peer_credit`` (persyn's 1/2) more than it brought, names it, and the
    bursts among the honest sites go on, outer steps included."""
    founding = len(IDS) * len(status_of(mesh[0])["sum_weights"])
    before = _window(mesh, insider, "before the sink")
    insider.sinking = True
    try:
        during = _window(mesh, insider, "while the insider sinks")
        wait_named(mesh, INSIDER)
    finally:
        insider.sinking = False
    stopped = time.monotonic()
    after = _window(mesh, insider, "after the sink was named")
    ROWS["sink"] = check_attack("sink", before, during, after, time.monotonic() - stopped)
    taken = dict(insider.taken)
    print(f"sink: taken per site {taken}, its pushes brought {dict(BROUGHT)}")
    assert set(taken) == set(IDS), taken  # every honest site is one of its in-neighbours
    assert all(t <= HALF_PUSH_CREDIT + BROUGHT[s] + TOLERANCE for s, t in taken.items()), taken
    expected = founding + sum(BROUGHT.values()) - sum(insider.taken.values())
    free, held = wait_accounted(mesh, lambda: expected)
    print(f"sink: honest Σw in [{free:.6f}, {held:.6f}], expected {expected:.6f}")


def test_the_honest_sum_of_weights_is_exact_after_every_attack(
    mesh: list[DaemonHandle], insider: PersynInsider
) -> None:
    """Last in the module: stop the honest sites one at a time (each hands its weight on;
    the last one's only live peer is the insider, which refuses it) and add up their final
    weights: the founding 3, plus what the insider's pushes merged, less what it sank. The
    synthetic job has one segment, which the insider's pushes carried."""
    assert not insider.sinking
    weights = stop_in_turn(mesh)
    total = sum(w[0] for w in weights)
    expected = len(IDS) + sum(BROUGHT.values()) - sum(insider.taken.values())
    print("persyn insider table:", *ROWS.values(), f"Σw at the end {weights}", sep="\n  ")
    assert all(len(w) == 1 for w in weights), weights
    assert abs(total - expected) <= TOLERANCE, (total, expected)
