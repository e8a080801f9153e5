"""When a site evaluates (``EvaluationCadence``): on the plain cadence, at outer steps once
they come, and on the cadence again when they stop."""

from __future__ import annotations

from gossipd.node.trainer.trainer_loop import EvaluationCadence


def evaluations(every: int, outer_at: set[int], steps: int) -> list[int]:
    """The steps a cadence evaluates at, given the steps an outer step was taken at."""
    cadence, outer, out = EvaluationCadence(every), 0, []
    for step in range(1, steps + 1):
        outer += step in outer_at
        if cadence.due(step, outer):
            out.append(step)
    return out


def test_without_outer_steps_every_multiple() -> None:
    assert evaluations(100, set(), 350) == [100, 200, 300]
    assert evaluations(0, set(), 350) == []


def test_at_the_first_outer_step_at_or_past_each_multiple() -> None:
    # outer steps every 30 steps from step 10: 10, 40, ..., 100, 130, ..., 190, 220, ...
    outer_at = set(range(10, 400, 30))
    assert evaluations(100, outer_at, 400) == [100, 220, 310]


def test_when_outer_steps_stop_the_plain_cadence_takes_over_after_a_whole_period() -> None:
    # A site whose bursts stay partial from step 150 on (a sink among its in-neighbours):
    # its last outer step was at 130, 30 steps after the one before, after the evaluation
    # at 100; none comes at or past 200, and at 300, more than a whole period since the
    # last, it evaluates its own model, and at every multiple after.
    outer_at = {10, 40, 70, 100, 130}
    assert evaluations(100, outer_at, 500) == [100, 300, 400, 500]


def test_outer_steps_that_come_back_are_waited_for_again() -> None:
    # 90 steps apart, then none for 180 (at 280) and more: on the cadence at 300 and 400;
    # back at 410 and 440 (30 apart), so 500 waits for the next, which does not come by 600
    outer_at = {10, 100, 410, 440}
    assert evaluations(100, outer_at, 600) == [100, 300, 400, 600]


def test_outer_steps_further_apart_than_the_cadence_are_still_waited_for() -> None:
    # DiLoCo over gossip at H = 200 with evaluations every 100 steps: the site's own inner
    # model in between is not what the mesh trains, and is not evaluated.
    outer_at = {200, 400, 600, 800}
    assert evaluations(100, outer_at, 850) == [100, 200, 400, 600, 800]


def test_outer_steps_run_until_twice_the_last_gap_or_a_whole_period_passes() -> None:
    """What the last evaluation asks: while they run, it is of the shared model of the last
    outer step (the site's own model is up to a period of inner steps past it)."""
    cadence = EvaluationCadence(100)
    assert not cadence.outer_running(50)  # none yet
    for step, outer in ((10, 1), (40, 2), (70, 3)):  # 30 apart
        cadence.due(step, outer)
    assert cadence.outer_running(170)  # a whole period since the last
    assert not cadence.outer_running(171)
    uncadenced = EvaluationCadence(0)  # no evaluation cadence: twice the gap alone
    for step, outer in ((10, 1), (40, 2)):
        uncadenced.due(step, outer)
    assert uncadenced.outer_running(100) and not uncadenced.outer_running(101)
