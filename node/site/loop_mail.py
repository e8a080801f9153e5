"""What the trainer thread tells its site's event loop, and how it gets there.

The loop owns the network's state (the Status reply among it) and the site's record of
its checkpoints; the trainer thread evaluates, writes periodic checkpoints and may die.
It never writes the loop's state: it hands one of the typed messages here to
:class:`LoopMail`, which schedules the loop's handler with ``call_soon_threadsafe``
(docs/design.md §3), so that state is written on the loop alone. The messages between the
replica and the network are :mod:`gossipd.node.trainer.messages`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("gossipd.node.site.site")


@dataclass(frozen=True)
class Evaluated:
    """An evaluation's metrics and the step it was taken at, for the Status reply."""

    metrics: dict[str, float]
    step: int


@dataclass(frozen=True)
class CheckpointWritten:
    """``checkpoint.pt`` of ``step`` is on disk: the step a restart resumes from."""

    step: int


@dataclass(frozen=True)
class TrainerDied:
    """Training died: the daemon must not idle on as a silent, half-alive peer, so the
    site shuts down (and `gossipd node` exits 1)."""


SiteMessage = Evaluated | CheckpointWritten | TrainerDied


class LoopMail:
    """The trainer thread's way to the site's loop: :meth:`send` from any thread runs
    ``handle`` on the loop. Until the loop is attached (before the trainer thread
    starts) and once it has closed (the daemon is past serving anything), a message has
    no one to read it and is dropped."""

    def __init__(self, handle: Callable[[SiteMessage], None]) -> None:
        self._handle = handle
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver to ``loop`` from now on (called on it, before the trainer starts)."""
        with self._lock:
            self._loop = loop

    def send(self, message: SiteMessage) -> None:
        with self._lock:
            loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._handle, message)
        except RuntimeError:  # the loop closed: nothing is served or recorded any more
            log.debug("dropped %r: the event loop has closed", message)
