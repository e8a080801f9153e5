"""What a core tells the world about itself: its status, the weight it exchanged with each
peer, and the receipts a leaving node hands back.

Every field a driver reads is declared here with its default for a core that does not
keep it, so the type checker sees each reader and each writer; ``extra`` alone is
free-form, and only ever shown to operators.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field


@dataclass(frozen=True)
class PeerMass:
    """Sum-weight this node committed to ``peer`` (``sent``: acknowledged) and merged from it
    (``received``), since ``peer``'s current incarnation was first seen; the ``*_before``
    pair is what went to and came from its previous incarnation (it restarted).
    ``incarnation``: the one these accounts are of, once ``peer`` restarted (0: the first
    this node saw); a restarted node's audit waits for its own here."""

    sent: float = 0.0
    received: float = 0.0
    sent_before: float = 0.0
    received_before: float = 0.0
    incarnation: int = 0


@dataclass(frozen=True)
class CoreStatus:
    """What status, metrics and checkpoints may know of a core, as one immutable copy."""

    protocol: str
    round: int
    epoch: int
    in_flight: int
    peers: AbstractSet[str]
    # Per segment, for a core that keeps sum-weights (the push protocols); empty for one
    # that keeps none (a core that only averages with pulled models). Status, metrics,
    # checkpoints and the launcher's summary then simply show no weights.
    weights: tuple[float, ...] = ()
    reserved: tuple[float, ...] = ()
    # Display only: what a core shows operators beyond the fields below (overlap: its mode,
    # period and the peer it pulls from). No driver reads it; what a driver needs is a field.
    extra: Mapping[str, object] = field(default_factory=dict)
    # Weight exchanged with each peer (summed over segments), for operators and audits.
    exchanged: Mapping[str, PeerMass] = field(default_factory=dict)
    # Peers suspected of sinking weight: no pushes to them.
    sinks: frozenset[str] = frozenset()
    # The most sum-weight a segment may hold after a merge.
    weight_cap: float = math.inf
    # Sum-weight received that did not fit under the weight cap since start, summed over
    # segments: merged payloads' weight that is gone.
    weight_cut: float = 0.0
    # Per segment, the weight balance's factor on what a push carries; empty where the core
    # keeps no weights or the balance is off.
    balance_factors: tuple[float, ...] = ()
    # Who picks this node's pulls: "coordinator", "decentralized", or "" for a core that
    # does not pull.
    scheduling: str = ""
    # A pulling core's pulls by outcome since start; empty otherwise.
    pulls: Mapping[str, int] = field(default_factory=dict)

    def spread_over_available(self, segment: int, weight: float) -> float | None:
        """``weight`` over what ``segment`` holds outside its pushes in flight: the factor
        that puts ``weight``'s worth of change into the model (a lossy codec's dropped
        difference, kept at home); None where the core keeps no weights or holds none."""
        if segment >= len(self.weights):
            return None
        available = self.weights[segment] - self.reserved[segment]
        return weight / available if available > 0 else None


@dataclass(frozen=True)
class Receipts:
    """What a node merged from one numbering of one sender: its (sequence, segment) pairs,
    and the sequences up to ``forgotten_up_to`` it no longer remembers.

    A leaving node merges nothing new, so what it merged is final: it sends each peer
    that peer's own receipts, and a push whose answer was lost on the way settles from
    them exactly instead of folding back weight the leaver merged and handed on."""

    incarnation: int  # the sender's
    base: int
    forgotten_up_to: int
    pairs: frozenset[tuple[int, int]]

    def merged(self, sequence: int, segment: int) -> bool | None:
        """Whether the pair was merged; None for a sequence too old to tell."""
        if sequence <= self.forgotten_up_to:
            return None
        return (sequence, segment) in self.pairs
