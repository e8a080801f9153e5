"""Reservations: the sending side of the sum-weight ledger (:mod:`.ledger`).

A sent share is *reserved*, not removed: it is removed only when the receiver
acknowledges that segment (acknowledge-then-commit), and the rest of the reservation
comes home on failure, folded back with the snapshot it left with, so a dead peer
never swallows mass and Σ w·x stays exact. A merge uses the *available* weight
(weight minus reservations). At most one push per peer is unacknowledged, and
``max_in_flight`` in all.

:class:`Reservations` is a part of :class:`~.ledger.SumWeightLedger`, kept in its own
file because sending and receiving change for different reasons; it owns no state of
its own and uses the ledger's, declared below.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING

from gossipd.node.protocols.base import FoldBack, Push, Settle, View
from gossipd.node.protocols.credit import PeerCredit
from gossipd.node.protocols.exchanged import ExchangedBook
from gossipd.node.protocols.numberings import Numberings
from gossipd.node.protocols.sinks import SinkWatch
from gossipd.node.protocols.weight_balance import WeightBalance

# The least share of this node's available weight a push is cut to by a peer's credit
# before that peer is passed over (:meth:`Reservations.credit_leaves_room`).
MIN_ROOM = 0.1


class Reservations:
    """Reserve, commit on acknowledgement, fold back the rest; the ledger's weights."""

    # What the ledger provides (see SumWeightLedger.__init__).
    node_id: str
    max_in_flight: int
    weights: list[float]
    reserved: list[float]
    in_flight: dict[tuple[str, int], Push]
    _to: dict[str, tuple[Push, ...]]  # in_flight by receiver, in the order sent
    round: int
    step: int
    numberings: Numberings
    exchanged: ExchangedBook
    sinks: SinkWatch
    credit: PeerCredit
    balance: WeightBalance
    view: View
    _shares: dict[tuple[str, int], tuple[float, ...]]
    _silent: dict[str, int]

    if TYPE_CHECKING:

        @property
        def peers(self) -> AbstractSet[str]: ...

        def exchanges_with(self, peer: str) -> bool: ...

        @property
        def rng(self) -> random.Random: ...

        @property
        def weight_cap(self) -> float: ...

    def available(self, segment: int) -> float:
        return self.weights[segment] - self.reserved[segment]

    def balanced(self, segment: int) -> float:
        """The factor a push of ``segment`` carries now (:mod:`.weight_balance`: under 1
        while this node has held less than its share); one call per segment and push."""
        return self.balance.factor(segment, self.weights[segment])

    def hear_receiver(
        self, key: tuple[str, int], acked: Sequence[int], reported: Sequence[float]
    ) -> None:
        """What the receiver of push ``key`` reports holding, less what the push brought
        (its weight before this node's push merged): the weight balance's view of its
        peers (:mod:`.weight_balance`, which bounds what a lie can do). A suspected sink's
        reports are not heard: its take is not the honest sites' share."""
        push = self.in_flight.get(key)
        if push is None or not self.balance.enabled or not reported:
            return
        if self.sinks.suspected(push.peer):
            return
        for s, weight in zip(acked, reported, strict=False):
            before = weight - push.weights.get(s, 0.0)
            self.balance.heard(push.peer, s, min(before, self.weight_cap))

    def busy_peers(self) -> set[str]:
        return set(self._to)

    def in_flight_to(self, peer: str, segment: int) -> float:
        """What this node's unsettled pushes to ``peer`` carry of ``segment`` (asked several
        times per push and per payload: a lookup, not a scan of every push in flight)."""
        pushes = self._to.get(peer)
        if not pushes:
            return 0.0
        return sum(p.weights.get(segment, 0.0) for p in pushes)

    def can_push(self, peer: str) -> bool:
        """A free slot, nothing unacknowledged to ``peer`` already (one per edge), ``peer``
        not suspected of sinking weight (:mod:`.sinks`), and its credit (:mod:`.credit`)
        leaving room for a push worth its bytes in some segment."""
        return (
            peer != self.node_id
            and len(self.in_flight) < self.max_in_flight
            and not self.sinks.suspected(peer)
            and peer not in self._to
            and self.credit_leaves_room(peer)
        )

    def credit_leaves_room(self, peer: str) -> bool:
        """Whether ``peer``'s credit admits at least ``MIN_ROOM`` of this node's available
        weight in some segment: a push cut to less than that moves nearly nothing for a
        whole payload's bytes, so the protocol picks another peer (or waits) instead."""
        credit = self.credit
        if not credit.on:
            return True
        for s, (weight, reserved) in enumerate(zip(self.weights, self.reserved, strict=True)):
            if credit.room(peer, s, self.in_flight_to(peer, s)) >= MIN_ROOM * (weight - reserved):
                return True
        return False

    def passed_over(self, peer: str) -> bool:
        """Whether the credit keeps this node's pushes from ``peer``: it holds all of it, or
        so much that the room left is under ``MIN_ROOM`` (a sink that returned a crumb, or
        whose net stopped short while this node's weight grew, is passed over as surely)."""
        return self.credit.on and (self.credit.holds_all(peer) or not self.credit_leaves_room(peer))

    def push(
        self, peer: str, amounts: Mapping[int, float], *, everything: bool = False
    ) -> Push | None:
        """Reserve ``amounts`` of the available weights and send them to ``peer``.

        ``everything`` hands over the whole weight exactly: w + reserved may
        round away from it, leaving a leaving node a crumb it no longer has.
        """
        asked = {s: float(w) for s, w in amounts.items()}
        weights = self._within_credit(peer, asked, everything)
        if not any(w > 0 for w in weights.values()) or self.sinks.suspected(peer):
            return None  # nothing to send, or nothing more for a suspected sink
        for s, w in weights.items():
            if w > self.available(s) * (1 + 1e-12):
                raise ValueError(f"segment {s}: pushing {w} exceeds available {self.available(s)}")
        settled = self.numberings.settled(peer)
        sequence, base = self.numberings.next(peer, self.step)
        # Each segment's share of the available weight, in the order of ``weights``: a tuple,
        # not a dict, since every push of a simulated round is in flight at once.
        shares = tuple(
            w / self.available(s) if self.available(s) > 0 else 1.0 for s, w in weights.items()
        )
        for s, w in weights.items():
            whole = everything and w == asked[s]
            self.reserved[s] = self.weights[s] if whole else self.reserved[s] + w
        push = Push(peer, sequence, weights, self.round, base, settled)
        self.in_flight[push.key] = push
        self._to[peer] = (*self._to.get(peer, ()), push)
        self._shares[push.key] = shares
        return push

    def _within_credit(
        self, peer: str, asked: dict[int, float], hand_off: bool
    ) -> dict[int, float]:
        """``asked``, each segment cut to what ``peer``'s credit allows: what it may hold of
        this node's weight, or for a hand-off, what it admits (:mod:`.credit`)."""
        if not self.credit.on:
            return asked
        limit = self.credit.handable if hand_off else self.credit.room
        return {s: min(w, limit(peer, s, self.in_flight_to(peer, s))) for s, w in asked.items()}

    def push_share(
        self, peer: str, fraction: float, segments: Iterable[int] | None = None
    ) -> Push | None:
        """Push ``fraction`` of the available weight of ``segments`` (all by default),
        times the balance factor of each."""
        chosen = range(len(self.weights)) if segments is None else segments
        return self.push(peer, {s: self.available(s) * fraction * self.balanced(s) for s in chosen})

    def hand_off(self, peer: str | None = None) -> Push | None:
        """Hand all available weight to ``peer`` (or a random live one) before leaving, or
        as much of it as ``peer`` admits (:mod:`.credit`): the rest goes to the next heir."""
        if peer is None:
            peers = sorted(p for p in self.peers if not self.sinks.suspected(p))
            if not peers:
                return None
            self.rng.shuffle(peers)  # ties: leavers do not all pick the same heir
            peer = max(peers, key=self._handable)
        if peer == self.node_id:
            raise ValueError("a node cannot hand its weight to itself")
        amounts = {s: self.available(s) for s in range(len(self.weights))}
        return self.push(peer, amounts, everything=True)

    def _handable(self, peer: str) -> float:
        """What a hand-off to ``peer`` could carry, over all segments (inf: no credit)."""
        if not self.credit.on:
            return math.inf
        return sum(
            self.credit.handable(peer, s, self.in_flight_to(peer, s))
            for s in range(len(self.weights))
        )

    def close_numberings(self, receivers: Iterable[str]) -> list[Settle]:
        """Close the numberings to ``receivers`` that have no push in flight, telling each
        receiver that merged any of its pushes (``Settle``) to forget its window."""
        settles: list[Settle] = []
        for receiver in receivers:
            if receiver in self._to:
                continue  # its push in flight is still being retried in this numbering
            closed = self.numberings.close(receiver)
            if closed is not None and closed[2]:
                settles.append(Settle(receiver, closed[0], closed[1]))
        return settles

    def settle(self, key: tuple[str, int], acked_segments: Sequence[int]) -> list[FoldBack]:
        """Commit acknowledged segments; the rest of the reservation comes home.

        Returned weight comes back with the snapshot it left with: the returned
        ``FoldBack`` actions fold that snapshot back in (x ← (1 − α)·x + α·x_sent,
        α = sent/available), exactly as if the push had been a message to self.
        Without them a failed push would keep the mass but lose its value, and
        Σ w·x would drift every time a peer dies mid-push.
        """
        push = self.in_flight.pop(key, None)
        shares = self._shares.pop(key, ())
        if push is None:
            return []
        to_peer = tuple(p for p in self._to.pop(push.peer) if p is not push)
        if to_peer:
            self._to[push.peer] = to_peer
        acked = set(acked_segments)
        folds = []
        sent = 0.0
        for s, w in push.weights.items():
            self.reserved[s] = max(self.reserved[s] - w, 0.0)
            if not self.in_flight:
                self.reserved[s] = 0.0  # no rounding remainder may outlive the pushes
            if s in acked:
                self.weights[s] = max(self.weights[s] - w, 0.0)
                sent += w
                self.credit.sent(push.peer, s, w)
            elif w > 0:
                available = self.available(s)
                folds.append(
                    FoldBack(push.peer, push.sequence, s, w / available if available > 0 else 1.0)
                )
        if not self.in_flight:  # nor in a segment this push did not carry
            self.reserved = [0.0] * len(self.reserved)
        if acked & push.weights.keys():
            self.numberings.acknowledged(push.peer, push.sequence_base, push.sequence)
            self.exchanged.add(push.peer, sent=sent, members=self.view.rank_of)
            taken = sum(f for s, f in zip(push.weights, shares, strict=False) if s in acked)
            self.sinks.sent(push.peer, taken / len(self.weights))
            for peer in self._silent:
                if self.exchanges_with(peer):  # silence counts only where weight could come
                    self._silent[peer] += 1
            if self.passed_over(push.peer):
                self._silent.setdefault(push.peer, 0)  # at most one per peer with a net kept
        return folds
