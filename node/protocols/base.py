"""The interface every gossip protocol core implements: events in, actions out.

A core is a sans-IO state machine (docs/design.md §2). It never touches sockets,
threads, clocks or torch: the driver (the daemon's replica, or the simulator)
tells it what happened with one :meth:`GossipProtocol.handle` call per event
and carries out the actions it returns. Events and actions are plain frozen
data, so a driver can log, replay or reorder them in tests.

What a driver promises:

* ``PayloadArrived`` is a *question*: the core answers with the merges it would
  do (or raises :class:`Refused`) and changes nothing. The driver computes every
  blend, checks it, and only then reports ``PayloadMerged`` for the same payload
  with no other event in between, so a payload merges whole or not at all.
* Every ``Push`` a core returns is answered by exactly one ``PushSettled`` (with
  the segments the receiver acknowledged, possibly none), whatever happens to it.
* ``StartTimer`` is answered by ``TimerFired`` at or after ``at_s`` (same clock as
  ``StepEnded.time_s``); ``Pull`` by ``PullArrived`` or ``PullFailed``.
* A ``Pull`` with ``merge_at_step`` is held until the boundary that ends that step
  (one that lands earlier waits there); if it has not landed by then, the trainer
  waits at that boundary until it merges or fails, and the wait is measured. The
  core sees ``PullArrived`` at that boundary, before ``StepEnded`` of the step.
* ``AskPeer`` is answered by exactly one ``PeerGranted`` (a peer, none free, or an
  error when no coordinator can answer); ``ReportTransfer`` by nothing.
* ``ViewChanged`` carries the whole current view of live members (this node
  included), so a core that ranks nodes needs no bookkeeping of ups and downs.
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar


class Refused(ValueError):
    """A payload the core will not merge; nothing was changed."""


class WeightCapExceeded(Refused):
    """A payload whose merge would lift a sum-weight over the cap; nothing was changed."""


# -- events ---------------------------------------------------------------------------
@dataclass(frozen=True)
class StepEnded:
    """The local optimizer finished step ``step`` at ``time_s`` (driver's clock, seconds)."""

    step: int
    time_s: float


@dataclass(frozen=True)
class TrainingEnded:
    """No more local steps will come; the node keeps merging until it leaves."""

    step: int
    time_s: float


@dataclass(frozen=True)
class ViewChanged:
    """The live members of the mesh as this node sees them, itself included.

    A simulator hands the same frozenset to thousands of cores; they keep it
    instead of copying it, and rank it once through :func:`ranked`.
    """

    members: frozenset[str]


@dataclass(frozen=True)
class PeerRestarted:
    """``peer`` came back as ``incarnation``, from a checkpoint or from nothing: what it
    remembers of earlier pushes is whatever its checkpoint held, no more."""

    peer: str
    incarnation: int


@dataclass(frozen=True)
class PayloadArrived:
    """A push from ``sender``: what would merging it do? (No state changes.)"""

    sender: str
    incarnation: int
    sequence: int
    round: int
    weights: Mapping[int, float]
    sequence_base: int = 1  # the sender's numbering this sequence belongs to (Push)


@dataclass(frozen=True)
class PayloadMerged:
    """The driver applied every ``Merge`` the core proposed for ``payload``: commit it."""

    payload: PayloadArrived


@dataclass(frozen=True)
class PushSettled:
    """A push ended: the receiver acknowledged ``acked`` segments; the rest comes home.
    ``receiver_weights``: the receiver's weight of each acknowledged segment after it
    merged, as its acknowledgement reports it (NaN: not reported; empty: none)."""

    peer: str
    sequence: int
    acked: tuple[int, ...] = ()
    receiver_weights: tuple[float, ...] = ()


@dataclass(frozen=True)
class HandOff:
    """This node leaves: hand all its weight to ``peer`` (or one the core picks)."""

    peer: str | None = None


@dataclass(frozen=True)
class TimerFired:
    tag: str
    time_s: float


@dataclass(frozen=True)
class PullArrived:
    """A pulled model from ``peer``: what would merging it do? (No state changes.)

    ``nbytes`` and ``transfer_s`` (from the pull's start to its last byte, driver's
    clock) are what a scheduling protocol learns link times from.
    """

    peer: str
    round: int
    weights: Mapping[int, float]
    nbytes: int = 0
    transfer_s: float = 0.0


@dataclass(frozen=True)
class PullMerged:
    """The driver applied every ``Merge`` proposed for ``pull``."""

    pull: PullArrived


@dataclass(frozen=True)
class PullFailed:
    peer: str
    round: int
    error: str


@dataclass(frozen=True)
class PeerGranted:
    """The coordinator's answer to ``AskPeer``: pull from ``peer`` starting at ``start_s``
    (driver's clock); ``peer`` None means none is free now (ask again), unless ``error``
    says no coordinator could answer (schedule without it)."""

    round: int
    peer: str | None
    start_s: float = 0.0
    error: str | None = None


Event = (
    StepEnded
    | TrainingEnded
    | ViewChanged
    | PeerRestarted
    | PayloadArrived
    | PayloadMerged
    | PushSettled
    | HandOff
    | TimerFired
    | PullArrived
    | PullMerged
    | PullFailed
    | PeerGranted
)


# -- actions --------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Push:
    """Snapshot these segments now and send them, with these sum-weights, to ``peer``.

    Slotted, and its key made once: every push of a simulated round is in flight at once,
    keyed in three books, and a key tuple made per lookup cost a million-node run a
    tuple per book."""

    peer: str
    sequence: int
    weights: Mapping[int, float]
    round: int = 0
    # The first sequence of the numbering this push belongs to. A sender starts a new
    # numbering (base = its next sequence) when the receiver restarts or leaves its view;
    # the receiver keeps one de-duplication window per numbering, so the windows it
    # restored from a checkpoint answer only for the pushes they saw.
    sequence_base: int = 1
    # Sequences to one receiver never repeat, so a push is known by (peer, sequence).
    key: tuple[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.peer, self.sequence))


@dataclass(frozen=True)
class Merge:
    """x ← (1 − alpha)·x + alpha·x_received on ``segment``; the weight becomes ``weight_after``.

    ``cut``: the part of the payload's weight that did not fit under the weight cap
    (:mod:`.weight_cap`), received and gone; the payload brought ``weight_after`` less the
    weight before, plus ``cut``."""

    segment: int
    alpha: float
    weight_after: float
    cut: float = 0.0


@dataclass(frozen=True)
class Duplicate:
    """Merged before: acknowledge again, change nothing."""

    segment: int


@dataclass(frozen=True)
class FoldBack:
    """A push's unacknowledged ``segment`` comes home: x ← (1 − alpha)·x + alpha·x_sent."""

    peer: str
    sequence: int
    segment: int
    alpha: float


@dataclass(frozen=True)
class Pull:
    """Fetch ``segments`` of ``peer``'s model, starting at ``at_s`` (driver's clock).

    With ``merge_at_step`` the model merges at the boundary that ends that step, not
    earlier, and the trainer waits there for it (scheduled overlap: the pull is timed
    to land as the period's steps end).
    """

    peer: str
    round: int
    segments: tuple[int, ...]
    at_s: float
    merge_at_step: int | None = None


@dataclass(frozen=True)
class AskPeer:
    """Ask the mesh's coordinator which peer to pull from, and when, for a period that
    ends at ``end_s`` (driver's clock)."""

    round: int
    end_s: float


@dataclass(frozen=True)
class ReportTransfer:
    """Tell the coordinator a pull it granted from ``peer`` took ``transfer_s`` (inf: it
    failed), so the peer is free again and the pair's estimate learns."""

    peer: str
    transfer_s: float


@dataclass(frozen=True)
class StartTimer:
    at_s: float
    tag: str


@dataclass(frozen=True)
class OuterStep:
    """A burst of averaging ended: apply the protocol's outer optimizer to the whole model
    (:mod:`gossipd.node.model.outer`), then train on from what it gives."""

    round: int
    learning_rate: float
    momentum: float


Action = (
    Push | Merge | Duplicate | FoldBack | Pull | StartTimer | AskPeer | ReportTransfer | OuterStep
)


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
    extra: Mapping[str, Any] = field(default_factory=dict)
    # Weight exchanged with each peer (summed over segments), for operators and audits.
    exchanged: Mapping[str, PeerMass] = field(default_factory=dict)

    # What a driver may read from ``extra``, each with its default for a core that does not
    # set it; the other keys of ``extra`` are shown to operators as they are.
    @property
    def sinks(self) -> frozenset[str]:
        """Peers suspected of sinking weight (``extra["sinks"]``): no pushes to them."""
        return frozenset(self.extra.get(EXTRA_SINKS, ()))

    def spread_over_available(self, segment: int, weight: float) -> float | None:
        """``weight`` over what ``segment`` holds outside its pushes in flight: the factor
        that puts ``weight``'s worth of change into the model (a lossy codec's dropped
        difference, kept at home); None where the core keeps no weights or holds none."""
        if segment >= len(self.weights):
            return None
        available = self.weights[segment] - self.reserved[segment]
        return weight / available if available > 0 else None

    @property
    def weight_cap(self) -> float:
        """The most sum-weight a segment may hold after a merge (``extra["weight_cap"]``)."""
        return float(self.extra.get(EXTRA_WEIGHT_CAP, math.inf))

    @property
    def weight_cut(self) -> float:
        """Sum-weight received that did not fit under the weight cap since start, summed
        over segments (``extra["weight_cut"]``): merged payloads' weight that is gone."""
        return float(self.extra.get(EXTRA_WEIGHT_CUT, 0.0))

    @property
    def balance_factors(self) -> tuple[float, ...]:
        """Per segment, the weight balance's factor on what a push carries
        (``extra["balance"]``); empty where the core keeps no weights or it is off."""
        return tuple(self.extra.get(EXTRA_BALANCE, ()))

    @property
    def scheduling(self) -> str:
        """Who picks this node's pulls: ``coordinator``, ``decentralized``, or "" for a core
        that does not pull (``extra["scheduling"]``)."""
        return str(self.extra.get(EXTRA_SCHEDULING, ""))

    @property
    def pulls(self) -> Mapping[str, int]:
        """A pulling core's pulls by outcome since start (``extra["pulls"]``); empty otherwise."""
        return dict(self.extra.get(EXTRA_PULLS, {}))


# The keys of CoreStatus.extra that drivers read (through the properties above).
EXTRA_SINKS = "sinks"
EXTRA_WEIGHT_CAP = "weight_cap"
EXTRA_WEIGHT_CUT = "weight_cut"
EXTRA_BALANCE = "balance"
EXTRA_SCHEDULING = "scheduling"
EXTRA_PULLS = "pulls"


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


class GossipProtocol(ABC):
    """One node's protocol state. Subclasses live one per file, each naming its paper.

    A driver reads a core through this class only: :meth:`handle`, :meth:`status`,
    :meth:`state_dict`, :meth:`load_state_dict` and the class attributes below, each
    with its default here. A new protocol that needs a driver to treat it differently
    declares the attribute here first, so every driver and test double sees it.
    """

    # The protocol's name in configs and the registry (``gossip.protocol``).
    name: ClassVar[str]
    # Sum-weights whose total the mesh conserves (the push protocols); False for a core
    # that only averages with pulled models: its status has no weights to check.
    keeps_weights: ClassVar[bool] = True
    # True: a node serves one protocol pull (``round`` > 0) at a time and answers a second
    # concurrent one with a failure, so that nodes scheduling alone that pick the same peer
    # hear at once that it is busy and pick another (docs/design.md §5). A join's bootstrap
    # pull (round 0) is always served. False: pulls are served concurrently.
    serves_one_pull: ClassVar[bool] = False

    @abstractmethod
    def handle(self, event: Event) -> list[Action]:
        """Apply one event; return what the driver must do. Raises ``Refused`` for payloads."""

    @abstractmethod
    def status(self) -> CoreStatus: ...

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (plain Python data: checkpoints pickle it)."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def receipts(self, sender: str, sequences: int | None = None) -> list[Receipts]:
        """What this node merged of ``sender``'s pushes, one entry per numbering kept
        (none for a core that keeps no de-duplication windows); ``sequences``: only each
        numbering's newest that many, the older ones said forgotten."""
        return []


# -- ranks and shared seeds --------------------------------------------------------------
@dataclass(frozen=True)
class View:
    """Members ranked by sorted node id; ``epoch`` names the view, equal wherever views are."""

    members: tuple[str, ...]
    rank_of: Mapping[str, int]
    epoch: int


class PeerSet(AbstractSet[str]):
    """A view's members but one node: read through the view, not copied from it.

    A core's peers are asked for at every status; a copy costs O(members), and at
    20,000 simulated nodes checking the invariants (a status of every node at every
    probe) took minutes. Compares, hashes and combines as a frozenset does."""

    __slots__ = ("_me", "_view")

    def __init__(self, view: View, me: str) -> None:
        self._view = view
        self._me = me

    def __contains__(self, peer: object) -> bool:
        return peer != self._me and peer in self._view.rank_of

    def __iter__(self) -> Iterator[str]:
        return (m for m in self._view.members if m != self._me)

    def __len__(self) -> int:
        return len(self._view.members) - (self._me in self._view.rank_of)

    def __repr__(self) -> str:
        return f"PeerSet({sorted(self)!r})"

    __hash__ = AbstractSet._hash

    @classmethod
    def _from_iterable(cls, it: Iterable[str]) -> frozenset[str]:
        return frozenset(it)


@lru_cache(maxsize=64)
def ranked(members: frozenset[str]) -> View:
    """Cached: a simulator's thousands of nodes share one view object per membership."""
    ordered = tuple(sorted(members))
    digest = hashlib.blake2b("\n".join(ordered).encode(), digest_size=6).digest()
    return View(ordered, {m: i for i, m in enumerate(ordered)}, int.from_bytes(digest, "big"))


def shared_seed(*parts: int | str) -> int:
    """A 64-bit seed every node derives alike from the same parts, with no shared RNG state."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")
