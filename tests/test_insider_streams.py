"""An insider (a 4th member with its own certificate and TLS server) against a 3-site mesh:
slot exhaustion and value poisoning.

Observed on a live mesh: 160 stalled push streams from the insider, or 140 streams
trickling one byte every 8 s (never ended by ``limits.stream_idle_timeout_s``), took
the honest sites' acknowledged pushes to 1% of their baseline for as long as the
attack lasted; one push of finite 1e30 values at weight 1 left every honest model at
mean 2.6e29 within seconds. An insider holding its 16 slots per site and reopening every
refused stream at once (about 900 a second per site) held honest pushes for their CPU
budget and took them to 0.05-0.08 of their rate; about 9,100 of 13,400 of those refusals
on Exchange streams reached it as grpc's INTERNAL instead of the daemon's status.

Each attack is measured by progress: the honest sites' acknowledged pushes must grow
by ``PROGRESS`` before, during and after it (each wait bounded), and the rates of
those windows are printed as ratios of the rate before (run with ``-s`` for the
table). The last test stops the sites one at a time and checks that the honest sites'
sum of weights is exactly 3 after every attack.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from gossipd.node.errors import (
    ConfigError,
    PayloadOutOfBounds,
    PushTooSlow,
    TooManyOpens,
    TooManyStreams,
)
from gossipd.node.jobs.registry import JobSpec, build_job
from gossipd.node.model.payload_bound import PayloadBound
from gossipd.node.net.limits.admission import IdleBounded, PeerSlots
from gossipd.node.net.limits.open_budget import OpenBudget
from gossipd.node.shared.tls import Credentials
from gossipd.node.trainer.messages import InboundPush, ReceivedSegment
from gossipd.node.trainer.replica import Replica
from gossipd.node.trainer.report import StepReport
from tests.conftest import (
    DaemonHandle,
    check_alive,
    scrape_metrics,
    status_of,
    stop_in_turn,
    wait_until,
)
from tests.insider import ack_rate
from tests.insider_streams import Insider
from tests.tls_mesh import Pki, insider_mesh_fixtures

IDS = ["a", "b", "c"]
INSIDER = "mallory"
# Back-offs stop doubling at 2 s, so the insider is out of its back-off soon after each
# attack and the next test meets it as a member in good standing. Gossip's CPU budget is
# on, as on a real site (the refusals an attack costs were once charged to it and held
# every honest push); at the default 0.03 a window of PROGRESS pushes takes half a minute.
MAX_BACKOFF_S = 2.0
CONFIG = {
    "gossip": {"push_probability": 0.5, "progress_timeout_s": 2.0, "cpu_share": 0.1},
    "membership": {"anti_entropy_interval_s": 0.5},
    "limits": {"max_open_backoff_s": MAX_BACKOFF_S},
}
# Acknowledged pushes, all honest sites together, per window: about 1.5 s of the mesh's
# rate on an idle machine, so at the observed 1% a window would need minutes.
PROGRESS = 600  # acknowledged pushes per window (1500 made the stalled case 92 s)
WINDOW_TIMEOUT_S = 60.0
STALLED = 160  # streams per honest site, as observed
TRICKLING = 140
TRICKLE_EVERY_S = 8.0
SLOTS = 16  # limits.max_inbound_pushes_per_peer: what the insider may hold of each site
FLOOD_TASKS = 8  # streams per site reopened the moment each ends, half of them Exchange
FLOOD_PROGRESS = 400  # a shorter window: three of them are most of the test's time
TOLERANCE = 1e-9
ROWS: dict[str, str] = {}


pki, mesh = insider_mesh_fixtures(IDS, INSIDER, CONFIG)


@pytest.fixture(scope="module")
def insider(pki: Pki, mesh: list[DaemonHandle]) -> Iterator[Insider]:
    """The 4th member: introduced to every honest site, which dials it back and admits it."""
    tls = Credentials(ca=pki.ca, cert=pki.pem(INSIDER), key=pki.key(INSIDER))
    with Insider(INSIDER, tls) as member:
        member.join(mesh)
        yield member


def _live_mass(mesh: list[DaemonHandle]) -> tuple[float, float]:
    """Σ sum-weights less the weight reserved by pushes in flight, and Σ sum-weights: the
    mass (3) lies between them while pushes are in flight, and equals both once none is."""
    free = held = 0.0
    for h in mesh:
        s = status_of(h)
        held += sum(s["sum_weights"])
        free += sum(s["sum_weights"]) - sum(s["reserved_weights"])
    return free, held


def _rejected(mesh: list[DaemonHandle], reason: str) -> list[int]:
    return [status_of(h)["rejected"].get(reason, 0) for h in mesh]


def _in_backoff(h: DaemonHandle) -> float:
    return scrape_metrics(h.node_json()["metrics_port"])["gossipd_peers_in_open_backoff"]


def _row(name: str, before: float, during: float, after: float, mesh: list[DaemonHandle]) -> None:
    ROWS[name] = (
        f"{name}: before {before:.1f}/s, during {during / before:.2f}x, after "
        f"{after / before:.2f}x, live Σw in [%.4f, %.4f]" % _live_mass(mesh)
    )
    print(ROWS[name])


@pytest.mark.parametrize(
    ("name", "streams", "every_s"),
    [("stalled", STALLED, None), ("trickling", TRICKLING, TRICKLE_EVERY_S)],
)
def test_one_insider_holding_push_streams_never_stops_the_honest_sites_gossip(
    mesh: list[DaemonHandle], insider: Insider, name: str, streams: int, every_s: float | None
) -> None:
    """Observation: 160 stalled (or 140 trickling) streams from one member took the honest
    sites to 1% of their acknowledged pushes. The insider now holds at most its own share
    of the slots and the honest pushes go on during the attack and after it."""
    check_alive(mesh)
    before = ack_rate(mesh, PROGRESS, "before the attack", WINDOW_TIMEOUT_S)
    refused_before = insider.ended["RESOURCE_EXHAUSTED"]
    insider.start_attack([h.address for h in mesh], streams, every_s)
    try:
        # The attack is in place once every site has turned streams away.
        wait_until(
            lambda: insider.ended["RESOURCE_EXHAUSTED"] - refused_before >= len(mesh),
            "the honest sites to refuse some of the insider's streams",
            60.0,
            lambda: check_alive(mesh),
        )
        during = ack_rate(mesh, PROGRESS, "during the attack", WINDOW_TIMEOUT_S)
    finally:
        insider.stop_attack()
    after = ack_rate(mesh, PROGRESS, "after the attack", WINDOW_TIMEOUT_S)
    _row(name, before, during, after, mesh)
    check_alive(mesh)


def test_an_insider_reopening_refused_streams_at_once_is_refused_for_a_back_off_not_the_mesh(
    mesh: list[DaemonHandle], insider: Insider
) -> None:
    """Observation: holding its 16 slots per site and reopening every refused stream at
    once, the insider made each site refuse 900 streams a second; honest pushes fell to
    0.05-0.08 of their rate and most refusals reached it as INTERNAL. Now its opens are
    budgeted (TooManyOpens, each answered after a wait): honest pushes keep at least half
    their rate during the attack and after it, and every refusal it hears is the daemon's
    own status."""
    check_alive(mesh)
    addresses = [h.address for h in mesh]
    before = ack_rate(mesh, FLOOD_PROGRESS, "before the flood", WINDOW_TIMEOUT_S)
    refused_before, ended_before = _rejected(mesh, "TooManyOpens"), insider.ended.copy()
    heard_before = insider.opens_refused
    insider.start_attack(addresses, SLOTS)
    insider.start_flood(addresses, FLOOD_TASKS)
    try:
        wait_until(
            lambda: all(
                n > b for n, b in zip(_rejected(mesh, "TooManyOpens"), refused_before, strict=True)
            ),
            "every honest site to refuse the insider's opens for its budget",
            60.0,
            lambda: check_alive(mesh),
        )
        during = ack_rate(mesh, FLOOD_PROGRESS, "during the flood", WINDOW_TIMEOUT_S)
    finally:
        insider.stop_attack()
    after = ack_rate(mesh, FLOOD_PROGRESS, "after the flood", WINDOW_TIMEOUT_S)
    _row("reopen flood", before, during, after, mesh)
    ended = insider.ended - ended_before
    refused = [n - b for n, b in zip(_rejected(mesh, "TooManyOpens"), refused_before, strict=True)]
    print(f"reopen flood: {dict(ended)} ended, TooManyOpens per site {refused}")
    wait_until(  # the next tests meet it as a member in good standing
        lambda: all(_in_backoff(h) == 0 for h in mesh),
        "the insider's back-off to end on every site",
        4 * MAX_BACKOFF_S + 10.0,
    )
    assert ended["INTERNAL"] == ended["UNKNOWN"] == 0, ended
    assert ended["RESOURCE_EXHAUSTED"] >= insider.opens_refused - heard_before > 0, ended
    # Windows side by side on shared cores vary by a quarter with no attack at all (after
    # the trickle: 0.75 to 2.1 of before); the attack used to take them to 0.05.
    assert during >= 0.5 * before, (before, during)
    assert after >= 0.5 * before, (before, after)


def test_values_far_from_the_receivers_model_are_refused_and_spread_nowhere(
    mesh: list[DaemonHandle], insider: Insider
) -> None:
    """Observation: one push of finite 1e30 values at weight 1 left every honest model at
    mean 2.6e29. Refused as out of bounds (the sender keeps its weight); the honest
    models stay small and finite while the mesh goes on gossiping."""
    numel = insider.numel
    before = ack_rate(mesh, PROGRESS, "before the poisoned pushes", WINDOW_TIMEOUT_S)
    outcomes = [
        insider.push(h.address, weight=w, values=torch.full((numel,), 1e30))
        for h in mesh
        for w in (1.0, 1e-3)
    ]
    during = ack_rate(mesh, PROGRESS, "after the poisoned pushes", WINDOW_TIMEOUT_S)
    largest = max(float(seg.abs().max()) for h in mesh for seg in insider.pull(h.address))
    _row("poison 1e30", before, during, during, mesh)
    assert not any(o.merged for o in outcomes), outcomes
    assert largest < 10.0, f"an honest model holds {largest:g} after the poisoned pushes"
    refused = [status_of(h)["rejected"] for h in mesh]
    assert all(r.get("PayloadOutOfBounds", 0) >= 2 for r in refused), (refused, outcomes)


def test_sum_of_honest_weights_is_exact_after_every_attack(
    tmp_path: Path, mesh: list[DaemonHandle], insider: Insider
) -> None:
    """Last in the module: stop the honest sites one at a time (each hands its weight on)
    and add up their final weights, per segment."""
    weights = stop_in_turn(mesh)
    totals = [sum(w[s] for w in weights) for s in range(len(weights[0]))]
    print("insider table:", *ROWS.values(), f"Σw at the end {totals}", sep="\n  ")
    assert all(abs(t - len(IDS)) <= TOLERANCE for t in totals), totals


# -- the same defences in one process (real torch, real asyncio; no daemon) -----------------


def _replica(bound: PayloadBound) -> Replica:
    job = build_job(JobSpec("synthetic", seed=3, learning_rate=0.0))
    options = {"options": {"push_probability": 0.0}, "max_weight": 100.0}
    return Replica("r", job.model, segment_bytes=4 << 20, settings=options, bound=bound)


def _deliver(replica: Replica, sequence: int, weight: float, values: torch.Tensor) -> StepReport:
    item = InboundPush("s", 1, sequence, [ReceivedSegment(0, weight, values)])
    replica.inbox.put(item)
    report = replica.idle(0)
    assert item.reply.done()
    return report


def test_a_payload_out_of_bounds_leaves_model_and_weight_as_they_were() -> None:
    """Refused whole before anything merges; the sender's next, honest push still merges."""
    replica = _replica(PayloadBound())
    before = replica.flat.buffers[0].clone()
    far = torch.full_like(before, 1e30)
    item = InboundPush("s", 1, 1, [ReceivedSegment(0, 1.0, far)])
    replica.inbox.put(item)
    replica.idle(0)
    with pytest.raises(PayloadOutOfBounds, match=r"limits\.max_payload_distance = 100"):
        item.reply.result(timeout=5.0)
    assert torch.equal(replica.flat.buffers[0], before)
    assert replica.summary.weights == (1.0,)
    report = _deliver(replica, 2, 0.25, before + 0.5)
    assert [m.merged_segments for m in report.merged] == [(0,)]
    assert torch.allclose(replica.flat.buffers[0], before + 0.2 * 0.5)
    assert replica.summary.weights == (1.25,)


def test_the_robust_merge_pulls_a_far_segment_in_and_keeps_its_weight() -> None:
    """``merge_clip = 2``: a payload 50 scales away (inside the bound) is merged as if it
    were 2 scales away along the same line, at its full weight; a near one is untouched."""
    replica = _replica(PayloadBound(clip=2.0))
    own = replica.flat.buffers[0].clone()
    scale = max(float(own.norm()) / own.numel() ** 0.5, 1.0)
    direction = torch.ones_like(own)  # RMS 1
    report = _deliver(replica, 1, 0.25, own + 50 * scale * direction)
    assert [m.clipped_segments for m in report.merged] == [(0,)]
    assert torch.allclose(replica.flat.buffers[0], own + 0.2 * 2 * scale * direction, atol=1e-5)
    assert replica.summary.weights == (1.25,)
    merged = replica.flat.buffers[0].clone()
    report = _deliver(replica, 2, 0.25, merged + 0.1)
    assert [m.clipped_segments for m in report.merged] == [()]
    assert replica.summary.weights == (1.5,)


def test_opens_over_the_budget_start_a_back_off_that_doubles_while_it_goes_on_and_resets() -> None:
    """A burst of 5, then 1 open a second: each overdraw refuses the peer's opens for a
    back-off that doubles (1, 2, then 4 s, the cap) while it stays over its budget, each
    refusal held at most 1 s; once its bucket is full again the next back-off is 1 s.
    Another peer keeps its own budget throughout."""
    now = [0.0]
    budget = OpenBudget(1.0, 5, 1.0, 4.0, clock=lambda: now[0])

    def opens(count: int, peer: str = "mallory") -> list[float | None]:
        """Each open's refusal hold, None where it was admitted."""
        holds: list[float | None] = []
        for _ in range(count):
            try:
                budget.admit(peer)
                holds.append(None)
            except TooManyOpens as err:
                holds.append(err.hold_s)
        return holds

    def backoff_ends(at: float) -> None:
        now[0] = at - 1e-3
        assert budget.in_backoff() == 1, f"still in its back-off just before {at} s"
        now[0] = at
        assert budget.in_backoff() == 0, f"out of it at {at} s"

    assert opens(6) == [None] * 5 + [1.0], "the burst spent, a back-off of 1 s"
    assert opens(1, "a") == [None]
    now[0] = 0.5
    assert opens(1) == [0.5], "refused until the back-off ends"
    backoff_ends(1.0)
    assert opens(2) == [None, 1.0], "one token earned, then over again: 2 s"
    backoff_ends(3.0)
    assert opens(3) == [None, None, 1.0], "two tokens earned, then over again: 4 s"
    backoff_ends(7.0)
    now[0] = 8.0  # quiet: its bucket is full again
    assert opens(6) == [None] * 5 + [1.0]
    backoff_ends(9.0)
    with pytest.raises(ConfigError, match=r"max_open_backoff_s = 0.5 is below"):
        OpenBudget(1.0, 5, 1.0, 0.5)


def test_one_peer_holds_at_most_its_own_streams_and_others_still_get_theirs() -> None:
    slots = PeerSlots(2, "inbound push streams", "limits.max_inbound_pushes_per_peer")
    first, second = slots.take("mallory"), slots.take("mallory")
    with pytest.raises(TooManyStreams, match=r"max_inbound_pushes_per_peer = 2"):
        slots.take("mallory")
    with slots.take("a"), slots.take("a"):
        assert slots.in_use == {"mallory": 2, "a": 2}
    first.release()
    first.release()  # idempotent
    slots.take("mallory").release()
    second.release()
    assert slots.in_use == {}


async def test_a_trickling_stream_is_ended_below_the_minimum_rate_and_a_fast_one_is_not() -> None:
    """Each byte comes well inside the idle timeout; the rate ends the trickle all the same."""

    async def trickle() -> AsyncIterator[bytes]:
        while True:
            await asyncio.sleep(0.05)
            yield b"\0"

    async def fast() -> AsyncIterator[bytes]:
        for _ in range(50):
            yield bytes(1024)

    def bounded(frames: AsyncIterator[bytes]) -> IdleBounded[bytes]:
        return IdleBounded(frames, 0.5, "idle", min_rate=1e4, rate_key="rate", size=len)

    got = 0
    with pytest.raises(PushTooSlow, match=r"below rate = 10000 bytes/s"):
        async for _ in bounded(trickle()):
            got += 1
    assert 3 <= got < 100
    assert [len(f) async for f in bounded(fast())] == [1024] * 50
