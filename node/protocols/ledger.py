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

This module holds the ledger's state and the core's interface (events in, actions
out, status, checkpoint state). Its parts: the sending side (reserve, commit, fold
back) is :mod:`.reservations`; the receiving side (plan a merge, commit it) is
:mod:`.receiving`; per-edge sequences, the
sender's numberings and the receiver's de-duplication windows, are :mod:`.sequences`;
the most weight a segment may hold after a merge is :mod:`.weight_cap`; how much a
push carries so weight does not follow speed is :mod:`.weight_balance`; the weight
exchanged with each peer is booked in :mod:`.exchanged`, suspected sinks in
:mod:`.sinks`, and how much of this node's weight each peer may hold (and bring) in
:mod:`.credit`.

Mass bound: without faults Σw is exact (no honest weight reaches the cap; a merge
that would pass it cuts what does not fit, counted in ``cut``). A push is folded back
into its sender only when the receiver refused it (it merged nothing) or was declared
dead; a receiver that merged a push and was then declared dead before its acknowledgement
arrived (it comes back after ``drop_after_s``) leaves that push's weight twice.
A crash and restart of one node from its checkpoint changes Σw by exactly what
the checkpoint does not hold: minus the weight it merged after the checkpoint,
plus the weight of its pushes that were in flight at the checkpoint or sent after
it and merged by their receivers. Pushes in flight *to* it are retried to the new
incarnation and cost nothing. Everything else (lost acknowledgements, retries,
duplicates, reordering) keeps the total exact.
"""

from __future__ import annotations

import math
import random
from abc import abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from gossipd.node.protocols.base import (
    Action,
    CoreStatus,
    Duplicate,
    Event,
    GossipProtocol,
    HandOff,
    Merge,
    PayloadArrived,
    PayloadMerged,
    PeerRestarted,
    PeerSet,
    PullArrived,
    PullFailed,
    PullMerged,
    Push,
    PushSettled,
    Receipts,
    Refused,
    SettleArrived,
    StepEnded,
    TimerFired,
    TrainingEnded,
    View,
    ViewChanged,
    ranked,
)
from gossipd.node.protocols.credit import DEFAULT_CREDIT, PeerCredit
from gossipd.node.protocols.exchanged import ExchangedBook
from gossipd.node.protocols.numberings import Numberings
from gossipd.node.protocols.receiving import Receiving
from gossipd.node.protocols.reservations import Reservations
from gossipd.node.protocols.sequences import Windows
from gossipd.node.protocols.settings import BOOK_ROWS, SETTLE_IDLE_STEPS
from gossipd.node.protocols.sinks import SinkWatch
from gossipd.node.protocols.weight_balance import WeightBalance
from gossipd.node.protocols.weight_cap import WeightCap

# A peer passed over for want of credit that gives nothing back while this node settles this
# many pushes per peer to the others is named a sink (SumWeightLedger.suspected_sinks).
SILENT_PUSHES_PER_PEER = 25


class SumWeightLedger(Reservations, Receiving, GossipProtocol):
    """Weights, reservations, de-duplication and the view; subclasses choose the pushes.

    A subclass implements :meth:`on_step` (and, if it needs them,
    :meth:`on_training_ended` and :meth:`on_timer`) using :meth:`push` to send
    shares of its available weight. Everything else, including settling and
    merging, is handled here identically for every protocol.
    """

    # limits.peer_credit when it is not set: what a protocol's honest pushes need along one
    # edge, and no more (:mod:`.credit`).
    default_peer_credit: ClassVar[float] = DEFAULT_CREDIT

    def __init__(
        self,
        node_id: str,
        num_segments: int,
        *,
        rng: random.Random | None = None,
        seed: int = 0,
        initial_weight: float = 1.0,
        max_in_flight: int = 2,
        max_weight: float | None = math.inf,
        sink_bound: float = 6.0,
        sink_allowance: float = 0.5,
        peer_credit: float | None = math.inf,
        weight_balance: bool = False,
        book_rows: int = BOOK_ROWS,
        settle_idle_steps: int = SETTLE_IDLE_STEPS,
    ) -> None:
        """``max_weight``: the most weight a segment may hold after a merge (None: derived
        from the number of founding members, see :mod:`.weight_cap`; the daemon's default);
        ``sink_bound`` and ``sink_allowance``: when a peer is suspected of sinking weight
        (:mod:`.sinks`); ``peer_credit``: the most of this node's weight a peer may hold
        (:mod:`.credit`; inf: unbounded; None: the protocol's :attr:`default_peer_credit`,
        the daemon's default); ``weight_balance``: whether pushes are scaled so a
        site's weight does not depend on its speed (:mod:`.weight_balance`; off here, so
        a core built bare pushes its paper's shares; on in the daemon's and the
        simulator's settings); ``book_rows`` and ``settle_idle_steps``: see
        :data:`~.settings.BOOK_ROWS` and :data:`~.settings.SETTLE_IDLE_STEPS`."""
        if num_segments < 1:
            raise ValueError(f"num_segments must be at least 1, got {num_segments}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        if not (math.isfinite(initial_weight) and initial_weight >= 0):
            raise ValueError(f"initial_weight must be finite and >= 0, got {initial_weight}")
        self.node_id = node_id
        self.max_in_flight = max_in_flight
        self._rng = rng
        self._seed = seed
        self._planned: tuple[PayloadArrived, list[Merge | Duplicate]] | None = None
        self.weights: list[float] = [float(initial_weight)] * num_segments
        self.reserved: list[float] = [0.0] * num_segments
        self.in_flight: dict[tuple[str, int], Push] = {}
        self._to: dict[str, tuple[Push, ...]] = {}
        self.round = 0
        self.view: View = ranked(frozenset({node_id}))
        self.relayed: frozenset[str] = frozenset()  # peers reached only through a relay
        self.numberings = Numberings(idle_steps=settle_idle_steps)  # this node's, per receiver
        self.step = 0  # the latest local step (an idle numbering is closed by the step)
        self._training_done = False
        self.windows = Windows()  # what this node merged, per sender numbering
        self.exchanged = ExchangedBook(rows=book_rows)
        self.sinks = SinkWatch(sink_bound, sink_allowance, rows=book_rows)
        credit = self.default_peer_credit if peer_credit is None else peer_credit
        self.credit = PeerCredit(credit, num_segments, rows=book_rows)
        self._shares: dict[tuple[str, int], tuple[float, ...]] = {}  # push -> share per segment
        # Peers passed over for want of credit (Reservations.passed_over): this node's pushes
        # settled since they were, or since their last merge.
        self._silent: dict[str, int] = {}
        self.cap = WeightCap(max_weight, max(1, math.ceil(initial_weight)))
        self.cut = 0.0  # weight received that did not fit under the cap, since this start
        self.balance = WeightBalance(num_segments, weight_balance)

    @property
    def rng(self) -> random.Random:
        """This node's own random draws, seeded with ``seed`` on first use: a generator's
        state is 2.5 KB, a fifth of what a simulated crossover node holds, and crossover
        draws only when a node leaves."""
        if self._rng is None:
            self._rng = random.Random(self._seed)
        return self._rng

    # -- the interface ------------------------------------------------------------------
    def handle(self, event: Event) -> list[Action]:
        # The plan of the arrival just handled, for its PayloadMerged: every driver merges
        # right after planning, and planning twice was a tenth of a simulated run. Any
        # other event in between and it is planned afresh.
        planned, self._planned = self._planned, None
        match event:  # the commonest events first: a match tries its cases in order
            case PayloadArrived():
                plan = self.plan_receive(*_payload_key(event), event.weights, event.sequence_base)
                self._planned = (event, plan)
                return list(plan)
            case PayloadMerged(payload=p):
                if planned is None or planned[0] is not p:
                    planned = (p, self.plan_receive(*_payload_key(p), p.weights, p.sequence_base))
                self.apply_receive(*_payload_key(p), planned[1], p.sequence_base)
                if p.settled:
                    self.windows.settle(p.sender, p.incarnation, p.sequence_base, p.settled, False)
                return []
            case PushSettled():
                key = (event.peer, event.sequence)
                self.hear_receiver(key, event.acked, event.receiver_weights)
                actions: list[Action] = list(self.settle(key, event.acked))
                if self._training_done and event.peer not in self._to:
                    actions.extend(self.close_numberings([event.peer]))  # no step will find it idle
                return actions
            case StepEnded():
                self.step = event.step
                actions = list(self.on_step(event))
                return actions + self.close_numberings(self.numberings.idle(event.step))
            case SettleArrived():
                self.windows.settle(
                    event.sender, event.incarnation, event.sequence_base, event.up_to, True
                )
                return []
            case ViewChanged():
                self.set_members(event.members)
                self.relayed = event.relayed
                return []
            case PeerRestarted():
                self.on_peer_restarted(event.peer, event.incarnation)
                return []
            case HandOff():
                push = self.hand_off(event.peer)
                return [push] if push else []
            case TrainingEnded():
                self._training_done = True
                actions = list(self.on_training_ended(event))
                return actions + self.close_numberings(list(self.numberings.last))
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
            exchanged=dict(self.exchanged.by_peer),
            sinks=self.suspected_sinks(),
            weight_cap=self.weight_cap,
            weight_cut=self.cut,
            balance_factors=tuple(self.balance.factors) if self.balance.enabled else (),
        )

    def segment_weights(self) -> Sequence[float]:
        return self.weights

    def hears_receiver_weights(self) -> bool:
        return self.balance.enabled

    def suspected_sinks(self) -> frozenset[str]:
        """Peers suspected of sinking weight: by the sink score (:mod:`.sinks`), or passed
        over for want of the credit this node gives them (:mod:`.credit`) and giving
        nothing back while this node settled ``SILENT_PUSHES_PER_PEER`` pushes per peer to
        others. With the credit on, a sink is stopped by the credit long before its score
        says so; this only names it (an honest peer pushes to this node well within that
        many)."""
        patience = SILENT_PUSHES_PER_PEER * max(len(self.peers), 1)
        silent = {p for p, n in self._silent.items() if n >= patience and self.exchanges_with(p)}
        return self.sinks.sinks() | silent

    def exchanges_with(self, peer: str) -> bool:
        """Whether this node and ``peer`` push to each other in the current view: every two
        members do, unless the protocol pushes along a graph. A peer that does not cannot
        give weight back, so its silence is not held against it (:meth:`suspected_sinks`):
        on the exponential graph, a join that shifted the ranks left honest peers holding
        this node's credit with no edge back, and named them sinks."""
        return peer in self.peers

    def receipts(self, sender: str, sequences: int | None = None) -> list[Receipts]:
        # Limited before the pairs are listed: a whole window is 4,096 sequences of every
        # segment, and a leave asks for every peer's on the trainer's thread.
        receipts = []
        for w in self.windows.of(sender):
            floor = w.forgotten_up_to
            if sequences is not None and w.highest is not None:
                floor = max(floor, w.highest - sequences)
            receipts.append(Receipts(w.incarnation, w.base, floor, frozenset(w.pairs(floor))))
        return receipts

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
            "sequences": dict(self.numberings.last),
            "windows": self.windows.state(),
            "exchanged": self.exchanged.state(),
            "sink_scores": self.sinks.state(),
            "credit_nets": self.credit.state(),
            "largest_view": self.cap.largest_view,
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
        self._to.clear()
        self.numberings.clear()
        self.round = int(state.get("round", 0))
        self.windows = Windows.restore(state.get("windows", ()))
        self.exchanged = ExchangedBook.restore(state.get("exchanged", {}), self.exchanged.rows)
        self._shares.clear()
        self._planned = None  # planned against the state this replaces
        self.sinks.restore(state.get("sink_scores", {}))
        self.credit.restore(state.get("credit_nets", {}))
        self.cap.saw_view(int(state.get("largest_view", 1)))

    # -- what subclasses decide ----------------------------------------------------------
    @abstractmethod
    def on_step(self, event: StepEnded) -> Iterable[Action]:
        """Which shares to push now that a local step ended (and, for a core that takes an
        outer step after its bursts, that step)."""

    def on_training_ended(self, event: TrainingEnded) -> Iterable[Action]:
        return ()

    def on_timer(self, event: TimerFired) -> Iterable[Action]:
        return ()

    # -- membership -------------------------------------------------------------------
    def set_members(self, members: frozenset[str]) -> None:
        # A receiver gone from the view may come back from a checkpoint: number anew. Only
        # the receivers this node numbered are looked at, not the whole view, which at
        # 100,000 simulated nodes made a change of view cost every node 100,000 steps.
        was_member = self.view.rank_of
        for gone in [p for p in self.numberings.last if p in was_member and p not in members]:
            self.numberings.renumber(gone)
        self.balance.keep_only(members)
        self.view = ranked(members | {self.node_id} if self.node_id not in members else members)
        self.cap.saw_view(len(self.view.members))

    @property
    def weight_cap(self) -> float:
        """The most sum-weight one segment may hold after a merge (:mod:`.weight_cap`)."""
        return self.cap.value

    @property
    def peers(self) -> PeerSet:
        return PeerSet(self.view, self.node_id)

    def on_peer_up(self, peer: str) -> None:
        self.set_members(frozenset(self.view.members) | {peer})

    def on_peer_down(self, peer: str) -> None:
        if peer != self.node_id:
            self.set_members(frozenset(self.view.members) - {peer})

    def on_peer_restarted(self, peer: str, incarnation: int) -> None:
        """``peer`` restarted: its old de-duplication state goes, our pushes to it start a
        new numbering (its restored windows know only the old one), and what we exchanged
        with its previous incarnation is kept apart from what follows."""
        self.windows.forget_sender(peer, incarnation)
        self.numberings.renumber(peer)
        self.exchanged.restarted(peer, incarnation)


def _payload_key(p: PayloadArrived) -> tuple[str, int, int]:
    return (p.sender, p.incarnation, p.sequence)
