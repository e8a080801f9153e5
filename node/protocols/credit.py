"""Per-peer weight credit: how much of this node's weight one peer may hold, and bring.

Part of the sum-weight ledger (:mod:`.ledger`). Weight is influence: a push at weight
w merged into a model of weight v moves it w/(v + w) of the way to the payload. A
member with a valid certificate that acknowledges every push and returns nothing (a
sink) took 2.997 of a 3-site mesh's 3.0 in 14 s before the sink watch
(:mod:`.sinks`) stopped the pushes, since each push carries half of what the sender
holds; and a member can claim any weight it likes in its own pushes. This book bounds
both in absolute weight, per peer and segment, with the *net* weight: what this node
sent the peer (acknowledged) minus what it merged from it.

* **take**: this node sizes every push so the net stays at most ``take``
  (``limits.peer_credit``): a peer can hold at most that much of this node's weight,
  whatever it does. With founding weight 1 per site, a sink ends with at most
  ``take`` of each honest site's weight: ``take`` = 1/3 leaves the honest sites at
  least two thirds of theirs.
* **bring**: a payload is refused (:class:`CreditExceeded`, nothing merged, the sender
  keeps its weight) if it would take the net below ``−bring``: a peer can bring at most
  what it took plus ``bring``. ``bring`` is ``take`` plus one founding member's
  weight, because a leaving site hands its own weight over, and with every peer's
  ``bring`` room together it always can (:meth:`handable`).

Both ends keep the same account of an edge (my net with you is minus yours with me),
so an honest sender that sizes by its own book is never refused by an honest
receiver: the sender counts what it has in flight to the peer as sent, the receiver
counts what it has in flight to the sender as sent, and the difference ``bring −
take`` absorbs what the two books disagree by after a restart from a checkpoint.

Honest peers do hit ``take``: the net weight of one edge is a random walk (weight can
go round a cycle of three sites for ever). Then this node pushes to another peer, or
pushes less: what that costs the mixing, measured on the simulator, is in docs/security.md
("What it costs honest sites").
The protocols of the exponential graph (:mod:`.pushsum_expgraph`, :mod:`.persyn`) turn
its direction every cycle, so weight comes back along every edge it left by; their
default credit is :data:`HALF_PUSH_CREDIT`, the half push their exact average needs.

The book keeps ``rows`` peers' nets per segment (:data:`~.settings.BOOK_ROWS`: every
peer of a federation; a few in a larger simulated mesh); a full one forgets the half of
its nets nearest 0. Forgetting a net resets that peer's credit, and the ones nearest 0
are those whose reset gives a peer the least: not a sink's (it holds all of ``take``) nor an
inflater's (it brought up to ``bring``), which go last. Where every push is cut to the
credit (crossover at scale: half a weight of 1 is more than a third) all new nets tie at
``take``, so in a mesh where a node meets more peers than it keeps rows for, a sink's
row can go with the honest ones and the sink gets ``take`` again: there the bound is the
sink watch's (:mod:`.sinks`), which no peer escapes by being forgotten. A net forgotten
at one end only leaves the two books apart by what it was, which ``bring − take`` covers
while it is under a founding weight; where peers meet again and again an honest push can
then be refused (and the sender keeps its weight): 101 in 100 simulated sumweight nodes
over 600 rounds with 8 rows, none in 4,000 crossover nodes over 20 rounds.

Pure: no clock, no I/O; the simulator drives it through the same cores.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gossipd.node.protocols.base import Refused
from gossipd.node.protocols.settings import BOOK_ROWS, overflow

# limits.peer_credit's default: a sink ends with at most a third of each honest site's
# founding weight, so the honest sites keep two thirds of theirs.
DEFAULT_CREDIT = 1 / 3
# Its default for the protocols that average exactly along the exponential graph
# (pushsum-expgraph, persyn): a half push at weight 1 is 1/2 along one edge, and one cut
# to 1/3 no longer averages (64 nodes: 0.11 after two persyn bursts instead of 2.5e-16).
HALF_PUSH_CREDIT = 1 / 2
# What a leaving site owns that it did not take: a founding member's weight.
FOUNDING_WEIGHT = 1.0
# A net this close to the credit (relatively) holds all of it: sums of pushes cut to the
# room left land on the credit only to rounding.
HOLDS_ALL_RTOL = 1e-9


class CreditExceeded(Refused):
    """A payload bringing more weight than the sender took from this node plus its credit."""


@dataclass
class PeerCredit:
    """Per peer and segment, weight sent minus weight received; pushes are sized by it.

    One dict of floats per segment: a segment-wise protocol sends each segment to a
    different peer, so most peers have a net in one segment only, and a list per peer
    cost a simulated node of a large crossover mesh 20 KB of its 156 KB."""

    take: float
    segments: int
    nets: list[dict[str, float]] = field(default_factory=list)
    rows: int = BOOK_ROWS  # peers whose net is kept, per segment
    on: bool = field(init=False)  # whether there is a book: read at every push and payload

    def __post_init__(self) -> None:
        if not self.take > 0:  # inf: no book (the credit off)
            raise ValueError(f"peer credit must be > 0, got {self.take}")
        if self.rows < 1:
            raise ValueError(f"a credit book keeps at least 1 row, got {self.rows}")
        if not self.nets:
            self.nets = [{} for _ in range(self.segments)]
        self.on = math.isfinite(self.take)

    @property
    def bring(self) -> float:
        return self.take + FOUNDING_WEIGHT

    def net(self, peer: str, segment: int) -> float:
        return self.nets[segment].get(peer, 0.0)

    def room(self, peer: str, segment: int, in_flight: float) -> float:
        """The most a push to ``peer`` may carry of ``segment`` now (``in_flight``: what
        this node's unsettled pushes to it carry of that segment)."""
        return max(0.0, self.take - self.net(peer, segment) - in_flight)

    def handable(self, peer: str, segment: int, in_flight: float) -> float:
        """The most a leaving node's hand-off to ``peer`` may carry: what ``peer`` admits."""
        return max(0.0, self.bring - self.net(peer, segment) - in_flight)

    def check(self, peer: str, segment: int, weight: float, in_flight: float) -> None:
        """Refuse a payload of ``weight`` from ``peer`` that would bring more than the
        credit allows (``in_flight``: what this node's unsettled pushes to ``peer`` carry
        of ``segment``, counted as sent: the sender may have merged them already)."""
        if not self.on:
            return
        allowed = self.bring + self.net(peer, segment) + in_flight
        if weight > allowed * (1 + 1e-9) + 1e-12:
            raise CreditExceeded(
                f"sum-weight {weight:.6g} of segment {segment} from {peer} is more than it may "
                f"bring: {allowed:.6g} (what it took from this node, net, plus "
                f"limits.peer_credit {self.take:g} plus a founding member's weight); refused, "
                "nothing merged, the sender keeps its weight"
            )

    def sent(self, peer: str, segment: int, weight: float) -> None:
        self._move(peer, segment, weight)

    def received(self, peer: str, segment: int, weight: float) -> None:
        self._move(peer, segment, -weight)

    def _move(self, peer: str, segment: int, delta: float) -> None:
        if not self.on or delta == 0.0:
            return
        nets = self.nets[segment]
        net = nets.get(peer)
        if net is None:
            for gone in overflow(nets, len(nets), self.rows, lambda p: abs(nets[p])):
                del nets[gone]
            net = 0.0
        nets[peer] = net + delta

    def holds_all(self, peer: str) -> bool:
        """Whether ``peer`` holds all the credit in every segment: nothing more goes to it.
        To rounding: pushes cut to the room left sum to the credit only nearly (a sink
        held 0.33333333333333326 of a site's third, was passed over for want of room and,
        under the exact comparison, never named)."""
        least = self.take * (1 - HOLDS_ALL_RTOL)
        return all(nets.get(peer, 0.0) >= least for nets in self.nets)

    def state(self) -> dict[str, list[float]]:
        """Every peer's nets, but those all 0 (weight that went back along its edge): the
        same book :meth:`restore` rebuilds."""
        peers = dict.fromkeys(p for nets in self.nets for p, net in nets.items() if net)
        return {p: [nets.get(p, 0.0) for nets in self.nets] for p in peers}

    def restore(self, nets: Mapping[str, Any]) -> None:
        """Nets from a checkpoint: a peer does not get its credit back by outlasting a restart
        (of either end)."""
        self.nets = [{} for _ in range(self.segments)]
        for p, n in nets.items():
            if len(n) == self.segments:
                for segment, x in enumerate(n):
                    if float(x):
                        self.nets[segment][str(p)] = float(x)
