"""The weight cap: the most sum-weight one segment may hold after a merge.

Part of the sum-weight ledger (:mod:`.ledger`), which refuses a payload whose merge
would lift a segment over it (:class:`~.base.WeightCapExceeded`: nothing merged, the
sender folds its weight back, nothing is lost). A forged payload carrying a huge
weight would otherwise make its model dominate every average downstream.

Founding members start at weight 1 and joiners at 0, so Σw is the number of founding
members and no honest weight exceeds it. Unless ``limits.max_sum_weight`` says
otherwise, a node takes that number as the largest view it has seen (itself
included): a joiner can only raise it (looser, never wrong), and a founder this node
never saw makes it tight, which refuses a merge until the view grows. The cap is
``FAULT_HEADROOM`` times that number: faults may create weight (a receiver declared
dead after it merged leaves the push's weight twice), and an honest node must not be
refused for it.
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

    def check(self, segment: int, held: float, weight: float) -> None:
        """Refuse merging ``weight`` into a segment that holds ``held`` if the result is
        over the cap (a result equal to it is merged)."""
        if held + weight > self.value:
            raise WeightCapExceeded(
                f"merging sum-weight {weight!r} into segment {segment} would raise it from "
                f"{held:g} to {held + weight:g}, over the cap {self.value:g} "
                "(limits.max_sum_weight; unset: the number of founding members, the largest "
                "view this node has seen); refused, nothing merged"
            )
