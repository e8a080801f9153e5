"""Weight balance: each site's data counts alike, whatever its speed.

Part of the sum-weight ledger (:mod:`.ledger`), for every protocol that pushes shares of
its weight. A site's local steps enter the mesh's models in proportion to the weight it
holds, so a site left with almost no weight trains a model nobody else takes in.

Without balance, weight settles where each site's outflow meets its inflow: a site that
pushes r times a second, half its weight each time, holds about 1/r of what a site
pushing once a second holds. Sites of a real federation differ in speed by design: a
2-rank site whose pushes the CPU budget held pushed 0.2 times a second beside a peer
pushing 5 times, and after two minutes held 1.9945 of the mesh's 2.0, its peer 5e-6;
the slow site's model, and so its data, was the consensus.

The rule, per segment: a node keeps the mean of the weight it holds over its last
pushes (about ``AVERAGE_PUSHES`` of them) and scales what each push carries by a factor
of at most 1. While that mean is under its share by more than ``DEAD_BAND`` of the
share, the factor shrinks a little at each push; while it is over by more, the factor
grows back. A site that pushes 25 times as often as another ends pushing a 25th of its
protocol's share, and both hold about their share. At equal speeds the mean stays
within the band (weights wander around the share), the factor stays near 1, and the
protocols push what their papers say: the structured ones (pushsum-expgraph, persyn,
crossover, shuffle-exchange) keep every weight at exactly the share there, so the
factor never moves.

The share is the mesh's weight per site as this node sees it: the mean of its own
weight and of each peer's, as the peer's acknowledgements report it (the receiver's
weight after it merged, less what this node's push brought; ``heard``). Founding sites
start at 1 and joiners at 0, and crashes lose weight, so the mesh's weight per site is
1 only in a mesh of founders that never lost any: a share fixed at 1 kept every site of
a mesh with as many joiners as founders under it for good, and its pushes at a
hundredth of their size.

On by default in every protocol with weights (``gossip.weight_balance``). The per-peer
credit (:mod:`.credit`) bounds what one peer holds of this node's weight, not how
weight follows speed across many sites.
What a peer could do to it, and what bounds that (the ledger's ``hear_receiver``):

* Lie in its acknowledgements. Each report in the share's mean is clamped to a
  founder's weight plus a third of one per other value in the mean, so one liar makes
  the share at most 4/3 of the honest sites' weight, inside the band, however few peers
  report (a directed protocol hears from its log2 N out-neighbours only): no honest
  factor moves. Two liars can shrink honest pushes, down to ``LEAST_FACTOR``.
* Sink weight. A suspected sink's reports are not heard (:mod:`.sinks`), and the share
  averages only the last ``REPORTERS`` peers to report, so a sink named by the credit
  instead, which gets no more pushes, drops out of it. Until then the honest sites look
  under the share, and their factors shrink a little and stay where they were.
"""

from __future__ import annotations

import math
from collections.abc import Container
from dataclasses import dataclass, field

SHARE = 1.0  # a founding site's weight: the share until a peer reports its own
AVERAGE_PUSHES = 50  # the held weight is averaged over about this many pushes
DEAD_BAND = 0.3  # a mean within this fraction of the share leaves the factor alone
GAIN = 0.05  # per push, the factor changes by exp(GAIN × how far the mean is from the share)
LEAST_FACTOR = 0.01  # a site 100 times faster than the slowest is balanced; faster, nearly
MOST_EXPONENT = -math.log(LEAST_FACTOR)  # one push never moves a factor further than this
# The share averages the latest reports of this many peers, the most recent reporters: a
# sample of the mesh, and what bounds the balance's memory in a simulated million nodes.
REPORTERS = 8
# A report moves the share's mean by less than this much of a founder's weight: one liar
# leaves the share under 4/3 of the honest weights, inside DEAD_BAND, however few report.
LIE_ROOM = 1 / 3


@dataclass
class WeightBalance:
    """Per segment, the mean weight held at this node's pushes, the factor they carry,
    and the latest reported weight of each of the last ``REPORTERS`` peers to report one
    (``enabled`` False: every factor is 1 and nothing is tracked)."""

    num_segments: int
    enabled: bool = False
    means: list[float] = field(init=False)
    factors: list[float] = field(init=False)
    reports: list[dict[str, float]] = field(init=False)  # per segment, oldest first

    def __post_init__(self) -> None:
        self.means = [SHARE] * self.num_segments
        self.factors = [1.0] * self.num_segments
        self.reports = [{} for _ in range(self.num_segments)]

    def heard(self, peer: str, segment: int, weight: float) -> None:
        """``peer`` held ``weight`` of ``segment`` before this node's push merged."""
        if not self.enabled or not math.isfinite(weight):
            return
        book = self.reports[segment]
        book.pop(peer, None)
        book[peer] = max(weight, 0.0)
        if len(book) > REPORTERS:
            del book[next(iter(book))]

    def keep_only(self, members: Container[str]) -> None:
        """Drop the reports of peers gone from the view (it looks at the reporters only,
        at most ``REPORTERS`` per segment, never the whole view)."""
        for book in self.reports:
            for gone in [p for p in book if p not in members]:
                del book[gone]

    def share(self, segment: int, held: float) -> float:
        """The mesh's weight per site: the mean of ``held`` and the peers' reports, each
        clamped so that it moves the mean by less than ``LIE_ROOM`` of a founder's weight
        (``SHARE`` while no peer has reported)."""
        book = self.reports[segment]
        if not book:
            return SHARE
        values = 1 + len(book)
        bound = SHARE + (values - 1) * LIE_ROOM
        return (held + math.fsum(min(w, bound) for w in book.values())) / values

    def factor(self, segment: int, held: float) -> float:
        """The factor for a push of ``segment`` now, which holds ``held``; each call is one
        push, and moves the mean and the factor one push further."""
        if not self.enabled:
            return 1.0
        mean = self.means[segment] + (held - self.means[segment]) / AVERAGE_PUSHES
        self.means[segment] = mean
        share = self.share(segment, held)
        off = (mean - share) / share if share > 0 else 0.0
        if abs(off) > DEAD_BAND:
            # Clamped to the widest move the factor's range allows: a share of 1e-300 (a
            # mesh a sink drained, or peers reporting crumbs) overflowed exp and stopped
            # the site's trainer.
            exponent = max(-MOST_EXPONENT, min(MOST_EXPONENT, GAIN * off))
            moved = self.factors[segment] * math.exp(exponent)
            self.factors[segment] = min(1.0, max(LEAST_FACTOR, moved))
        return self.factors[segment]
