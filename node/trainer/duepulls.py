"""Pulls due at a named step's boundary, and the trainer's wait for them.

A core may ask for a pull to merge at the end of step k (``Pull.merge_at_step``):
the network starts it at its own ``at_s``, mid-step if need be, so its transfer
overlaps the steps before k. Then one of two things happens, and this ledger keeps
track of both apart from the replica's other bookkeeping:

* it lands early: its outcome is *held* and merges once step k's boundary is reached;
* it has not landed by then: the trainer *waits* for it at that boundary. The time
  it waits is what the overlap failed to hide, so it is measured here
  (:attr:`DuePulls.wait_s`, :meth:`DuePulls.wait_fraction`) for status and metrics.

It touches neither the model nor the core: the replica (``node/trainer/replica.py``) owns
one, asks it what is due and what may merge now, and does the merging and waiting
under its own locks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from gossipd.node.trainer.messages import OutboundPull, PullOutcome


class DuePulls:
    """The pulls still out that a step's boundary waits for, and those held until it.

    ``max_wait_s``: the longest the trainer waits at one boundary (the pull's own
    deadlines end it sooner; this only guards against a driver bug).
    """

    def __init__(self, clock: Callable[[], float], max_wait_s: float) -> None:
        self.clock = clock
        self.max_wait_s = max_wait_s
        self.due: dict[int, tuple[OutboundPull, int]] = {}  # id(out) -> (out, step)
        self.held: list[PullOutcome] = []  # landed early: merge at their step's boundary
        self.wait_s = 0.0  # time the trainer spent waiting for due pulls
        self.started_s: float | None = None  # the first step's end (wall time counts from it)

    def first_step_ended(self) -> None:
        """Start counting wall time (for :meth:`wait_fraction`) at the first step's end."""
        if self.started_s is None:
            self.started_s = self.clock()

    def wait_fraction(self) -> float:
        """The share of wall time since the first step ended that the trainer spent
        waiting for pulls due at its step boundaries."""
        if self.started_s is None:
            return 0.0
        wall = self.clock() - self.started_s
        return min(self.wait_s / wall, 1.0) if wall > 0 else 0.0

    def started(self, out: OutboundPull) -> None:
        """Note a pull the core started; one with a ``merge_at_step`` is waited for there."""
        if out.pull.merge_at_step is not None:
            self.due[id(out)] = (out, out.pull.merge_at_step)

    def landed(self, outcome: PullOutcome, steps: int, training_done: bool) -> bool:
        """Note that ``outcome``'s pull landed (or failed); True if it is held for a
        later step's boundary, False if it merges now."""
        self.due.pop(id(outcome.out), None)
        if not training_done and _due_step(outcome) > steps:
            self.held.append(outcome)
            return True
        return False

    def release(self, steps: int, training_done: bool) -> list[PullOutcome]:
        """The held pulls whose step's boundary is reached (all once training ended)."""
        ready = [o for o in self.held if training_done or _due_step(o) <= steps]
        if ready:
            self.held = [o for o in self.held if o not in ready]
        return ready

    def due_now(self, steps: int) -> bool:
        """Whether a pull due by the end of step ``steps`` is still out."""
        return any(step <= steps for _, step in self.due.values())

    def due_by(self, steps: int) -> list[OutboundPull]:
        """The pulls still out that are due by the end of step ``steps``."""
        return [out for out, step in self.due.values() if step <= steps]

    def give_up(self, steps: int) -> None:
        """Stop waiting for what is due by step ``steps``: it merges whenever it lands."""
        late = [k for k, (_, step) in self.due.items() if step <= steps]
        for key in late:
            del self.due[key]

    @contextlib.contextmanager
    def waiting(self) -> Iterator[float]:
        """Count the time spent inside toward :attr:`wait_s`; yields the clock time
        at which to give up (``max_wait_s`` from now)."""
        started = self.clock()
        try:
            yield started + self.max_wait_s
        finally:
            self.wait_s += self.clock() - started


def _due_step(outcome: PullOutcome) -> int:
    """The step whose boundary merges this pull (0: the next boundary)."""
    return outcome.out.pull.merge_at_step or 0
