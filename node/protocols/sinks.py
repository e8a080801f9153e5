"""Suspecting a weight sink: a member that takes this node's weight and never gives any back.

mTLS proves who a peer is, not that it is honest. A member that acknowledges every
push as merged and never pushes back drains the mesh's sum-weights to nothing (a
3-site mesh lost Σw 2.47e6 → 8e-14 in 8 s and stopped gossiping). This watch keeps,
per peer, one score of the weight the peer took from this node and did not return,
and the ledger stops pushing to a peer while its score is over ``bound``.

The score is a one-sided CUSUM over *shares of this node's own weight*, so it does
not care how much weight the mesh holds (a sink that drains the mesh shrinks every
push; a score in absolute weight would stop growing before it tripped):

* an acknowledged push to the peer adds ``(1 − allowance)·f``, where ``f`` is the
  fraction of this node's available weight the push carried (mean over segments;
  every protocol here pushes halves, f = 1/2);
* a payload merged from the peer subtracts ``(1 + allowance)·r/a``, where ``r`` is
  the weight it brought and ``a`` this node's available weight before it (mean over
  segments); the score never goes below 0.

Honest flows between two peers are a zero-drift random walk in weight, and in these
shares they drift *down* (r/a averages at least 1/2 when both push halves of
weights with the same mean, by Jensen), and ``allowance`` adds a drift of
``−allowance·(f + r/a)`` per event, so an honest peer's score is a reflected walk
with negative drift: it has a stationary distribution with an exponential tail and
does not creep up with the length of the run (a cumulative net weight, or a count of
pushes, does: their excursions grow as √t). A sink returns nothing, so its score
grows by ``(1 − allowance)·f`` per push and it is suspected after at most
``ceil(bound / ((1 − allowance)·f))`` acknowledged pushes from this node, plus the
pushes already in flight to it (one per edge). That is the amount a sink can take:
that many pushes' worth, each ``f`` of this node's weight at the time (and each below
``limits.max_sum_weight``). A peer stays suspected until it returns weight (its own
pushes bring the score down); nothing but that clears it, so waiting does not help a
sink.

The book keeps ``rows`` peers' scores (:data:`~.settings.BOOK_ROWS`: every peer of a
federation; a few in a larger simulated mesh). The peers without a row are watched as one
peer, whose score is the ``floor``:

* a push to a peer without a row gives it a row at the floor plus the push;
* a payload from a peer without a row lowers the floor, as it would that peer's row;
* a full book forgets its lowest half of rows (not the oldest: a sink that takes weight and then
  stays quiet would be forgotten first and come back with a clean score) and raises the
  floor to each one's score less what the floor fell while that row was kept.

So a peer gains by being forgotten no more than what the peers without a row returned
since it got its row, and a sink near the bound is the last row forgotten; one that keeps
its score low enough to be forgotten takes no more than an honest peer met once. Where a
node keeps a row for every peer it met (every mesh of fewer sites than ``rows``) the floor
stays 0. The fall is what stops a ratchet: a newcomer's row starts at the floor, so a
floor raised to the full score forgotten climbed by a push's worth each time the book
turned over, whatever the payloads of peers without a row took off it (with 8 rows, 500
simulated crossover nodes had a mean floor of 3.5 of the bound 6 after 160 rounds, 3.3
with the payloads lowering it; 0.06 now). And rows do not move with the floor: had each
row kept its score as an excess over the floor, a sink pushed every tenth push beside
8 rows of peers met once was never suspected (honest returns lowered its score too).

Pure: no clock, no I/O; the simulator drives it through the same cores.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gossipd.node.protocols.settings import BOOK_ROWS, overflow


@dataclass
class SinkWatch:
    """Per-peer score of weight taken and not returned; suspected while over ``bound``."""

    bound: float
    allowance: float
    scores: dict[str, float] = field(default_factory=dict)
    # The score of every peer without a row (see the module's text).
    floor: float = 0.0
    rows: int = BOOK_ROWS
    # How far the floor has fallen in all, and how far it had when each row was made.
    fallen: float = 0.0
    made: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.bound > 0:  # inf: no peer is ever suspected
            raise ValueError(f"sink bound must be > 0, got {self.bound}")
        if not 0 <= self.allowance < 1:
            raise ValueError(f"sink allowance must be in [0, 1), got {self.allowance}")
        if self.rows < 1:
            raise ValueError(f"a sink watch keeps at least 1 row, got {self.rows}")

    def pushes_to_suspect(self, share: float = 0.5) -> float:
        """How many acknowledged pushes of ``share`` of this node's weight, none returned,
        make a peer suspected: the stated amount a sink can take (plus one in flight);
        inf when the watch is off."""
        if math.isinf(self.bound):
            return math.inf
        return math.floor(self.bound / ((1 - self.allowance) * share)) + 1

    def sent(self, peer: str, share: float) -> None:
        """``peer`` acknowledged a push of ``share`` of this node's available weight."""
        self._move(peer, (1 - self.allowance) * share)

    def received(self, peer: str, share: float) -> None:
        """A payload of ``share`` (its weight over this node's available weight) merged."""
        self._move(peer, -(1 + self.allowance) * share)

    def suspected(self, peer: str) -> bool:
        return self.scores.get(peer, self.floor) > self.bound

    def sinks(self) -> frozenset[str]:
        """Every peer suspected now (of those with a row)."""
        return frozenset(p for p, s in self.scores.items() if s > self.bound)

    def _move(self, peer: str, delta: float) -> None:
        score = self.scores.get(peer)
        if score is None:
            if delta <= 0.0:  # returned by a peer without a row: the floor's to lower
                fallen = min(self.floor, -delta)
                self.floor -= fallen
                self.fallen += fallen
                return
            for lowest in overflow(self.scores, len(self.scores), self.rows, self.scores.get):
                since = self.fallen - self.made.pop(lowest, self.fallen)
                self.floor = max(self.floor, self.scores.pop(lowest) - since)
            score = self.floor
            self.made[peer] = self.fallen
        self.scores[peer] = max(0.0, score + delta)

    def state(self) -> dict[str, Any]:
        """The rows, and the floor under the key ``""`` (no node id is empty)."""
        return {**self.scores, "": self.floor} if self.floor else dict(self.scores)

    def restore(self, scores: Mapping[str, Any]) -> None:
        """Scores from a checkpoint: a sink does not escape suspicion by outlasting a restart."""
        rows = {str(p): float(s) for p, s in scores.items()}
        self.floor = rows.pop("", 0.0)
        self.scores = rows
        self.fallen = 0.0  # a row restored folds into the floor at its full score
        self.made = dict.fromkeys(rows, 0.0)
