"""Weight exchanged with each peer, for operators and audits (``CoreStatus.exchanged``).

Part of the sum-weight ledger (:mod:`.ledger`): every acknowledged push adds to what
this node sent a peer, every merged payload to what it received from it. When the
peer restarts, its totals so far become the ``*_before`` pair, so a crash audit can
tell what went to and came from its previous incarnation (tests/test_crash_one_site.py
bounds a crash's cost by them). Only verified peers are booked, and at most
``EXCHANGED_KEPT`` of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

from gossipd.node.protocols.base import PeerMass

# Peers whose exchanged weight is kept; beyond this, one out of the view (or the oldest)
# is forgotten.
EXCHANGED_KEPT = 1024


@dataclass
class ExchangedBook:
    """Per peer, the sum-weight sent and received (summed over segments)."""

    by_peer: dict[str, PeerMass] = field(default_factory=dict)

    def add(
        self, peer: str, *, sent: float = 0.0, received: float = 0.0, members: Container[str] = ()
    ) -> None:
        """Book weight sent to or received from ``peer``; a peer new to a full book takes
        the place of one not in ``members`` (the view), or of the oldest."""
        mass = self.by_peer.get(peer)
        if mass is None:
            if len(self.by_peer) >= EXCHANGED_KEPT:
                stale = next((p for p in self.by_peer if p not in members), None)
                self.by_peer.pop(stale if stale is not None else next(iter(self.by_peer)))
            mass = PeerMass()
        self.by_peer[peer] = dataclasses.replace(
            mass, sent=mass.sent + sent, received=mass.received + received
        )

    def restarted(self, peer: str, incarnation: int) -> None:
        """``peer`` came back as ``incarnation``: what it exchanged so far is its past."""
        before = self.by_peer.get(peer, PeerMass())
        self.by_peer[peer] = PeerMass(
            sent_before=before.sent, received_before=before.received, incarnation=incarnation
        )

    def state(self) -> dict[str, dict[str, float]]:
        return {peer: dataclasses.asdict(m) for peer, m in self.by_peer.items()}

    @classmethod
    def restore(cls, state: Mapping[str, Mapping[str, Any]]) -> ExchangedBook:
        return cls({peer: PeerMass(**m) for peer, m in state.items()})
