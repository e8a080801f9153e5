"""The actions a core returns for its driver to carry out.

Plain frozen data, like the events (:mod:`.events`); what answers each is in :mod:`.base`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


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
    # The highest sequence of this numbering whose push ``peer`` acknowledged before this
    # one went (0: none): the receiver forgets those, as it would on a ``Settle``.
    settled: int = 0
    # Sequences to one receiver never repeat, so a push is known by (peer, sequence).
    key: tuple[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.peer, self.sequence))


@dataclass(frozen=True, slots=True)
class Settle:
    """Tell ``peer`` that this node's numbering ``sequence_base`` towards it is closed, every
    push of it up to ``up_to`` settled: it forgets that numbering's de-duplication window.

    Idempotent and weightless: the driver delivers it on its own, retrying until ``peer``
    answers or leaves the view, and nothing comes back to the core (which has forgotten
    the numbering already: its next push to ``peer`` opens a new one). A lost settle
    leaves ``peer`` a window it no longer needs, never weight."""

    peer: str
    sequence_base: int
    up_to: int


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
    Push
    | Settle
    | Merge
    | Duplicate
    | FoldBack
    | Pull
    | StartTimer
    | AskPeer
    | ReportTransfer
    | OuterStep
)
