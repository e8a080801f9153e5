"""How fast one peer may open push streams: a token bucket per peer, and a back-off for a
peer that overdraws it.

Every stream a peer opens costs this node a call's set-up and tear-down in grpc (about
0.5 ms of CPU on two cores, refused or not), whatever caps then refuse it. A member that
holds its share of the slots (``limits.max_inbound_pushes_per_peer``) and reopens every
refused stream at once was measured at 900 opens a second per site: a core of the
node's CPU, spent on it alone. So opens are budgeted per peer: ``limits.stream_open_burst``
at once, ``limits.max_stream_opens_per_s`` on average. An honest peer opens up to 4
streams per push and reuses them push after push, far below both.

A peer over its budget is refused (:class:`TooManyOpens`) for a back-off of
``limits.open_backoff_s``; whatever it opens meanwhile is refused too, still spending its
tokens. If it is still over its budget when the back-off ends, the next one lasts twice
as long, up to ``limits.max_open_backoff_s``; once its bucket is full again (it stayed
within its rate for ``burst / rate`` seconds) the next back-off starts from the first.
Such a refusal is answered only at the back-off's end or after ``limits.open_backoff_s``
(its ``hold_s``): a peer that waits for its answers before reopening is slowed to one
open per stream and second.

Pure bookkeeping on the event loop's clock: no awaits, no locks. One account per peer
that has opened a stream (a node id of the mesh's certificates), kept for the node's life.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from gossipd.node.errors import ConfigError, TooManyOpens
from gossipd.node.shared.config_sections import LimitsConfig


@dataclass
class _Account:
    """One peer's tokens, and its back-off."""

    tokens: float
    updated: float
    next_backoff_s: float
    backoff_until: float = 0.0


class OpenBudget:
    """Stream opens per peer: :meth:`admit` each, and it raises :class:`TooManyOpens` for a
    peer over its budget or in a back-off."""

    def __init__(
        self,
        rate_per_s: float,
        burst: int,
        backoff_s: float,
        max_backoff_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_backoff_s < backoff_s:
            raise ConfigError(
                f"limits.max_open_backoff_s = {max_backoff_s:g} is below limits.open_backoff_s "
                f"= {backoff_s:g}, where back-offs start; raise it to at least that"
            )
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._accounts: dict[str, _Account] = {}

    @classmethod
    def from_limits(cls, limits: LimitsConfig) -> OpenBudget:
        return cls(
            limits.max_stream_opens_per_s,
            limits.stream_open_burst,
            limits.open_backoff_s,
            limits.max_open_backoff_s,
        )

    def admit(self, peer: str) -> None:
        """One stream ``peer`` opens now: spends a token if it has one; raises
        :class:`TooManyOpens` if it has none (a back-off starts) or is in a back-off."""
        now = self._clock()
        account = self._refilled(peer, now)
        within = account.tokens >= 1.0
        if within:
            account.tokens -= 1.0
        left_s = account.backoff_until - now
        if left_s > 0.0:
            raise TooManyOpens(
                f"{peer!r} opened push streams faster than limits.max_stream_opens_per_s = "
                f"{self.rate_per_s:g} allows and is refused for {left_s:.1f} s more, longer "
                f"each time it goes on; {self._fix(peer)}",
                min(left_s, self.backoff_s),
            )
        if not within:
            backoff_s = account.next_backoff_s
            account.backoff_until = now + backoff_s
            account.next_backoff_s = min(2.0 * backoff_s, self.max_backoff_s)
            raise TooManyOpens(
                f"{peer!r} opened more than limits.stream_open_burst = {self.burst} push "
                f"streams at limits.max_stream_opens_per_s = {self.rate_per_s:g}: its new "
                f"streams are refused for {backoff_s:g} s, twice as long each time it goes "
                f"on (up to limits.max_open_backoff_s = {self.max_backoff_s:g} s); "
                f"{self._fix(peer)}",
                min(backoff_s, self.backoff_s),
            )

    def in_backoff(self) -> int:
        """Peers whose new streams are refused now."""
        now = self._clock()
        return sum(now < a.backoff_until for a in self._accounts.values())

    def _refilled(self, peer: str, now: float) -> _Account:
        account = self._accounts.get(peer)
        if account is None:
            account = self._accounts[peer] = _Account(float(self.burst), now, self.backoff_s)
        account.tokens = min(
            float(self.burst), account.tokens + (now - account.updated) * self.rate_per_s
        )
        account.updated = now
        if account.tokens >= self.burst and now >= account.backoff_until:
            account.next_backoff_s = self.backoff_s  # within its budget again: start over
        return account

    def _fix(self, peer: str) -> str:
        return (
            "an honest site opens a few per push and reuses them, so check that "
            f"{peer!r} runs this gossipd release, or remove it from tls.allow (SIGHUP); "
            "raise the limit only if honest sites are refused"
        )
