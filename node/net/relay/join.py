"""A local socket joined to a relay stream: bytes in, frames out, until either end goes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import grpc

from gossipd.node.net.relay.hub import MAX_FRAME_BYTES
from gossipd.proto import gossip_pb2 as pb

RelayCall = grpc.aio.StreamStreamCall[pb.RelayFrame, pb.RelayFrame]


async def join(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    call: RelayCall,
    on_leaving: Callable[[], None] | None = None,
) -> None:
    """Copy until the socket or the stream ends, then close both; memory is bounded by
    gRPC's flow control one way and the socket's drain the other. ``on_leaving`` is
    called when the relay says it is leaving (a dialler's side only)."""

    async def up() -> None:
        while data := await reader.read(MAX_FRAME_BYTES):
            await call.write(pb.RelayFrame(data=data))
        await call.done_writing()

    async def down() -> None:
        while True:
            frame: Any = await call.read()
            if frame is grpc.aio.EOF:
                return
            if frame.data:
                writer.write(frame.data)
                await writer.drain()
            elif frame.leaving and on_leaving is not None:
                on_leaving()

    tasks = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        call.cancel()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
