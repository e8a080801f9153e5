"""Caps on what inbound streams may hold: stream slots, pending payload bytes, and silence.

A flood of streams must not stop the mesh, so everything an outsider can make
this node hold has a cap with a config key: concurrent push and pull streams
(:class:`Slots`), payload bytes of unfinished pushes (:class:`ByteBudget`), and
how long a stream may stay silent (:class:`IdleBounded`). Over a cap the
request is refused at once with :class:`Busy` (RESOURCE_EXHAUSTED), never
queued, and the message names the key to raise.

All state here belongs to the event loop that serves gRPC: nothing awaits
while it holds a count and nothing locks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

from gossipd.node.errors import Busy, ConfigError, PushTooSlow, StreamIdle, TooManyStreams
from gossipd.node.segments import SegmentPlan

T = TypeVar("T")


class Slot:
    """One taken slot; ``release`` is idempotent so every exit path may call it."""

    def __init__(self, owner: Slots | PeerSlots, key: str = "") -> None:
        self._owner: Slots | PeerSlots | None = owner
        self._key = key

    def release(self) -> None:
        if self._owner is not None:
            self._owner.give_back(self._key)
            self._owner = None

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Slots:
    """At most ``capacity`` streams of one kind at once; one more is refused, not queued."""

    def __init__(self, capacity: int, what: str, key: str) -> None:
        self.capacity = capacity
        self.what = what
        self.key = key
        self.in_use = 0

    def take(self) -> Slot:
        if self.in_use >= self.capacity:
            raise Busy(
                f"{self.in_use} {self.what} are open already, the most {self.key} = "
                f"{self.capacity} allows; retry later"
            )
        self.in_use += 1
        return Slot(self)

    def give_back(self, key: str) -> None:
        self.in_use -= 1


class PeerSlots:
    """At most ``capacity`` streams per peer, so one member cannot hold the slots of
    :class:`Slots` that the others need; a peer's entry lives only while it holds one."""

    def __init__(self, capacity: int, what: str, key: str) -> None:
        self.capacity = capacity
        self.what = what
        self.key = key
        self.in_use: dict[str, int] = {}

    def take(self, peer: str) -> Slot:
        held = self.in_use.get(peer, 0)
        if held >= self.capacity:
            raise TooManyStreams(
                f"{peer!r} holds {held} {self.what} already, the most {self.key} = "
                f"{self.capacity} allows one peer; retry when one of them ends"
            )
        self.in_use[peer] = held + 1
        return Slot(self, peer)

    def give_back(self, key: str) -> None:
        left = self.in_use[key] - 1
        if left:
            self.in_use[key] = left
        else:
            del self.in_use[key]


class Hold:
    """What one stream has reserved from a :class:`ByteBudget`; released all at once."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.nbytes = 0

    def reserve(self, nbytes: int) -> None:
        """Charge ``nbytes`` to the budget before they are allocated; Busy if they do not fit."""
        self.budget.take(nbytes)
        self.nbytes += nbytes

    def release(self) -> None:
        self.budget.in_use -= self.nbytes
        self.nbytes = 0

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ByteBudget:
    """Payload bytes that unfinished inbound pushes may hold, all streams together."""

    def __init__(self, capacity: int, key: str) -> None:
        self.capacity = capacity
        self.key = key
        self.in_use = 0

    def hold(self) -> Hold:
        """A per-stream account; use it as a context manager so it is released however it ends."""
        return Hold(self)

    def take(self, nbytes: int) -> None:
        if self.in_use + nbytes > self.capacity:
            raise Busy(
                f"a segment of {nbytes} bytes does not fit in {self.key} = {self.capacity}: "
                f"{self.in_use} bytes are held by unfinished inbound pushes; retry later"
            )
        self.in_use += nbytes

    def check_fits(self, plan: SegmentPlan) -> None:
        """Refuse a budget below the largest segment: no push could ever be received."""
        largest = max(plan.segments, key=lambda s: s.nbytes)
        if largest.nbytes > self.capacity:
            raise ConfigError(
                f"{self.key} = {self.capacity} is below the largest model segment "
                f"({largest.nbytes} bytes, segment {largest.index}), so no push could ever be "
                f"received; raise {self.key} to at least {largest.nbytes}"
            )


class IdleBounded(Generic[T]):
    """The frames of one inbound stream, each awaited for at most ``idle_s`` seconds.

    The clock runs only while waiting for the peer, from before the first frame
    on; the time this node spends on a frame does not count against it. With a
    ``min_rate`` (bytes per second, each frame's bytes given by ``size``), the
    waiting as a whole is bounded too: after a first ``idle_s`` that is free, each
    byte buys ``1 / min_rate`` seconds more, so a peer trickling a byte just inside
    ``idle_s`` is ended all the same (:class:`PushTooSlow`).
    """

    def __init__(
        self,
        frames: AsyncIterator[T],
        idle_s: float,
        key: str,
        *,
        min_rate: float | None = None,
        rate_key: str = "",
        size: Callable[[T], int] = lambda frame: 0,
    ) -> None:
        self.frames = frames
        self.idle_s = idle_s
        self.key = key
        self.min_rate = min_rate
        self.rate_key = rate_key
        self.size = size
        self.waited_s = 0.0
        self.received = 0

    def __aiter__(self) -> IdleBounded[T]:
        return self

    def _allowed_s(self) -> float:
        """Waiting this stream may still do, as the minimum rate allows."""
        if self.min_rate is None:
            return float("inf")
        return self.idle_s + self.received / self.min_rate - self.waited_s

    async def __anext__(self) -> T:
        limit_s = min(self.idle_s, self._allowed_s())
        started = time.monotonic()
        try:
            async with asyncio.timeout(max(limit_s, 0.0)):
                frame = await anext(self.frames)
        except TimeoutError:
            if limit_s < self.idle_s:
                raise PushTooSlow(
                    f"{self.received} bytes in {self.waited_s + limit_s:.0f} s of waiting, "
                    f"below {self.rate_key} = {self.min_rate:g} bytes/s; the stream was ended "
                    "and its slot and reserved bytes released"
                ) from None
            raise StreamIdle(
                f"no frame for {self.idle_s:g} s ({self.key}); the stream was ended and "
                "its reserved bytes released"
            ) from None
        finally:
            self.waited_s += time.monotonic() - started
        self.received += self.size(frame)
        return frame
