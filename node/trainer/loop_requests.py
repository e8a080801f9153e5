"""What the event loop and its worker threads ask of the replica, from their own threads:
queue an event for the trainer, ask for a hand-off, receipts or a barrier (each answered
on the trainer's thread through a future), gauge a received segment, and fire due timers
or apply the coordinator's grant at once, mid-step.

The third part of :class:`~gossipd.node.trainer.replica.Replica`, beside
:class:`~gossipd.node.trainer.arrivals.Arrivals` (what it applies of these on the trainer
thread) and the replica itself (steps and the core): none of these writes a parameter,
and the only state they touch is the bounded event queue and, under the core's lock,
the core.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from gossipd.node.protocols.base import GossipProtocol, PeerGranted, Receipts, SettleArrived
from gossipd.node.trainer.messages import (
    Barrier,
    EventQueue,
    HandOffRequest,
    OutboundPush,
    PullOutcome,
    PushOutcome,
    ReceiptsRequest,
    Rejected,
    RestartNotice,
    ViewNotice,
)

if TYPE_CHECKING:
    import torch

    from gossipd.node.model.payload_bound import Gauge, PayloadBound
    from gossipd.node.model.segments import FlatModel
    from gossipd.node.trainer.dispatch import Dispatcher


class LoopRequests:
    """What the loop calls on the replica; mixed into the replica, whose state it uses."""

    core: GossipProtocol
    flat: FlatModel
    bound: PayloadBound
    dispatch: Dispatcher
    events: EventQueue
    core_lock: threading.RLock
    clock: Callable[[], float]

    def post(
        self,
        event: PushOutcome | PullOutcome | ViewNotice | RestartNotice | Rejected,
    ) -> None:
        """Queue ``event`` for the trainer's next step boundary (never blocks)."""
        self.events.put(event)

    def request_hand_off(self, peer: str | None) -> concurrent.futures.Future[OutboundPush | None]:
        """The push handing all weight to ``peer``, made on the trainer's thread."""
        reply: concurrent.futures.Future[OutboundPush | None] = concurrent.futures.Future()
        self.events.put(HandOffRequest(peer, reply))
        return reply

    def request_receipts(
        self, peers: tuple[str, ...], sequences: int
    ) -> concurrent.futures.Future[dict[str, list[Receipts]]]:
        """What this node merged of each peer's pushes (each numbering's newest
        ``sequences``), read on the trainer's thread."""
        reply: concurrent.futures.Future[dict[str, list[Receipts]]] = concurrent.futures.Future()
        self.events.put(ReceiptsRequest(peers, sequences, reply))
        return reply

    def barrier(self) -> concurrent.futures.Future[int]:
        """Resolves once every event queued before it was applied on the trainer's thread,
        with how many of this node's pushes were still outstanding then."""
        reply: concurrent.futures.Future[int] = concurrent.futures.Future()
        self.events.put(Barrier(reply))
        return reply

    def gauge(
        self,
        segment: int,
        values: torch.Tensor,
        each: Callable[[torch.Tensor], None] | None = None,
    ) -> Gauge | None:
        """A received segment's norms against ours (:meth:`PayloadBound.gauge`); called by
        the network's receiving workers, without the lock: the numbers feed a bound, not
        the blend, which is computed at merge time."""
        return self.bound.gauge(self.flat.buffers[segment], values, each)

    # -- called from a worker thread of the loop -------------------------------------
    def fire_due_timers(self) -> None:
        """Fire the timers that came due, now, even while the trainer is inside a step.

        Only the core is touched (under :attr:`core_lock`): a ``Pull`` it asks for
        starts at once and a new timer is scheduled, while a ``Push`` waits for the
        step boundary, where its snapshot is taken before anything merges.
        """
        with self.core_lock:
            self.dispatch.fire_due(self.clock(), mid_step=True)

    def forget_settled(self, settled: SettleArrived) -> None:
        """A sender closed its numbering towards this node: forget its window, at once, even
        mid-step (only the core is touched). Not through the inbox: a settle waiting there
        for a step boundary held a slot a push needed."""
        with self.core_lock:
            self.dispatch.carry_out(self.core.handle(settled), mid_step=True)

    def grant(self, granted: PeerGranted) -> None:
        """The coordinator's answer to the core's ``AskPeer``, applied at once, even
        mid-step (like a timer: only the core is touched)."""
        with self.core_lock:
            self.dispatch.carry_out(self.core.handle(granted), mid_step=True)
