"""The daemon's periodic progress line: what an operator tailing the log sees it doing.

A site started as the quickstart says used to write nothing for many minutes while it
trained, which reads as a hang. One INFO line per ``progress_interval_s`` says the
step, the loss, the live peers, the sum-weight (and what of it is in flight) and how
many pushes peers acknowledged per second since the previous line.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from gossipd.node.trainer.report import Summary

log = logging.getLogger("gossipd.node.launch.progress")


def _weight(summary: Summary) -> str:
    """One number when every segment holds the same weight (the usual case), else a range."""
    weights = summary.weights
    if not weights:
        return "no sum-weight"
    low, high = min(weights), max(weights)
    text = f"weight {low:.4g}" if high - low < 1e-9 else f"weight {low:.4g}..{high:.4g}"
    reserved = max(summary.reserved, default=0.0)
    return f"{text} ({reserved:.4g} in flight)" if reserved else text


class ProgressLog:
    """Logs one progress line per ``interval_s`` from the replica's published summary."""

    def __init__(
        self, interval_s: float, summary: Callable[[], Summary], live_peers: Callable[[], int]
    ) -> None:
        self.interval_s = interval_s
        self.summary = summary
        self.live_peers = live_peers
        self._last: tuple[float, Summary] | None = None

    def line(self, now: float | None = None) -> str:
        """The next line; rates are over the time since the previous one."""
        now = time.monotonic() if now is None else now
        s = self.summary()
        previous, self._last = self._last, (now, s)
        elapsed = now - previous[0] if previous else 0.0
        if previous and elapsed > 0:
            steps_s = (s.steps - previous[1].steps) / elapsed
            acked_s = (s.pushes_acked - previous[1].pushes_acked) / elapsed
            rates = f" ({steps_s:.1f} steps/s)"
            acked = f"{acked_s:.2f} pushes acknowledged/s"
        else:
            rates, acked = "", f"{s.pushes_acked} pushes acknowledged"
        loss = "no step yet" if math.isnan(s.loss) else f"loss {s.loss:.4g}"
        return (
            f"progress: step {s.steps}{rates}, {loss}, {self.live_peers()} live peers, "
            f"{_weight(s)}, {acked}"
        )

    async def run(self) -> None:
        """Until cancelled: a line now, then one per interval."""
        while True:
            log.info("%s", self.line())
            await asyncio.sleep(self.interval_s)
