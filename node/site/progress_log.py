"""The daemon's periodic progress line: what an operator tailing the log sees it doing.

A site started as the quickstart says used to write nothing for many minutes while it
trained, which reads as a hang. One INFO line per ``progress_interval_s`` says the
step (and the ranks of a site of several processes), the loss, the live peers, then
what the protocol exchanges in its own terms since the previous line: for a push
protocol the sum-weight (and what of it is in flight) and the pushes peers
acknowledged per second; for a pulling one (its summary counts ``pulls`` by outcome)
the pulls merged per second, the share of the time the trainer waited for them, and
who schedules them. A pulling protocol acknowledges no pushes and keeps no
sum-weights, so a push line read "0.00 pushes acknowledged/s" for a healthy node.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from gossipd.node.trainer.report import Summary

log = logging.getLogger("gossipd.node.launch.progress")

# How the line names a summary's ``scheduling``.
SCHEDULED_BY = {"coordinator": "scheduled by the coordinator", "decentralized": "scheduled alone"}


def _weight(summary: Summary) -> str:
    """One number when every segment holds the same weight (the usual case), else a range."""
    weights = summary.weights
    if not weights:
        return "no sum-weight"
    low, high = min(weights), max(weights)
    text = f"weight {low:.4g}" if high - low < 1e-9 else f"weight {low:.4g}..{high:.4g}"
    reserved = max(summary.reserved, default=0.0)
    return f"{text} ({reserved:.4g} in flight)" if reserved else text


def _pushes(now: Summary, before: Summary | None, elapsed_s: float) -> str:
    if before is None:
        return f"{_weight(now)}, {now.pushes_acked} pushes acknowledged"
    acked_s = (now.pushes_acked - before.pushes_acked) / elapsed_s
    return f"{_weight(now)}, {acked_s:.2f} pushes acknowledged/s"


def _pulls(now: Summary, before: Summary | None, elapsed_s: float) -> str:
    """Pulls merged (and failed) and the trainer's wait share, over the interval when there
    was a previous line, else since the first step."""
    merged, failed = now.pulls.get("merged", 0), now.pulls.get("failed", 0)
    if before is None:
        pulls = f"{merged} pulls merged"
        waited = now.wait_fraction
    else:
        merged_s = (merged - before.pulls.get("merged", 0)) / elapsed_s
        failed -= before.pulls.get("failed", 0)
        pulls = f"{merged_s:.2f} pulls merged/s"
        waited = (now.wait_s - before.wait_s) / elapsed_s
    if failed:
        pulls += f" ({failed} failed)"
    scheduled = SCHEDULED_BY.get(now.scheduling, "not scheduled yet")
    return f"{pulls}, waiting {waited:.1%} of the time for pulls, {scheduled}"


class ProgressLog:
    """Logs one progress line per ``interval_s`` from the replica's published summary;
    ``ranks``: the processes training this site (rank 0 logs for them)."""

    def __init__(
        self,
        interval_s: float,
        summary: Callable[[], Summary],
        live_peers: Callable[[], int],
        ranks: int = 1,
    ) -> None:
        self.interval_s = interval_s
        self.summary = summary
        self.live_peers = live_peers
        self.ranks = ranks
        self._last: tuple[float, Summary] | None = None

    def line(self, now: float | None = None) -> str:
        """The next line; rates are over the time since the previous one."""
        now = time.monotonic() if now is None else now
        s = self.summary()
        previous, self._last = self._last, (now, s)
        elapsed = now - previous[0] if previous else 0.0
        before = previous[1] if previous and elapsed > 0 else None
        rates = f" ({(s.steps - before.steps) / elapsed:.1f} steps/s)" if before else ""
        ranks = f" on {self.ranks} ranks" if self.ranks > 1 else ""
        loss = "no step yet" if math.isnan(s.loss) else f"loss {s.loss:.4g}"
        exchange = (_pulls if s.pulls else _pushes)(s, before, elapsed)
        return (
            f"progress: step {s.steps}{rates}{ranks}, {loss}, {self.live_peers()} live peers, "
            f"{exchange}"
        )

    async def run(self) -> None:
        """Until cancelled: a line now, then one per interval."""
        while True:
            log.info("%s", self.line())
            await asyncio.sleep(self.interval_s)
