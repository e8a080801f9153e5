"""The interface every gossip protocol core implements: events in, actions out.

A core is a sans-IO state machine (docs/design.md §2). It never touches sockets,
threads, clocks or torch: the driver (the daemon's replica, or the simulator)
tells it what happened with one :meth:`GossipProtocol.handle` call per event
and carries out the actions it returns. Events (:mod:`.events`) and actions
(:mod:`.actions`) are plain frozen data, so a driver can log, replay or reorder them
in tests; a core's status is :mod:`.status`, its view of the members :mod:`.views`.

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

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from gossipd.node.protocols.actions import (
    Action,
    AskPeer,
    Duplicate,
    FoldBack,
    Merge,
    OuterStep,
    Pull,
    Push,
    ReportTransfer,
    Settle,
    StartTimer,
)
from gossipd.node.protocols.events import (
    Event,
    HandOff,
    PayloadArrived,
    PayloadMerged,
    PeerGranted,
    PeerRestarted,
    PullArrived,
    PullFailed,
    PullMerged,
    PushSettled,
    SettleArrived,
    StepEnded,
    TimerFired,
    TrainingEnded,
    ViewChanged,
)
from gossipd.node.protocols.status import CoreStatus, PeerMass, Receipts
from gossipd.node.protocols.views import PeerSet, View, ranked, shared_seed

# The events, actions, status and views are in their own modules; they are named here too,
# the one place drivers and cores import the interface from.
__all__ = [
    "Action",
    "AskPeer",
    "CoreStatus",
    "Duplicate",
    "Event",
    "FoldBack",
    "GossipProtocol",
    "HandOff",
    "Merge",
    "OuterStep",
    "PayloadArrived",
    "PayloadMerged",
    "PeerGranted",
    "PeerMass",
    "PeerRestarted",
    "PeerSet",
    "Pull",
    "PullArrived",
    "PullFailed",
    "PullMerged",
    "Push",
    "PushSettled",
    "Receipts",
    "Refused",
    "ReportTransfer",
    "Settle",
    "SettleArrived",
    "StartTimer",
    "StepEnded",
    "TimerFired",
    "TrainingEnded",
    "View",
    "ViewChanged",
    "WeightCapExceeded",
    "ranked",
    "shared_seed",
]


class Refused(ValueError):
    """A payload the core will not merge; nothing was changed."""


class WeightCapExceeded(Refused):
    """A payload whose merge would lift a sum-weight over the cap; nothing was changed."""


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

    def segment_weights(self) -> Sequence[float]:
        """The sum-weight of each segment as held now, read in place (empty for a core that
        keeps none): a simulator reads them at every push and probe, where a whole
        :meth:`status` per read would cost more than the simulated step."""
        return ()

    def hears_receiver_weights(self) -> bool:
        """Whether this core's pushes want their receivers' weights reported back in the
        acknowledgements (its weight balance learns from them); a driver that knows it
        does not spares every push that report."""
        return False
