"""Shuffle-exchange groups (SESGD; Yang, Qi, Wang, Sun, Li, Quek).

Every ``round_steps`` local steps (1: every iteration; H > 1: the paper's
"local" variant), all nodes derive one shuffle of the ranks from a stateless
hash of (mesh seed, view epoch, round) and cut it into k = round(√N) contiguous
groups of near-equal size. A node in a group of g sends each of the g − 1 other
members a share 1/g of its available weight (every segment), keeping 1/g: when
all of a group's pushes arrive, the group holds the average of its members'
models. Each node talks to O(√N) peers per round instead of Ring-SGD's O(N).

Invariant: the round's mixing matrix is block-diagonal with blocks J_g/g, which
is doubly stochastic, so the weights stay where they were and the sum of weights
is constant whatever arrives (the ledger's job). The shares are computed from
the available weight before the first reservation, so every member gets the
same 1/g; a member that cannot be reached this round (a push to it still
unsettled, or no free slot: a group of g needs ``max_in_flight`` ≥ g − 1 to
average exactly) simply gets nothing, and its share stays here. The weight balance
(:mod:`.weight_balance`) scales every share of a node that has held less than its
weight for a while (it steps faster than the others); at equal speeds every weight
stays 1 and the shares are exactly 1/g. No barrier:
messages from other rounds are merged by the sum-weight rule.
"""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import Field

from gossipd.node.protocols.base import Push, StepEnded
from gossipd.node.protocols.rounds import SeededRounds
from gossipd.node.protocols.settings import RoundSettings
from gossipd.node.protocols.topology import shuffled_groups


class ShuffleExchangeSettings(RoundSettings):
    """``[gossip.shuffle-exchange]``"""

    round_steps: int = Field(
        1, ge=1, description="local steps per round; more than 1 is the paper's 'local' variant"
    )


class ShuffleExchange(SeededRounds):
    name = "shuffle-exchange"
    Settings = ShuffleExchangeSettings

    def group(self) -> list[str]:
        """This round's group, this node included, in rank order of the shuffle."""
        view = self.view
        grouping = shuffled_groups(len(view.members), self.mesh_seed, view.epoch, self.round)
        mine = grouping.groups[grouping.group_of[view.rank_of[self.node_id]]]
        return [view.members[r] for r in mine]

    def on_step(self, event: StepEnded) -> Iterable[Push]:
        if not self.starts_round(event):
            return []
        group = self.group()
        if len(group) < 2:
            return []
        share = 1.0 / len(group)
        amounts = {
            s: self.available(s) * share * self.balanced(s) for s in range(len(self.weights))
        }
        pushes = []
        for peer in group:
            if peer == self.node_id or not self.can_push(peer):
                continue  # busy: that member's share stays here this round
            push = self.push(peer, amounts)
            if push:
                pushes.append(push)
        return pushes
