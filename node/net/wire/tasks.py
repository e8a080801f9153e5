"""The tasks a node runs on its event loop, and the one flag that says it is closing.

Every part of the network side starts its background work here instead of with a bare
``asyncio.create_task``, so that :meth:`LoopTasks.close` ends all of it and nothing
outlives the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopTasks:
    """The node's tasks, kept until they end or the node closes."""

    def __init__(self) -> None:
        self.stopping = asyncio.Event()
        self._tasks: set[asyncio.Future[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        """Run ``coro`` as a task of the node's (named, for stack dumps and tests)."""
        task = asyncio.ensure_future(coro)
        if name:
            task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Cancel every task still running and wait until each has ended."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
