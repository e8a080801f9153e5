"""Caps on what inbound streams may hold: stream slots, pending payload bytes, and silence.

A flood of streams must not stop the mesh, so everything an outsider can make
this node hold has a cap with a config key: concurrent push and pull streams
(:class:`Slots`), memory the segments of unfinished pushes hold (:class:`ByteBudget`),
how long a stream may stay silent and how long a whole push may take
(:class:`IdleBounded`), and how long a connection lives (:func:`server_options`). Over a cap the
request is refused at once with :class:`Busy` (RESOURCE_EXHAUSTED), never
queued, and the message names the key to raise.

All state here belongs to the event loop that serves gRPC: nothing awaits
while it holds a count and nothing locks.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Generic, TypeVar

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.compression.codecs import Codec
from gossipd.node.errors import (
    Busy,
    ConfigError,
    PushTooLong,
    PushTooSlow,
    StreamIdle,
    TooManyStreams,
)
from gossipd.node.model.segments import Segment, SegmentPlan

if TYPE_CHECKING:
    from gossipd.node.shared.config import NodeConfig

T = TypeVar("T")
U = TypeVar("U")


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


def held_bytes(segment: Segment, codec: Codec, difference: bool = False) -> int:
    """Memory one received segment holds at its peak: the wire buffer plus, when the codec
    is not the model's dtype, the decoded copy (:func:`codec.decode` makes it while the
    buffer is alive); with the dtype on the wire the tensor is a view of the buffer. A
    ``difference`` from a kept copy (error feedback) adds the values rebuilt from it."""
    encoded = wirecodec.encoded_nbytes(codec, segment.dtype, segment.numel)
    rebuilt = segment.numel * segment.dtype.itemsize if difference else 0
    return encoded + wirecodec.decoded_copy_bytes(codec, segment.dtype, segment.numel) + rebuilt


def largest_held(plan: SegmentPlan, differences: bool = False) -> tuple[int, Segment, Codec]:
    """The most any one segment of ``plan`` may hold, over every codec a peer may choose
    (``differences``: this node keeps copies, so a segment may come as a difference)."""
    kinds = (False, True) if differences else (False,)
    return max(
        (
            (held_bytes(seg, codec, d), seg, codec)
            for seg in plan.segments
            for codec in Codec
            for d in kinds
        ),
        key=lambda entry: entry[0],
    )


class ByteBudget:
    """Memory that segments of unfinished inbound pushes may hold, all streams together
    (:func:`held_bytes` each, from their header until the merge has answered)."""

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

    def check_fits(self, plan: SegmentPlan, differences: bool = False) -> None:
        """Refuse a budget below what the largest segment holds: no push of it could ever
        be received (with fp16 or bf16 that is the wire bytes plus the decoded copy)."""
        nbytes, largest, codec = largest_held(plan, differences)
        if nbytes > self.capacity:
            raise ConfigError(
                f"{self.key} = {self.capacity} is below the largest model segment "
                f"({nbytes} bytes held while received: segment {largest.index} "
                f"in {codec.name.lower()}), so a push of it could never be received; raise "
                f"{self.key} to at least {nbytes}"
            )


def push_deadline_s(config: NodeConfig, plan: SegmentPlan) -> float:
    """How long one inbound push stream may take (``limits.max_push_s``), or ConfigError.

    An honest push must fit: one of the largest segment at exactly
    ``limits.min_push_rate_bytes_s``, after the free first
    ``limits.stream_idle_timeout_s``. Unset, it is that or ``gossip.push_timeout_s``
    (a sender's own deadline for a push, from open to answer), whichever is longer,
    so this node never ends a push its sender is still waiting for.
    """
    limits = config.limits
    largest = max(plan.segments, key=lambda seg: seg.nbytes)  # raw: the most wire bytes
    wire_bytes = largest.nbytes
    needed_s = limits.stream_idle_timeout_s + wire_bytes / limits.min_push_rate_bytes_s
    if limits.max_push_s is None:
        return max(needed_s, config.gossip.push_timeout_s)
    if limits.max_push_s < needed_s:
        raise ConfigError(
            f"limits.max_push_s = {limits.max_push_s:g} is below the {needed_s:.3g} s a push of "
            f"the largest segment ({wire_bytes} bytes, segment {largest.index}) may take at "
            f"limits.min_push_rate_bytes_s = {limits.min_push_rate_bytes_s:g} after the first "
            f"limits.stream_idle_timeout_s = {limits.stream_idle_timeout_s:g} s; raise it to at "
            "least that, raise min_push_rate_bytes_s, or leave max_push_s unset"
        )
    return limits.max_push_s


def server_options(config: NodeConfig, plan: SegmentPlan) -> list[tuple[str, int]]:
    """gRPC server options that bound how long a connection, and the calls on it, can live.

    grpc cannot cancel a call from the server: a pull whose reader stopped reading
    is cut off (its slot freed) but lingers in grpc until its client goes away.
    After ``limits.max_connection_age_s`` the server sends GOAWAY: a well-behaved
    client opens a new connection for its next call, and calls in flight get a
    grace of the longest an honest call takes (a push: its deadline and the merge
    wait; a pull: ``gossip.push_timeout_s``), after which the connection is closed
    and whatever still lingers on it with it.
    """
    limits = config.limits
    longest_s = max(push_deadline_s(config, plan), config.gossip.push_timeout_s)
    grace_s = longest_s + limits.merge_wait_s
    return [
        ("grpc.max_connection_age_ms", _grpc_ms(limits.max_connection_age_s)),
        ("grpc.max_connection_age_grace_ms", _grpc_ms(grace_s)),
    ]


def _grpc_ms(seconds: float) -> int:
    """Milliseconds as grpc's int options take them (a C int: at most about 24 days)."""
    return min(round(seconds * 1000), 2**31 - 1)


class IdleBounded(Generic[T]):
    """The frames of one inbound stream, each awaited for at most ``idle_s`` seconds.

    The clock runs only while waiting for the peer, from before the first frame
    on; the time this node spends on a frame does not count against it. With a
    ``min_rate`` (bytes per second, each frame's bytes given by ``size``), the
    waiting as a whole is bounded too: after a first ``idle_s`` that is free, each
    byte buys ``1 / min_rate`` seconds more, so a peer trickling a byte just inside
    ``idle_s`` is ended all the same (:class:`PushTooSlow`). With a ``deadline_s``
    the whole stream, from its first frame awaited to its last, gets that long on
    the wall clock (:class:`PushTooLong`): a peer sending big chunks just fast
    enough would otherwise hold its slot and reserved bytes as long as it likes.
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
        deadline_s: float | None = None,
        deadline_key: str = "",
    ) -> None:
        self.frames = frames
        self.idle_s = idle_s
        self.key = key
        self.min_rate = min_rate
        self.rate_key = rate_key
        self.size = size
        self.deadline_s = deadline_s
        self.deadline_key = deadline_key
        self.waited_s = 0.0
        self.received = 0
        self.started: float | None = None

    def __aiter__(self) -> IdleBounded[T]:
        return self

    def _allowed_s(self) -> float:
        """Waiting this stream may still do, as the minimum rate allows."""
        if self.min_rate is None:
            return float("inf")
        return self.idle_s + self.received / self.min_rate - self.waited_s

    def _left_s(self, now: float) -> float:
        """Wall-clock time the whole stream may still take (its deadline)."""
        if self.deadline_s is None or self.started is None:
            return float("inf")
        return self.deadline_s - (now - self.started)

    async def __anext__(self) -> T:
        frame = await self.wait(anext(self.frames))
        self.received += self.size(frame)
        return frame

    async def wait(self, pending: Awaitable[U], nbytes: int = 0) -> U:
        """``pending`` (waiting for the peer) within this stream's limits; ``nbytes``: what
        it brings, credited in advance (a bulk-lane read of a whole payload, whose own
        socket timeout bounds each silence). Frames come through :meth:`__anext__`."""
        started = time.monotonic()
        if self.started is None:
            self.started = started
        rate_s = self._allowed_s() + (nbytes / self.min_rate if self.min_rate else 0.0)
        left_s = self._left_s(started)
        limit_s = min(self.idle_s if not nbytes else math.inf, rate_s, left_s)
        try:
            async with asyncio.timeout(max(limit_s, 0.0) if math.isfinite(limit_s) else None):
                result = await pending
        except TimeoutError:
            if limit_s == left_s:
                raise PushTooLong(
                    f"{self.received} bytes received and the push still open after "
                    f"{self.deadline_s:g} s ({self.deadline_key}); the stream was ended and its "
                    f"slot and reserved bytes released. An honest sender this slow needs a "
                    f"faster link, or {self.deadline_key} raised on this node"
                ) from None
            if limit_s < self.idle_s or nbytes:
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
        self.received += nbytes
        return result
