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

It needs no clock and no message: only the weights a node holds when it pushes. The
share is a founding site's, so a mesh whose joiners (they start at 0) bring its mean
under 1 − ``DEAD_BAND`` shrinks everyone's pushes: turn it off there
(``gossip.weight_balance = false``).
"""

from __future__ import annotations

import math

SHARE = 1.0  # a founding site's weight: Σw over the mesh is the number of founding sites
AVERAGE_PUSHES = 50  # the held weight is averaged over about this many pushes
DEAD_BAND = 0.3  # a mean within this of the share leaves the factor alone
GAIN = 0.05  # per push, the factor changes by exp(GAIN × how far the mean is from the share)
LEAST_FACTOR = 0.01  # a site 100 times faster than the slowest is balanced; faster, nearly


class WeightBalance:
    """Per segment, the mean weight held at this node's pushes and the factor they carry."""

    def __init__(self, num_segments: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.means = [SHARE] * num_segments
        self.factors = [1.0] * num_segments

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
