"""The parameter side of a node: the daemon's driver of its protocol core.

The replica owns the model's flat segments and the core, and carries out every
action the core returns (DESIGN §2): ``Push`` and ``Pull`` go to the network
through its :class:`~gossipd.node.messages.LoopPort`; ``Merge``, ``Duplicate`` and
``FoldBack`` are applied to the parameters here, whole or not at all; ``StartTimer``
fires at the first step boundary (or idle moment) at or after its time. A pull
starts at its own ``at_s`` on the loop, mid-step if need be, and merges here.

The event loop never writes parameters and the trainer never awaits the network.
They meet only through typed messages (``node/messages.py``): the loop puts whole
inbound pushes in the bounded inbox and every other event in the bounded event
queue; the trainer applies both at each step boundary, under :attr:`Replica.lock`.
Each :meth:`Replica.step` returns a :class:`~gossipd.node.report.StepReport`.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gossipd.node.config import NodeConfig
from gossipd.node.errors import (
    GossipdError,
    InvalidFrame,
    NonFinitePayload,
    PayloadOutOfBounds,
    WeightOverCap,
)
from gossipd.node.fairlock import FairLock
from gossipd.node.messages import (
    Ack,
    Barrier,
    Detached,
    EventQueue,
    Granted,
    HandOffRequest,
    InboundPush,
    Inbox,
    LoopPort,
    OutboundPull,
    OutboundPush,
    PeerRestart,
    Pulled,
    PullOutcome,
    PushOutcome,
    Rejected,
    ViewChange,
)
from gossipd.node.messages import (
    Event as LoopEvent,
)
from gossipd.node.payload_bound import PayloadBound
from gossipd.node.protocols import DEFAULT_PROTOCOL, CoreSettings, build
from gossipd.node.protocols.base import (
    Action,
    AskPeer,
    Duplicate,
    Event,
    FoldBack,
    GossipProtocol,
    HandOff,
    Merge,
    PayloadArrived,
    PayloadMerged,
    PeerGranted,
    PeerRestarted,
    Pull,
    PullArrived,
    PullFailed,
    PullMerged,
    Push,
    PushSettled,
    Refused,
    ReportTransfer,
    StartTimer,
    StepEnded,
    TimerFired,
    TrainingEnded,
    ViewChanged,
    WeightCapExceeded,
    shared_seed,
)
from gossipd.node.report import (
    MergeRecord,
    PullRecord,
    PushRecord,
    Rejection,
    StepReport,
    Summary,
    log_sinks,
)
from gossipd.node.segments import FlatModel

# Events a replica may have waiting: outcomes of its pushes and pulls (bounded by the
# core's in-flight limits), restarts, requests from the leaving loop, and refusals
# (dropped beyond this; counted where they were refused).
EVENT_QUEUE_SIZE = 4096

log = logging.getLogger(__name__)


class Replica:
    """A site's copy of the model and its protocol core; call :meth:`step` after each step.

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
        bound: PayloadBound | None = None,
        max_wait_s: float = 60.0,
    ) -> None:
        """``bound``: what a payload may do to the model (the config's defaults if None);
        ``max_wait_s``: the
        longest the trainer waits at a step boundary for a pull due there (the pull's
        own deadlines end it sooner; this only guards against a driver bug)."""
        self.flat = FlatModel(model, segment_bytes)
        self.bound = bound or PayloadBound()
        self.core: GossipProtocol = build(
            protocol,
            CoreSettings(node_id, len(self.flat.plan), **(settings or {})),
        )
        self.inbox = Inbox(inbox_size)
        self.events = EventQueue(EVENT_QUEUE_SIZE)
        self.port: LoopPort = Detached(self.events)
        self.clock = clock
        self.steps = 0
        self.last_loss = float("nan")
        self.training_done = False
        self._outstanding: set[tuple[str, int]] = set()  # pushes sent, not yet settled
        self._pulls_out = 0  # pulls started, not yet merged or failed
        # Pulls to merge at a given step's boundary: those still out (the trainer waits
        # for them there), and those that landed early (held until then).
        self._due: dict[int, tuple[OutboundPull, int]] = {}  # id(out) -> (out, step)
        self._held: list[PullOutcome] = []
        self.max_wait_s = max_wait_s
        self.wait_s = 0.0  # time the trainer spent waiting for due pulls
        self.started_s: float | None = None  # the first step's end (wall time counts from it)
        self._timers: list[tuple[float, str]] = []  # heap of (at_s, tag)
        # Held by whoever reads or writes parameters: the trainer while stepping,
        # the loop while snapshotting for PullModel or checkpoints.
        self.lock = FairLock()
        # Held by whoever touches the core and what is in flight: the trainer at its
        # step boundaries (inside ``lock``), and a timer that fires mid-step (alone:
        # it must not wait for the step, and it writes no parameter).
        self.core_lock = threading.RLock()
        self._deferred: list[Push] = []  # made by a timer mid-step, sent at the boundary
        self.pushes_acked = 0
        self.pushes_failed = 0
        self.pushes_merged = 0
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
                "sink_bound": config.limits.sink_score_bound,
                "sink_allowance": config.limits.sink_allowance,
                "coordinator": config.coordinator is not None,
                "options": gossip.options,  # the protocol's own [gossip.<protocol>] table
            },
            inbox_size=config.limits.inbox_size,
            bound=PayloadBound.from_limits(config.limits),
            max_wait_s=2 * gossip.push_timeout_s,
        )

    def wait_fraction(self) -> float:
        """The share of wall time since the first step ended that the trainer spent
        waiting for pulls due at its step boundaries."""
        if self.started_s is None:
            return 0.0
        wall = self.clock() - self.started_s
        return min(self.wait_s / wall, 1.0) if wall > 0 else 0.0

    @property
    def fingerprint(self) -> str:
        return self.flat.fingerprint

    def attach(self, port: LoopPort) -> None:
        """The network that carries this replica's pushes and pulls from now on."""
        self.port = port

    def publish(self) -> None:
        """Refresh the summary that status and metrics read (after a restore, say)."""
        with self.lock, self.core_lock:
            self.summary = Summary.of(self)

    def state_dict(self) -> dict[str, Any]:
        """The core's state, for a checkpoint (take it under :attr:`lock`)."""
        with self.core_lock:
            return self.core.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        with self.lock, self.core_lock:
            self.core.load_state_dict(state)
            self.summary = Summary.of(self)

    # -- called from the event loop (any thread) -------------------------------------
    def post(
        self,
        event: PushOutcome | PullOutcome | ViewChange | PeerRestart | Rejected,
    ) -> None:
        """Queue ``event`` for the trainer's next step boundary (never blocks)."""
        self.events.put(event)

    def request_hand_off(self, peer: str | None) -> concurrent.futures.Future[OutboundPush | None]:
        """The push handing all weight to ``peer``, made on the trainer's thread."""
        reply: concurrent.futures.Future[OutboundPush | None] = concurrent.futures.Future()
        self.events.put(HandOffRequest(peer, reply))
        return reply

    def barrier(self) -> concurrent.futures.Future[None]:
        """Resolves once every event queued before it was applied on the trainer's thread."""
        reply: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.events.put(Barrier(reply))
        return reply

    # -- called from the trainer thread ----------------------------------------------
    def step(self, loss: float | None = None) -> StepReport:
        """Close one local step: merge what arrived, settle push outcomes, maybe push.

        A pull the core wants merged at this boundary (``Pull.merge_at_step``) that
        has not landed yet is waited for here, outside the locks (so this node still
        serves pulls meanwhile), before the core hears that the step ended, and again
        after if the core asks for one due at once.
        """
        with self.lock, self.core_lock:
            self.steps += 1
            if loss is not None:
                self.last_loss = float(loss)
            if self.started_s is None:
                self.started_s = self.clock()
            report = StepReport(self.steps)
            self.drain(report)
            told = not self._due_now()  # the core hears of the step once nothing is due
            if told:
                self._end_step(report)
                if not self._due_now():
                    self._publish()
                    return report
        self._wait_for_due(report)  # for what was due, or what the core asked due at once
        with self.lock, self.core_lock:
            if not told:
                self._end_step(report)
            if told or not self._due_now():
                self._publish()
                return report
        self._wait_for_due(report)
        with self.lock, self.core_lock:
            self._publish()
        return report

    def _end_step(self, report: StepReport) -> None:
        for push in self._handle(StepEnded(self.steps, self.clock())):
            report.started_push_to = push.peer

    def _publish(self) -> None:
        before, self.summary = self.summary, Summary.of(self)
        log_sinks(before, self.summary)

    def _due_now(self) -> bool:
        return any(step <= self.steps for _, step in self._due.values())

    def _wait_for_due(self, report: StepReport) -> None:
        """Wait, holding no lock, until every pull due by this step merged or failed."""
        started = self.clock()
        try:
            while True:
                # The steps ended sooner than predicted: start now what is due here, on
                # each pass, for a pull re-picked meanwhile (the first failed) is due too.
                with self.core_lock:
                    due = [out for out, step in self._due.values() if step <= self.steps]
                for out in due:
                    self.port.hurry_pull(out)
                left = started + self.max_wait_s - self.clock()
                if left <= 0:
                    with self.core_lock:
                        late = [k for k, (_, step) in self._due.items() if step <= self.steps]
                        for key in late:
                            del self._due[key]  # merged whenever it lands
                    log.warning(
                        "step %d: a pull due here did not land within %.0f s; training on "
                        "without it (it merges when it lands)",
                        self.steps,
                        self.max_wait_s,
                    )
                    return
                with self.lock.suspended():  # a caller may hold it around the whole step
                    event = self.events.get(min(left, 1.0))
                with self.lock, self.core_lock:
                    if event is not None:
                        self._apply(event, report)
                    self._apply_events(report)
                    self._release_held(report)
                    if not self._due_now():
                        return
        finally:
            self.wait_s += self.clock() - started

    def finish_training(self) -> None:
        """No more steps: a protocol may still owe the mesh a final exchange."""
        with self.lock, self.core_lock:
            self.training_done = True
            self._handle(TrainingEnded(self.steps, self.clock()))
            self.summary = Summary.of(self)

    def idle(self, wait_s: float) -> StepReport:
        """After training ends, keep merging what peers push so they can still settle."""
        with self.lock, self.core_lock:
            report = StepReport(self.steps)
            self.drain(report, wait_s)
            before, self.summary = self.summary, Summary.of(self)
            log_sinks(before, self.summary)
            return report

    def settled(self) -> bool:
        """Nothing of this replica's is in flight, waiting in its queues, or due to fire.

        A pull that landed and waits for the step it merges at is settled while training
        goes on (it waits for the trainer, not the network); once training ended it
        merges at the next boundary and must have.
        """
        with self.lock, self.core_lock:
            return not (
                self._outstanding
                or self._pulls_out
                or (self._held and self.training_done)
                or self._timers
                or self.inbox.pending()
                or self.events.pending()
            )

    def idle_until(self, stop: threading.Event) -> None:
        """Drive the replica (merges, outcomes, requests) without stepping until ``stop``."""
        while not stop.is_set():
            self.idle(0.05)

    def drain(self, report: StepReport, wait_s: float | None = None) -> None:
        """Apply pending events and merge every queued push; optionally wait for the first.

        Events are applied before the merges (peer changes, push outcomes) and again
        after, so an outcome that arrived while merging is not left for the next step.
        Timers that came due fire here too, if the network's wake-up (which fires them
        mid-step, see :meth:`fire_due_timers`) has not yet; pushes a timer made
        mid-step leave first, with the model as it was before anything merges.
        """
        self._send_deferred()
        self._apply_events(report)
        item = self.inbox.get(wait_s)
        while item is not None:
            self._merge(item, report)
            item = self.inbox.get(None)
        self._apply_events(report)
        self._release_held(report)
        self._fire_due(mid_step=False)

    def _apply_events(self, report: StepReport) -> None:
        while (event := self.events.get()) is not None:
            self._apply(event, report)

    def _release_held(self, report: StepReport) -> None:
        """Merge the pulls that landed early, once their step's boundary is reached."""
        ready = [o for o in self._held if self.training_done or _due_step(o) <= self.steps]
        if ready:
            self._held = [o for o in self._held if o not in ready]
            for outcome in ready:
                self._pulled(outcome.out, outcome.pulled, outcome.error, report)

    def _apply(self, event: LoopEvent, report: StepReport) -> None:
        match event:
            case PushOutcome(out=out, acks=acks, error=error):
                self.settle_push(out, acks, error, report)
            case PullOutcome(out=out):
                self._due.pop(id(out), None)
                if out.adopted is None:
                    self._pulls_out -= 1  # landed (or failed); a held one merges later
                if not self.training_done and _due_step(event) > self.steps:
                    self._held.append(event)  # landed early: merge at its step's boundary
                else:
                    self._pulled(out, event.pulled, event.error, report)
            case Granted(granted=granted):
                self._carry_out(self.core.handle(granted))
            case ViewChange(members=members):
                self._handle(ViewChanged(members))
            case PeerRestart(peer=peer, incarnation=incarnation):
                self._handle(PeerRestarted(peer, incarnation))
            case Rejected(peer=peer, reason=reason, detail=detail):
                report.rejected.append(Rejection(peer, reason, detail))
            case HandOffRequest(peer=peer, reply=reply):
                _resolve(reply, lambda: self.hand_off(peer))
            case Barrier(reply=reply):
                # What the waiter reads next (the peers to hand off to) must include
                # every event before the barrier, not the previous boundary's copy.
                self.summary = Summary.of(self)
                _resolve(reply, lambda: None)

    def hand_off(self, peer: str | None = None) -> OutboundPush | None:
        """The push that hands all weight to ``peer`` when leaving; the caller delivers it."""
        with self.lock, self.core_lock:
            pushes = [a for a in self.core.handle(HandOff(peer)) if isinstance(a, Push)]
            if not pushes:
                return None
            self._outstanding.add(pushes[0].key)
            return OutboundPush(pushes[0], self.flat.snapshot(pushes[0].weights))

    def settle_push(
        self,
        out: OutboundPush,
        acks: Sequence[Ack],
        error: str | None,
        report: StepReport | None = None,
    ) -> None:
        """Commit what the receiver acknowledged; fold unacknowledged snapshots back in."""
        acked = tuple(a.segment for a in acks)
        with self.lock, self.core_lock:
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

    # -- called from a worker thread of the loop -------------------------------------
    def fire_due_timers(self) -> None:
        """Fire the timers that came due, now, even while the trainer is inside a step.

        Only the core is touched (under :attr:`core_lock`): a ``Pull`` it asks for
        starts at once and a new timer is scheduled, while a ``Push`` waits for the
        step boundary, where its snapshot is taken before anything merges.
        """
        with self.core_lock:
            self._fire_due(mid_step=True)

    def grant(self, granted: PeerGranted) -> None:
        """The coordinator's answer to the core's ``AskPeer``, applied at once, even
        mid-step (like a timer: only the core is touched)."""
        with self.core_lock:
            self._carry_out(self.core.handle(granted), mid_step=True)

    def _fire_due(self, *, mid_step: bool) -> None:
        now = self.clock()
        while self._timers and self._timers[0][0] <= now:
            _, tag = heapq.heappop(self._timers)
            self._carry_out(self.core.handle(TimerFired(tag, now)), mid_step=mid_step)

    def _send_deferred(self) -> None:
        with self.core_lock:
            deferred, self._deferred = self._deferred, []
            self._send(deferred)

    def _handle(self, event: Event) -> list[Push]:
        """Hand ``event`` to the core and carry out what it asks; returns the pushes sent."""
        return self._carry_out(self.core.handle(event))

    def _send(self, pushes: Sequence[Push]) -> None:
        # One copy of each segment serves every push of this event (a group exchange
        # sends the same model to several peers); snapshots are never written.
        snapshot = self.flat.snapshot(sorted({s for p in pushes for s in p.weights}))
        for push in pushes:
            self.port.send_push(OutboundPush(push, {s: snapshot[s] for s in push.weights}))

    def _carry_out(self, actions: Sequence[Action], *, mid_step: bool = False) -> list[Push]:
        pushes = [a for a in actions if isinstance(a, Push)]
        for action in actions:
            match action:
                case Push():
                    self._outstanding.add(action.key)
                case StartTimer():
                    heapq.heappush(self._timers, (action.at_s, action.tag))
                    self.port.wake_at(action.at_s)
                case Pull():
                    self._pulls_out += 1
                    out = OutboundPull(action)
                    if action.merge_at_step is not None:
                        self._due[id(out)] = (out, action.merge_at_step)
                    self.port.start_pull(out)
                case AskPeer():
                    self.port.ask_peer(action)
                case ReportTransfer():
                    self.port.report_transfer(action)
                case _:
                    raise GossipdError(
                        f"protocol {self.core.name} returned {action!r} outside a payload or a "
                        "settle; only a PayloadArrived or PullArrived may be answered by merges"
                    )
        if mid_step:
            self._deferred.extend(pushes)
        else:
            self._send(pushes)
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
            what = f"push {item.sender}#{item.sequence}"
            plan, blends, clipped = self._plan(arrival, values, what, merge_new=item.merge_new)
            if item.merge_new:
                self.core.handle(PayloadMerged(arrival))
            for segment, blended in blends.items():
                self.flat.load_segment(segment, blended)
            weights = self.core.status().weights
            acks = [
                Ack(a.segment, isinstance(a, Duplicate), weights[a.segment] if weights else 0.0)
                for a in plan
                if isinstance(a, Merge | Duplicate)
            ]
            if blends:
                self.pushes_merged += 1
            report.merged.append(
                MergeRecord(
                    item.sender,
                    item.sequence,
                    tuple(blends),
                    tuple(a.segment for a in plan if isinstance(a, Duplicate)),
                    clipped,
                )
            )
            # Whoever hears this acknowledgement may read our status next: it must
            # already show the merge, not the previous step boundary's summary.
            self.summary = Summary.of(self)
            item.reply.set_result(acks)
        except (InvalidFrame, NonFinitePayload, PayloadOutOfBounds) as err:
            item.reply.set_exception(err)  # refused whole: the model is untouched
        except Exception as err:  # never strand the waiting servicer
            item.reply.set_exception(err)
            raise

    def _pulled(
        self, out: OutboundPull, pulled: Pulled | None, error: str | None, report: StepReport
    ) -> None:
        """Merge a pulled model whole or not at all, like a push; tell the core either way."""
        pull = out.pull
        if out.adopted is not None:
            _resolve(out.adopted, lambda: self._adopt(pull.peer, pulled, error))
            return
        if pulled is not None and error is None:
            arrival = PullArrived(
                pull.peer, pull.round, dict(pulled.weights), pulled.nbytes, pulled.transfer_s
            )
            try:
                _, blends, _ = self._plan(arrival, pulled.values, f"pull from {pull.peer}")
            except (InvalidFrame, NonFinitePayload, PayloadOutOfBounds) as err:
                error = str(err)
            else:
                actions = self.core.handle(PullMerged(arrival))
                for segment, blended in blends.items():
                    self.flat.load_segment(segment, blended)
                report.pulled.append(
                    PullRecord(
                        pull.peer, pull.round, tuple(blends), pulled.nbytes, arrival.transfer_s
                    )
                )
                self._carry_out(actions)
                return
        report.pulled.append(PullRecord(pull.peer, pull.round, (), error=error))
        self._carry_out(self.core.handle(PullFailed(pull.peer, pull.round, str(error))))

    def _adopt(self, peer: str, pulled: Pulled | None, error: str | None) -> None:
        """Load a joiner's bootstrap model whole (on the trainer thread, like any merge)."""
        if pulled is None or error is not None:
            raise GossipdError(f"join: pulling the model from {peer} failed: {error}")
        if sorted(pulled.values) != list(range(len(self.flat.plan))):
            raise GossipdError(f"join: {peer} sent segments {sorted(pulled.values)}, not all")
        for index, values in pulled.values.items():
            self.flat.load_segment(index, values)
        self.summary = Summary.of(self)

    def restore(
        self, segments: Sequence[torch.Tensor], core: Mapping[str, Any], steps: int
    ) -> None:
        """Resume from a checkpoint's model, core state and step count.

        Called once at start-up, before the network serves and before the trainer
        thread exists, so nothing else reads or writes the parameters meanwhile.
        """
        with self.lock, self.core_lock:
            for index, values in enumerate(segments):
                self.flat.load_segment(index, values)
            self.core.load_state_dict(core)
            self.steps = steps
            self.summary = Summary.of(self)

    def _plan(
        self,
        arrival: PayloadArrived | PullArrived,
        values: Mapping[int, torch.Tensor],
        what: str,
        *,
        merge_new: bool = True,
    ) -> tuple[list[Action], dict[int, torch.Tensor], tuple[int, ...]]:
        """The core's answer to ``arrival``, every blend it asks for (checked against the
        payload bound, none applied) and the segments the robust merge clipped.

        ``merge_new`` False keeps only the DUPLICATE answers (a leaving node merges nothing).
        """
        try:
            plan = self.core.handle(arrival)
        except Refused as err:
            refusal = WeightOverCap if isinstance(err, WeightCapExceeded) else InvalidFrame
            raise refusal(f"{what}: {err}") from None
        if not merge_new:
            plan = [a for a in plan if isinstance(a, Duplicate)]
        blends: dict[int, torch.Tensor] = {}
        clipped: list[int] = []
        for action in plan:
            if not isinstance(action, Merge):
                continue
            if action.segment not in values:
                raise InvalidFrame(f"{what}: the core merges segment {action.segment}, not sent")
            own = self.flat.buffers[action.segment]
            incoming, clip = self.bound.admit(own, values[action.segment], what, action.segment)
            if clip:
                clipped.append(action.segment)
            blended = self.flat.blend(action.segment, incoming, action.alpha)
            if blended is None:
                raise NonFinitePayload(
                    f"merging segment {action.segment} of {what} would make the model "
                    "non-finite; refused, nothing merged"
                )
            blends[action.segment] = blended
        return plan, blends, tuple(clipped)


def _due_step(outcome: PullOutcome) -> int:
    """The step whose boundary merges this pull (0: the next boundary)."""
    return outcome.out.pull.merge_at_step or 0


def _resolve(reply: concurrent.futures.Future[Any], fn: Callable[[], Any]) -> None:
    if reply.set_running_or_notify_cancel():
        try:
            reply.set_result(fn())
        except BaseException as err:
            reply.set_exception(err)
