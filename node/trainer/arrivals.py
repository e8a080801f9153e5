"""What the loop sends the replica, applied on the trainer thread: outcomes of its pushes
and pulls, view changes, restarts, refusals, the leave's requests, and inbound pushes.

The half of :class:`~gossipd.node.trainer.replica.Replica` that the event loop feeds
(through its bounded inbox and event queue); the other half steps, publishes and owns
the core. Each is applied whole or not at all, under the replica's locks, at a step
boundary or an idle moment.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gossipd.node.errors import InvalidFrame, NonFinitePayload, PayloadOutOfBounds
from gossipd.node.protocols.base import (
    Event,
    GossipProtocol,
    HandOff,
    PeerRestarted,
    Push,
    PushSettled,
    Settle,
    ViewChanged,
)
from gossipd.node.trainer.messages import (
    Ack,
    Barrier,
    EventQueue,
    Granted,
    HandOffRequest,
    InboundPush,
    Inbox,
    LoopMessage,
    OutboundPull,
    OutboundPush,
    Pulled,
    PullOutcome,
    PushOutcome,
    ReceiptsRequest,
    Rejected,
    RestartNotice,
    ViewNotice,
)
from gossipd.node.trainer.report import PushRecord, Rejection, StepReport, Summary

if TYPE_CHECKING:
    import torch

    from gossipd.node.model.segments import FlatModel
    from gossipd.node.trainer.dispatch import Dispatcher
    from gossipd.node.trainer.duepulls import DuePulls
    from gossipd.node.trainer.fairlock import FairLock
    from gossipd.node.trainer.merging import Merger


class Arrivals:
    """Applies what arrived from the loop; mixed into the replica, whose state it uses."""

    core: GossipProtocol
    flat: FlatModel
    merger: Merger
    dispatch: Dispatcher
    due_pulls: DuePulls
    inbox: Inbox
    events: EventQueue
    lock: FairLock
    core_lock: threading.RLock
    clock: Callable[[], float]
    steps: int
    training_done: bool
    summary: Summary
    pushes_acked: int
    pushes_failed: int
    pushes_merged: int
    merge_cpu_s: float

    def drain(self, report: StepReport) -> None:
        """Apply pending events and merge every queued push.

        Events are applied before the merges (peer changes, push outcomes) and again
        after, so an outcome that arrived while merging is not left for the next step.
        Timers that came due fire here too, if the network's wake-up (which fires them
        mid-step, see :meth:`fire_due_timers`) has not yet; pushes a timer made
        mid-step leave first, with the model as it was before anything merges.
        """
        with self.core_lock:
            self.dispatch.send_deferred()
        self._apply_events(report)
        self._merge_queued(report)
        self._apply_events(report)
        self._release_held(report)
        self.dispatch.fire_due(self.clock(), mid_step=False)

    def _merge_queued(self, report: StepReport) -> None:
        item = self.inbox.get()
        while item is not None:
            self._merge(item, report)
            item = self.inbox.get()

    def _apply_events(self, report: StepReport) -> None:
        while (event := self.events.get()) is not None:
            self._apply(event, report)

    def _release_held(self, report: StepReport) -> None:
        """Merge the pulls that landed early, once their step's boundary is reached."""
        for outcome in self.due_pulls.release(self.steps, self.training_done):
            self._pulled(outcome.out, outcome.pulled, outcome.error, report)

    def _apply(self, event: LoopMessage, report: StepReport) -> None:
        match event:
            case PushOutcome(out=out, acks=acks, error=error, rebuilt=rebuilt):
                self.settle_push(out, acks, error, report, rebuilt)
            case PullOutcome(out=out):
                held = self.due_pulls.landed(event, self.steps, self.training_done)
                if out.adopted is None:
                    self.dispatch.pull_ended()  # landed (or failed); a held one merges later
                if not held:
                    self._pulled(out, event.pulled, event.error, report)
            case Granted(granted=granted):
                self.dispatch.carry_out(self.core.handle(granted))
            case ViewNotice(members=members, relayed=relayed):
                self._handle(ViewChanged(members, relayed))
            case RestartNotice(peer=peer, incarnation=incarnation):
                self._handle(PeerRestarted(peer, incarnation))
            case Rejected(peer=peer, reason=reason, detail=detail):
                report.rejected.append(Rejection(peer, reason, detail))
            case HandOffRequest(peer=peer, reply=reply):
                # A push accepted before the node began leaving may still wait in the
                # inbox (events apply first): merged after the hand-off, its weight
                # would stay here in the final checkpoint. Nothing accepted after that
                # moment merges (merge_new is False), so this empties what could.
                self._merge_queued(report)
                _resolve(reply, lambda: self.hand_off(peer))
            case ReceiptsRequest(peers=peers, sequences=sequences, reply=reply):
                _resolve(reply, lambda: {p: self.core.receipts(p, sequences) for p in peers})
            case Barrier(reply=reply):
                # What the waiter reads next (the peers to hand off to) must include
                # every event before the barrier, not the previous boundary's copy.
                self.summary = Summary.of(self)
                _resolve(reply, lambda: len(self.dispatch.outstanding))

    def hand_off(self, peer: str | None = None) -> OutboundPush | None:
        """The push that hands all weight to ``peer`` when leaving; the caller delivers it."""
        with self.lock, self.core_lock:
            pushes = [a for a in self.core.handle(HandOff(peer)) if isinstance(a, Push)]
            if not pushes:
                return None
            self.dispatch.outstanding.add(pushes[0].key)
            return OutboundPush(pushes[0], self.flat.snapshot(pushes[0].weights), exact=True)

    def settle_push(
        self,
        out: OutboundPush,
        acks: Sequence[Ack],
        error: str | None,
        report: StepReport | None = None,
        rebuilt: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        """Commit what the receiver acknowledged; fold unacknowledged snapshots back in.
        ``rebuilt``: per acknowledged segment sent through a lossy codec with error
        feedback, what the receiver merged instead of the snapshot (its difference stays)."""
        acked = tuple(a.segment for a in acks)
        with self.lock, self.core_lock:
            if not self.dispatch.settle(out.push):
                return  # settled before (a late duplicate outcome changes nothing)
            reported = tuple(a.receiver_weight for a in acks)
            settled = self.core.handle(
                PushSettled(out.push.peer, out.push.sequence, acked, reported)
            )
            self.merger.fold_back(out, settled)
            self.dispatch.carry_out([a for a in settled if isinstance(a, Settle)])
            if rebuilt:
                self.merger.keep_dropped(out, rebuilt, acked, self.core.status())
            if len(acked) == len(out.push.weights):
                self.pushes_acked += 1
            else:
                self.pushes_failed += 1
            self.summary = Summary.of(self)
        if report is not None:
            record = PushRecord(out.push.peer, out.push.sequence, acked, error)
            (report.failed if error else report.pushed).append(record)

    def _pulled(
        self, out: OutboundPull, pulled: Pulled | None, error: str | None, report: StepReport
    ) -> None:
        """Merge a pulled model whole or not at all, like a push; tell the core either way."""
        pull = out.pull
        if out.adopted is not None:
            _resolve(out.adopted, lambda: self._adopt(pull.peer, pulled, error))
            return
        actions, record = self.merger.merge_pull(pull, pulled, error)
        report.pulled.append(record)
        self.dispatch.carry_out(actions)

    def _adopt(self, peer: str, pulled: Pulled | None, error: str | None) -> None:
        """Load a joiner's bootstrap model whole (on the trainer thread, like any merge)."""
        self.merger.adopt(peer, pulled, error)
        self.summary = Summary.of(self)

    def _merge(self, item: InboundPush, report: StepReport) -> None:
        """Merge a whole push or nothing: plan, compute every blend, check, then commit."""
        if not item.reply.set_running_or_notify_cancel():
            return  # the loop gave up waiting; the sender keeps its weight
        cpu0 = time.thread_time()
        try:
            acks, record = self.merger.merge_push(item)
            if record.merged_segments:
                self.pushes_merged += 1
            report.merged.append(record)
            # Whoever hears this acknowledgement may read our status next: it must
            # already show the merge, not the previous step boundary's summary.
            self.summary = Summary.of(self)
            item.reply.set_result(acks)
        except (InvalidFrame, NonFinitePayload, PayloadOutOfBounds) as err:
            item.reply.set_exception(err)  # refused whole: the model is untouched
        except Exception as err:  # never strand the waiting servicer
            item.reply.set_exception(err)
            raise
        finally:
            self.merge_cpu_s += time.thread_time() - cpu0

    def _handle(self, event: Event) -> list[Push]:
        """Hand ``event`` to the core and carry out what it asks; returns the pushes sent."""
        return self.dispatch.carry_out(self.core.handle(event))


def _resolve(reply: concurrent.futures.Future[Any], fn: Callable[[], Any]) -> None:
    if reply.set_running_or_notify_cancel():
        try:
            reply.set_result(fn())
        except BaseException as err:
            reply.set_exception(err)
