"""The events a driver hands a core, one :meth:`~.base.GossipProtocol.handle` call each.

Plain frozen data, so a driver can log, replay or reorder them in tests; what a driver
promises about their order is in :mod:`.base`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


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
    instead of copying it, and rank it once through :func:`ranked`. ``relayed``: the
    members reached only through a relay (docs/nat.md), a slower link than a direct one.
    """

    members: frozenset[str]
    relayed: frozenset[str] = frozenset()


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
    settled: int = 0  # what of that numbering the sender settled before this push (Push)


@dataclass(frozen=True)
class SettleArrived:
    """``sender`` (as ``incarnation``) closed its numbering ``sequence_base`` towards this
    node, every push of it up to ``up_to`` settled (a ``Settle``): forget its window."""

    sender: str
    incarnation: int
    sequence_base: int
    up_to: int


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
    | SettleArrived
    | PayloadMerged
    | PushSettled
    | HandOff
    | TimerFired
    | PullArrived
    | PullMerged
    | PullFailed
    | PeerGranted
)
