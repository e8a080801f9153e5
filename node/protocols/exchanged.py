"""Weight exchanged with each peer, for operators and audits (``CoreStatus.exchanged``).

Part of the sum-weight ledger (:mod:`.ledger`): every acknowledged push adds to what
this node sent a peer, every merged payload to what it received from it. When the
peer restarts, its totals so far become the ``*_before`` pair, so a crash audit can
tell what went to and came from its previous incarnation (tests/test_crash_one_site.py
bounds a crash's cost by them). Only verified peers are booked, and at most ``rows`` of
them (:data:`~.settings.BOOK_ROWS`; a few in a larger simulated mesh): a full book
forgets half its peers, those out of the view first, then the oldest. It is an
account, not a defence: nothing is refused or sized by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

from gossipd.node.protocols.base import PeerMass
from gossipd.node.protocols.settings import BOOK_ROWS, overflow


@dataclass
class ExchangedBook:
    """Per peer, the sum-weight sent and received (summed over segments).

    Two dicts of floats and the restarted peers' past apart, not a record per peer:
    a simulated node of a large mesh exchanges with a new peer at nearly every push,
    and a frozen record replaced at each one held 27 KB of its 156 KB."""

    sent: dict[str, float] = field(default_factory=dict)
    received: dict[str, float] = field(default_factory=dict)
    past: dict[str, PeerMass] = field(default_factory=dict)  # restarted peers' before pair
    rows: int = BOOK_ROWS  # peers kept in each of the three

    def add(
        self,
        peer: str,
        *,
        sent: float | None = None,
        received: float | None = None,
        members: Container[str] = (),
    ) -> None:
        """Book weight sent to or received from ``peer``; a peer new to a full book makes it
        forget half its peers, those not in ``members`` (the view) first, then the oldest."""
        if sent is not None:
            _book(self.sent, peer, sent, members, self.rows)
        if received is not None:
            _book(self.received, peer, received, members, self.rows)

    @property
    def by_peer(self) -> dict[str, PeerMass]:
        """Every peer's account (built on each call, for a status)."""
        peers = dict.fromkeys([*self.past, *self.sent, *self.received])
        return {peer: self.mass(peer) for peer in peers}

    def mass(self, peer: str) -> PeerMass:
        past = self.past.get(peer, PeerMass())
        return dataclasses.replace(
            past, sent=self.sent.get(peer, 0.0), received=self.received.get(peer, 0.0)
        )

    def restarted(self, peer: str, incarnation: int) -> None:
        """``peer`` came back as ``incarnation``: what it exchanged so far is its past."""
        before = self.mass(peer)
        if peer not in self.past and len(self.past) >= self.rows:
            self.past.pop(next(iter(self.past)))
        self.past[peer] = PeerMass(
            sent_before=before.sent, received_before=before.received, incarnation=incarnation
        )
        self.sent.pop(peer, None)
        self.received.pop(peer, None)

    def state(self) -> dict[str, dict[str, float]]:
        return {peer: dataclasses.asdict(m) for peer, m in self.by_peer.items()}

    @classmethod
    def restore(
        cls, state: Mapping[str, Mapping[str, Any]], rows: int = BOOK_ROWS
    ) -> ExchangedBook:
        book = cls(rows=rows)
        for peer, m in state.items():
            mass = PeerMass(**m)
            book.sent[peer] = mass.sent
            book.received[peer] = mass.received
            if (mass.sent_before, mass.received_before, mass.incarnation) != (0.0, 0.0, 0):
                book.past[peer] = dataclasses.replace(mass, sent=0.0, received=0.0)
        return book


def _book(
    totals: dict[str, float], peer: str, amount: float, members: Container[str], rows: int
) -> None:
    total = totals.get(peer)
    if total is None:
        for gone in overflow(totals, len(totals), rows, members.__contains__):  # out of view
            del totals[gone]  # first, then the oldest (the sort is stable)
        total = 0.0
    totals[peer] = total + amount
