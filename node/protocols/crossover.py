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

from pydantic import Field

from gossipd.node.protocols.base import Push, StepEnded
from gossipd.node.protocols.rounds import SeededRounds
from gossipd.node.protocols.settings import RoundSettings
from gossipd.node.protocols.topology import derangement


class CrossoverSettings(RoundSettings):
    """``[gossip.crossover]``"""

    round_steps: int = Field(
        1, ge=1, description="local steps per round; each round every segment goes to one peer"
    )


class CrossoverGossip(SeededRounds):
    name = "crossover"
    Settings = CrossoverSettings

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
        if not self.starts_round(event):
            return []
        pushes = []
        for peer, segments in self.destinations().items():
            if not self.can_push(peer):
                continue  # busy: these segments' weight stays here this round
            push = self.push_share(peer, 0.5, segments)
            if push:
                pushes.append(push)
        return pushes
