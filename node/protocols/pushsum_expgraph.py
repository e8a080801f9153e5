"""Push-sum on the directed exponential graph (SGP's baseline; Assran et al., ICML 2019).

At iteration k = step // round_steps (one push per iteration, at the step that
starts it), the node of rank i pushes half its mass, every segment, to rank
(i ± 2^(k mod m)) mod N, with m = ⌈log2 N⌉ and ranks taken from the current view:
+ in cycle c = k // m when c is even, − when it is odd.

Why the turn (not in SGP): along a graph that only goes forward, an honest
out-neighbour never sends weight back, so a member that takes every push and returns
nothing (a sink) looks like any honest peer and takes the mesh's weight. Turning the
direction every cycle sends weight back along every edge it took, so the per-peer
credit and the sink watch of the ledger apply as they do to the undirected protocols;
each cycle is still the same product of m matrices (see
:func:`~gossipd.node.protocols.topology.exponential_peer`).

Why the ceiling: SGP writes log2 N because it assumes N is a power of two; then
the shifts are 1, 2, …, N/2 and this is exactly the directed exponential graph,
whose m consecutive mixing matrices multiply to the exact average J/N. For
other N, ⌈log2 N⌉ keeps every shift below N (no self-edge) and lets sums of
distinct shifts reach every offset, so any m consecutive iterations still carry
every node's mass to every other; ⌊log2 N⌋ would drop the longest hop. The
product is then contracting but no longer the exact average.

Invariant: each iteration's map is a permutation (a rotation of the ranks), so
with every push delivered each node sends and receives one half-share and the
mixing matrix (I + P)/2 is doubly stochastic; sum-weights travel with every push
and are never inferred from the graph, so a skipped or lost push changes the
weights, never the total.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import Field

from gossipd.node.protocols.base import Push, StepEnded
from gossipd.node.protocols.credit import HALF_PUSH_CREDIT
from gossipd.node.protocols.ledger import SumWeightLedger
from gossipd.node.protocols.settings import CoreSettings, ProtocolSettings
from gossipd.node.protocols.topology import (
    ceil_log2,
    cycle_backward,
    exponential_neighbours,
    exponential_peer,
)


class PushSumExpGraphSettings(ProtocolSettings):
    """``[gossip.pushsum-expgraph]``"""

    round_steps: int = Field(
        1, ge=1, description="local steps per iteration k of the exponential graph"
    )


class PushSumExpGraph(SumWeightLedger):
    name = "pushsum-expgraph"
    default_peer_credit = HALF_PUSH_CREDIT  # its exact average needs whole half pushes
    Settings = PushSumExpGraphSettings

    @classmethod
    def from_settings(cls, common: CoreSettings, own: PushSumExpGraphSettings) -> PushSumExpGraph:
        return cls(**common.ledger(), round_steps=own.round_steps)

    def __init__(
        self,
        node_id: str,
        num_segments: int,
        *,
        round_steps: int,
        **ledger: Any,
    ) -> None:
        """``ledger``: ``rng`` or ``seed`` and the optional ``SumWeightLedger`` settings."""
        if round_steps < 1:
            raise ValueError(f"round_steps must be at least 1, got {round_steps}")
        super().__init__(node_id, num_segments, **ledger)
        self.round_steps = round_steps

    def destination(self) -> str | None:
        """This iteration's out-neighbour, or None when alone."""
        n = len(self.view.members)
        if n < 2:
            return None
        rank = self.view.rank_of[self.node_id]
        backward = cycle_backward(self.round // ceil_log2(n))
        return self.view.members[exponential_peer(rank, n, self.round, backward)]

    def exchanges_with(self, peer: str) -> bool:
        return exponential_neighbours(self.view, self.node_id, peer)

    def on_step(self, event: StepEnded) -> Iterable[Push]:
        self.round = event.step // self.round_steps
        if event.step % self.round_steps:
            return []
        peer = self.destination()
        if peer is None or not self.can_push(peer):
            return []  # busy: the mass stays here this iteration
        push = self.push_share(peer, 0.5)
        return [push] if push else []
