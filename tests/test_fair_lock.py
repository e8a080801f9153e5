"""Tests for gossipd.node.replica.FairLock: re-entrant, owner-checked, handed over in arrival order.

No sleep is used as synchronisation: threads meet on Events (every wait bounded), and where a
test must know a thread is queued it polls ``len(lock._waiters)`` in a bounded loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from gossipd.node.replica import FairLock

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


def test_waiter_arriving_while_owner_loops_freely_is_not_starved() -> None:
    """Same as above without a rendezvous inside the loop: the waiter arrives whenever the
    scheduler runs it. If the looper, holding the lock at its count ``c``, sees it queued,
    its release hands over, so the waiter gets in while the count is still ``c``.
    """
    iterations = 10_000
    lock = FairLock()
    count = 0
    first_seen_queued: list[int] = []
    entered_at: list[int] = []
    ready = threading.Event()

    def looper() -> None:
        nonlocal count
        for _ in range(iterations):
            lock.acquire()
            count += 1
            ready.set()  # no waiting: the waiter arrives whenever it is scheduled
            if lock._waiters and not first_seen_queued:
                first_seen_queued.append(count)
            lock.release()

    def waiter() -> None:
        assert ready.wait(WAIT_S)
        with lock:
            entered_at.append(count)

    w = _Worker(waiter, "waiter")
    loop = _Worker(looper, "looper")
    w.start()
    loop.start()
    loop.finish()
    w.finish()
    assert count == iterations
    assert len(entered_at) == 1
    if first_seen_queued:
        assert entered_at == first_seen_queued


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
