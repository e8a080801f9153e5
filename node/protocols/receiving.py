"""Receiving: the merging side of the sum-weight ledger (:mod:`.ledger`).

A push merges by the sum-weight rule x_r ← (w_r·x_r + w_s·x_s)/(w_r + w_s) against the
*available* weight (weight minus reservations), which keeps Σ w·x exact while this
node's own pushes are in flight. A receiver de-duplicates by (sender, incarnation,
sequence, segment) (:mod:`.sequences`), so a retried push whose acknowledgement was
lost never merges twice; what does not fit under the weight cap is cut and counted
(:mod:`.weight_cap`), and a sender past its credit is refused (:mod:`.credit`).

Planning and committing are two calls: a driver asks what merging would do, blends,
checks, and only then commits, so a payload merges whole or not at all.

:class:`Receiving` is a part of :class:`~.ledger.SumWeightLedger`, kept in its own file
as :mod:`.reservations` is; it owns no state of its own and uses the ledger's, declared
below.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gossipd.node.protocols.base import Duplicate, Merge, Refused, View
from gossipd.node.protocols.credit import PeerCredit
from gossipd.node.protocols.exchanged import ExchangedBook
from gossipd.node.protocols.sequences import DEDUP_WINDOW, Windows
from gossipd.node.protocols.sinks import SinkWatch
from gossipd.node.protocols.weight_cap import WeightCap


class Receiving:
    """Plan a merge without changing anything, then commit the plan; the ledger's weights."""

    # What the ledger provides (see SumWeightLedger.__init__).
    weights: list[float]
    windows: Windows
    credit: PeerCredit
    cap: WeightCap
    cut: float
    exchanged: ExchangedBook
    sinks: SinkWatch
    view: View
    _silent: dict[str, int]

    if TYPE_CHECKING:

        def available(self, segment: int) -> float: ...

        def in_flight_to(self, peer: str, segment: int) -> float: ...

        def passed_over(self, peer: str) -> bool: ...

    def plan_receive(
        self,
        sender: str,
        incarnation: int,
        sequence: int,
        weights: Mapping[int, float],
        base: int = 1,
    ) -> list[Merge | Duplicate]:
        """What merging this push would do, without doing it; raises ``Refused``."""
        window = self.windows.find(sender, incarnation, base)
        window.check(sequence)
        actions: list[Merge | Duplicate] = []
        for segment, weight in weights.items():
            if not 0 <= segment < len(self.weights):
                raise Refused(f"segment {segment} out of range 0..{len(self.weights) - 1}")
            if not (math.isfinite(weight) and weight >= 0):
                raise Refused(
                    f"sum-weight {weight} of segment {segment} is not a finite number >= 0"
                )
            if not window.is_new(sequence, segment):
                actions.append(Duplicate(segment))
                continue
            self.credit.check(sender, segment, weight, self.in_flight_to(sender, segment))
            fits = self.cap.fit(segment, self.weights[segment], weight)
            mine = self.available(segment)
            total = mine + fits
            alpha = fits / total if total > 0 else 0.0
            actions.append(Merge(segment, alpha, self.weights[segment] + fits, weight - fits))
        return actions

    def apply_receive(
        self,
        sender: str,
        incarnation: int,
        sequence: int,
        plan: Sequence[Merge | Duplicate],
        base: int = 1,
    ) -> None:
        """Commit a plan from :meth:`plan_receive`, with no other call in between."""
        window = self.windows.open(sender, incarnation, base)
        capacity = DEDUP_WINDOW * len(self.weights)
        received = 0.0
        share = 0.0
        merged = False
        for action in plan:
            if isinstance(action, Merge) and window.admit(sequence, action.segment, capacity):
                weight = action.weight_after - self.weights[action.segment] + action.cut
                mine = self.available(action.segment)
                received += weight
                self.cut += action.cut
                self.credit.received(sender, action.segment, weight)
                share += weight / mine if mine > 0 else (math.inf if weight > 0 else 0.0)
                self.weights[action.segment] = action.weight_after
                merged = True
        if merged:
            self.windows.share(sender)
            if self.passed_over(sender):  # a crumb back buys it patience, not its room
                self._silent[sender] = 0
            else:
                self._silent.pop(sender, None)
            self.exchanged.add(sender, received=received, members=self.view.rank_of)
            self.sinks.received(sender, share / len(self.weights))
