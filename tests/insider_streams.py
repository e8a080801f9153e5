"""An insider for tests: a 4th member with its own certificate of the mesh CA and its own
TLS server, that holds inbound push slots and sends poisoned values.

A member of the mesh (``tests/insider.py``): it serves TLS and daemons admit it after
dialling it back. Pushes the honest sites make to it are refused with
RESOURCE_EXHAUSTED, a known outcome their senders settle by folding the weight back,
so the mesh's sum of weights stays exact whatever the attack.

The attacks open push streams to daemons over its TLS channels: ``stall`` sends a
valid PushOpen and then nothing, ``trickle`` sends a PushOpen, a segment header and
then one payload byte every ``every_s``. Each stream is reopened as soon as the
daemon ends it, so the attack holds every slot it is given for as long as it runs.
A ``flood`` (:meth:`Insider.start_flood`) reopens stalling streams, ``PushSegments`` and
``Exchange`` alike, the moment each ends, with no pause: as fast as the daemons answer.
How the daemons ended each stream is counted by status code (``ended``), and how many
refusals named the budget of opens (``opens_refused``).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import grpc

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.shared.tls import Credentials
from gossipd.proto import gossip_pb2 as pb
from tests.fakepeer import MESH
from tests.insider import Member

REOPEN_PAUSE_S = 0.05  # between a stream the daemon ended and the next, so a refusal is no spin


class Insider(Member):
    """A member of the mesh (a valid certificate for ``node_id``) that misbehaves on request."""

    def __init__(self, node_id: str, tls: Credentials, *, incarnation: int = 1) -> None:
        self.open_streams = 0  # attack streams the daemons have not ended yet
        self.ended: Counter[str] = Counter()  # how the daemons ended attack streams, by code
        self.opens_refused = 0  # refusals that named limits.max_stream_opens_per_s
        self.pushes_refused = 0  # honest pushes to this insider, refused
        self._stop_attack = asyncio.Event()
        super().__init__(node_id, tls, incarnation=incarnation)

    async def on_push(self, request_iterator: Any, context: Any) -> pb.PushReply:
        self.pushes_refused += 1
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "the insider merges nothing")
        return pb.PushReply()

    # -- attacks on the inbound push slots --------------------------------------------------

    def _open_frame(self) -> pb.PushFrame:
        # Every attack stream says sequence 1: none is ever merged, and real pushes stay
        # within the receiver's window of sequences admitted from this sender.
        sequence = 1
        return pb.PushFrame(
            open=pb.PushOpen(
                mesh_id=MESH,
                sender=self.node_id,
                fingerprint=self.fingerprint,
                sequence=sequence,
                segment_count=1,
                incarnation=self.incarnation,
                sequence_base=1,
            )
        )

    def _header_frame(self, sequence: int) -> pb.PushFrame:
        payload = bytes(self.numel * 4)
        return pb.PushFrame(
            header=pb.SegmentHeader(
                sender=self.node_id,
                segment=0,
                sequence=sequence,
                sum_weight=0.5,
                dtype=pb.DTYPE_FLOAT32,
                numel=self.numel,
                codec=pb.CODEC_RAW,
                payload_bytes=len(payload),
                checksum=wirecodec.checksum(payload),
            )
        )

    async def _frames(self, trickle_every_s: float | None) -> AsyncIterator[bytes]:
        opened = self._open_frame()
        yield opened.SerializeToString()
        if trickle_every_s is not None:
            yield self._header_frame(opened.open.sequence).SerializeToString()
            for _ in range(self.numel * 4):
                try:
                    await asyncio.wait_for(self._stop_attack.wait(), trickle_every_s)
                    return
                except TimeoutError:
                    yield pb.PushFrame(chunk=b"\0").SerializeToString()
        await self._stop_attack.wait()

    async def _one_stream(self, address: str, exchange: bool, frames: AsyncIterator[bytes]) -> None:
        """One attack stream until the daemon ends it (its status counted)."""
        channel = self._channel(address)
        call: Any
        if exchange:  # the daemon's own push stream, fed as the daemon's client feeds it
            call = channel.stream_stream(
                "/gossipd.v1.Gossip/Exchange",
                request_serializer=lambda b: b,
                response_deserializer=pb.PushReply.FromString,
            )(frames, timeout=3600.0)
        else:
            call = channel.stream_unary(
                "/gossipd.v1.Gossip/PushSegments",
                request_serializer=lambda b: b,
                response_deserializer=pb.PushReply.FromString,
            )(frames, timeout=3600.0)
        self.open_streams += 1
        try:
            if exchange:
                while await call.read() is not grpc.aio.EOF:
                    pass
            else:
                await call
            self.ended["OK"] += 1
        except grpc.aio.AioRpcError as err:
            self.ended[err.code().name] += 1
            self.opens_refused += "limits.max_stream_opens_per_s" in (err.details() or "")
        finally:
            self.open_streams -= 1
            if self._stop_attack.is_set():
                call.cancel()

    async def _hold(
        self, address: str, trickle_every_s: float | None, exchange: bool, pause_s: float
    ) -> None:
        while not self._stop_attack.is_set():
            await self._one_stream(address, exchange, self._frames(trickle_every_s))
            if pause_s and not self._stop_attack.is_set():
                await asyncio.sleep(pause_s)

    def _start_holders(self, holders: list[tuple[str, float | None, bool, float]]) -> None:
        async def start() -> None:
            if not self.tasks:
                self._stop_attack = asyncio.Event()
            self.tasks += [asyncio.create_task(self._hold(*holder)) for holder in holders]

        self.run(start())

    def start_attack(
        self, addresses: list[str], streams: int, trickle_every_s: float | None = None
    ) -> None:
        """``streams`` push streams to each address, held until :meth:`stop_attack`."""
        self._start_holders(
            [(a, trickle_every_s, False, REOPEN_PAUSE_S) for a in addresses] * streams
        )

    def start_flood(self, addresses: list[str], tasks: int) -> None:
        """``tasks`` stalling streams to each address, half of them ``Exchange``, each
        reopened the moment the daemon ends it, until :meth:`stop_attack`."""
        self._start_holders([(a, None, i % 2 == 1, 0.0) for a in addresses for i in range(tasks)])

    def stop_attack(self) -> None:
        """End every attack stream (from this side) and wait until they are all gone."""

        async def stop() -> None:
            self._stop_attack.set()
            for task in self.tasks:
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            self.tasks = []

        self.run(stop())
