"""Counting refused requests without letting a flood write the log or grow a table.

Every refusal is counted by reason (for Status and Prometheus). The log gets one
line per (peer, reason) per interval, carrying how many were refused since the
last line, so 3,000 junk calls cost one line, not 3,000. The table of (peer,
reason) keys is capped: the least recently logged key is forgotten first.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict

log = logging.getLogger("gossipd.node.shared.rejections")


def peer_host(peer: str) -> str:
    """``ipv4:1.2.3.4:5678`` → ``1.2.3.4``: one key per remote host, not per connection."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host = rest.rpartition(":")[0]
        return host.strip("[]") or rest
    return peer


class Throttle:
    """At most one line per key and interval; the table of keys is capped (least recently
    logged forgotten first), so whoever makes up keys cannot grow it."""

    def __init__(self, interval_s: float, max_keys: int = 1024) -> None:
        self.interval_s = interval_s
        self.max_keys = max_keys
        # key -> (monotonic time of the last line, occurrences since then)
        self._last: OrderedDict[object, tuple[float, int]] = OrderedDict()

    def admit(self, key: object, now: float | None = None) -> int | None:
        """None: stay quiet; else log now, saying how many were kept quiet since the last."""
        now = time.monotonic() if now is None else now
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval_s:
            self._last[key] = (last[0], last[1] + 1)
            return None
        self._last[key] = (now, 0)
        self._last.move_to_end(key)
        while len(self._last) > self.max_keys:
            self._last.popitem(last=False)
        return last[1] if last is not None else 0


class RejectionLog:
    def __init__(self, interval_s: float, max_keys: int = 1024) -> None:
        self.counts: Counter[str] = Counter()
        self.throttle = Throttle(interval_s, max_keys)

    def record(
        self,
        peer: str,
        reason: str,
        detail: str,
        now: float | None = None,
        level: int = logging.WARNING,
    ) -> bool:
        """Count one refusal; True if it was logged (first of its kind in this interval).

        ``level``: INFO for a refusal that is part of normal operation (a benign race),
        so that WARNING keeps meaning "look at this"."""
        self.counts[reason] += 1
        suppressed = self.throttle.admit((peer, reason), now)
        if suppressed is None:
            return False
        more = f" (and {suppressed} more since the last report)" if suppressed else ""
        log.log(level, "refused a request from %s: %s%s", peer, detail, more)
        return True
