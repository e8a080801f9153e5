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
of at most 1. While that mean is under its share (a founding site's weight, 1) by more
than ``DEAD_BAND``, the factor shrinks a little at each push; while it is over by more,
the factor grows back. A site that pushes 25 times as often as another ends pushing a
25th of its protocol's share, and both hold about 1. At equal speeds the mean stays
within the band (weights wander around 1), the factor stays near 1, and the protocols
push what their papers say: the structured ones (pushsum-expgraph, persyn, crossover,
shuffle-exchange) keep every weight at exactly 1 there, so the factor never moves.

It needs no clock and no message: only the weights a node holds when it pushes. It is
off by default (``gossip.weight_balance``), because its share is a founding site's weight
and a mesh can hold less than that per site for reasons other than speed: a sink took
weight (an insider that acknowledges every push and never pushes back: the honest sites'
factors shrank as it drained them, so the sink watch, which counts the share each push
carried, took 607 pushes instead of 26 to suspect it in a CI run, and the honest
sites' weight, under the band for good after it, would keep their pushes small),
crashes lost it, or joiners (they start at 0) spread it thinner. Turn it on where sites
differ in speed and none of those holds; the fix that lets it default on is an
estimate of the mesh's weight per site.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SHARE = 1.0  # a founding site's weight: Σw over the mesh is the number of founding sites
AVERAGE_PUSHES = 50  # the held weight is averaged over about this many pushes
DEAD_BAND = 0.3  # a mean within this of the share leaves the factor alone
GAIN = 0.05  # per push, the factor changes by exp(GAIN × how far the mean is from the share)
LEAST_FACTOR = 0.01  # a site 100 times faster than the slowest is balanced; faster, nearly


@dataclass
class WeightBalance:
    """Per segment, the mean weight held at this node's pushes and the factor they carry
    (``enabled`` False: every factor is 1 and nothing is tracked)."""

    num_segments: int
    enabled: bool = False
    means: list[float] = field(init=False)
    factors: list[float] = field(init=False)

    def __post_init__(self) -> None:
        self.means = [SHARE] * self.num_segments
        self.factors = [1.0] * self.num_segments

    def factor(self, segment: int, held: float) -> float:
        """The factor for a push of ``segment`` now, which holds ``held``; each call is one
        push, and moves the mean and the factor one push further."""
        if not self.enabled:
            return 1.0
        mean = self.means[segment] + (held - self.means[segment]) / AVERAGE_PUSHES
        self.means[segment] = mean
        off = mean - SHARE
        if abs(off) > DEAD_BAND:
            moved = self.factors[segment] * math.exp(GAIN * off)
            self.factors[segment] = min(1.0, max(LEAST_FACTOR, moved))
        return self.factors[segment]
