"""A sender's long-lived push stream to one receiver (the ``Exchange`` RPC), receiver side.

A call per push costs grpc a call set-up and tear-down on both sides, about as
much CPU as the rest of a small push; on a site whose cores all train, that is
taken from the trainer at every push. So a sender keeps a few streams open to
each peer and sends push after push on them.

Each push on the stream is framed exactly as one ``PushSegments`` call (open,
then per segment a header and its chunks) and closed by a ``PushEnd`` frame; a
small one comes whole in one ``FrameBatch`` message (a message costs both sides a
grpc operation, more than a small segment's bytes do). It
is received by the same code (:meth:`GossipServicer.receive_push`) under the
same caps, which it takes when it opens and gives back when it is answered (one
``PushReply``, in order), and a refused push ends the stream with the status
``PushSegments`` would have answered: the sender's settle-once and retry rules do
not change. Between pushes a stream holds no push slot and no byte; open streams
are capped like pushes, per peer (``limits.max_inbound_pushes_per_peer``) and in
all (``limits.max_inbound_pushes``), and one idle for
``limits.stream_idle_timeout_s`` between pushes is ended (OK): its sender opens
another when it pushes again. Each stream opened counts against its peer's budget of
opens (:mod:`~gossipd.node.net.limits.open_budget`); one refused before its first frame is
answered after that frame (:meth:`GossipServicer.refuse_early`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator

import grpc

from gossipd.node.errors import GossipdError, InvalidFrame
from gossipd.node.net.limits.admission import PeerSlots, Slots
from gossipd.node.net.serve.servicer import (
    GossipServicer,
    PushContext,
    parse_push_frame,
    status_code,
)
from gossipd.node.net.wire.intake import PushFrameIn
from gossipd.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)


def _kind(frame: PushFrameIn) -> str | None:
    return frame.WhichOneof("kind") if isinstance(frame, pb.PushFrame) else None


async def _one_push(
    first: PushFrameIn, frames: AsyncIterator[PushFrameIn]
) -> AsyncIterator[PushFrameIn]:
    """``first`` and the frames after it up to (not including) the push's end frame;
    a batch ``first`` is a whole push on its own, unpacked here."""
    if isinstance(first, pb.PushFrame) and first.WhichOneof("kind") == "batch":
        inner = [parse_push_frame(data) for data in first.batch.frames]
        ends = [i for i, frame in enumerate(inner) if _kind(frame) == "end"]
        if ends != [len(inner) - 1]:
            raise InvalidFrame(
                f"a batch of {len(inner)} frames must hold one whole push, ending with its "
                f"end frame (end frames at {ends[:4]})"
            )
        for frame in inner[:-1]:
            yield frame
        return
    yield first
    async for frame in frames:
        if _kind(frame) == "end":
            return
        yield frame


def _deadline_s(first: PushFrameIn) -> float | None:
    """The seconds the sender still waits, from a well-formed open frame (else None)."""
    if isinstance(first, pb.PushFrame) and first.WhichOneof("kind") == "open":
        deadline = first.open.deadline_s
        if math.isfinite(deadline) and deadline > 0:
            return deadline
    return None


class ExchangeServicer:
    """Serves ``Exchange`` streams with a :class:`GossipServicer`'s push path."""

    def __init__(self, servicer: GossipServicer) -> None:
        limits = servicer.node.config.limits
        self.servicer = servicer
        self.peer_streams = PeerSlots(
            limits.max_inbound_pushes_per_peer,
            "Exchange streams",
            "limits.max_inbound_pushes_per_peer",
        )
        self.streams = Slots(
            limits.max_inbound_pushes, "Exchange streams", "limits.max_inbound_pushes"
        )

    def _open(self, context: PushContext, peer: str) -> tuple[str | None, contextlib.ExitStack]:
        """A new stream's peer (None in plaintext) and the slots it takes, or the refusal:
        over the peer's budget of opens, or over either cap of streams. In plaintext the
        connection stands for the peer (the global cap still holds)."""
        who = self.servicer.open_stream(context)
        slots = contextlib.ExitStack()
        try:
            slots.enter_context(self.peer_streams.take(who or peer))
            slots.enter_context(self.streams.take())
        except BaseException:
            slots.close()
            raise
        return who, slots

    async def Exchange(
        self, request_iterator: AsyncIterator[PushFrameIn], context: PushContext
    ) -> None:
        servicer = self.servicer
        peer, frames = context.peer(), aiter(request_iterator)
        try:
            try:
                who, slots = self._open(context, peer)
            except GossipdError as err:
                await servicer.refuse_early(context, peer, frames, err)
                return
            with slots:
                while True:
                    try:
                        async with asyncio.timeout(servicer.idle_s):
                            first = await anext(frames, None)
                    except TimeoutError:
                        return  # idle between pushes: the sender opens another when it pushes
                    if first is None:
                        return  # the sender closed it
                    reply = await servicer.receive_push(
                        who, _one_push(first, frames), _deadline_s(first)
                    )
                    await servicer.write_within(
                        context, reply, "the sender took no reply", "its stream was ended"
                    )
        except GossipdError as err:
            servicer.refused(peer, err)
            await context.abort(status_code(err), str(err))
        except grpc.aio.AbortError:
            raise
        except Exception as err:
            log.exception("internal error serving an Exchange stream to %s", peer)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {err!r}")


def _serialize(reply: pb.PushReply) -> bytes:
    return reply.SerializeToString()


def method_handler(servicer: GossipServicer) -> grpc.RpcMethodHandler[PushFrameIn, pb.PushReply]:
    """``Exchange`` for :func:`servicer.add_to_server` (chunks parsed without a copy)."""
    return grpc.stream_stream_rpc_method_handler(
        ExchangeServicer(servicer).Exchange, parse_push_frame, _serialize
    )
