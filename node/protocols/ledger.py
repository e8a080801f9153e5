"""Sum-weight mass accounting shared by every push-based protocol core.

Every protocol here mixes models with the sum-weight rule (GoSGD; docs/design.md §5):
a node keeps a float64 weight w per segment, sends (x, share of w), and a
receiver merges x_r ← (w_r·x_r + w_s·x_s)/(w_r + w_s), w_r ← w_r + w_s. The
protocols differ only in *whom* they send *which* share, and when; this module
is the part they share, and it keeps the total weight exact over a real network:

* a sent share is *reserved*, not removed; it is removed only when the receiver
  acknowledges that segment (acknowledge-then-commit), and folded back on
  failure, so a dead peer never swallows mass;
* the receiver de-duplicates by (sender, incarnation, sequence, segment), so a
  retried push whose acknowledgement was lost never merges twice;
* a merge uses the node's *available* weight (weight minus reservations), which
  keeps Σ w·x exact while pushes are in flight;
* a message for an earlier or later round, or from a sender this node did not
  expect, is merged by the same rule: never waited for, never dropped.

Sequences are per edge and never repeat: a sender numbers its pushes to each
receiver 1, 2, 3… for its whole incarnation, and a retry reuses its number. When
the receiver restarts (or leaves the view and comes back) the sender starts a new
*numbering*: the next sequence becomes its ``sequence_base``, carried by every push.
The receiver keeps one de-duplication window per (sender, incarnation, base). A
restarted receiver restores the windows of its checkpoint, which are a faithful
record of what its restored model holds: a retry of a push it merged before that
checkpoint is answered DUPLICATE, one it merged after (lost with the crash) is
merged again, and new pushes open a fresh window. A sender that restarted numbering
at 1 into the receiver's restored window would be answered DUPLICATE for pushes
never merged, and drop their weight: that was the defect this design removes.

Within a window the receiver admits a sequence at most ``SEQUENCE_AHEAD`` beyond
the highest it admitted (beyond ``base - 1`` before the first) and refuses anything
further: it is never allowed to move the window. Only a segment this node remembers
merging is answered DUPLICATE; a sequence older than what it remembers is refused,
so the sender folds it back rather than losing it. An honest sender never sees
either refusal (it has one push in flight per edge); a forger who can pass as a
sender can at worst get that sender's pushes refused, never answered DUPLICATE
unmerged.

Mass bound: without faults Σw is exact. A push is folded back into its sender
only when the receiver refused it (it merged nothing) or was declared dead; a
receiver that merged a push and was then declared dead before its acknowledgement
arrived (it comes back after ``drop_after_s``) leaves that push's weight twice.
A crash and restart of one node from its checkpoint changes Σw by exactly what
the checkpoint does not hold: minus the weight it merged after the checkpoint,
plus the weight of its pushes that were in flight at the checkpoint or sent after
it and merged by their receivers. Pushes in flight *to* it are retried to the new
incarnation and cost nothing. Everything else (lost acknowledgements, retries,
duplicates, reordering) keeps the total exact.
"""

from __future__ import annotations

import dataclasses
import math
import random
from abc import abstractmethod
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from gossipd.node.protocols.base import (
    EXTRA_SINKS,
    EXTRA_WEIGHT_CAP,
    Action,
    CoreStatus,
    Duplicate,
    Event,
    FoldBack,
    GossipProtocol,
    HandOff,
    Merge,
    PayloadArrived,
    PayloadMerged,
    PeerMass,
    PeerRestarted,
    PullArrived,
    PullFailed,
    PullMerged,
    Push,
    PushSettled,
    Refused,
    StepEnded,
    TimerFired,
    TrainingEnded,
    View,
    ViewChanged,
    WeightCapExceeded,
    ranked,
)
from gossipd.node.protocols.sinks import SinkWatch

# How many recent sequences are remembered per (sender, incarnation). Sequences are
# per edge and a sender has at most one push in flight to us, so a retry older
# than this is long settled and treated as already merged.
DEDUP_WINDOW = 4096
# How far beyond the highest admitted sequence a push may be. Sequences to one
# receiver grow by one per push, so a gap only comes from pushes given up on.
SEQUENCE_AHEAD = 1024
# Windows kept per sender incarnation. A sender starts a numbering only when this
# node restarts or drops out of its view, and has one push in flight to it, so
# only the newest two ever matter; the rest bounds what a lying sender can open.
NUMBERINGS_KEPT = 4
# The derived weight cap is this many times the number of founding members (weight_cap).
FAULT_HEADROOM = 2.0
# Peers whose exchanged weight is kept (operators' audit; verified peers only).
EXCHANGED_KEPT = 1024


class _Window:
    """Recently merged (sequence, segment) pairs of one sender incarnation, bounded in size."""

    def __init__(self, base: int = 1) -> None:
        self.base = base
        self.seen: set[tuple[int, int]] = set()
        self.order: deque[tuple[int, int]] = deque()
        self.forgotten_up_to = -1
        self.highest: int | None = None

    def check(self, sequence: int) -> None:
        """Refuse a sequence too far ahead (it must not move the window) or forgotten."""
        if sequence < self.base:
            raise Refused(
                f"sequence {sequence} is below the base {self.base} of its own numbering; refused"
            )
        highest = self.base - 1 if self.highest is None else self.highest
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

    def state(self) -> dict[str, Any]:
        return {"order": list(self.order), "forgotten": self.forgotten_up_to, "high": self.highest}

    @classmethod
    def restore(cls, state: Mapping[str, Any]) -> _Window:
        window = cls(int(state.get("base", 1)))
        window.order = deque(tuple(pair) for pair in state["order"])
        window.seen = set(window.order)
        window.forgotten_up_to = state["forgotten"]
        window.highest = state["high"]
        return window


class SumWeightLedger(GossipProtocol):
    """Weights, reservations, de-duplication and the view; subclasses choose the pushes.

    A subclass implements :meth:`on_step` (and, if it needs them,
    :meth:`on_training_ended` and :meth:`on_timer`) using :meth:`push` to send
    shares of its available weight. Everything else, including settling and
    merging, is handled here identically for every protocol.
    """

    # Whether an honest peer returns, over time, about the weight it takes from this node
    # (the sink watch assumes it). True where a node picks its peers at random or swaps
    # with a whole group; a protocol that pushes along a fixed directed graph sends each
    # out-neighbour weight that comes back only by way of other nodes, so every honest
    # out-neighbour would look like a sink: it sets this False and has no sink watch.
    returns_weight_per_peer: ClassVar[bool] = True

    def __init__(
        self,
        node_id: str,
        num_segments: int,
        *,
        rng: random.Random,
        initial_weight: float = 1.0,
        max_in_flight: int = 2,
        max_weight: float | None = math.inf,
        sink_bound: float = 6.0,
        sink_allowance: float = 0.5,
    ) -> None:
        """``max_weight``: the most weight a segment may hold after a merge (None: derived
        from the number of founding members, see :attr:`weight_cap`; the daemon's default);
        ``sink_bound`` and ``sink_allowance``: when a peer is suspected of sinking weight
        (:mod:`.sinks`)."""
        if num_segments < 1:
            raise ValueError(f"num_segments must be at least 1, got {num_segments}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        if not (math.isfinite(initial_weight) and initial_weight >= 0):
            raise ValueError(f"initial_weight must be finite and >= 0, got {initial_weight}")
        self.node_id = node_id
        self.max_in_flight = max_in_flight
        self.max_weight = max_weight
        self.rng = rng
        self.weights: list[float] = [float(initial_weight)] * num_segments
        self.reserved: list[float] = [0.0] * num_segments
        self.in_flight: dict[tuple[str, int], Push] = {}
        self.round = 0
        self.view: View = ranked(frozenset({node_id}))
        self._sequences: dict[str, int] = {}  # last sequence used towards each receiver
        self._bases: dict[str, int] = {}  # first sequence of the current numbering to each
        self._seen: dict[tuple[str, int, int], _Window] = {}  # (sender, incarnation, base)
        self._exchanged: dict[str, PeerMass] = {}
        self.sinks = SinkWatch(
            sink_bound if self.returns_weight_per_peer else math.inf, sink_allowance
        )
        self._shares: dict[tuple[str, int], dict[int, float]] = {}  # push -> share per segment
        self._largest_view = max(1, math.ceil(initial_weight))

    # -- the interface ------------------------------------------------------------------
    def handle(self, event: Event) -> list[Action]:
        match event:
            case StepEnded():
                return list(self.on_step(event))
            case PayloadArrived():
                return list(
                    self.plan_receive(*_payload_key(event), event.weights, event.sequence_base)
                )
            case PayloadMerged(payload=p):
                plan = self.plan_receive(*_payload_key(p), p.weights, p.sequence_base)
                self.apply_receive(*_payload_key(p), plan, p.sequence_base)
                return []
            case PushSettled():
                return list(self.settle((event.peer, event.sequence), event.acked))
            case ViewChanged():
                self.set_members(event.members)
                return []
            case PeerRestarted():
                self.on_peer_restarted(event.peer, event.incarnation)
                return []
            case HandOff():
                push = self.hand_off(event.peer)
                return [push] if push else []
            case TrainingEnded():
                return list(self.on_training_ended(event))
            case TimerFired():
                return list(self.on_timer(event))
            case PullArrived() | PullMerged() | PullFailed():
                raise Refused(f"protocol {self.name} never pulls; a pulled model is not merged")
        raise TypeError(f"not a protocol event: {event!r}")

    def status(self) -> CoreStatus:
        return CoreStatus(
            protocol=self.name,
            round=self.round,
            epoch=self.view.epoch,
            weights=tuple(self.weights),
            reserved=tuple(self.reserved),
            in_flight=len(self.in_flight),
            peers=self.peers,
            exchanged=dict(self._exchanged),
            extra={EXTRA_SINKS: self.sinks.sinks(), EXTRA_WEIGHT_CAP: self.weight_cap},
        )

    def state_dict(self) -> dict[str, Any]:
        """Weights as held (reservations count as held: their pushes' outcomes are unknown
        to whoever restores this), the round, the de-duplication windows, and the pushes
        that were in flight, for the record."""
        return {
            "protocol": self.name,
            "weights": list(self.weights),
            "reserved": list(self.reserved),
            "round": self.round,
            "in_flight": [
                {
                    "peer": p.peer,
                    "sequence": p.sequence,
                    "round": p.round,
                    "weights": dict(p.weights),
                }
                for p in self.in_flight.values()
            ],
            "sequences": dict(self._sequences),
            "windows": [
                {"sender": s, "incarnation": i, "base": b, **w.state()}
                for (s, i, b), w in self._seen.items()
            ],
            "exchanged": {peer: dataclasses.asdict(m) for peer, m in self._exchanged.items()},
            "sink_scores": self.sinks.state(),
            "largest_view": self._largest_view,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume as a new incarnation: held weights, round and windows come back.

        Pushes that were in flight are not resumed (nothing will settle them), so
        their reservations are not restored; the weights already count them as
        held, which is the crash bound above. Sequences towards receivers restart
        at 1, because receivers key their windows by this node's new incarnation.
        The windows stay keyed by the senders' numberings: a sender retrying a push
        it made before this restart is answered from the window that saw it.
        """
        if state.get("protocol", self.name) != self.name:
            raise ValueError(
                f"state of protocol {state['protocol']!r} cannot resume a {self.name!r} core; "
                "set gossip.protocol back or start from a fresh checkpoint directory"
            )
        weights = [float(w) for w in state["weights"]]
        if len(weights) != len(self.weights):
            raise ValueError(
                f"state has {len(weights)} segment weights, this model has {len(self.weights)}"
            )
        self.weights = weights
        self.reserved = [0.0] * len(weights)
        self.in_flight.clear()
        self._sequences.clear()
        self._bases.clear()
        self.round = int(state.get("round", 0))
        self._seen = {
            (w["sender"], w["incarnation"], int(w.get("base", 1))): _Window.restore(w)
            for w in state.get("windows", ())
        }
        self._exchanged = {peer: PeerMass(**m) for peer, m in state.get("exchanged", {}).items()}
        self._shares.clear()
        self.sinks.restore(state.get("sink_scores", {}))
        self._largest_view = max(self._largest_view, int(state.get("largest_view", 1)))

    # -- what subclasses decide ----------------------------------------------------------
    @abstractmethod
    def on_step(self, event: StepEnded) -> Iterable[Push]:
        """Which shares to push now that a local step ended."""

    def on_training_ended(self, event: TrainingEnded) -> Iterable[Action]:
        return ()

    def on_timer(self, event: TimerFired) -> Iterable[Action]:
        return ()

    # -- membership -------------------------------------------------------------------
    def set_members(self, members: frozenset[str]) -> None:
        for gone in frozenset(self.view.members) - members:
            self.new_numbering(gone)  # it may come back from a checkpoint
        self.view = ranked(members | {self.node_id} if self.node_id not in members else members)
        self._largest_view = max(self._largest_view, len(self.view.members))

    @property
    def weight_cap(self) -> float:
        """The most sum-weight one segment may hold after a merge.

        Founding members start at weight 1 and joiners at 0, so Σw is the number of
        founding members and no honest weight exceeds it. Unless ``max_weight`` says
        otherwise, this node takes that number as the largest view it has seen (itself
        included): a joiner can only raise it (looser, never wrong), and a founder this
        node never saw makes it tight, which refuses a merge (the sender folds its weight
        back: nothing is lost) until the view grows. The cap is ``FAULT_HEADROOM`` times
        that number: faults may create weight (a receiver declared dead after it merged
        leaves the push's weight twice), and an honest node must not be refused for it.
        """
        if self.max_weight is not None:
            return self.max_weight
        return FAULT_HEADROOM * float(self._largest_view)

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self.view.members) - {self.node_id}

    def on_peer_up(self, peer: str) -> None:
        self.set_members(frozenset(self.view.members) | {peer})

    def on_peer_down(self, peer: str) -> None:
        if peer != self.node_id:
            self.set_members(frozenset(self.view.members) - {peer})

    def on_peer_restarted(self, peer: str, incarnation: int) -> None:
        """``peer`` restarted: its old de-duplication state goes, our pushes to it start a
        new numbering (its restored windows know only the old one), and what we exchanged
        with its previous incarnation is kept apart from what follows."""
        self.forget_sender(peer, incarnation)
        self.new_numbering(peer)
        before = self._exchanged.get(peer, PeerMass())
        self._exchanged[peer] = PeerMass(sent_before=before.sent, received_before=before.received)

    def new_numbering(self, peer: str) -> None:
        """Number the next pushes to ``peer`` in a numbering of their own (see module doc)."""
        if peer in self._sequences:
            self._bases[peer] = self._sequences[peer] + 1

    def forget_sender(self, sender: str, keep_incarnation: int) -> None:
        """Drop de-duplication state of a sender's older incarnations (it restarted)."""
        for key in [k for k in self._seen if k[0] == sender and k[1] < keep_incarnation]:
            del self._seen[key]

    def _account(self, peer: str, *, sent: float = 0.0, received: float = 0.0) -> None:
        mass = self._exchanged.get(peer)
        if mass is None:
            if len(self._exchanged) >= EXCHANGED_KEPT:
                stale = next((p for p in self._exchanged if p not in self.view.rank_of), None)
                self._exchanged.pop(stale if stale is not None else next(iter(self._exchanged)))
            mass = PeerMass()
        self._exchanged[peer] = dataclasses.replace(
            mass, sent=mass.sent + sent, received=mass.received + received
        )

    # -- sending ----------------------------------------------------------------------
    def available(self, segment: int) -> float:
        return self.weights[segment] - self.reserved[segment]

    def busy_peers(self) -> set[str]:
        return {peer for peer, _ in self.in_flight}

    def can_push(self, peer: str) -> bool:
        """A free slot, nothing unacknowledged to ``peer`` already (one per edge), and
        ``peer`` not suspected of sinking weight (:mod:`.sinks`)."""
        return (
            peer != self.node_id
            and len(self.in_flight) < self.max_in_flight
            and not self.sinks.suspected(peer)
            and all(p != peer for p, _ in self.in_flight)
        )

    def push(
        self, peer: str, amounts: Mapping[int, float], *, everything: bool = False
    ) -> Push | None:
        """Reserve ``amounts`` of the available weights and send them to ``peer``.

        ``everything`` hands over the whole weight exactly: w + reserved may
        round away from it, leaving a leaving node a crumb it no longer has.
        """
        weights = {s: float(w) for s, w in amounts.items()}
        if not any(w > 0 for w in weights.values()) or self.sinks.suspected(peer):
            return None  # nothing to send, or nothing more for a suspected sink
        for s, w in weights.items():
            if w > self.available(s) * (1 + 1e-12):
                raise ValueError(f"segment {s}: pushing {w} exceeds available {self.available(s)}")
        sequence = self._sequences.get(peer, 0) + 1
        self._sequences[peer] = sequence
        shares = {
            s: w / self.available(s) if self.available(s) > 0 else 1.0 for s, w in weights.items()
        }
        for s, w in weights.items():
            self.reserved[s] = self.weights[s] if everything else self.reserved[s] + w
        push = Push(peer, sequence, weights, self.round, self._bases.get(peer, 1))
        self.in_flight[push.key] = push
        self._shares[push.key] = shares
        return push

    def push_share(
        self, peer: str, fraction: float, segments: Iterable[int] | None = None
    ) -> Push | None:
        """Push ``fraction`` of the available weight of ``segments`` (all by default)."""
        chosen = range(len(self.weights)) if segments is None else segments
        return self.push(peer, {s: self.available(s) * fraction for s in chosen})

    def hand_off(self, peer: str | None = None) -> Push | None:
        """Hand all available weight to ``peer`` (or a random live one) before leaving."""
        if peer is None:
            peers = sorted(p for p in self.peers if not self.sinks.suspected(p))
            if not peers:
                return None
            peer = self.rng.choice(peers)
        if peer == self.node_id:
            raise ValueError("a node cannot hand its weight to itself")
        amounts = {s: self.available(s) for s in range(len(self.weights))}
        return self.push(peer, amounts, everything=True)

    def settle(self, key: tuple[str, int], acked_segments: Sequence[int]) -> list[FoldBack]:
        """Commit acknowledged segments; the rest of the reservation comes home.

        Returned weight comes back with the snapshot it left with: the returned
        ``FoldBack`` actions fold that snapshot back in (x ← (1 − α)·x + α·x_sent,
        α = sent/available), exactly as if the push had been a message to self.
        Without them a failed push would keep the mass but lose its value, and
        Σ w·x would drift every time a peer dies mid-push.
        """
        push = self.in_flight.pop(key, None)
        shares = self._shares.pop(key, {})
        if push is None:
            return []
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
            elif w > 0:
                available = self.available(s)
                folds.append(
                    FoldBack(push.peer, push.sequence, s, w / available if available > 0 else 1.0)
                )
        if acked & push.weights.keys():
            self._account(push.peer, sent=sent)
            taken = sum(f for s, f in shares.items() if s in acked)
            self.sinks.sent(push.peer, taken / len(self.weights))
        return folds

    # -- receiving ----------------------------------------------------------------------
    def plan_receive(
        self,
        sender: str,
        incarnation: int,
        sequence: int,
        weights: Mapping[int, float],
        base: int = 1,
    ) -> list[Merge | Duplicate]:
        """What merging this push would do, without doing it; raises ``Refused``."""
        window = self._seen.get((sender, incarnation, base)) or _Window(base)
        window.check(sequence)
        actions: list[Merge | Duplicate] = []
        for segment, weight in weights.items():
            if not 0 <= segment < len(self.weights):
                raise Refused(f"segment {segment} out of range 0..{len(self.weights) - 1}")
            if not (math.isfinite(weight) and weight >= 0):
                raise Refused(
                    f"sum-weight {weight} of segment {segment} is not a finite number >= 0"
                )
            if not window.is_new(sequence, segment):
                actions.append(Duplicate(segment))
                continue
            if self.weights[segment] + weight > self.weight_cap:
                raise WeightCapExceeded(
                    f"merging sum-weight {weight!r} into segment {segment} would raise it from "
                    f"{self.weights[segment]:g} to {self.weights[segment] + weight:g}, over the "
                    f"cap {self.weight_cap:g} (limits.max_sum_weight; unset: the number of "
                    "founding members, the largest view this node has seen); refused, nothing "
                    "merged"
                )
            mine = self.available(segment)
            total = mine + weight
            alpha = weight / total if total > 0 else 0.0
            actions.append(Merge(segment, alpha, self.weights[segment] + weight))
        return actions

    def apply_receive(
        self,
        sender: str,
        incarnation: int,
        sequence: int,
        plan: Sequence[Merge | Duplicate],
        base: int = 1,
    ) -> None:
        """Commit a plan from :meth:`plan_receive`, with no other call in between."""
        window = self._seen.get((sender, incarnation, base))
        if window is None:
            numberings = sorted(b for s, i, b in self._seen if (s, i) == (sender, incarnation))
            for old in numberings[: max(0, len(numberings) + 1 - NUMBERINGS_KEPT)]:
                del self._seen[(sender, incarnation, old)]
            window = self._seen[(sender, incarnation, base)] = _Window(base)
        capacity = DEDUP_WINDOW * len(self.weights)
        received = 0.0
        share = 0.0
        merged = False
        for action in plan:
            if isinstance(action, Merge) and window.admit(sequence, action.segment, capacity):
                weight = action.weight_after - self.weights[action.segment]
                mine = self.available(action.segment)
                received += weight
                share += weight / mine if mine > 0 else (math.inf if weight > 0 else 0.0)
                self.weights[action.segment] = action.weight_after
                merged = True
        if merged:
            self._account(sender, received=received)
            self.sinks.received(sender, share / len(self.weights))

    def on_message(
        self, sender: str, incarnation: int, sequence: int, segment: int, weight: float
    ) -> Merge | Duplicate:
        """One segment planned and applied at once (raises ``Refused``)."""
        (action,) = self.plan_receive(sender, incarnation, sequence, {segment: weight})
        self.apply_receive(sender, incarnation, sequence, [action])
        return action


def _payload_key(p: PayloadArrived) -> tuple[str, int, int]:
    return (p.sender, p.incarnation, p.sequence)
