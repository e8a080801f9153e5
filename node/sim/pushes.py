"""The simulator's push side: snapshots, the wire, merges, acknowledgements, retries.

A :class:`~gossipd.node.protocols.base.Push` is snapshotted when the core asks, sent
over a link that takes latency + bytes/bandwidth, merged whole or not at all at the
receiver (``PayloadArrived``, the blends, then ``PayloadMerged``), acknowledged over
the latency back, retried with the same sequence until the receiver answers or leaves
every view, and settled exactly once with ``PushSettled``, its unacknowledged segments
folded back from that snapshot. A ``Settle`` (the sender closed a numbering) goes over
the latency too, retried after the timeout while a loss takes it, until the receiver
has it or has left every view.

:class:`PushSide` is a part of :class:`~gossipd.node.sim.driver.Simulation`, kept in
its own file as :mod:`.pulls` is; it owns no state of its own and uses the driver's
clock, links, nodes and counters, declared below.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from gossipd.node.errors import StaleReference
from gossipd.node.protocols.base import (
    Action,
    Duplicate,
    FoldBack,
    Merge,
    PayloadArrived,
    PayloadMerged,
    Push,
    PushSettled,
    Refused,
    Settle,
    SettleArrived,
)
from gossipd.node.sim.accounting import MassBook
from gossipd.node.sim.payloads import Payload, VectorPayload
from gossipd.node.sim.scenarios import Scenario
from gossipd.node.sim.spec import Flight, SimNode
from gossipd.node.sim.spectral import MixingTracker

if TYPE_CHECKING:
    from gossipd.node.sim.compression import SimCodec

INCARNATION = 1  # simulated nodes never restart; a join is a new node id


def _reported(sender: SimNode, receiver: SimNode, acked: tuple[int, ...]) -> tuple[float, ...]:
    """The receiver's weights its acknowledgement reports, as the daemon's does; only for a
    sender whose weight balance hears them (a tuple per push costs a million-node run)."""
    if not sender.core.hears_receiver_weights():
        return ()
    weights = receiver.core.segment_weights()
    return tuple(weights[s] for s in acked) if weights else ()


def _arrival(sender: str, push: Push) -> PayloadArrived:
    p = push
    return PayloadArrived(
        sender, INCARNATION, p.sequence, p.round, p.weights, p.sequence_base, p.settled
    )


def _numel(values: Any) -> int:
    """Elements of a snapshot: a numpy vector's ``size``, a tensor's ``numel()``."""
    return int(values.size) if isinstance(values, np.ndarray) else int(values.numel())


class PushSide:
    """Pushes from snapshot to settle, as the replica and the outbound path carry them out."""

    # What the driver provides (see Simulation.__init__).
    scenario: Scenario
    payload: Payload
    codec: SimCodec | None
    tracker: MixingTracker | None
    book: MassBook
    rng: random.Random
    by_id: dict[str, SimNode]
    members: frozenset[str]
    messages: int
    settles: int
    acks: int
    retries: int
    refused: int
    bytes_sent: int

    if TYPE_CHECKING:

        @property
        def now(self) -> float: ...
        def _at(self, at_s: float, fn: Callable[..., None], *args: Any) -> None: ...
        def _link(self, a: SimNode, b: SimNode) -> tuple[float, float]: ...
        def _act(self, node: SimNode, actions: list[Action]) -> None: ...
        def _finish_leaving(self, node: SimNode) -> None: ...

    def _send(self, node: SimNode, pushes: list[Push]) -> None:
        """Pushes asked for at once share one snapshot, as in the replica: nothing can
        change the model between them, and shuffle-exchange's √N pushes a step would
        otherwise hold √N copies (1.5 GB at N = 1,024 with the mixing tracker)."""
        segments = sorted({s for push in pushes for s in push.weights})
        values = self.payload.snapshot(node.index, segments)
        rows = self.tracker.snapshot(node.index, segments) if self.tracker is not None else None
        for push in pushes:
            sent = None
            if self.codec is None or node.leaving:  # a hand-off goes raw, as in the daemon
                nbytes = sum(self.payload.segment_nbytes[s] for s in push.weights)
            else:
                mine = {s: values[s] for s in push.weights}
                sent = self.codec.send(node.id, push.peer, push.sequence, mine)
                nbytes = sum(
                    self.codec.wire_bytes(
                        self.payload.segment_nbytes[s], _numel(values[s]), sent[s]
                    )
                    for s in push.weights
                )
            flight = Flight(push, node, values, rows, nbytes)
            flight.sent = sent
            node.flights[push.key] = flight
            self._transmit(flight)

    def _transmit(self, flight: Flight) -> None:
        flight.attempts += 1
        self.messages += 1
        self.bytes_sent += flight.nbytes
        receiver = self.by_id[flight.push.peer]
        if self.scenario.loss and self.rng.random() < self.scenario.loss:
            self._at(self.now + self.scenario.timeout_s, self._retry, flight)
            return
        latency, bandwidth = self._link(flight.sender, receiver)
        self._at(self.now + latency + flight.nbytes / bandwidth, self._deliver, flight, receiver)

    def _deliver(self, flight: Flight, receiver: SimNode) -> None:
        sender, push = flight.sender, flight.push
        if not sender.alive:
            return  # the sender crashed mid-stream: nothing merges (booked lost at the crash)
        if not receiver.alive:
            self._at(self.now + self.scenario.timeout_s, self._retry, flight)
            return
        arrival = _arrival(sender.id, push)
        acked: tuple[int, ...] = ()
        reported: tuple[float, ...] = ()
        values = flight.values
        if self.codec is not None and flight.sent is not None:
            try:
                values = self.codec.receive(receiver.id, sender.id, flight.sent, flight.values)
            except StaleReference:
                # Refused whole, as the daemon's receiver does: the sender starts over.
                self.refused += 1
                self.codec.stale_copy(sender.id, receiver.id)
                latency, _ = self._link(receiver, sender)
                self._at(self.now + latency, self._ack, flight, ())
                return
        try:
            plan = receiver.core.handle(arrival)
            merges = [a for a in plan if isinstance(a, Merge)]
            # Whole or nothing: a blend the payload refuses (non-finite) refuses the push,
            # and a leaving node merges nothing new (it still acknowledges duplicates).
            if receiver.leaving and merges:
                self.refused += 1
            elif isinstance(self.payload, VectorPayload) or all(
                self._would_blend(receiver, m, values) for m in merges
            ):
                for m in merges:
                    self.payload.blend(receiver.index, m.segment, values[m.segment], m.alpha)
                    if self.tracker is not None:
                        self.tracker.blend(
                            receiver.index, m.segment, flight.rows[m.segment], m.alpha
                        )
                receiver.core.handle(PayloadMerged(arrival))
                for m in merges:
                    if m.cut:
                        self.book.cut(m.segment, m.cut, values[m.segment])
                acked = tuple(a.segment for a in plan if isinstance(a, Merge | Duplicate))
                reported = _reported(flight.sender, receiver, acked)
                if self.codec is not None and flight.sent is not None:
                    merged = {s: values[s] for s in acked}
                    flight.kept = self.codec.keep(receiver.id, sender.id, flight.sent, merged)
                flight.merged = flight.merged or bool(merges)
            else:
                self.refused += 1
        except Refused:
            self.refused += 1
        if self.scenario.loss and self.rng.random() < self.scenario.loss:
            self._at(self.now + self.scenario.timeout_s, self._retry, flight)
            return
        latency, _ = self._link(receiver, sender)
        self._at(self.now + latency, self._ack, flight, acked, reported)

    def _keep_what_the_codec_dropped(self, flight: Flight, acked: tuple[int, ...]) -> None:
        """The receiver merged the rebuilt values r, not the snapshot x: Σ w·x moved by
        w·(r − x) per segment. The sender adds that back to its own model, spread over
        the weight it still holds (as the replica does): x ← x + (w/available)·(x − r)."""
        sender, push = flight.sender, flight.push
        status = sender.core.status()
        assert flight.sent is not None
        for s in acked:
            factor = status.spread_over_available(s, push.weights.get(s, 0.0))
            if s not in flight.sent or not factor:
                continue
            rebuilt = flight.sent[s].rebuilt
            values = flight.values[s]
            if isinstance(values, np.ndarray):
                rebuilt = rebuilt.numpy()
            self.payload.correct(sender.index, s, values - rebuilt, factor)

    def _would_blend(self, receiver: SimNode, merge: Merge, values: Mapping[int, Any]) -> bool:
        """Whether a blend stays finite (a vector payload's always does: finite vectors blend
        to finite vectors, so :meth:`_deliver` does not ask)."""
        mine = self.payload.values(receiver.index, merge.segment)
        other = np.asarray(values[merge.segment], dtype=float)
        return bool(np.isfinite((1.0 - merge.alpha) * mine + merge.alpha * other).all())

    def _ack(
        self, flight: Flight, acked: tuple[int, ...], reported: tuple[float, ...] = ()
    ) -> None:
        self.acks += 1
        if flight.sender.alive and flight.push.key in flight.sender.flights:
            self._settle(flight, acked, reported)

    def _retry(self, flight: Flight) -> None:
        """No answer: try again with the same sequence, or fold back once the peer is gone."""
        sender = flight.sender
        if not sender.alive or flight.push.key not in sender.flights:
            return
        receiver = self.by_id[flight.push.peer]
        if flight.push.peer not in self.members and not receiver.alive:
            self._settle(flight, ())  # declared dead, or gone after leaving: fold back
            return
        self.retries += 1
        self._transmit(flight)

    def _settle(
        self, flight: Flight, acked: tuple[int, ...], reported: tuple[float, ...] = ()
    ) -> None:
        sender, push = flight.sender, flight.push
        del sender.flights[push.key]
        if self.codec is not None:
            kept = set(acked).intersection(flight.kept)
            self.codec.settled(sender.id, push.peer, push.sequence, kept, set(push.weights))
        if flight.merged and not acked:
            self.book.folded_back_after_merge(push.weights, flight.values)
        for action in sender.core.handle(PushSettled(push.peer, push.sequence, acked, reported)):
            if isinstance(action, FoldBack):
                seg = action.segment
                self.payload.blend(sender.index, seg, flight.values[seg], action.alpha)
                if self.tracker is not None:
                    self.tracker.blend(sender.index, seg, flight.rows[seg], action.alpha)
            else:
                self._act(sender, [action])
        if self.codec is not None and self.codec.error_feedback and flight.sent and acked:
            self._keep_what_the_codec_dropped(flight, acked)
        if sender.leaving and not sender.flights:
            self._finish_leaving(sender)

    def _send_settle(self, sender: SimNode, settle: Settle) -> None:
        self.settles += 1
        if self.scenario.loss and self.rng.random() < self.scenario.loss:
            self._at(self.now + self.scenario.timeout_s, self._retry_settle, sender, settle)
            return
        receiver = self.by_id[settle.peer]
        latency, _ = self._link(sender, receiver)
        self._at(self.now + latency, self._deliver_settle, sender, settle)

    def _deliver_settle(self, sender: SimNode, settle: Settle) -> None:
        receiver = self.by_id[settle.peer]
        if not receiver.alive:
            self._at(self.now + self.scenario.timeout_s, self._retry_settle, sender, settle)
            return
        arrived = SettleArrived(sender.id, INCARNATION, settle.sequence_base, settle.up_to)
        receiver.core.handle(arrived)

    def _retry_settle(self, sender: SimNode, settle: Settle) -> None:
        """Again, unless the receiver is gone from every view (then nobody needs it)."""
        if settle.peer in self.members or self.by_id[settle.peer].alive:
            self._send_settle(sender, settle)
