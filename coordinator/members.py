"""The coordinator's state: who is in the view, since when it heard from them, the epoch,
the scheduler, and the Membership streams to tell of every change.

No gRPC here: the servicer checks who is asking and what they ask, this module keeps
the books. Times are the coordinator's monotonic clock, passed in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import dataclass

from gossipd.node.protocols.scheduler import Grant, Scheduler, SchedulerError

log = logging.getLogger("gossipd.coordinator")


@dataclass(frozen=True)
class View:
    members: dict[str, str]  # node id -> address
    epoch: int


class Members:
    def __init__(self, scheduler: Scheduler, epoch: int = 0) -> None:
        self.scheduler = scheduler
        self.epoch = epoch
        self.addresses: dict[str, str] = {}
        self.last_seen: dict[str, float] = {}
        self.granted: dict[str, str] = {}  # node -> the peer it was last granted, unreported
        # One stream per member: a new one from the same node ends its old one, so the
        # number of open streams never exceeds the number of members.
        self.streams: dict[str, asyncio.Queue[View | None]] = {}
        self.dirty = False  # something worth persisting changed since the last write

    def view(self) -> View:
        return View(dict(sorted(self.addresses.items())), self.epoch)

    def known(self, node: str) -> bool:
        return node in self.addresses

    # -- membership ---------------------------------------------------------------------
    def register(self, node: str, address: str, now_s: float) -> bool:
        """Add ``node`` (or note its new address); True when the view changed."""
        self.last_seen[node] = now_s
        if self.addresses.get(node) == address:
            return False
        new = node not in self.addresses
        self.addresses[node] = address
        self.scheduler.add(node)
        log.info(
            "%s %s at %s; view epoch %d",
            "registered" if new else "re-addressed",
            node,
            address,
            self.epoch + 1,
        )
        self._changed()
        return True

    def heartbeat(self, node: str, now_s: float) -> bool:
        """Note that ``node`` is alive; False when it is not in the view (register again)."""
        if node not in self.addresses:
            return False
        self.last_seen[node] = now_s
        return True

    def sweep(self, now_s: float, drop_after_s: float) -> list[str]:
        """Drop the members silent for ``drop_after_s``; returns who was dropped."""
        gone = [n for n, seen in self.last_seen.items() if now_s - seen >= drop_after_s]
        for node in gone:
            del self.addresses[node], self.last_seen[node]
            self.granted.pop(node, None)
            self.scheduler.remove(node)
            stream = self.streams.pop(node, None)
            if stream is not None:
                _replace(stream, None)
        if gone:
            self._changed()
            log.warning(
                "dropped %s: no heartbeat for %.0f s; view epoch %d (they are added back when "
                "they register again)",
                ", ".join(sorted(gone)),
                drop_after_s,
                self.epoch,
            )
        return gone

    def subscribe(self, node: str) -> asyncio.Queue[View | None]:
        """A queue that holds the newest view not yet sent (None: the stream should end)."""
        old = self.streams.pop(node, None)
        if old is not None:
            _replace(old, None)
        queue: asyncio.Queue[View | None] = asyncio.Queue(maxsize=1)
        queue.put_nowait(self.view())
        self.streams[node] = queue
        return queue

    def end_streams(self) -> None:
        """End every Membership stream (the coordinator is stopping)."""
        for queue in self.streams.values():
            _replace(queue, None)

    def unsubscribe(self, node: str, queue: asyncio.Queue[View | None]) -> None:
        if self.streams.get(node) is queue:
            del self.streams[node]

    # -- scheduling ---------------------------------------------------------------------
    def start_time(self, node: str, end_s: float, now_s: float) -> Grant | None:
        """The scheduler's answer for ``node``. A node asking again has finished (or given
        up) its last pull even if its report was lost: that peer is freed first."""
        peer = self.granted.pop(node, None)
        if peer is not None:
            with contextlib.suppress(SchedulerError):  # its lease ran out, or the peer left
                self.scheduler.report(node, peer, math.inf)
        grant = self.scheduler.start_time(node, end_s, now_s)
        if grant is not None:
            self.granted[node] = grant.peer
        return grant

    def report(self, node: str, peer: str, transfer_s: float) -> None:
        self.scheduler.report(node, peer, transfer_s)
        self.granted.pop(node, None)
        if transfer_s != math.inf:
            self.dirty = True

    def estimates(self) -> int:
        return len(self.scheduler.state_dict()["estimates"])

    # -- internals ------------------------------------------------------------------------
    def _changed(self) -> None:
        self.epoch += 1
        self.dirty = True
        view = self.view()
        for queue in self.streams.values():
            _replace(queue, view)


def _replace(queue: asyncio.Queue[View | None], item: View | None) -> None:
    """Put ``item`` in a one-slot queue, replacing what the reader has not taken yet: a
    slow reader gets the newest view, never a backlog."""
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(item)
