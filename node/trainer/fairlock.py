"""A lock handed over in arrival order, for the replica's parameters."""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Iterator


class FairLock:
    """A re-entrant lock handed over in arrival order.

    The trainer releases and re-takes its lock once per step, a few hundred
    times a second; with a plain RLock it wins every race and a reader (status,
    PullModel snapshot, checkpoint) can starve for seconds.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._waiters: deque[tuple[int, threading.Event]] = deque()
        self._owner: int | None = None
        self._depth = 0

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._guard:
            if self._owner == me:
                self._depth += 1
                return
            if self._owner is None and not self._waiters:
                self._owner, self._depth = me, 1
                return
            turn = threading.Event()
            self._waiters.append((me, turn))
        turn.wait()

    def release(self) -> None:
        with self._guard:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth:
                return
            if self._waiters:
                self._owner, turn = self._waiters.popleft()
                self._depth = 1
                turn.set()
            else:
                self._owner = None

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Give the lock up entirely (every level this thread holds) for the block, and
        take it back, in arrival order, at the same depth afterwards.

        For a trainer that waits at a step boundary while holding the lock around its
        whole step: peers' pulls must snapshot the model meanwhile.
        """
        with self._guard:
            depth = self._depth if self._owner == threading.get_ident() else 0
            if depth:
                self._depth = 1
        if depth:
            self.release()
        try:
            yield
        finally:
            if depth:
                self.acquire()
                with self._guard:
                    self._depth = depth
