"""gossipd.node.trainer.fairlock.FairLock: re-entrant, owner-checked, handed over in arrival order.

No sleep is used as synchronisation: threads meet on Events (every wait bounded), and where a
test must know a thread is queued it polls ``len(lock._waiters)`` in a bounded loop. The
free-running fairness test watches hand-overs through a counting stand-in for the lock's
internal guard instead of relying on where the scheduler happens to run the waiter.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from gossipd.node.trainer.fairlock import FairLock

WAIT_S = 30.0
pytestmark = pytest.mark.timeout(120)


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` until true; fail after WAIT_S. The short waits only yield the CPU."""
    pause = threading.Event()
    for _ in range(int(WAIT_S / 0.001)):
        if condition():
            return
        pause.wait(0.001)
    pytest.fail(f"timed out waiting for {what}")


def _queued(lock: FairLock, n: int) -> Callable[[], bool]:
    def check() -> bool:
        with lock._guard:
            return len(lock._waiters) == n

    return check


class _Worker(threading.Thread):
    """Runs ``body`` in a daemon thread and re-raises its exception on ``finish``."""

    def __init__(self, body: Callable[[], None], name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.body = body
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.body()
        except BaseException as err:
            self.error = err

    def finish(self) -> None:
        self.join(WAIT_S)
        assert not self.is_alive(), f"{self.name} did not finish within {WAIT_S} s"
        if self.error is not None:
            raise self.error


# ---------------------------------------------------------------------------
# ownership


def test_uncontended_acquire_release_and_context_manager() -> None:
    lock = FairLock()
    lock.acquire()
    assert lock._owner == threading.get_ident()
    lock.release()
    assert lock._owner is None
    with lock as held:
        assert held is lock
        assert lock._owner == threading.get_ident()
    assert lock._owner is None
    assert lock._depth == 0


def test_reentrant_for_the_owner() -> None:
    lock = FairLock()
    with lock:
        with lock:
            lock.acquire()
            assert lock._depth == 3
            lock.release()
        assert lock._depth == 1
        assert lock._owner == threading.get_ident()
    assert lock._owner is None
    assert lock._depth == 0


def test_reentered_lock_is_held_until_the_outermost_release() -> None:
    lock = FairLock()
    entered = threading.Event()

    def other() -> None:
        with lock:
            entered.set()

    lock.acquire()
    lock.acquire()
    worker = _Worker(other, "other")
    worker.start()
    _wait_for(_queued(lock, 1), "the other thread to queue")
    lock.release()
    assert not entered.is_set()
    assert lock._owner == threading.get_ident()
    lock.release()
    assert entered.wait(WAIT_S)
    worker.finish()
    assert lock._owner is None


def test_release_of_an_unheld_lock_raises() -> None:
    lock = FairLock()
    with pytest.raises(RuntimeError, match="does not hold it"):
        lock.release()
    with lock:
        pass
    with pytest.raises(RuntimeError, match="does not hold it"):
        lock.release()


def test_release_by_non_owner_raises_and_leaves_the_lock_held() -> None:
    lock = FairLock()
    errors: list[BaseException] = []

    def intruder() -> None:
        try:
            lock.release()
        except RuntimeError as err:
            errors.append(err)

    with lock:
        worker = _Worker(intruder, "intruder")
        worker.start()
        worker.finish()
        assert len(errors) == 1
        assert "does not hold it" in str(errors[0])
        assert lock._owner == threading.get_ident()
        assert lock._depth == 1
    assert lock._owner is None


def test_owner_releasing_hands_the_lock_to_the_waiter() -> None:
    lock = FairLock()
    owner_seen: list[int | None] = []
    go = threading.Event()

    def waiter() -> None:
        with lock:
            owner_seen.append(lock._owner)
            go.wait(WAIT_S)

    with lock:
        worker = _Worker(waiter, "waiter")
        worker.start()
        _wait_for(_queued(lock, 1), "the waiter to queue")
    # Released: the waiter owns it now, even if it has not run yet.
    assert lock._owner == worker.ident
    assert len(lock._waiters) == 0
    with pytest.raises(RuntimeError):
        lock.release()  # we are no longer the owner
    go.set()
    worker.finish()
    assert owner_seen == [worker.ident]
    assert lock._owner is None


# ---------------------------------------------------------------------------
# fairness


@pytest.mark.parametrize("arrival", [0, 1, 4_999, 9_998])
def test_waiter_gets_in_before_a_looping_owner_retakes(arrival: int) -> None:
    """The starvation case: the trainer re-takes the lock every step while a reader waits.

    The looper signals the waiter while holding the lock at iteration ``arrival``, and
    keeps going once the waiter is queued. Its next acquire must queue behind the waiter,
    so the waiter gets in after exactly one more release: while the looper's count is
    ``arrival + 1``.
    """
    iterations = 10_000
    lock = FairLock()
    count = 0  # looper iterations that got the lock; written only while holding it
    arrive = threading.Event()
    entered_at: list[int] = []

    def looper() -> None:
        nonlocal count
        for i in range(iterations):
            lock.acquire()
            count += 1
            if i == arrival:
                arrive.set()
                _wait_for(_queued(lock, 1), "the waiter to queue")
            lock.release()

    def waiter() -> None:
        assert arrive.wait(WAIT_S), "looper never reached the arrival iteration"
        with lock:
            entered_at.append(count)

    workers = [_Worker(waiter, "waiter"), _Worker(looper, "looper")]
    for w in workers:
        w.start()
    for w in workers:
        w.finish()
    assert count == iterations
    assert entered_at == [arrival + 1]
    assert lock._owner is None
    assert not lock._waiters


class _HoldCountingGuard:
    """Stands in for ``lock._guard`` (a real ``threading.Lock`` inside) to watch hand-overs.

    Every change of ``lock._owner`` happens inside the guard, so on leaving it this counts
    each time the looper became the owner (``holds``), and on the waiter's first entry (its
    arrival: where ``acquire`` takes the lock or queues) it notes ``holds`` and whether the
    lock was held then. A fair lock lets the waiter in before the looper's next hold.
    """

    def __init__(self, lock: FairLock, looper: str, waiter: str) -> None:
        self._inner = lock._guard
        self._lock = lock
        self._names = (looper, waiter)
        self._looper_ident: int | None = None
        self._owner_on_entry: int | None = None
        self.holds = 0
        self.arrival: int | None = None
        self.arrived_while_held: bool | None = None

    def __enter__(self) -> _HoldCountingGuard:
        self._inner.acquire()
        name = threading.current_thread().name
        if name == self._names[0]:
            self._looper_ident = threading.get_ident()
        if name == self._names[1] and self.arrival is None:
            self.arrival = self.holds
            self.arrived_while_held = self._lock._owner is not None
        self._owner_on_entry = self._lock._owner
        return self

    def __exit__(self, *exc: object) -> None:
        owner = self._lock._owner
        if owner is not None and owner == self._looper_ident and owner != self._owner_on_entry:
            self.holds += 1
        self._inner.release()


def _free_running_trial() -> tuple[bool, int, int]:
    """A looper re-takes the lock as fast as it can until a waiter has been in once.

    The looper does a little work under the lock (a training step's stand-in), never waits
    for the waiter, and stops only once the waiter has entered, so the waiter always
    arrives while the looper is looping. Returns (arrived while the lock was held, the
    looper's hold count at the waiter's arrival, and at its entry).
    """
    lock = FairLock()
    guard = _HoldCountingGuard(lock, "looper", "waiter")
    lock._guard = guard  # type: ignore[assignment]
    ready, done = threading.Event(), threading.Event()
    entered_at: list[int] = []

    def looper() -> None:
        deadline = time.monotonic() + WAIT_S
        sink = 0
        while not done.is_set():
            assert time.monotonic() < deadline, "the waiter never got in: starved"
            with lock:
                ready.set()  # no rendezvous: the waiter arrives whenever it is scheduled
                for k in range(200):
                    sink += k
        assert sink > 0

    def waiter() -> None:
        assert ready.wait(WAIT_S)
        with lock:
            entered_at.append(guard.holds)  # fixed while we hold it: only we can hand over
            done.set()

    workers = [_Worker(looper, "looper"), _Worker(waiter, "waiter")]
    for w in workers:
        w.start()
    for w in workers:
        w.finish()
    assert guard.arrival is not None and guard.arrived_while_held is not None
    assert guard.arrival >= 1  # it came after the looper's first hold, while it looped
    assert len(entered_at) == 1
    assert lock._owner is None and not lock._waiters
    return guard.arrived_while_held, guard.arrival, entered_at[0]


def test_waiter_arriving_while_owner_loops_freely_is_not_starved() -> None:
    """Same as above without a rendezvous inside the loop. Whenever the waiter arrives, the
    looper may not take the lock again before the waiter has had it: if the lock was held
    at its arrival, it gets in on that hold's release; if it was free, at once.

    Which case happens is up to the scheduler, so trials repeat (each a fresh lock) until
    ``contended_wanted`` of them had the waiter arrive while the looper held the lock, the case
    an unfair lock gets wrong; every trial, contended or not, must hold the property.
    """
    contended_wanted, max_trials = 5, 500
    contended = 0
    for trial in range(max_trials):
        held, arrival, entered = _free_running_trial()
        assert entered == arrival, (
            f"trial {trial}: the looper took the lock {entered - arrival} more time(s) "
            f"after the waiter arrived ({'held' if held else 'free'} at its arrival)"
        )
        contended += held
        if contended == contended_wanted:
            return
    pytest.fail(
        f"only {contended} of {max_trials} trials had the waiter arrive while the lock was "
        "held: the contended case was not exercised"
    )


def test_waiters_are_served_in_arrival_order_and_owner_requeues_last() -> None:
    n = 5
    lock = FairLock()
    order: list[int] = []
    starts = [threading.Event() for _ in range(n)]

    def waiter(k: int) -> Callable[[], None]:
        def body() -> None:
            assert starts[k].wait(WAIT_S)
            with lock:
                order.append(k)

        return body

    workers = [_Worker(waiter(k), f"waiter-{k}") for k in range(n)]
    for w in workers:
        w.start()
    lock.acquire()
    # Start them in reverse thread-creation order so arrival, not creation, decides.
    arrival = list(reversed(range(n)))
    for queued, k in enumerate(arrival, start=1):
        starts[k].set()
        _wait_for(_queued(lock, queued), f"waiter {k} to queue")
    assert [ident for ident, _ in lock._waiters] == [workers[k].ident for k in arrival]
    lock.release()
    # The old owner asks again at once: it must queue behind every earlier waiter.
    lock.acquire()
    assert order == arrival
    lock.release()
    for w in workers:
        w.finish()
    assert lock._owner is None
    assert not lock._waiters


def test_many_threads_contending_all_get_in_and_exclusion_holds() -> None:
    n, rounds = 8, 300
    lock = FairLock()
    inside = 0
    overlaps = 0
    counter = 0
    go = threading.Event()

    def body() -> None:
        nonlocal inside, overlaps, counter
        assert go.wait(WAIT_S)
        for _ in range(rounds):
            with lock:
                inside += 1
                if inside != 1:
                    overlaps += 1
                with lock:  # re-entry under contention
                    counter += 1
                inside -= 1

    workers = [_Worker(body, f"worker-{k}") for k in range(n)]
    for w in workers:
        w.start()
    go.set()
    for w in workers:
        w.finish()
    assert overlaps == 0
    assert counter == n * rounds
    assert lock._owner is None
    assert not lock._waiters
