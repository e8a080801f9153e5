"""The scheduled-overlap core (node/protocols/overlap.py), driven by hand with events.

No I/O: each test hands the pure core the events a driver would (steps with their
times, pulls that land or fail, the coordinator's answers) and checks the actions
it returns: when each pull starts (``at_s``), at which step it merges
(``merge_at_step``), from whom, and what it asks of the coordinator. The daemon's
side of the same contract is in ``tests/test_overlap_daemon.py``; many periods in closed
loops (waits, consensus) in ``tests/test_overlap_loops.py``.
"""

from __future__ import annotations

import math
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossipd.node.protocols.base import (
    Action,
    AskPeer,
    Merge,
    PeerGranted,
    Pull,
    PullArrived,
    PullFailed,
    PullMerged,
    Refused,
    ReportTransfer,
    StartTimer,
    StepEnded,
    TimerFired,
    ViewChanged,
)
from gossipd.node.protocols.overlap import Mode, OverlapGossip
from gossipd.node.protocols.overlap import OverlapSettings as Settings
from gossipd.node.protocols.settings import CoreSettings

SEGMENTS = 3
STEP_S = 0.5  # the driver's clock advances this much per step unless a test says otherwise


def make_core(
    node: str = "a",
    view: tuple[str, ...] = ("a", "b"),
    *,
    period_steps: int = 4,
    mode: Mode = "scheduled",
    coordinator: bool = False,
) -> OverlapGossip:
    core = OverlapGossip(
        CoreSettings(node, SEGMENTS, coordinator=coordinator),
        Settings(period_steps=period_steps, mode=mode),
    )
    core.handle(ViewChanged(frozenset(view)))
    return core


def pulls(actions: list[Action]) -> list[Pull]:
    return [a for a in actions if isinstance(a, Pull)]


def only_pull(actions: list[Action]) -> Pull:
    [pull] = pulls(actions)
    return pull


def arrival(pull: Pull, transfer_s: float = 0.1, segments: int = SEGMENTS) -> PullArrived:
    return PullArrived(pull.peer, pull.round, dict.fromkeys(range(segments), 0.0), 64, transfer_s)


def land(core: OverlapGossip, pull: Pull, transfer_s: float = 0.1) -> list[Action]:
    """The driver merges ``pull`` at its boundary: the question, then the commit."""
    merged = arrival(pull, transfer_s)
    assert core.handle(merged) == [Merge(s, 0.5, 0.0) for s in range(SEGMENTS)]
    return core.handle(PullMerged(merged))


# -- when a pull starts and where it merges ------------------------------------------------
@pytest.mark.parametrize(
    ("transfer_s", "expected_at_s"),
    [(0.3, 4.0 - 0.3), (3.0, 2.0)],
    ids=["end minus c_ij", "now: c_ij longer than the period"],
)
def test_scheduled_mode_starts_the_pull_at_the_predicted_end_minus_c_ij(
    transfer_s: float, expected_at_s: float
) -> None:
    core = make_core()
    # Step 1 has no step time yet and the pair no estimate: the first pull starts at once.
    first = only_pull(core.handle(StepEnded(1, 0.5)))
    assert (first.peer, first.round, first.at_s, first.merge_at_step) == ("b", 1, 0.5, 4)
    assert first.segments == tuple(range(SEGMENTS))
    assert core.handle(StepEnded(2, 1.0)) == [] and core.handle(StepEnded(3, 1.5)) == []
    land(core, first, transfer_s)  # the pull merges at step 4's boundary: c_ab learned
    assert core.step_s == pytest.approx(STEP_S)
    # Period 2 starts at the boundary of step 4 (t = 2.0) and ends 4 steps later, at 4.0.
    second = only_pull(core.handle(StepEnded(4, 2.0)))
    assert second.peer == "b" and second.round == 2 and second.merge_at_step == 8
    assert second.at_s == pytest.approx(max(2.0, 4.0 - transfer_s)) == expected_at_s


def test_naive_mode_starts_the_pull_at_the_period_start() -> None:
    core = make_core(mode="naive")
    first = only_pull(core.handle(StepEnded(1, 0.5)))
    assert (first.at_s, first.merge_at_step) == (0.5, 4)
    for step in (2, 3):
        assert core.handle(StepEnded(step, step * STEP_S)) == []
    land(core, first, 0.3)
    second = only_pull(core.handle(StepEnded(4, 2.0)))
    assert (second.at_s, second.merge_at_step) == (2.0, 8)  # now, though c_ab is known


def test_none_mode_pulls_when_the_period_s_steps_are_done_and_merges_at_that_step() -> None:
    core = make_core(mode="none")
    for step in (1, 2, 3):
        assert core.handle(StepEnded(step, step * STEP_S)) == []
    pull = only_pull(core.handle(StepEnded(4, 2.0)))
    assert (pull.at_s, pull.merge_at_step, pull.round) == (2.0, 4, 1)
    land(core, pull, 0.3)
    for step in (5, 6, 7):
        assert core.handle(StepEnded(step, step * STEP_S)) == []
    again = only_pull(core.handle(StepEnded(8, 4.0)))
    assert (again.at_s, again.merge_at_step, again.round) == (4.0, 8, 2)


def test_a_node_alone_in_its_view_asks_for_nothing() -> None:
    core = make_core(view=("a",))
    assert all(core.handle(StepEnded(s, s * STEP_S)) == [] for s in range(1, 10))
    assert core.status().extra["pulls"]["alone"] == 0


# -- what a pull merges ----------------------------------------------------------------------
def test_every_pull_averages_and_a_pull_not_asked_for_is_refused_changing_nothing() -> None:
    core = make_core(view=("a", "b", "c"))
    pull = only_pull(core.handle(StepEnded(1, 0.5)))
    before = (core.status(), core.state_dict(), core.period)
    unasked = [
        PullArrived("c", pull.round, dict.fromkeys(range(SEGMENTS), 0.0)),  # another peer
        PullArrived(pull.peer, pull.round + 1, dict.fromkeys(range(SEGMENTS), 0.0)),  # round
        arrival(pull, segments=SEGMENTS - 1),  # a segment missing
        PullArrived(pull.peer, pull.round, dict.fromkeys(range(SEGMENTS + 1), 0.0)),  # extra
    ]
    for event in unasked:
        with pytest.raises(Refused):
            core.handle(event)
        assert (core.status(), core.state_dict(), core.period) == before
    # The pull asked for: every segment averaged half and half (x_i + x_j) / 2.
    assert core.handle(arrival(pull)) == [Merge(s, 0.5, 0.0) for s in range(SEGMENTS)]
    # A merge reported for a pull that was not asked for changes nothing either.
    assert core.handle(PullMerged(PullArrived("c", 7, {}))) == []
    assert (core.status(), core.period) == (before[0], before[2])


# -- failures, busy peers and the coordinator ------------------------------------------------
def test_a_failed_or_busy_pull_frees_the_peer_and_re_picks_within_the_period() -> None:
    core = make_core(view=("a", "b", "c"))
    first = only_pull(core.handle(StepEnded(1, 0.5)))
    assert first.peer == "b" and core.scheduler.busy() == {"b"}
    again = only_pull(core.handle(PullFailed("b", first.round, "busy")))
    # b freed (its failure reported as inf: no estimate learned), c picked, same period.
    assert again.peer == "c" and core.scheduler.busy() == {"c"}
    assert math.isinf(core.scheduler.estimate("a", "b"))
    assert (again.round, again.merge_at_step) == (first.round, first.merge_at_step)
    # Both peers failed: the period trains on without a merge (bounded by the peers).
    assert core.handle(PullFailed("c", first.round, "unreachable")) == []
    assert core.scheduler.busy() == frozenset() and core.period is None
    assert core.status().extra["pulls"] == {
        "merged": 0,
        "failed": 2,
        "repicked": 1,
        "skipped": 0,
        "coordinator": 0,
        "alone": 2,
        "fallback": 0,
    }
    # A late failure of a pull long re-picked changes nothing.
    assert core.handle(PullFailed("b", first.round, "late")) == []


def test_with_a_coordinator_a_failure_is_reported_as_inf_and_the_coordinator_asked_again() -> None:
    core = make_core(view=("a", "b", "c"), coordinator=True)
    [ask] = core.handle(StepEnded(1, 0.5))
    assert ask == AskPeer(1, 0.5)
    pull = only_pull(core.handle(PeerGranted(1, "c", 0.7)))
    assert (pull.peer, pull.at_s, pull.merge_at_step) == ("c", 0.7, 4)
    assert core.status().extra["scheduling"] == "coordinator"
    assert core.handle(PullFailed("c", 1, "busy")) == [
        ReportTransfer("c", math.inf),
        AskPeer(1, 0.5),
    ]
    pull = only_pull(core.handle(PeerGranted(1, "b", 0.8)))
    actions = land(core, pull, 0.25)
    assert actions == [ReportTransfer("b", 0.25)]
    assert core.scheduler.estimate("a", "b") == 0.25  # learned for scheduling alone later


def test_a_coordinator_error_falls_back_to_the_local_scheduler_in_the_same_period() -> None:
    core = make_core(view=("a", "b", "c"), coordinator=True)
    [ask] = core.handle(StepEnded(1, 0.5))
    pull = only_pull(core.handle(PeerGranted(ask.round, None, 0.6, "no coordinator is reachable")))
    assert (pull.peer, pull.round, pull.merge_at_step, pull.at_s) == ("b", 1, 4, 0.6)
    extra = core.status().extra
    assert extra["scheduling"] == "decentralized" and extra["pulls"]["fallback"] == 1
    assert extra["pulling_from"] == "b"


def test_no_free_peer_asks_again_by_timer_and_stale_grants_are_ignored() -> None:
    core = make_core(view=("a", "b", "c"), coordinator=True)
    [ask] = core.handle(StepEnded(1, 0.5))
    [timer] = core.handle(PeerGranted(ask.round, None, 0.6))  # none free now
    assert timer == StartTimer(0.6 + Settings().retry_s, "ask-1")
    assert core.handle(TimerFired("ask-0", 0.7)) == []  # not this period's timer
    assert core.handle(PeerGranted(0, "b", 0.7)) == []  # an older round's answer
    assert core.handle(TimerFired("ask-1", 0.7)) == [AskPeer(1, 0.7)]
    pull = only_pull(core.handle(PeerGranted(1, "b", 0.8)))
    assert core.handle(PeerGranted(1, "c", 0.9)) == []  # a second answer: ignored
    assert core.handle(TimerFired("ask-1", 1.0)) == []  # the period has its peer
    assert core.status().extra["pulling_from"] == pull.peer == "b"


def test_a_period_with_no_free_peer_is_skipped_at_its_due_step() -> None:
    core = make_core(view=("a", "b", "c"), coordinator=True)
    core.handle(StepEnded(1, 0.5))
    core.handle(PeerGranted(1, None, 0.6))
    for step in (2, 3):
        assert core.handle(StepEnded(step, step * STEP_S)) == []
    # Step 4 ends the period with nobody granted: skipped, the next period asks at once.
    assert core.handle(StepEnded(4, 2.0)) == [AskPeer(2, 4.0)]
    assert core.status().extra["pulls"]["skipped"] == 1


# -- decentralized rotation ------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(
        st.text("abcdefghij0123456789-", min_size=1, max_size=6),
        min_size=2,
        max_size=12,
        unique=True,
    ),
    period_steps=st.integers(1, 6),
)
def test_equal_nodes_alone_pull_in_a_rotation_of_derangements(
    ids: list[str], period_steps: int
) -> None:
    """N cores on the same view, equal periods, no coordinator: in every one of the
    first N − 1 periods the peers they pick form a derangement (nobody picks itself,
    no two pick the same peer, so nobody is Busy), and over them each node pulls
    every other node once."""
    view = tuple(ids)
    cores = {i: make_core(i, view, period_steps=period_steps) for i in ids}
    picked: dict[str, list[str]] = {i: [] for i in ids}
    due = {i: only_pull(c.handle(StepEnded(1, STEP_S))) for i, c in cores.items()}
    for _ in range(len(ids) - 1):
        peers = [due[i].peer for i in ids]
        assert sorted(peers) == sorted(ids) and all(p != i for i, p in zip(ids, peers, strict=True))
        for i in ids:
            picked[i].append(due[i].peer)
        boundary = due[ids[0]].merge_at_step
        assert all(p.merge_at_step == boundary for p in due.values())
        for i, core in cores.items():
            land(core, due[i])
            due[i] = only_pull(core.handle(StepEnded(boundary, boundary * STEP_S)))
    assert all(sorted(picked[i]) == sorted(set(ids) - {i}) for i in ids)


# -- learning --------------------------------------------------------------------------------
def test_the_step_time_average_and_c_ij_learn_and_the_pull_starts_later_as_c_ij_shrinks() -> None:
    core = make_core(period_steps=4)
    pull = only_pull(core.handle(StepEnded(1, 0.0)))
    starts: list[float] = []
    now = 0.0
    step = 1
    for transfer_s in (1.6, 0.8, 0.4, 0.2):  # each more than θ below the last: replaced
        while step < pull.merge_at_step - 1:
            step, now = step + 1, now + STEP_S
            core.handle(StepEnded(step, now))
        step, now = step + 1, now + STEP_S
        land(core, pull, transfer_s)
        assert core.scheduler.estimate("a", "b") == transfer_s
        pull = only_pull(core.handle(StepEnded(step, now)))
        starts.append(pull.at_s - now)  # how long after the period's start it starts
    assert starts == pytest.approx([4 * STEP_S - c for c in (1.6, 0.8, 0.4, 0.2)])
    assert starts == sorted(starts) and len(set(starts)) == 4
    # Slower steps: the average moves towards them by the smoothing weight per step.
    expected = core.step_s
    for _ in range(3):
        step, now = step + 1, now + 2.0
        core.handle(StepEnded(step, now))
        expected = 0.8 * expected + 0.2 * 2.0
    assert core.step_s == pytest.approx(expected) and STEP_S < core.step_s < 2.0


def test_a_wait_at_the_due_step_is_not_counted_as_step_time() -> None:
    core = make_core(period_steps=4)
    pull = only_pull(core.handle(StepEnded(1, 0.5)))
    for step in (2, 3):
        core.handle(StepEnded(step, step * STEP_S))
    land(core, pull, 0.3)
    later = only_pull(core.handle(StepEnded(4, 2.0 + 5.0)))  # the trainer waited 5 s
    assert core.step_s == STEP_S
    assert later.at_s == pytest.approx(7.0 + 4 * STEP_S - 0.3)


# -- state and status ------------------------------------------------------------------------
def test_state_dict_round_trips_the_estimates_and_the_step_time() -> None:
    core = make_core(view=("a", "b", "c"))
    pull = only_pull(core.handle(StepEnded(1, 0.0)))
    for step in (2, 3):
        core.handle(StepEnded(step, (step - 1) * 0.25))
    land(core, pull, 0.3)
    state = pickle.loads(pickle.dumps(core.state_dict()))
    restored = make_core(view=("a", "b", "c"))
    restored.load_state_dict(state)
    assert restored.state_dict() == core.state_dict()
    assert restored.round == 1 and restored.step_s == core.step_s == pytest.approx(0.25)
    assert restored.scheduler.estimate("b", "a") == 0.3
    # The restored node schedules with what it learned: its first pull from b starts at
    # end − c_ab, where end = now + (due − step)·step_time (a fresh node starts at once).
    resumed = only_pull(restored.handle(StepEnded(8, 100.0)))
    assert (resumed.peer, resumed.round, resumed.merge_at_step) == ("b", 2, 12)
    assert resumed.at_s == pytest.approx(100.0 + 4 * 0.25 - 0.3)
    with pytest.raises(ValueError, match="holds protocol 'sumweight', not overlap"):
        restored.load_state_dict({"protocol": "sumweight"})


def test_status_shows_the_mode_the_period_the_pulls_and_who_schedules() -> None:
    core = make_core(view=("a", "b", "c"), mode="naive", period_steps=5)
    status = core.status()
    assert status.protocol == "overlap" and status.weights == () and status.in_flight == 0
    assert status.peers == {"b", "c"}
    assert status.extra == {
        "mode": "naive",
        "period_steps": 5,
        "step_time_s": None,
        "pulls": dict.fromkeys(
            ("merged", "failed", "repicked", "skipped", "coordinator", "alone", "fallback"), 0
        ),
        "pulling_from": None,
        "scheduling": "decentralized",
    }
    pull = only_pull(core.handle(StepEnded(1, 0.0)))
    core.handle(StepEnded(2, 0.5))
    status = core.status()
    assert status.round == 1 and status.in_flight == 1
    assert status.extra["pulling_from"] == pull.peer and status.extra["step_time_s"] == 0.5
    land(core, pull)
    assert core.status().in_flight == 0 and core.status().extra["pulls"]["merged"] == 1
