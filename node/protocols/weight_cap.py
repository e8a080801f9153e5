"""The weight cap: the most sum-weight one segment may hold after a merge.

Part of the sum-weight ledger (:mod:`.ledger`). A forged payload carrying a huge weight
would otherwise make its model dominate every average downstream.

Founding members start at weight 1 and joiners at 0, so Σw is the number of founding
members and no honest weight exceeds it. Unless ``limits.max_sum_weight`` says
otherwise, a node takes that number as the largest view it has seen (itself
included): a joiner can only raise it (looser, never wrong), and a founder this node
never saw makes it tight. The cap is ``FAULT_HEADROOM`` times that number: faults may
create weight (a receiver declared dead after it merged leaves the push's weight
twice), and an honest node must not meet the cap for it.

What reaches the cap: a payload heavier than the cap on its own is a lie (no node can
hold that much) and is refused (:class:`~.base.WeightCapExceeded`: nothing merged, the
sender keeps its weight). Any other payload is merged with the part of its weight that
fits under the cap (:meth:`WeightCap.fit`), and the rest is cut: acknowledged, booked as
received, and gone. Refusing it instead let one member stop a mesh for good (issue 32):
an insider with the credit off (or several together) topped every honest site up to
just under the cap, after which every honest push was refused and none ever settled.
Merging what fits keeps the honest sites exchanging (a site at the cap takes nothing
from a push, but its own pushes halve what it holds, and it takes again), and bounds
what one payload moves a model by exactly as the refusal did: it is merged with the
share of what fits. The weight cut is counted (``gossipd_sum_weight_cut``), so the books
still close: founding weight, plus what peers brought, less what they took, less what
was cut.
"""

from __future__ import annotations

from dataclasses import dataclass

from gossipd.node.protocols.base import WeightCapExceeded

# The derived cap is this many times the number of founding members.
FAULT_HEADROOM = 2.0


@dataclass
class WeightCap:
    """``max_weight`` (None: derived from ``largest_view``, the daemon's default)."""

    max_weight: float | None
    largest_view: int = 1  # members in the largest view seen, this node included

    @property
    def value(self) -> float:
        if self.max_weight is not None:
            return self.max_weight
        return FAULT_HEADROOM * float(self.largest_view)

    def saw_view(self, members: int) -> None:
        self.largest_view = max(self.largest_view, members)

    def fit(self, segment: int, held: float, weight: float) -> float:
        """The part of a payload of ``weight`` that a segment holding ``held`` merges: all of
        it if the result stays at most the cap, else what fits under it (0 at the cap); a
        payload heavier than the cap on its own is refused."""
        cap = self.value
        if weight > cap:
            raise WeightCapExceeded(
                f"sum-weight {weight!r} of segment {segment} is more than any node may hold, "
                f"the cap {cap:g} (limits.max_sum_weight; unset: twice the number of "
                "founding members, the largest view this node has seen); refused, nothing "
                "merged"
            )
        return min(weight, max(0.0, cap - held))
