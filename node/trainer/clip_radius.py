"""How far one payload may pull a model: a radius set by what the other peers send.

mTLS says who may speak, not that a member is honest. The sanity bound
(``model/payload_bound.py``) refuses payloads far beyond any estimate of the model, but
a member with a valid certificate pushed our own values plus 50 at weight 1, well
inside it, and within 3 s the mean of all three honest models went from −1.6e-5 to
49.8. Honest payloads are estimates of the same average, so their distances from
our own model are alike; a payload much farther than the *others'* is what one
member can do alone.

ClippedGossip (He, Karimireddy, Jaggi, 2022) clips each neighbour's difference to a
radius around one's own model. Here the radius of a segment is ``limits.clip_factor``
times the upper median, over the *other* senders, of the largest RMS distance each
one's last ``DISTANCES_KEPT`` payloads had from our segment (at least ``RADIUS_FLOOR``
of the segment's scale, see ``model/payload_bound.py``). One entry per sender, so a member
pushing many times (even at weight 0) still holds one entry; its own payloads are
measured against the others' distances only; and with one dishonest member, the upper
median of the others can only be raised by it, never lowered (a lowered radius would
cut honest merges short: a defence that stalls the honest sites is an attack of its
own).

Why the largest of each sender's last few, not its latest: with the latest only, a
3-site learning-rate-0 crossover mesh ended 3% off the exact mean at a factor of 10.
Near consensus, a sender that has just merged with this node is very close, while an
edge the credit left idle for a few rounds brings an honest payload from where the
mesh was then: measured against the close one's latest distance alone, it was clipped,
while the close one's earlier payloads were about as far. This makes honest clips rarer,
not impossible: a node far from a mesh that has converged (a restarted node, a healed
partition) is clipped where the mesh's own senders set the radius, and merged in more
slowly (where it receives, every other sender is as far, and nothing is clipped). That
is the trade a robust merge makes, so the clip is on by default (one member with a
valid certificate is the threat this bounds) and ``inf`` turns it off where every
member is trusted; what it cost honest sites on the label-skewed jobs is in
docs/security.md.

A payload farther than the radius is pulled toward our segment along the line between
them until it is exactly that far, then merged at its full weight: the weights stay
exact, and one merge moves a segment by at most ``alpha`` times the radius. With no
other sender on record (the first payloads, a two-site mesh) there is no radius and
only the sanity bound applies.

An honest payload farther than ``clip_factor`` times the others' is clipped too: on
label-skewed sites, honest disagreement is large and uneven, so the factor trades
how far one member can pull against how much honest merging is cut short (docs/
security.md has the measurements). Pure: no clock, no I/O, no torch.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

# Senders whose distances are kept; the least recently heard is forgotten first.
SENDERS_KEPT = 64
# Per sender and segment, how many of its latest distances its entry is the largest of.
DISTANCES_KEPT = 16


@dataclass
class RecentDistances:
    """Per sender and segment, the RMS distances its latest payloads had from our segment
    (at most ``DISTANCES_KEPT``, oldest first)."""

    on: bool
    latest: OrderedDict[str, dict[int, deque[float]]] = field(default_factory=OrderedDict)

    def typical(self, sender: str, segment: int) -> float | None:
        """The upper median, over the other senders, of the largest of each one's recent
        distances from our ``segment``; None when there is none (off, or no other sender
        on record)."""
        if not self.on:
            return None
        others = sorted(
            max(d[segment]) for peer, d in self.latest.items() if peer != sender and segment in d
        )
        return others[len(others) // 2] if others else None

    def record(self, sender: str, segment: int, distance: float) -> None:
        """The distance ``sender``'s payload had, measured before any clipping."""
        if not self.on:
            return
        entry = self.latest.pop(sender, None)
        if entry is None:
            entry = {}
            if len(self.latest) >= SENDERS_KEPT:
                self.latest.popitem(last=False)
        entry.setdefault(segment, deque(maxlen=DISTANCES_KEPT)).append(distance)
        self.latest[sender] = entry  # most recently heard last
