"""Sum-weight gossip (GoSGD; Blot, Picard, Thome, Cord, Neurocomputing 2019), sans-IO.

After each local step, with probability p, a node s picks a live peer r uniformly
at random and pushes (x_s, w_s/2) for every segment. The receiver merges
x_r ← (w_r·x_r + w_s·x_s)/(w_r + w_s) and w_r ← w_r + w_s.

Invariant: the sum of weights over the mesh is constant when no message is lost,
and each node's x is already unbiased (no de-biasing division). To keep it exact
over a real network:

* the sent half is *reserved*, not removed; it is removed only when the receiver
  acknowledges that segment (acknowledge-then-commit), and returned on failure,
  so a dead peer never swallows mass;
* the receiver de-duplicates by (sender, incarnation, sequence, segment), so a
  retried push whose acknowledgement was lost never merges twice;
* a merge uses the node's *available* weight (weight minus reservations), which
  keeps Σ w·x exact while pushes are in flight.

A leaving node pushes all its available weight to one peer; a joining node
starts at weight 0 and only gains weight through ordinary pushes.

Sequences are per edge: a sender numbers its pushes to each receiver 1, 2, 3…
(starting again when the receiver restarts) and a retry reuses its number. The
receiver admits a sequence at most ``SEQUENCE_AHEAD`` beyond the highest it
admitted from that sender incarnation (beyond 0 before the first) and refuses
anything further: it is never allowed to move the window. Only a segment this
node remembers merging is answered DUPLICATE; a sequence older than what it
remembers is refused, so the sender folds it back rather than losing it. An
honest sender never sees either refusal (it has one push in flight per edge);
a forger who can pass as a sender can at worst get that sender's pushes
refused, never answered DUPLICATE unmerged. Who may pass as a sender is the
membership's (and, with certificates, TLS's) business.

Mass bound: without faults Σw is exact. A push is folded back into its sender
only when the receiver refused it (it merged nothing) or was declared dead; the
one remaining error is a receiver that merged a push and was then declared
dead before its acknowledgement arrived (it comes back after ``drop_after_s``,
or restarts from a checkpoint taken after the merge): that push's weight then
exists twice. Everything else (lost acknowledgements, retries, duplicates,
reordering) keeps the total exact.

This module does no I/O: it takes events and returns actions, and its random
choices come from the ``random.Random`` it is given.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

# How many recent sequences are remembered per (sender, incarnation). Sequences are
# per edge and a sender has at most one push in flight to us, so a retry older
# than this is long settled and treated as already merged.
DEDUP_WINDOW = 4096
# How far beyond the highest admitted sequence a push may be. Sequences to one
# receiver grow by one per push, so a gap only comes from pushes given up on.
SEQUENCE_AHEAD = 1024


class Refused(ValueError):
    """A payload the core will not merge; nothing was changed."""


@dataclass(frozen=True)
class Push:
    """Send these segments of the current model, with these weights, to ``peer``."""

    peer: str
    sequence: int
    weights: dict[int, float]

    @property
    def key(self) -> tuple[str, int]:
        """Sequences are per receiver, so a push in flight is known by (peer, sequence)."""
        return (self.peer, self.sequence)


@dataclass(frozen=True)
class Merge:
    """Apply x ← (1 − alpha)·x + alpha·x_received to ``segment``."""

    segment: int
    alpha: float
    weight_after: float


@dataclass(frozen=True)
class Duplicate:
    """Already merged earlier: acknowledge again, change nothing."""

    segment: int


class _Window:
    """Recently merged (sequence, segment) pairs of one sender incarnation, bounded in size."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, int]] = set()
        self.order: deque[tuple[int, int]] = deque()
        self.forgotten_up_to = -1
        self.highest: int | None = None

    def check(self, sequence: int) -> None:
        """Refuse a sequence too far ahead (it must not move the window) or forgotten."""
        highest = self.highest or 0
        if sequence > highest + SEQUENCE_AHEAD:
            raise Refused(
                f"sequence {sequence} is more than {SEQUENCE_AHEAD} beyond the highest "
                f"admitted from this sender ({highest}); refused"
            )
        if sequence <= self.forgotten_up_to:
            raise Refused(
                f"sequence {sequence} is older than this node remembers (up to "
                f"{self.forgotten_up_to} forgotten); refused, not acknowledged"
            )

    def is_new(self, sequence: int, segment: int) -> bool:
        return sequence > self.forgotten_up_to and (sequence, segment) not in self.seen

    def admit(self, sequence: int, segment: int, capacity: int) -> bool:
        """True the first time a pair is offered; False for a repeat or anything too old."""
        ident = (sequence, segment)
        if not self.is_new(sequence, segment):
            return False
        self.highest = sequence if self.highest is None else max(self.highest, sequence)
        self.seen.add(ident)
        self.order.append(ident)
        while len(self.order) > capacity:
            old = self.order.popleft()
            self.seen.discard(old)
            self.forgotten_up_to = max(self.forgotten_up_to, old[0])
        return True


class SumWeightGossip:
    """State of one node: per-segment sum-weights, reservations and the de-duplication window."""

    def __init__(
        self,
        node_id: str,
        num_segments: int,
        *,
        push_probability: float,
        rng: random.Random,
        initial_weight: float = 1.0,
        max_in_flight: int = 2,
        max_weight: float = math.inf,
    ) -> None:
        if not 0.0 <= push_probability <= 1.0:
            raise ValueError(f"push_probability must be in [0, 1], got {push_probability}")
        if num_segments < 1:
            raise ValueError(f"num_segments must be at least 1, got {num_segments}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        if not (math.isfinite(initial_weight) and initial_weight >= 0):
            raise ValueError(f"initial_weight must be finite and >= 0, got {initial_weight}")
        self.node_id = node_id
        self.push_probability = push_probability
        self.max_in_flight = max_in_flight
        self.max_weight = max_weight
        self.rng = rng
        self.weights: list[float] = [float(initial_weight)] * num_segments
        self.reserved: list[float] = [0.0] * num_segments
        self.in_flight: dict[tuple[str, int], Push] = {}
        self.peers: set[str] = set()
        self._sequences: dict[str, int] = {}  # last sequence used towards each receiver
        # Per (sender, incarnation): the remembered (sequence, segment) pairs, their order,
        # and the highest sequence already forgotten (anything at or below it is old).
        self._seen: dict[tuple[str, int], _Window] = {}

    # -- membership -----------------------------------------------------------------
    def on_peer_up(self, peer: str) -> None:
        if peer != self.node_id:
            self.peers.add(peer)

    def on_peer_down(self, peer: str) -> None:
        self.peers.discard(peer)

    # -- weights --------------------------------------------------------------------
    def available(self, segment: int) -> float:
        return self.weights[segment] - self.reserved[segment]

    def _push(self, peer: str, fraction: float) -> Push | None:
        weights = {s: self.available(s) * fraction for s in range(len(self.weights))}
        if not any(w > 0 for w in weights.values()):
            return None
        sequence = self._sequences.get(peer, 0) + 1
        self._sequences[peer] = sequence
        for s, w in weights.items():
            # Handing over everything reserves the whole weight exactly: w + reserved
            # may round away from it, leaving a leaving node a crumb it no longer has.
            self.reserved[s] = self.weights[s] if fraction == 1.0 else self.reserved[s] + w
        push = Push(peer, sequence, weights)
        self.in_flight[push.key] = push
        return push

    def busy_peers(self) -> set[str]:
        return {peer for peer, _ in self.in_flight}

    def on_step_end(self) -> list[Push]:
        """Maybe push half of the available weight to a random live peer that is not busy.

        At most one push per peer is unacknowledged, and ``max_in_flight`` in all:
        a slow or hung receiver holds one slot while the others keep gossiping,
        and a node with every slot taken skips its turn instead of queueing.
        """
        if len(self.in_flight) >= self.max_in_flight:
            return []
        candidates = sorted(self.peers - self.busy_peers())
        if not candidates:
            return []
        if self.rng.random() >= self.push_probability:
            return []
        push = self._push(self.rng.choice(candidates), 0.5)
        return [push] if push else []

    def hand_off(self, peer: str | None = None) -> Push | None:
        """Hand all available weight to ``peer`` (or a random live one) before leaving."""
        if peer is None:
            if not self.peers:
                return None
            peer = self.rng.choice(sorted(self.peers))
        if peer == self.node_id:
            raise ValueError("a node cannot hand its weight to itself")
        return self._push(peer, 1.0)

    def on_push_acked(self, key: tuple[str, int], acked_segments: Sequence[int]) -> list[Merge]:
        """Commit acknowledged segments; the rest of the reservation returns to the node.

        Returned weight comes back with the snapshot it left with: the returned
        ``Merge`` actions fold that snapshot back in (x ← (1 − α)·x + α·x_sent,
        α = sent/available), exactly as if the push had been a message to self.
        Without them a failed push would keep the mass but lose its value, and
        Σ w·x would drift every time a peer dies mid-push.
        """
        push = self.in_flight.pop(key, None)
        if push is None:
            return []
        acked = set(acked_segments)
        merges = []
        for s, w in push.weights.items():
            self.reserved[s] = max(self.reserved[s] - w, 0.0)
            if not self.in_flight:
                self.reserved[s] = 0.0  # no rounding remainder may outlive the pushes
            if s in acked:
                self.weights[s] = max(self.weights[s] - w, 0.0)
            elif w > 0:
                available = self.available(s)
                merges.append(Merge(s, w / available if available > 0 else 1.0, self.weights[s]))
        return merges

    def on_push_failed(self, key: tuple[str, int]) -> list[Merge]:
        """The receiver refused the push or was declared dead: the weight comes home."""
        return self.on_push_acked(key, ())

    # -- receiving ------------------------------------------------------------------
    def plan_receive(
        self, sender: str, incarnation: int, sequence: int, weights: dict[int, float]
    ) -> list[Merge | Duplicate]:
        """What merging this push would do, without doing it; raises ``Refused``.

        A push is merged whole or not at all: the driver checks the plan (for
        example that every merged value stays finite) and only then calls
        :meth:`apply_receive` with it.
        """
        window = self._seen.get((sender, incarnation)) or _Window()
        window.check(sequence)
        actions: list[Merge | Duplicate] = []
        for segment, weight in weights.items():
            if not 0 <= segment < len(self.weights):
                raise Refused(f"segment {segment} out of range 0..{len(self.weights) - 1}")
            if not (math.isfinite(weight) and 0 <= weight <= self.max_weight):
                raise Refused(
                    f"sum-weight {weight} of segment {segment} is not a finite number in "
                    f"[0, {self.max_weight}] (limits.max_sum_weight)"
                )
            if not window.is_new(sequence, segment):
                actions.append(Duplicate(segment))
                continue
            mine = self.available(segment)
            total = mine + weight
            alpha = weight / total if total > 0 else 0.0
            actions.append(Merge(segment, alpha, self.weights[segment] + weight))
        return actions

    def apply_receive(
        self, sender: str, incarnation: int, sequence: int, plan: Sequence[Merge | Duplicate]
    ) -> None:
        """Commit a plan from :meth:`plan_receive`, with no other call in between."""
        window = self._seen.setdefault((sender, incarnation), _Window())
        capacity = DEDUP_WINDOW * len(self.weights)
        for action in plan:
            if isinstance(action, Merge) and window.admit(sequence, action.segment, capacity):
                self.weights[action.segment] = action.weight_after

    def on_message(
        self, sender: str, incarnation: int, sequence: int, segment: int, weight: float
    ) -> Merge | Duplicate:
        """One segment planned and applied at once (raises ``Refused``)."""
        (action,) = self.plan_receive(sender, incarnation, sequence, {segment: weight})
        self.apply_receive(sender, incarnation, sequence, [action])
        return action

    def on_peer_restarted(self, peer: str, incarnation: int) -> None:
        """``peer`` restarted: its old de-duplication state goes, and our numbering to it
        starts again at 1, since the new incarnation remembers nothing of ours."""
        self.forget_sender(peer, incarnation)
        self._sequences.pop(peer, None)

    def forget_sender(self, sender: str, keep_incarnation: int) -> None:
        """Drop de-duplication state of a sender's older incarnations (it restarted)."""
        for key in [k for k in self._seen if k[0] == sender and k[1] < keep_incarnation]:
            del self._seen[key]
