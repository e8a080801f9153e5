"""The trainer side of a node: owns the parameters and the gossip core.

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
import queue
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gossipd.node.config import NodeConfig
from gossipd.node.errors import Busy, InvalidFrame, NonFinitePayload
from gossipd.node.protocols.sumweight import Merge, Push, Refused, SumWeightGossip
from gossipd.node.segments import FlatModel
from gossipd.node.wire import ReceivedSegment
from gossipd.proto import gossip_pb2 as pb


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
    started_push_to: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed and not self.rejected


@dataclass
class InboundPush:
    """A whole, validated push waiting for the trainer; ``reply`` resolves with the acks."""

    sender: str
    incarnation: int
    sequence: int
    segments: list[ReceivedSegment]
    reply: concurrent.futures.Future[list[pb.SegmentAck]] = field(
        default_factory=concurrent.futures.Future
    )


@dataclass(frozen=True)
class OutboundPush:
    push: Push
    snapshot: dict[int, torch.Tensor]


class FairLock:
    """A re-entrant lock handed over in arrival order.

    The trainer releases and re-takes its lock once per step, a few hundred
    times a second; with a plain RLock it wins every race and a reader (status,
    PullModel snapshot, checkpoint) can starve for seconds.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._waiters: deque[tuple[int, threading.Event]] = deque()
        self._owner: int | None = None
        self._depth = 0

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._guard:
            if self._owner == me:
                self._depth += 1
                return
            if self._owner is None and not self._waiters:
                self._owner, self._depth = me, 1
                return
            turn = threading.Event()
            self._waiters.append((me, turn))
        turn.wait()

    def release(self) -> None:
        with self._guard:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth:
                return
            if self._waiters:
                self._owner, turn = self._waiters.popleft()
                self._depth = 1
                turn.set()
            else:
                self._owner = None

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


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
    """Sum-weight gossip around a model the caller trains; call :meth:`step` after each step."""

    def __init__(
        self,
        node_id: str,
        model: torch.nn.Module,
        *,
        push_probability: float,
        segment_bytes: int,
        inbox_size: int = 16,
        seed: int = 0,
        initial_weight: float = 1.0,
        max_in_flight: int = 4,
        max_weight: float = 1e6,
    ) -> None:
        self.flat = FlatModel(model, segment_bytes)
        self.core = SumWeightGossip(
            node_id,
            len(self.flat.plan),
            push_probability=push_probability,
            rng=random.Random(seed),
            initial_weight=initial_weight,
            max_in_flight=max_in_flight,
            max_weight=max_weight,
        )
        self.inbox = Inbox(inbox_size)
        self.steps = 0
        self.last_loss = float("nan")
        self.training_done = False
        self.send: Callable[[OutboundPush], None] = lambda out: None
        self._events: queue.SimpleQueue[Callable[[StepReport], None]] = queue.SimpleQueue()
        # Held by whoever reads or writes parameters: the trainer while stepping,
        # the loop while snapshotting for PullModel or status.
        self.lock = FairLock()
        self.pushes_acked = 0
        self.pushes_failed = 0
        self.pushes_merged = 0
        self.summary = Summary.of(self)

    @classmethod
    def from_config(cls, config: NodeConfig, model: torch.nn.Module) -> Replica:
        """The trainer a site's config asks for (a joiner starts at weight 0)."""
        return cls(
            config.node_id,
            model,
            push_probability=config.gossip.push_probability,
            segment_bytes=config.gossip.segment_bytes,
            inbox_size=config.limits.inbox_size,
            seed=config.gossip.seed,
            initial_weight=0.0 if config.join else 1.0,
            max_in_flight=config.gossip.max_pushes_in_flight,
            max_weight=config.limits.max_sum_weight,
        )

    @property
    def fingerprint(self) -> str:
        return self.flat.fingerprint

    def publish(self) -> None:
        """Refresh the summary that status and metrics read (after a restore, say)."""
        with self.lock:
            self.summary = Summary.of(self)

    # -- called from the event loop (any thread) -------------------------------------
    def post(self, event: Callable[[StepReport], None]) -> None:
        """Run ``event`` on the trainer thread at the next step boundary."""
        self._events.put(event)

    def post_push_result(
        self, out: OutboundPush, acks: list[pb.SegmentAck], error: str | None
    ) -> None:
        self.post(lambda report: self.settle_push(out, acks, error, report))

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
            if out.push.key not in self.core.in_flight:
                return  # settled before (a late duplicate outcome changes nothing)
            for merge in self.core.on_push_acked(out.push.key, acked):
                # Our own snapshot coming home: finite, and the blend cannot overflow.
                blended = self.flat.blend(merge.segment, out.snapshot[merge.segment], merge.alpha)
                if blended is not None:
                    self.flat.load_segment(merge.segment, blended)
            if len(acked) == len(out.push.weights):
                self.pushes_acked += 1
            else:
                self.pushes_failed += 1
            self.summary = Summary.of(self)
        if report is not None:
            record = PushRecord(out.push.peer, out.push.sequence, acked, error)
            (report.failed if error else report.pushed).append(record)

    def post_rejection(self, peer: str, reason: str, detail: str) -> None:
        self.post(lambda report: report.rejected.append(Rejection(peer, reason, detail)))

    def post_peer(self, peer: str, up: bool) -> None:
        self.post(lambda report: (self.core.on_peer_up if up else self.core.on_peer_down)(peer))

    # -- called from the trainer thread ----------------------------------------------
    def step(self, loss: float | None = None) -> StepReport:
        """Close one local step: merge what arrived, settle push outcomes, maybe push."""
        with self.lock:
            self.steps += 1
            if loss is not None:
                self.last_loss = float(loss)
            report = StepReport(self.steps)
            self.drain(report)
            for push in self.core.on_step_end():
                report.started_push_to = push.peer
                self.send(OutboundPush(push, self.flat.snapshot(push.weights)))
            self.summary = Summary.of(self)
            return report

    def drain(self, report: StepReport, wait_s: float | None = None) -> None:
        """Apply pending events and merge every queued push; optionally wait for the first.

        Events are applied before the merges (peer changes, push outcomes) and again
        after, so an outcome that arrived while merging is not left for the next step.
        """
        self._apply_events(report)
        item = self.inbox.get(wait_s)
        while item is not None:
            self._merge(item, report)
            item = self.inbox.get(None)
        self._apply_events(report)

    def _apply_events(self, report: StepReport) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            event(report)

    def idle(self, wait_s: float) -> StepReport:
        """After training ends, keep merging what peers push so they can still settle."""
        with self.lock:
            report = StepReport(self.steps)
            self.drain(report, wait_s)
            self.summary = Summary.of(self)
            return report

    def leave(self, peer: str | None = None) -> OutboundPush | None:
        with self.lock:
            push = self.core.hand_off(peer)
            return OutboundPush(push, self.flat.snapshot(push.weights)) if push else None

    def _merge(self, item: InboundPush, report: StepReport) -> None:
        """Merge a whole push or nothing: plan, compute every blend, check, then commit."""
        if not item.reply.set_running_or_notify_cancel():
            return  # the loop gave up waiting; the sender keeps its weight
        try:
            weights = {seg.segment: seg.sum_weight for seg in item.segments}
            values = {seg.segment: seg.values for seg in item.segments}
            try:
                plan = self.core.plan_receive(item.sender, item.incarnation, item.sequence, weights)
            except Refused as err:
                raise InvalidFrame(f"push {item.sender}#{item.sequence}: {err}") from None
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
            self.core.apply_receive(item.sender, item.incarnation, item.sequence, plan)
            for segment, blended in blends.items():
                self.flat.load_segment(segment, blended)
            acks = [
                pb.SegmentAck(
                    segment=action.segment,
                    result=pb.SEGMENT_RESULT_MERGED
                    if isinstance(action, Merge)
                    else pb.SEGMENT_RESULT_DUPLICATE,
                    receiver_weight=self.core.weights[action.segment],
                )
                for action in plan
            ]
            if blends:
                self.pushes_merged += 1
            report.merged.append(
                MergeRecord(
                    item.sender,
                    item.sequence,
                    tuple(blends),
                    tuple(a.segment for a in plan if not isinstance(a, Merge)),
                )
            )
            item.reply.set_result(acks)
        except (InvalidFrame, NonFinitePayload) as err:
            item.reply.set_exception(err)  # refused whole: the model is untouched
        except Exception as err:  # never strand the waiting servicer
            item.reply.set_exception(err)
            raise


@dataclass(frozen=True)
class Summary:
    """A consistent copy of trainer state, replaced whole at each step boundary.

    Readers on other threads (status, metrics, health) read the current object
    without taking the trainer's lock, so they never wait on a step.
    """

    steps: int
    loss: float
    weights: tuple[float, ...]
    reserved: tuple[float, ...]
    in_flight: int
    pushes_acked: int
    pushes_failed: int
    pushes_merged: int
    peers: frozenset[str]

    @classmethod
    def of(cls, replica: Replica) -> Summary:
        core = replica.core
        return cls(
            steps=replica.steps,
            loss=replica.last_loss,
            weights=tuple(core.weights),
            reserved=tuple(core.reserved),
            in_flight=len(core.in_flight),
            pushes_acked=replica.pushes_acked,
            pushes_failed=replica.pushes_failed,
            pushes_merged=replica.pushes_merged,
            peers=frozenset(core.peers),
        )
