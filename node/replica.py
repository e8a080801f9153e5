"""The parameter side of a node: owns the model replica and drives the protocol core.

The event loop never writes parameters and the trainer never awaits the
network. They meet here: the loop puts validated inbound pushes into a bounded
inbox and push outcomes into an event queue; the trainer drains both at each
step boundary, merges under ``torch.no_grad()``, and hands outbound snapshots to
the loop through a callback (``call_soon_threadsafe`` in the daemon).

Each :meth:`Replica.step` returns a :class:`StepReport`, so a caller sees
what happened in its own loop (merged, pushed, rejected, failed), not only in a log.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from gossipd.node.config import NodeConfig
from gossipd.node.errors import Busy, GossipdError, InvalidFrame, NonFinitePayload
from gossipd.node.fairlock import FairLock
from gossipd.node.protocols import DEFAULT_PROTOCOL, CoreSettings, build
from gossipd.node.protocols.base import (
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
    Pull,
    PullArrived,
    PullFailed,
    PullMerged,
    Push,
    PushSettled,
    Refused,
    StartTimer,
    StepEnded,
    TimerFired,
    TrainingEnded,
    ViewChanged,
    shared_seed,
)
from gossipd.node.segments import FlatModel
from gossipd.node.wire import ReceivedSegment
from gossipd.proto import gossip_pb2 as pb

T = TypeVar("T")


@dataclass(frozen=True)
class MergeRecord:
    sender: str
    sequence: int
    merged_segments: tuple[int, ...]
    duplicate_segments: tuple[int, ...]


@dataclass(frozen=True)
class PushRecord:
    peer: str
    sequence: int
    acked_segments: tuple[int, ...]
    error: str | None = None


@dataclass(frozen=True)
class PullRecord:
    peer: str
    round: int
    merged_segments: tuple[int, ...]
    nbytes: int = 0
    transfer_s: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class Rejection:
    peer: str
    reason: str
    detail: str


@dataclass
class StepReport:
    """What gossip did since the previous step; ``ok`` is False if anything failed."""

    step: int
    merged: list[MergeRecord] = field(default_factory=list)
    pushed: list[PushRecord] = field(default_factory=list)
    failed: list[PushRecord] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    pulled: list[PullRecord] = field(default_factory=list)
    started_push_to: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed and not self.rejected and all(p.error is None for p in self.pulled)


@dataclass
class InboundPush:
    """A whole, validated push waiting for the trainer; ``reply`` resolves with the acks."""

    sender: str
    incarnation: int
    sequence: int
    segments: list[ReceivedSegment]
    round: int = 0
    merge_new: bool = True  # False: only acknowledge what was merged before (leaving)
    sequence_base: int = 1  # the sender's numbering (protocols.ledger)
    reply: concurrent.futures.Future[list[pb.SegmentAck]] = field(
        default_factory=concurrent.futures.Future
    )


@dataclass(frozen=True)
class OutboundPush:
    push: Push
    snapshot: dict[int, torch.Tensor]


@dataclass(frozen=True)
class OutboundPull:
    """A pull for the network to start at ``pull.at_s`` (the replica's clock), even mid-step."""

    pull: Pull


@dataclass
class Pulled:
    """What a pull brought: each segment's values and sum-weight, the payload bytes, and the
    time from the pull's start to its last byte (the replica's clock)."""

    values: dict[int, torch.Tensor] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    nbytes: int = 0
    transfer_s: float = 0.0


class Inbox:
    """Bounded, thread-safe: the loop's ``put`` fails fast with ``Busy`` instead of blocking."""

    def __init__(self, capacity: int) -> None:
        self._items: queue.Queue[InboundPush] = queue.Queue(maxsize=capacity)

    def put(self, item: InboundPush) -> None:
        try:
            self._items.put_nowait(item)
        except queue.Full:
            raise Busy(
                f"receiver inbox is full ({self._items.maxsize} pushes waiting for a step "
                "boundary); retry later or raise limits.inbox_size"
            ) from None

    def get(self, timeout_s: float | None) -> InboundPush | None:
        try:
            return self._items.get(timeout=timeout_s) if timeout_s else self._items.get_nowait()
        except queue.Empty:
            return None


class Replica:
    """A site's copy of the model and its protocol core; call :meth:`step` after each step.

    The replica drives the core: it turns what the network reports into events,
    and the core's actions into merges, fold-backs and snapshots for the network.
    It never names a protocol; :func:`gossipd.node.protocols.build` does.
    """

    def __init__(
        self,
        node_id: str,
        model: torch.nn.Module,
        *,
        segment_bytes: int,
        protocol: str = DEFAULT_PROTOCOL,
        settings: Mapping[str, Any] | None = None,
        inbox_size: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.flat = FlatModel(model, segment_bytes)
        self.core: GossipProtocol = build(
            protocol, CoreSettings(node_id, len(self.flat.plan), **(settings or {}))
        )
        self.inbox = Inbox(inbox_size)
        self.clock = clock
        self.steps = 0
        self.last_loss = float("nan")
        self.training_done = False
        self.send: Callable[[OutboundPush], None] = lambda out: None
        # With no network to carry it, a pull fails at the next step boundary.
        self.start_pull: Callable[[OutboundPull], None] = lambda out: self.post_pull_result(
            out, None, "no network is attached to carry out pulls"
        )
        self._events: queue.SimpleQueue[Callable[[StepReport], None]] = queue.SimpleQueue()
        self._outstanding: set[tuple[str, int]] = set()  # pushes sent, not yet settled
        self._timers: list[tuple[float, str]] = []  # heap of (at_s, tag)
        # Held by whoever reads or writes parameters: the trainer while stepping,
        # the loop while snapshotting for PullModel or checkpoints.
        self.lock = FairLock()
        self.pushes_acked = 0
        self.pushes_failed = 0
        self.pushes_merged = 0
        self.pulls_merged = 0
        self.pulls_failed = 0
        self.summary = Summary.of(self)

    @classmethod
    def from_config(cls, config: NodeConfig, model: torch.nn.Module) -> Replica:
        """The replica a site's config asks for (a joiner starts at weight 0)."""
        gossip = config.gossip
        return cls(
            config.node_id,
            model,
            segment_bytes=gossip.segment_bytes,
            protocol=gossip.protocol,
            settings={
                "seed": gossip.seed,
                "mesh_seed": shared_seed(config.mesh_id),
                "initial_weight": 0.0 if config.join else 1.0,
                "max_in_flight": gossip.max_pushes_in_flight,
                "max_weight": config.limits.max_sum_weight,
                "push_probability": gossip.push_probability,
                "round_steps": gossip.round_steps,
                "average_every_steps": gossip.average_every_steps,
            },
            inbox_size=config.limits.inbox_size,
        )

    @property
    def fingerprint(self) -> str:
        return self.flat.fingerprint

    def publish(self) -> None:
        """Refresh the summary that status and metrics read (after a restore, say)."""
        with self.lock:
            self.summary = Summary.of(self)

    def state_dict(self) -> dict[str, Any]:
        """The core's state, for a checkpoint (take it under :attr:`lock`)."""
        return self.core.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self.lock:
            self.core.load_state_dict(state)
            self.summary = Summary.of(self)

    # -- called from the event loop (any thread) -------------------------------------
    def post(self, event: Callable[[StepReport], None]) -> None:
        """Run ``event`` on the trainer thread at the next step boundary."""
        self._events.put(event)

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``fn`` on the thread that drives this replica, after every event posted
        before it; the network leaves the mesh this way instead of touching parameters."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run(report: StepReport) -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:
                    future.set_exception(err)

        self.post(run)
        return future

    def post_push_result(
        self, out: OutboundPush, acks: list[pb.SegmentAck], error: str | None
    ) -> None:
        self.post(lambda report: self.settle_push(out, acks, error, report))

    def post_pull_result(self, out: OutboundPull, pulled: Pulled | None, error: str | None) -> None:
        """What a pull brought (or why it failed): merged at the next step boundary."""
        self.post(lambda report: self._pulled(out, pulled, error, report))

    def post_rejection(self, peer: str, reason: str, detail: str) -> None:
        self.post(lambda report: report.rejected.append(Rejection(peer, reason, detail)))

    def post_view(self, members: frozenset[str]) -> None:
        """The live members as the network sees them now (this node included)."""
        self.post(lambda report: self._handle(ViewChanged(members)))

    def post_restart(self, peer: str, incarnation: int) -> None:
        self.post(lambda report: self._handle(PeerRestarted(peer, incarnation)))

    # -- called from the trainer thread ----------------------------------------------
    def step(self, loss: float | None = None) -> StepReport:
        """Close one local step: merge what arrived, settle push outcomes, maybe push."""
        with self.lock:
            self.steps += 1
            if loss is not None:
                self.last_loss = float(loss)
            report = StepReport(self.steps)
            self.drain(report)
            for push in self._handle(StepEnded(self.steps, self.clock())):
                report.started_push_to = push.peer
            self.summary = Summary.of(self)
            return report

    def finish_training(self) -> None:
        """No more steps: a protocol may still owe the mesh a final exchange."""
        with self.lock:
            self.training_done = True
            self._handle(TrainingEnded(self.steps, self.clock()))
            self.summary = Summary.of(self)

    def idle(self, wait_s: float) -> StepReport:
        """After training ends, keep merging what peers push so they can still settle."""
        with self.lock:
            report = StepReport(self.steps)
            self.drain(report, wait_s)
            self.summary = Summary.of(self)
            return report

    def idle_until(self, stop: threading.Event) -> None:
        """Drive the replica (merges, outcomes, calls) without stepping until ``stop``."""
        while not stop.is_set():
            self.idle(0.05)

    def drain(self, report: StepReport, wait_s: float | None = None) -> None:
        """Apply pending events and merge every queued push; optionally wait for the first.

        Events are applied before the merges (peer changes, push outcomes) and again
        after, so an outcome that arrived while merging is not left for the next step.
        Timers that came due fire here: the replica has no thread of its own.
        """
        self._apply_events(report)
        item = self.inbox.get(wait_s)
        while item is not None:
            self._merge(item, report)
            item = self.inbox.get(None)
        self._apply_events(report)
        now = self.clock()
        while self._timers and self._timers[0][0] <= now:
            _, tag = heapq.heappop(self._timers)
            self._handle(TimerFired(tag, now))

    def _apply_events(self, report: StepReport) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            event(report)

    def hand_off(self, peer: str | None = None) -> OutboundPush | None:
        """The push that hands all weight to ``peer`` when leaving; the caller delivers it."""
        with self.lock:
            pushes = [a for a in self.core.handle(HandOff(peer)) if isinstance(a, Push)]
            if not pushes:
                return None
            self._outstanding.add(pushes[0].key)
            return OutboundPush(pushes[0], self.flat.snapshot(pushes[0].weights))

    def settle_push(
        self,
        out: OutboundPush,
        acks: list[pb.SegmentAck],
        error: str | None,
        report: StepReport | None = None,
    ) -> None:
        """Commit what the receiver acknowledged; fold unacknowledged snapshots back in."""
        acked = tuple(
            a.segment
            for a in acks
            if a.result in (pb.SEGMENT_RESULT_MERGED, pb.SEGMENT_RESULT_DUPLICATE)
        )
        with self.lock:
            if out.push.key not in self._outstanding:
                return  # settled before (a late duplicate outcome changes nothing)
            self._outstanding.discard(out.push.key)
            for action in self.core.handle(PushSettled(out.push.peer, out.push.sequence, acked)):
                if isinstance(action, FoldBack):
                    # Our own snapshot coming home: finite, and the blend cannot overflow.
                    snapshot = out.snapshot[action.segment]
                    blended = self.flat.blend(action.segment, snapshot, action.alpha)
                    if blended is not None:
                        self.flat.load_segment(action.segment, blended)
            if len(acked) == len(out.push.weights):
                self.pushes_acked += 1
            else:
                self.pushes_failed += 1
            self.summary = Summary.of(self)
        if report is not None:
            record = PushRecord(out.push.peer, out.push.sequence, acked, error)
            (report.failed if error else report.pushed).append(record)

    def _handle(self, event: Event) -> list[Push]:
        """Hand ``event`` to the core and carry out what it asks; returns the pushes sent."""
        return self._carry_out(self.core.handle(event))

    def _carry_out(self, actions: list) -> list[Push]:
        pushes = [a for a in actions if isinstance(a, Push)]
        # One copy of each segment serves every push of this event (a group exchange
        # sends the same model to several peers); snapshots are never written.
        snapshot = self.flat.snapshot(sorted({s for p in pushes for s in p.weights}))
        for action in actions:
            match action:
                case Push():
                    self._outstanding.add(action.key)
                    self.send(OutboundPush(action, {s: snapshot[s] for s in action.weights}))
                case StartTimer():
                    heapq.heappush(self._timers, (action.at_s, action.tag))
                case Pull():
                    self.start_pull(OutboundPull(action))
                case _:
                    raise GossipdError(
                        f"protocol {self.core.name} asked for {action!r}, which this "
                        "daemon does not carry out; pick another gossip.protocol"
                    )
        return pushes

    def _merge(self, item: InboundPush, report: StepReport) -> None:
        """Merge a whole push or nothing: plan, compute every blend, check, then commit."""
        if not item.reply.set_running_or_notify_cancel():
            return  # the loop gave up waiting; the sender keeps its weight
        try:
            arrival = PayloadArrived(
                item.sender,
                item.incarnation,
                item.sequence,
                item.round,
                {seg.segment: seg.sum_weight for seg in item.segments},
                item.sequence_base,
            )
            values = {seg.segment: seg.values for seg in item.segments}
            try:
                plan = self.core.handle(arrival)
            except Refused as err:
                raise InvalidFrame(f"push {item.sender}#{item.sequence}: {err}") from None
            if not item.merge_new:
                plan = [a for a in plan if isinstance(a, Duplicate)]
            blends: dict[int, torch.Tensor] = {}
            for action in plan:
                if isinstance(action, Merge):
                    blended = self.flat.blend(action.segment, values[action.segment], action.alpha)
                    if blended is None:
                        raise NonFinitePayload(
                            f"merging segment {action.segment} of push {item.sender}#"
                            f"{item.sequence} would make the model non-finite; refused, "
                            "nothing merged"
                        )
                    blends[action.segment] = blended
            if item.merge_new:
                self.core.handle(PayloadMerged(arrival))
            for segment, blended in blends.items():
                self.flat.load_segment(segment, blended)
            weights = self.core.status().weights
            acks = [
                pb.SegmentAck(
                    segment=action.segment,
                    result=pb.SEGMENT_RESULT_MERGED
                    if isinstance(action, Merge)
                    else pb.SEGMENT_RESULT_DUPLICATE,
                    receiver_weight=weights[action.segment],
                )
                for action in plan
                if isinstance(action, Merge | Duplicate)
            ]
            if blends:
                self.pushes_merged += 1
            report.merged.append(
                MergeRecord(
                    item.sender,
                    item.sequence,
                    tuple(blends),
                    tuple(a.segment for a in plan if isinstance(a, Duplicate)),
                )
            )
            item.reply.set_result(acks)
        except (InvalidFrame, NonFinitePayload) as err:
            item.reply.set_exception(err)  # refused whole: the model is untouched
        except Exception as err:  # never strand the waiting servicer
            item.reply.set_exception(err)
            raise

    def _pulled(
        self, out: OutboundPull, pulled: Pulled | None, error: str | None, report: StepReport
    ) -> None:
        """Merge a pulled model whole or not at all, like a push; tell the core either way."""
        pull = out.pull
        if pulled is not None and error is None:
            arrival = PullArrived(
                pull.peer, pull.round, dict(pulled.weights), pulled.nbytes, pulled.transfer_s
            )
            try:
                blends = self._blends(arrival, pulled.values, f"pull from {pull.peer}")
            except (InvalidFrame, NonFinitePayload) as err:
                error = str(err)
            else:
                actions = self.core.handle(PullMerged(arrival))
                for segment, blended in blends.items():
                    self.flat.load_segment(segment, blended)
                self.pulls_merged += 1
                report.pulled.append(
                    PullRecord(
                        pull.peer, pull.round, tuple(blends), pulled.nbytes, arrival.transfer_s
                    )
                )
                self._carry_out(actions)
                return
        self.pulls_failed += 1
        report.pulled.append(PullRecord(pull.peer, pull.round, (), error=error))
        self._carry_out(self.core.handle(PullFailed(pull.peer, pull.round, str(error))))

    def _blends(
        self, arrival: PullArrived, values: Mapping[int, torch.Tensor], what: str
    ) -> dict[int, torch.Tensor]:
        """Every blend the core proposes for ``arrival``, computed and checked, none applied."""
        try:
            plan = self.core.handle(arrival)
        except Refused as err:
            raise InvalidFrame(f"{what}: {err}") from None
        blends: dict[int, torch.Tensor] = {}
        for action in plan:
            if not isinstance(action, Merge):
                continue
            if action.segment not in values:
                raise InvalidFrame(f"{what}: the core merges segment {action.segment}, not pulled")
            blended = self.flat.blend(action.segment, values[action.segment], action.alpha)
            if blended is None:
                raise NonFinitePayload(
                    f"merging segment {action.segment} of the {what} would make the model "
                    "non-finite; refused, nothing merged"
                )
            blends[action.segment] = blended
        return blends


@dataclass(frozen=True)
class Summary:
    """A consistent copy of replica state, replaced whole at each step boundary.

    Readers on other threads (status, metrics, health) read the current object
    without taking the replica's lock, so they never wait on a step.
    """

    steps: int
    loss: float
    protocol: str
    round: int
    epoch: int
    weights: tuple[float, ...]
    reserved: tuple[float, ...]
    in_flight: int
    pushes_acked: int
    pushes_failed: int
    pushes_merged: int
    peers: frozenset[str]
    exchanged: Mapping[str, PeerMass]

    @classmethod
    def of(cls, replica: Replica) -> Summary:
        core = replica.core.status()
        return cls(
            steps=replica.steps,
            loss=replica.last_loss,
            protocol=core.protocol,
            round=core.round,
            epoch=core.epoch,
            weights=core.weights,
            reserved=core.reserved,
            in_flight=core.in_flight,
            pushes_acked=replica.pushes_acked,
            pushes_failed=replica.pushes_failed,
            pushes_merged=replica.pushes_merged,
            peers=core.peers,
            exchanged=core.exchanged,
        )
