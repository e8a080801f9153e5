"""How far one payload may pull a model: a radius set by what the other peers send.

mTLS says who may speak, not that a member is honest. The sanity bound
(:mod:`.payload_bound`) refuses payloads far beyond any estimate of the model, but
a member with a valid certificate pushed our own values plus 50 at weight 1, well
inside it, and within 3 s the mean of all three honest models went from −1.6e-5 to
49.8. Honest payloads are estimates of the same average, so their distances from
our own model are alike; a payload much farther than the *others'* is what one
member can do alone.

ClippedGossip (He, Karimireddy, Jaggi, 2022) clips each neighbour's difference to a
radius around one's own model. Here the radius of a segment is ``limits.clip_factor``
times the upper median, over the *other* senders, of the RMS distance each one's
latest payload had from our segment (at least ``RADIUS_FLOOR`` of the segment's
scale, see :mod:`.payload_bound`). One entry per sender, so a member pushing many
times (even at weight 0) still holds one entry; its own payloads are measured
against the others' distances only; and with one dishonest member, the upper median
of the others can only be raised by it, never lowered (a lowered radius would cut
honest merges short: a defence that stalls the honest sites is an attack of its
own). A payload farther than the radius is pulled toward our segment along the line
between them until it is exactly that far, then merged at its full weight: the
weights stay exact, and one merge moves a segment by at most ``alpha`` times the
radius. With no other sender on record (the first payloads, a two-site mesh) there
is no radius and only the sanity bound applies.

An honest payload farther than ``clip_factor`` times the others' is clipped too: on
label-skewed sites, honest disagreement is large and uneven, so the factor trades
how far one member can pull against how much honest merging is cut short (docs/
security.md has the measurements). Pure: no clock, no I/O, no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

# Senders whose latest distances are kept; the least recently heard is forgotten first.
SENDERS_KEPT = 64


@dataclass
class RecentDistances:
    """Per sender and segment, the RMS distance its latest payload had from our segment."""

    on: bool
    latest: OrderedDict[str, dict[int, float]] = field(default_factory=OrderedDict)

    def typical(self, sender: str, segment: int) -> float | None:
        """The upper median of the other senders' latest distances from our ``segment``;
        None when there is none (off, or no other sender on record)."""
        if not self.on:
            return None
        others = sorted(
            d[segment] for peer, d in self.latest.items() if peer != sender and segment in d
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
        entry[segment] = distance
        self.latest[sender] = entry  # most recently heard last
