"""Segment-wise gossip on a fair random topology (Crossover-SGD; Yeo et al., CCPE 2022).

Every ``round_steps`` local steps (round r = step // round_steps), for each
segment s, every node derives the same derangement d of the ranks from a
stateless hash of (mesh seed, view epoch, r, s) and the node of rank i pushes
half of segment s's available weight to rank d(i). Segments bound for the same
peer travel in one push.

Invariant: with every push of a round delivered, each node sends and receives
exactly one half-share of each segment, so the round's mixing matrix
(I + P_{r,s})/2 is doubly stochastic (P_{r,s} the permutation matrix of d) and
the weights stay where they were; the sum of weights is constant whatever
arrives (the ledger's job). A derangement has no fixed point, so there is
never a self-edge; with one node there is nothing to do.

No barrier: a node whose destination is busy (a push to it still unsettled, or
no free slot) skips that segment this round and the weight simply stays; a
message from another round, or from a node whose view briefly differs, is
merged by the sum-weight rule like any other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import Field

from gossipd.node.protocols.base import Push, StepEnded
from gossipd.node.protocols.ledger import SumWeightLedger
from gossipd.node.protocols.settings import CoreSettings, ProtocolSettings
from gossipd.node.protocols.topology import derangement


class CrossoverSettings(ProtocolSettings):
    """``[gossip.crossover]``"""

    round_steps: int = Field(
        1, ge=1, description="local steps per round; each round every segment goes to one peer"
    )


class CrossoverGossip(SumWeightLedger):
    name = "crossover"
    Settings = CrossoverSettings

    @classmethod
    def from_settings(cls, common: CoreSettings, own: CrossoverSettings) -> CrossoverGossip:
        return cls(**common.ledger(), mesh_seed=common.mesh_seed, round_steps=own.round_steps)

    def __init__(
        self,
        node_id: str,
        num_segments: int,
        *,
        mesh_seed: int,
        round_steps: int,
        **ledger: Any,
    ) -> None:
        """``ledger``: ``rng`` or ``seed`` and the optional ``SumWeightLedger`` settings."""
        if round_steps < 1:
            raise ValueError(f"round_steps must be at least 1, got {round_steps}")
        super().__init__(node_id, num_segments, **ledger)
        self.mesh_seed = mesh_seed
        self.round_steps = round_steps

    def destinations(self) -> dict[str, list[int]]:
        """This round's peer for each segment, grouped: {peer: [segments]} (empty if alone)."""
        view = self.view
        n = len(view.members)
        if n < 2:
            return {}
        rank = view.rank_of[self.node_id]
        grouped: dict[str, list[int]] = {}
        for s in range(len(self.weights)):
            d = derangement(n, self.mesh_seed, view.epoch, self.round, s)
            grouped.setdefault(view.members[d[rank]], []).append(s)
        return grouped

    def on_step(self, event: StepEnded) -> Iterable[Push]:
        self.round = event.step // self.round_steps
        if event.step % self.round_steps:
            return []
        pushes = []
        for peer, segments in self.destinations().items():
            if not self.can_push(peer):
                continue  # busy: these segments' weight stays here this round
            push = self.push_share(peer, 0.5, segments)
            if push:
                pushes.append(push)
        return pushes
