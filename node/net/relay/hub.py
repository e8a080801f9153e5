"""The relay's side: the sites attached to this node, and the connections it joins to them.

A site that cannot be dialled keeps an ``Attach`` stream open here. A dialler's ``Dial``
names the site; the relay sends the site an order with a fresh token over its
attachment, the site opens a ``Take`` stream with that token, and from then on the
relay copies frames between the two streams. It never looks inside them: they carry
the end sites' own TLS records, so the relay can drop or delay a connection (a faulty
link, which the end sites already survive) but not read, alter, replay or forge it.

Who dials and who takes is the certificate of each stream's connection to the relay,
never a name in a frame. Everything here is bounded: attached sites
(``reach.max_sites``), joined connections (``reach.max_sessions``, and
``reach.max_sessions_per_origin`` for one dialler, so a flood through a relay is
refused), frames queued per connection (``QUEUE_FRAMES`` of at most ``MAX_FRAME_BYTES``
each way), and the bytes forwarded per second (``reach.rate_mbit``).

A relay that leaves (:meth:`RelayHub.begin_leaving`) tells its attached sites to attach
elsewhere and each dialler to finish its calls and close its connection, and waits for
that (:meth:`RelayHub.drained`, bounded) before its server stops: cut at once, a push
between two sites with no other relay would stay half-answered for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from gossipd.node.errors import (
    InvalidFrame,
    MeshMismatch,
    NotRelaying,
    RelayAbsent,
    RelayBusy,
    RelayForged,
    RelayLoop,
    RelayRefused,
)
from gossipd.node.net.telemetry.metrics import NodeMetrics
from gossipd.node.shared.config_reach import ReachConfig
from gossipd.node.shared.relay_address import parse
from gossipd.proto import gossip_pb2 as pb

log = logging.getLogger(__name__)
F = TypeVar("F")

# The most bytes one relayed frame may carry, and how many may wait each way per
# connection: what one joined connection can hold in this process is bounded.
MAX_FRAME_BYTES = 64 << 10
QUEUE_FRAMES = 4
# How long a Dial waits for the attached site's Take, and any stream for its first frame.
TAKE_WAIT_S = 5.0
FIRST_FRAME_S = 5.0
# A site silent this many keepalive periods is given up.
SILENT_PERIODS = 3
TOKEN_BYTES = 16


@dataclass
class _Attached:
    site: str
    address: str
    heard: float
    orders: asyncio.Queue[pb.RelayOrder | None] = field(default_factory=asyncio.Queue)


@dataclass
class _Session:
    """One joined connection: the frames each way, and whether either end has gone."""

    origin: str
    target: str
    to_site: asyncio.Queue[bytes] = field(default_factory=lambda: asyncio.Queue(QUEUE_FRAMES))
    to_dialer: asyncio.Queue[bytes] = field(default_factory=lambda: asyncio.Queue(QUEUE_FRAMES))
    taken: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    leaving: asyncio.Event = field(default_factory=asyncio.Event)  # the relay is leaving
    told: bool = False  # the dialler was told so

    async def next(self, queue: asyncio.Queue[bytes], notice: bool = False) -> bytes | None:
        """The next frame of ``queue``, or None once either end has gone and it is empty;
        with ``notice``, b"" once when the relay starts leaving (the dialler is told)."""
        while True:
            if notice and self.leaving.is_set() and not self.told:
                self.told = True
                return b""
            if not queue.empty():
                return queue.get_nowait()
            if self.done.is_set():
                return None
            get = asyncio.ensure_future(queue.get())
            stops = {asyncio.ensure_future(self.done.wait())}
            if notice and not self.told:
                stops.add(asyncio.ensure_future(self.leaving.wait()))
            try:
                await asyncio.wait({get, *stops}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for stop in stops:
                    stop.cancel()
                if not get.done():
                    get.cancel()
            if get.done() and not get.cancelled():
                return get.result()


class Pace:
    """Bytes forwarded, paced to ``rate_mbit`` for all connections together (0: no cap)."""

    def __init__(self, rate_mbit: float) -> None:
        self.rate_bytes_s = rate_mbit * 1e6 / 8
        self.free_at = 0.0

    async def take(self, nbytes: int) -> None:
        if not self.rate_bytes_s:
            return
        now = asyncio.get_running_loop().time()
        self.free_at = max(self.free_at, now) + nbytes / self.rate_bytes_s
        if self.free_at - now > 0.05:
            await asyncio.sleep(self.free_at - now)


class RelayHub:
    """The attached sites and joined connections of one node; ``enabled`` once the node
    knows it can be dialled and ``reach.relay`` is on."""

    def __init__(
        self, node_id: str, mesh_id: str, config: ReachConfig, metrics: NodeMetrics
    ) -> None:
        self.node_id = node_id
        self.mesh_id = mesh_id
        self.config = config
        self.metrics = metrics
        self.enabled = False
        self.sites: dict[str, _Attached] = {}
        self.sessions: dict[bytes, _Session] = {}
        self.per_origin: Counter[str] = Counter()
        self.pace = Pace(config.rate_mbit)
        self.forwarded = 0
        self.leaving = False  # begin_leaving: no new attachment, diallers told to move
        self._ended = asyncio.Event()  # a joined connection ended (drained() waits on it)
        metrics.relay_sites.set_function(lambda: len(self.sites))
        metrics.relay_sessions.set_function(lambda: len(self.sessions))

    def refused(self, err: RelayRefused) -> None:
        self.metrics.relay_refused.labels(err.reason).inc()

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise NotRelaying(
                f"{self.node_id} relays for nobody (it cannot be dialled itself, or its "
                "reach.relay is off); attach to another reachable peer"
            )

    # -- leaving ---------------------------------------------------------------------
    async def leave(self, leave_mesh: Awaitable[None], drain_s: float) -> None:
        """This node leaves: the sites relayed here are told to move first (their pushes
        to each other through here settle while ``leave_mesh`` hands this node's weight
        off), then the connections they still hold here get up to ``drain_s`` to finish
        before the server stops (docs/nat.md, "A relay leaving")."""
        joined = self.begin_leaving()
        await leave_mesh
        if not joined:
            return
        left = await self.drained(drain_s)
        log.info(
            "relay: %d connection(s) joined here for other sites when leaving; %s",
            len(joined),
            f"{len(left)} still open after {drain_s:g} s are cut ({', '.join(left)}): "
            "a push on them is retried through another relay, or folds back"
            if left
            else "all finished their calls first",
        )

    def begin_leaving(self) -> list[str]:
        """This node is leaving the mesh: tell every attached site to attach elsewhere, and
        every dialler (but this node) to finish the calls on its connection and open the
        next ones through another relay. Connections keep being joined meanwhile, new
        ones too: a push whose answer is crossing, or its retry, still settles here.
        Returns the connections other sites hold here now (:meth:`others_sessions`)."""
        self.leaving = True
        for site in self.sites.values():
            site.orders.put_nowait(pb.RelayOrder(leaving=True))
        for session in self.sessions.values():
            if session.origin != self.node_id:
                session.leaving.set()
        return self.others_sessions()

    def others_sessions(self) -> list[str]:
        """Joined connections that other sites dialled (this node's own end with it), as
        "origin -> target"."""
        return [
            f"{s.origin} -> {s.target}" for s in self.sessions.values() if s.origin != self.node_id
        ]

    async def drained(self, within_s: float) -> list[str]:
        """Wait until the connections other sites dialled through here have ended (their
        diallers close them once their calls finished), at most ``within_s``; returns
        those still open, which this node's stop cuts."""
        deadline = asyncio.get_running_loop().time() + within_s
        while left := self.others_sessions():
            self._ended.clear()
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return left
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._ended.wait()
        return []

    # -- an attached site ----------------------------------------------------------
    async def attach(
        self, site: str, frames: AsyncIterator[pb.AttachFrame]
    ) -> AsyncIterator[pb.RelayOrder]:
        """Orders (and pings) for ``site`` for as long as it stays attached and heard."""
        self._check_enabled()
        first = await _first(frames, "an Attach")
        if first.mesh_id != self.mesh_id:
            raise MeshMismatch(f"{site} attaches for mesh {first.mesh_id!r}, not ours")
        relayed = parse(first.address)
        if relayed is None or relayed.site != site:
            raise NotRelaying(
                f"{site} attaches with address {first.address!r}: a site that needs a relay "
                f"cannot be dialled, so it must advertise relay://{site}@... (its relays), "
                "not a direct address"
            )
        if self.leaving:
            raise NotRelaying(
                f"{self.node_id} is leaving the mesh; attach to another reachable peer"
            )
        if site not in self.sites and len(self.sites) >= self.config.max_sites:
            raise RelayBusy(
                f"{self.node_id} already relays for {len(self.sites)} sites "
                "(reach.max_sites); attach to another reachable peer"
            )
        loop = asyncio.get_running_loop()
        old = self.sites.get(site)
        if old is not None:
            old.orders.put_nowait(None)  # the newer attachment of the same site wins
        me = self.sites[site] = _Attached(site, first.address, loop.time())
        log.info("relaying for %s (attached)", site)
        listener = asyncio.ensure_future(self._hear(me, frames))
        period = self.config.keepalive_s
        try:
            yield pb.RelayOrder(ping=True)  # attached: the site need not wait a period to know
            while not listener.done():
                try:
                    order = await asyncio.wait_for(me.orders.get(), period)
                except TimeoutError:
                    order = pb.RelayOrder(ping=True)
                if order is None:
                    return
                if loop.time() - me.heard > SILENT_PERIODS * period:
                    log.info(
                        "%s was silent for %.0f s: no longer relaying for it", site, 3 * period
                    )
                    return
                yield order
        finally:
            listener.cancel()
            if self.sites.get(site) is me:
                del self.sites[site]
                for session in self.sessions.values():
                    if session.target == site:
                        session.done.set()

    @staticmethod
    async def _hear(me: _Attached, frames: AsyncIterator[pb.AttachFrame]) -> None:
        async for _ in frames:
            me.heard = asyncio.get_running_loop().time()

    # -- a dialler -----------------------------------------------------------------
    async def dial(
        self, origin: str, frames: AsyncIterator[pb.RelayFrame]
    ) -> AsyncIterator[pb.RelayFrame]:
        """``origin``'s connection to the site its first frame names, once that site took it."""
        self._check_enabled()
        first = await _first(frames, "a Dial")
        target = first.target
        if target in (self.node_id, origin):
            raise RelayLoop(f"{origin} asks {self.node_id} to relay to {target!r}: a loop")
        site = self.sites.get(target)
        if site is None:
            raise RelayAbsent(
                f"{target!r} is not attached to relay {self.node_id}; it may be attached to "
                "another relay its address names"
            )
        self._check_room(origin)
        token = os.urandom(TOKEN_BYTES)
        session = self.sessions[token] = _Session(origin, target)
        if self.leaving and origin != self.node_id:
            session.leaving.set()
        self.per_origin[origin] += 1
        pump: asyncio.Future[None] | None = None
        try:
            site.orders.put_nowait(pb.RelayOrder(token=token, origin=origin))
            try:
                async with asyncio.timeout(TAKE_WAIT_S):
                    await session.taken.wait()
            except TimeoutError:
                raise RelayAbsent(
                    f"{target} did not take a connection within {TAKE_WAIT_S:g} s"
                ) from None
            yield pb.RelayFrame(target=target)  # joined: the dialler may send
            pump = asyncio.ensure_future(self._pump(frames, session, session.to_site, "to_site"))
            while (data := await session.next(session.to_dialer, notice=True)) is not None:
                yield pb.RelayFrame(data=data) if data else pb.RelayFrame(leaving=True)
        finally:
            session.done.set()
            if pump is not None:
                pump.cancel()
            self.sessions.pop(token, None)
            self._ended.set()
            self.per_origin[origin] -= 1
            if self.per_origin[origin] <= 0:
                del self.per_origin[origin]

    def _check_room(self, origin: str) -> None:
        cap = self.config.max_sessions_per_origin
        if self.per_origin[origin] >= cap:
            raise RelayBusy(
                f"{origin} already holds {cap} connections through relay {self.node_id} "
                "(reach.max_sessions_per_origin)"
            )
        if len(self.sessions) >= self.config.max_sessions:
            raise RelayBusy(
                f"relay {self.node_id} joins {len(self.sessions)} connections already "
                "(reach.max_sessions)"
            )

    # -- the attached site's side of one connection --------------------------------
    async def take(
        self, site: str, frames: AsyncIterator[pb.RelayFrame]
    ) -> AsyncIterator[pb.RelayFrame]:
        first = await _first(frames, "a Take")
        session = self.sessions.get(first.token)
        if session is None or session.target != site or session.taken.is_set():
            raise RelayForged(
                f"{site} takes a connection with a token this relay did not give it (or "
                "gave and saw taken already): refused"
            )
        session.taken.set()
        pump = asyncio.ensure_future(self._pump(frames, session, session.to_dialer, "to_dialer"))
        try:
            while (data := await session.next(session.to_site)) is not None:
                yield pb.RelayFrame(data=data)
        finally:
            session.done.set()
            pump.cancel()

    async def _pump(
        self,
        frames: AsyncIterator[pb.RelayFrame],
        session: _Session,
        queue: asyncio.Queue[bytes],
        direction: str,
    ) -> None:
        """One end's frames into the other end's queue, paced and counted."""
        counter = self.metrics.relay_bytes.labels(direction)
        try:
            async for frame in frames:
                data = frame.data
                if len(data) > MAX_FRAME_BYTES:
                    raise InvalidFrame(
                        f"relayed frame of {len(data)} bytes (max {MAX_FRAME_BYTES})"
                    )
                if not data:
                    continue
                await self.pace.take(len(data))
                counter.inc(len(data))
                self.forwarded += len(data)
                await queue.put(data)
        except Exception as err:
            log.debug("relayed connection %s -> %s ended: %r", session.origin, session.target, err)
        finally:
            session.done.set()


async def _first(frames: AsyncIterator[pb.AttachFrame | pb.RelayFrame], what: str):  # type: ignore[no-untyped-def]
    try:
        async with asyncio.timeout(FIRST_FRAME_S):
            return await anext(frames)
    except (TimeoutError, StopAsyncIteration):
        raise InvalidFrame(
            f"{what} stream sent no first frame within {FIRST_FRAME_S:g} s"
        ) from None
