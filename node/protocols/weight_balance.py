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
weight follows speed across many sites, and the directed protocols have no credit.
What a peer could do to it, and what bounds that (the ledger's ``hear_receiver``):

* Lie in its acknowledgements. A report is clamped to a founder's weight plus the
  default credit from every other member, so one liar makes the share at most 4/3 of
  the honest sites' weight, inside the band: no honest factor moves. Two liars can
  shrink honest pushes, down to ``LEAST_FACTOR``.
* Sink weight. A sink's report is dropped once it is suspected (:mod:`.sinks`, and a
  peer holding all its credit while giving nothing back): its take is not the honest
  sites' share. Until then the honest sites look under the share, and their factors
  shrink a little and stay where they were when the sink was named.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SHARE = 1.0  # a founding site's weight: the share until a peer reports its own
AVERAGE_PUSHES = 50  # the held weight is averaged over about this many pushes
DEAD_BAND = 0.3  # a mean within this fraction of the share leaves the factor alone
GAIN = 0.05  # per push, the factor changes by exp(GAIN × how far the mean is from the share)
LEAST_FACTOR = 0.01  # a site 100 times faster than the slowest is balanced; faster, nearly


@dataclass
class WeightBalance:
    """Per segment, the mean weight held at this node's pushes, the factor they carry,
    and each peer's latest reported weight (``enabled`` False: every factor is 1 and
    nothing is tracked)."""

    num_segments: int
    enabled: bool = False
    means: list[float] = field(init=False)
    factors: list[float] = field(init=False)
    reports: dict[str, list[float]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.means = [SHARE] * self.num_segments
        self.factors = [1.0] * self.num_segments

    def heard(self, peer: str, segment: int, weight: float) -> None:
        """``peer`` held ``weight`` of ``segment`` (already clamped by the caller)."""
        if not self.enabled or not math.isfinite(weight):
            return
        held = self.reports.setdefault(peer, [math.nan] * self.num_segments)
        held[segment] = max(weight, 0.0)

    def keep_only(self, members: frozenset[str]) -> None:
        """Forget the reports of peers no longer in the view (bounded by the view)."""
        for gone in [p for p in self.reports if p not in members]:
            del self.reports[gone]

    def share(self, segment: int, held: float) -> float:
        """The mesh's weight per site: the mean of ``held`` and the peers' reports
        (``SHARE`` while no peer has reported)."""
        heard = [r[segment] for r in self.reports.values() if not math.isnan(r[segment])]
        if not heard:
            return SHARE
        return (held + math.fsum(heard)) / (1 + len(heard))

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
            moved = self.factors[segment] * math.exp(GAIN * off)
            self.factors[segment] = min(1.0, max(LEAST_FACTOR, moved))
        return self.factors[segment]
