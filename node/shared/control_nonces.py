"""The replay window of signed control commands: each nonce is obeyed once, in bounded memory."""

from __future__ import annotations

import heapq
import math

MAX_REMEMBERED = 4096  # nonces kept against replay; beyond it the oldest go (see NonceWindow)


class NonceWindow:
    """The nonces obeyed whose command is still within the window, at most ``capacity``.

    A nonce is forgotten once its command is older than the window (it would be refused as
    stale). When more than ``capacity`` are fresh, the oldest is forgotten and every command
    issued at or before it is refused from then on: memory stays bounded and no replay gets
    through; what it costs is refusing old commands never seen, under a flood only an
    operator (who must sign each) can make."""

    def __init__(self, window_s: float, capacity: int = MAX_REMEMBERED) -> None:
        self.window_s = window_s
        self.capacity = capacity
        self._by_time: list[tuple[int, str]] = []
        self._seen: set[str] = set()
        self.floor = -math.inf  # issued_at at or below which a forgotten one may hide

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, nonce: str, issued_at: int, now_s: float) -> bool:
        """Remember ``nonce``; False when it was seen, or may have been and was forgotten."""
        while self._by_time and self._by_time[0][0] < now_s - self.window_s:
            self._seen.discard(heapq.heappop(self._by_time)[1])
        if nonce in self._seen or issued_at <= self.floor:
            return False
        if len(self._seen) >= self.capacity:
            oldest, forgotten = heapq.heappop(self._by_time)
            self._seen.discard(forgotten)
            self.floor = max(self.floor, oldest)
        heapq.heappush(self._by_time, (issued_at, nonce))
        self._seen.add(nonce)
        return True
