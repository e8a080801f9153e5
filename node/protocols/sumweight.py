"""Sum-weight gossip (GoSGD; Blot, Picard, Thome, Cord, Neurocomputing 2019).

After each local step, with probability p, a node s picks a live peer r uniformly
at random and pushes (x_s, w_s/2) for every segment. The receiver merges
x_r ← (w_r·x_r + w_s·x_s)/(w_r + w_s) and w_r ← w_r + w_s.

Invariant: the sum of weights over the mesh is constant when no message is lost,
and each node's x is already unbiased (no de-biasing division); how that stays
exact over a real network (reservations, acknowledge-then-commit, per-edge
sequences and de-duplication) is :mod:`gossipd.node.protocols.ledger`'s job.

A leaving node pushes all its available weight to one peer; a joining node
starts at weight 0 and only gains weight through ordinary pushes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import Field

from gossipd.node.protocols.base import Push, StepEnded
from gossipd.node.protocols.ledger import SumWeightLedger
from gossipd.node.protocols.settings import CoreSettings, ProtocolSettings

# Draws from the whole view before a node lists the peers it may push to (random_candidate).
CANDIDATE_DRAWS = 8
# A peer reached only through a relay (docs/nat.md) is drawn this much as often as a
# direct one: its link is slower (two hops, and the relay's own traffic), so the push
# that goes there takes longer to be acknowledged.
RELAYED_WEIGHT = 0.5


class SumWeightSettings(ProtocolSettings):
    """``[gossip.sumweight]``"""

    push_probability: float = Field(
        0.5, ge=0.0, le=1.0, description="chance of a push after each local step (p)"
    )


class SumWeightGossip(SumWeightLedger):
    name = "sumweight"
    Settings = SumWeightSettings

    @classmethod
    def from_settings(cls, common: CoreSettings, own: SumWeightSettings) -> SumWeightGossip:
        return cls(**common.ledger(), push_probability=own.push_probability)

    def __init__(
        self,
        node_id: str,
        num_segments: int,
        *,
        push_probability: float,
        **ledger: Any,
    ) -> None:
        """``ledger``: ``rng`` or ``seed`` and the optional ``SumWeightLedger`` settings."""
        if not 0.0 <= push_probability <= 1.0:
            raise ValueError(f"push_probability must be in [0, 1], got {push_probability}")
        super().__init__(node_id, num_segments, **ledger)
        self.push_probability = push_probability

    def on_step(self, event: StepEnded) -> Iterable[Push]:
        self.round = event.step
        return self.on_step_end()

    def on_step_end(self) -> list[Push]:
        """Maybe push half of the available weight to a random live peer that is not busy.

        A peer suspected of sinking weight is no candidate (:mod:`.sinks`), nor one
        whose credit leaves no room (:mod:`.credit`).
        At most one push per peer is unacknowledged, and ``max_in_flight`` in all:
        a slow or hung receiver holds one slot while the others keep gossiping,
        and a node with every slot taken skips its turn instead of queueing.
        """
        if len(self.in_flight) >= self.max_in_flight or not self.peers:
            return []
        if self.rng.random() >= self.push_probability:
            return []
        peer = self.random_candidate()
        push = self.push_share(peer, 0.5) if peer is not None else None
        return [push] if push else []

    def random_candidate(self) -> str | None:
        """A peer drawn from those :meth:`can_push` allows, or None if none is: uniformly,
        but a relayed one at ``RELAYED_WEIGHT`` of a direct one's odds.

        Drawn from the whole view and kept if allowed, up to ``CANDIDATE_DRAWS`` times,
        then from the list of the allowed: the same odds either way (each allowed peer is
        as likely at every draw), and O(1) while most peers are allowed, as they are in a
        large mesh. Listing every allowed peer at every step made a step O(members): a
        5,000-node simulated mesh ran past 5 minutes for 2 rounds.
        """
        members, relayed = self.view.members, self.relayed
        for _ in range(CANDIDATE_DRAWS):
            peer = members[self.rng.randrange(len(members))]
            if peer in relayed and self.rng.random() >= RELAYED_WEIGHT:
                continue
            if self.can_push(peer):
                return peer
        candidates = [p for p in self.peers if self.can_push(p)]  # in view order: sorted
        if not candidates:
            return None
        if relayed.isdisjoint(candidates):
            return self.rng.choice(candidates)
        weights = [RELAYED_WEIGHT if p in relayed else 1.0 for p in candidates]
        return self.rng.choices(candidates, weights)[0]
