"""What the event loop and the replica (the daemon's protocol driver) say to each other.

The loop owns the network; the trainer thread owns the parameters and the protocol
core. They meet only through the typed messages here (docs/design.md §3, and
docs/contributing.md "Threads"):

* loop → trainer: whole inbound pushes in the bounded :class:`Inbox`, and every other
  event (a push's outcome, a pull's result, a view change, a restart, a refusal, a
  request from the leaving loop) in the bounded :class:`EventQueue`;
* trainer → loop: :class:`OutboundPush` and :class:`OutboundPull`, handed to the
  :class:`LoopPort` the network attaches;
* what the loop may touch of the replica itself is :class:`ReplicaLink`: those queues,
  the summary it publishes, snapshots under its lock, and the norms its receiving
  workers take; the network imports nothing else of the trainer.

What the trainer thread tells the site's own loop (an evaluation, a checkpoint's step,
its death) is the site's: ``node/site/loop_mail.py``.

Nothing here imports grpc or protobuf: the loop converts at its edge, so the trainer
side can be read, tested and driven without a wire.
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from gossipd.node.errors import Busy, GossipdError
from gossipd.node.model.payload_bound import Gauge
from gossipd.node.protocols.base import (
    AskPeer,
    PeerGranted,
    Pull,
    Push,
    Receipts,
    ReportTransfer,
    Settle,
    SettleArrived,
)

if TYPE_CHECKING:
    from gossipd.node.model.segments import FlatModel
    from gossipd.node.trainer.report import Summary


# -- payloads ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ReceivedSegment:
    """One whole, verified segment of a push or a pull; ``gauge``: its norms against our
    own, taken as it arrived (None: the merge measures it)."""

    segment: int
    sum_weight: float
    values: torch.Tensor
    gauge: Gauge | None = None
    version: int = 0  # the copy these values become, with error feedback (0: none)


@dataclass(frozen=True)
class Ack:
    """A receiver's answer for one segment: merged now, or merged before (``duplicate``);
    ``receiver_weight``: the receiver's weight of it after (NaN: unknown); ``kept``: it
    keeps what the segment stood for as its copy (error feedback)."""

    segment: int
    duplicate: bool
    receiver_weight: float
    kept: bool = False


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
    settled: int = 0  # what of that numbering the sender settled before this push
    reply: concurrent.futures.Future[list[Ack]] = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class OutboundPush:
    push: Push
    snapshot: dict[int, torch.Tensor]
    # Sent raw whatever the codec: a leaving node's hand-off, which leaves no model behind
    # to keep what a lossy codec would drop.
    exact: bool = False
    # A settle carried on the push path (``Settle``): no segments, nothing to book.
    closes: bool = False


@dataclass(frozen=True)
class OutboundPull:
    """A pull for the network to start at ``pull.at_s`` (the replica's clock), even mid-step.

    ``adopted`` marks a joiner's bootstrap: not the core's pull, but the driver's own,
    whose model replaces the joiner's (its weight is 0, so that is the sum-weight merge
    with α = 1); it resolves once the trainer thread has loaded it, or with the error.
    """

    pull: Pull
    adopted: concurrent.futures.Future[None] | None = None


@dataclass
class Pulled:
    """What a pull brought: each segment's values and sum-weight, the payload bytes, and the
    time from the pull's start to its last byte (the replica's clock)."""

    values: dict[int, torch.Tensor] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    gauges: dict[int, Gauge] = field(default_factory=dict)
    nbytes: int = 0
    transfer_s: float = 0.0


# -- events, loop → trainer --------------------------------------------------------------
@dataclass(frozen=True)
class PushOutcome:
    """How a push ended: the segments the receiver acknowledged, and why the rest did not."""

    out: OutboundPush
    acks: tuple[Ack, ...]
    error: str | None
    # Per acknowledged segment sent through a lossy codec with error feedback, what the
    # receiver merged in place of the snapshot: the sender keeps the difference.
    rebuilt: Mapping[int, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class PullOutcome:
    out: OutboundPull
    pulled: Pulled | None
    error: str | None


@dataclass(frozen=True)
class ViewNotice:
    """The live members as the network sees them now, this node included (the loop's
    notice; the replica hands the core a ``ViewChanged`` event from it)."""

    members: frozenset[str]
    relayed: frozenset[str] = frozenset()  # of those, the ones reached through a relay


@dataclass(frozen=True)
class RestartNotice:
    """A verified peer came back in a new incarnation (the loop's notice; the core hears
    ``PeerRestarted``)."""

    peer: str
    incarnation: int


@dataclass(frozen=True)
class Rejected:
    """An inbound request the loop refused, for the next step's report."""

    peer: str
    reason: str
    detail: str


@dataclass(frozen=True)
class HandOffRequest:
    """The leaving loop asks for the push that hands all weight to ``peer``."""

    peer: str | None
    reply: concurrent.futures.Future[OutboundPush | None]


@dataclass(frozen=True)
class ReceiptsRequest:
    """The leaving loop asks what this node merged of each peer's pushes, to send each
    peer its own with the Leave (final by then: a leaving node merges nothing new)."""

    peers: tuple[str, ...]
    sequences: int  # each numbering's newest this many
    reply: concurrent.futures.Future[dict[str, list[Receipts]]]


@dataclass(frozen=True)
class Barrier:
    """Resolved once every event queued before it has been applied, with the number of
    this node's pushes still outstanding then (a leave hands off only once it is 0)."""

    reply: concurrent.futures.Future[int]


@dataclass(frozen=True)
class Granted:
    """The answer to the core's ``AskPeer`` (applied at a step boundary, or at once by
    :meth:`~gossipd.node.trainer.replica.Replica.grant` when the loop can call it)."""

    granted: PeerGranted


LoopMessage = (
    PushOutcome
    | PullOutcome
    | ViewNotice
    | RestartNotice
    | Rejected
    | HandOffRequest
    | ReceiptsRequest
    | Barrier
    | Granted
)


class EventQueue:
    """Bounded and thread-safe; the loop's ``put`` never blocks.

    What must arrive (outcomes, restarts, requests) is bounded by construction: a
    core has at most ``max_in_flight`` pushes and a few pulls out, and the loop asks
    one thing at a time while leaving. A view change replaces the one still waiting
    (only the newest view matters), and a refusal is dropped when the queue is full
    (it was counted and logged where it was refused): a flood cannot grow the queue.
    """

    def __init__(self, capacity: int) -> None:
        self._items: queue.Queue[LoopMessage] = queue.Queue(maxsize=capacity)
        self._view: ViewNotice | None = None
        self._view_lock = threading.Lock()

    def put(self, event: LoopMessage) -> None:
        if isinstance(event, ViewNotice):
            with self._view_lock:
                pending, self._view = self._view, event
            if pending is not None:
                return  # the one already queued will read the newest view
        try:
            self._items.put_nowait(event)
        except queue.Full:
            if isinstance(event, Rejected):
                return
            raise GossipdError(
                f"the replica's event queue is full ({self._items.maxsize} events): the "
                "trainer thread is not draining it; this is a bug, please report it"
            ) from None

    def pending(self) -> int:
        return self._items.qsize()

    def get(self, timeout_s: float | None = None) -> LoopMessage | None:
        """The next event; None if there is none (after ``timeout_s``, if given)."""
        try:
            if timeout_s is None:
                event = self._items.get_nowait()
            else:
                event = self._items.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if isinstance(event, ViewNotice):
            with self._view_lock:
                event, self._view = self._view or event, None
        return event


class Inbox:
    """Bounded, thread-safe: the loop's ``put`` fails fast with ``Busy`` instead of blocking.

    :meth:`wait` lets the trainer wait for a push without taking one, so it can wait
    without holding the replica's lock (a pull's snapshot or a status needs that lock)
    and still count a push as pending until it is merged (:meth:`Replica.settled`).
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: collections.deque[InboundPush] = collections.deque()
        self._ready = threading.Condition()

    def put(self, item: InboundPush) -> None:
        with self._ready:
            if len(self._items) >= self._capacity:
                raise Busy(
                    f"receiver inbox is full ({self._capacity} pushes waiting for a step "
                    "boundary); retry later or raise limits.inbox_size"
                )
            self._items.append(item)
            self._ready.notify()

    def pending(self) -> int:
        return len(self._items)

    def wait(self, timeout_s: float) -> None:
        """Until a push is waiting, at most ``timeout_s``; the push stays queued."""
        with self._ready:
            self._ready.wait_for(lambda: self._items, timeout_s)

    def get(self) -> InboundPush | None:
        """The oldest waiting push, or None at once."""
        with self._ready:
            return self._items.popleft() if self._items else None


# -- trainer → loop ------------------------------------------------------------------------
class LoopPort(Protocol):
    """Where the replica hands what the network must carry out (the network implements it)."""

    def send_push(self, out: OutboundPush) -> None: ...

    def send_settle(self, settle: Settle) -> None:
        """Deliver ``settle`` until its peer answers or leaves the view; nothing comes back."""

    def start_pull(self, out: OutboundPull) -> None: ...

    def wake_at(self, at_s: float) -> None:
        """Call the replica's ``fire_due_timers`` at ``at_s`` (its clock), mid-step or not."""

    def hurry_pull(self, out: OutboundPull) -> None:
        """Start ``out`` now if it is still waiting for its ``at_s``."""

    def ask_peer(self, ask: AskPeer) -> None:
        """Ask the coordinator; answer exactly once with the replica's ``grant``."""

    def report_transfer(self, report: ReportTransfer) -> None:
        """Tell the coordinator (best effort: a lost report only delays its lease)."""


class Detached:
    """The port of a replica no network carries: every push and pull fails at once."""

    def __init__(self, events: EventQueue) -> None:
        self.events = events

    def send_push(self, out: OutboundPush) -> None:
        self.events.put(PushOutcome(out, (), "no network is attached to carry out pushes"))

    def send_settle(self, settle: Settle) -> None:
        """Nobody to tell: no push of this replica reached anyone."""

    def start_pull(self, out: OutboundPull) -> None:
        self.events.put(PullOutcome(out, None, "no network is attached to carry out pulls"))

    def wake_at(self, at_s: float) -> None:
        """Nothing to wake: timers fire at the caller's step boundaries."""

    def hurry_pull(self, out: OutboundPull) -> None:
        """Its pull failed already."""

    def ask_peer(self, ask: AskPeer) -> None:
        error = "no network is attached to reach a coordinator"
        self.events.put(Granted(PeerGranted(ask.round, None, 0.0, error)))

    def report_transfer(self, report: ReportTransfer) -> None:
        """Nobody to tell."""


# -- what the loop may use of a replica ---------------------------------------------------
class ReplicaLink(Protocol):
    """The replica as the event loop sees it (:class:`~gossipd.node.trainer.replica.Replica`
    implements it): queues to post to, futures answered on the trainer's thread, the
    published summary, and the model read only under :attr:`lock`."""

    flat: FlatModel
    inbox: Inbox
    summary: Summary
    training_done: bool
    clock: Callable[[], float]

    @property
    def lock(self) -> AbstractContextManager[object]: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def serves_one_pull(self) -> bool: ...
    def attach(self, port: LoopPort) -> None: ...
    def published(self) -> Summary: ...
    def post(
        self, event: PushOutcome | PullOutcome | ViewNotice | RestartNotice | Rejected
    ) -> None: ...
    def request_hand_off(
        self, peer: str | None
    ) -> concurrent.futures.Future[OutboundPush | None]: ...
    def request_receipts(
        self, peers: tuple[str, ...], sequences: int
    ) -> concurrent.futures.Future[dict[str, list[Receipts]]]: ...
    def barrier(self) -> concurrent.futures.Future[int]: ...
    def grant(self, granted: PeerGranted) -> None: ...
    def forget_settled(self, settled: SettleArrived) -> None: ...
    def fire_due_timers(self) -> None: ...
    def gauge(
        self, segment: int, values: torch.Tensor, each: Callable[[torch.Tensor], None] | None = None
    ) -> Gauge | None: ...
