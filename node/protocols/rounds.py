"""A sum-weight core that pushes once a round along a topology every node derives alike.

Crossover and shuffle-exchange both count a round every ``round_steps`` local steps and
draw that round's topology from a stateless hash of (mesh seed, view epoch, round), so
the nodes agree on it with no message; they differ only in the topology and the shares.
This is what they share: their settings, how they are built, and when a round starts.
"""

from __future__ import annotations

from typing import Any, ClassVar, Self

from gossipd.node.protocols.base import StepEnded
from gossipd.node.protocols.ledger import SumWeightLedger
from gossipd.node.protocols.settings import CoreSettings, RoundSettings


class SeededRounds(SumWeightLedger):
    """A ledger whose subclass pushes at the first step of each round (:meth:`starts_round`)."""

    Settings: ClassVar[type[RoundSettings]] = RoundSettings

    @classmethod
    def from_settings(cls, common: CoreSettings, own: RoundSettings) -> Self:
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

    def starts_round(self, event: StepEnded) -> bool:
        """Count the round ``event`` falls in; whether its step is the round's first."""
        self.round = event.step // self.round_steps
        return event.step % self.round_steps == 0
