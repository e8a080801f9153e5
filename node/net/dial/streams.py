"""A sender's long-lived push streams to one peer (``Exchange``), kept and reused.

A call per push costs grpc a call set-up and tear-down on both sides, about as
much CPU as the rest of a small push; so a :class:`~gossipd.node.net.dial.client.PeerClient`
keeps its streams to a peer here between pushes. Frames reach grpc through its
own request consumer, fed from a one-frame queue, while the reply is awaited.

The receiver's status is what says whether a push was refused (settle it) or its
outcome is unknown (retry it), and grpc.aio records a local INTERNAL over it when
the receiver ends the call while a write is in flight (grpc/grpc#36066), through
``write()`` and the request consumer alike. So the receiver answers a refusal only
once it has read the frame a stream starts with (a small push whole, in one message),
and a refusal reaches this side with the receiver's status; one that races the later
frames of a large push can still read as INTERNAL, an unknown outcome retried with
the same sequence.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from gossipd.proto import gossip_pb2 as pb

STREAM_IDLE_S = 2.0  # a push stream unused this long is replaced rather than reused
STREAM_MAX_AGE_S = 60.0  # and one this old
# A push part of at most this many model bytes goes as one message (FrameBatch).
COALESCE_BYTES = 256 << 10
END_FRAME = pb.PushFrame(end=pb.PushEnd()).SerializeToString()


async def batched(frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A push's frames as one ``FrameBatch`` message."""
    batch = pb.FrameBatch(frames=[frame async for frame in frames])
    yield pb.PushFrame(batch=batch).SerializeToString()


async def _requests(queue: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    """A stream's frames as grpc asks for them; None half-closes it."""
    while (frame := await queue.get()) is not None:
        yield frame


@dataclass
class Stream:
    """One ``Exchange`` call and the one-frame queue grpc takes its frames from."""

    call: grpc.aio.StreamStreamCall[bytes, pb.PushReply]
    queue: asyncio.Queue[bytes | None]
    opened_s: float
    used_s: float
    reused: bool = False

    def retire(self) -> None:
        """Half-close an idle stream (the receiver ends it OK), or drop a busy one."""
        try:
            self.queue.put_nowait(None)
        except asyncio.QueueFull:
            self.drop()

    def drop(self) -> None:
        """Cancel the call and end its request iterator. grpc cancels its task that feeds
        the call from the iterator only while the call still runs; after a receiver ended
        it, that task waited on the empty queue for good, and asyncio logged it at ERROR
        when the loop closed ("Task was destroyed but it is pending", then "aclose():
        asynchronous generator is already running"), dozens per daemon under a flood."""
        self.call.cancel()
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(None)


class StreamPool:
    """A peer's idle long-lived push streams (``Exchange``), reused push after push.

    One is replaced when unused for ``STREAM_IDLE_S`` (the receiver ends a stream idle
    for ``limits.stream_idle_timeout_s``) or older than ``STREAM_MAX_AGE_S`` (a
    receiver closes a connection past ``limits.max_connection_age_s``, after a grace
    for the calls on it): either way a new stream costs one call set-up.
    """

    def __init__(
        self, open_stream: grpc.aio.StreamStreamMultiCallable[bytes, pb.PushReply]
    ) -> None:
        self._open = open_stream
        self._idle: list[Stream] = []
        self.closed = False  # a stream handed back after close() is retired, not kept

    def take(self, fresh: bool = False) -> Stream:
        now = time.monotonic()
        while self._idle and not fresh:
            stream = self._idle.pop()
            if (
                not stream.call.done()
                and now - stream.used_s < STREAM_IDLE_S
                and now - stream.opened_s < STREAM_MAX_AGE_S
            ):
                stream.reused = True
                return stream
            stream.retire()
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=1)
        return Stream(self._open(_requests(queue)), queue, now, now)

    def put_back(self, stream: Stream) -> None:
        stream.used_s = time.monotonic()
        if self.closed:
            stream.retire()
        else:
            self._idle.append(stream)

    def close(self) -> None:
        self.closed = True
        for stream in self._idle:
            stream.retire()
        self._idle.clear()
