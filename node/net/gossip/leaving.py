"""A node's leaving of the mesh: settle the pushes in flight, hand all weight to live
peers, and tell every peer, with what this node merged of its pushes.

The pushes themselves go as any other (:mod:`.outbound`): a hand-off is a push whose
outcome settles exactly, and :meth:`Outbound.begin_leaving` makes every push in flight
retry at once instead of waiting for the CPU budget.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import TYPE_CHECKING

from gossipd.node.net.dial.channels import RPC_TIMEOUT_S
from gossipd.node.net.gossip.outbound import Delivery
from gossipd.node.net.wire.lastwords import SEQUENCES_SAID
from gossipd.node.trainer.messages import PushOutcome

if TYPE_CHECKING:
    from gossipd.node.net.dial.channels import PeerChannels
    from gossipd.node.net.gossip.outbound import Outbound
    from gossipd.node.net.peers.membership import Membership
    from gossipd.node.protocols.base import Receipts
    from gossipd.node.shared.config import GossipConfig
    from gossipd.node.trainer.messages import ReplicaLink

# The hand-off's lines go out under the pushes' logger, where an operator following a
# leave's pushes already reads them.
log = logging.getLogger("gossipd.node.net.gossip.outbound")
HAND_OFF_ROUNDS = 3  # hand-offs per leave: weight a late fold-back returns goes too


class Leaver:
    """Leaves the mesh once, for a node whose trainer stopped stepping."""

    def __init__(
        self,
        *,
        outbound: Outbound,
        replica: ReplicaLink,
        membership: Membership,
        channels: PeerChannels,
        gossip: GossipConfig,
        shutdown_timeout_s: float,
    ) -> None:
        """``outbound`` delivers the hand-offs and holds the pushes still in flight;
        ``membership`` names the live peers the weight may go to; ``shutdown_timeout_s``
        bounds the whole leave."""
        self.outbound = outbound
        self.replica = replica
        self.membership = membership
        self.channels = channels
        self.gossip = gossip
        self.shutdown_timeout_s = shutdown_timeout_s
        self.rng = random.Random(gossip.seed ^ 0x5EED)

    async def leave_mesh(self) -> None:
        """Refuse new work, settle pushes, hand all weight to a live peer, tell every peer.

        Call once the replica's thread stopped stepping but still drives it
        (``Replica.idle_until``): parameters are only written there. Unacknowledged
        pushes are retried at once, so a receiver that came back settles them
        exactly. After ``settle_s``, pushes whose receiver is not live (hung or
        gone) are cancelled and folded back, so their weight leaves with the
        hand-off; pushes to a live but slow receiver (one that just resumed, say)
        get up to half the shutdown budget. If a receiver had merged a push
        cancelled here, that push's weight is counted twice (the bound in the
        sum-weight core's docstring).
        """
        # Whatever the core still wants to send (a timer, a last round) is folded back
        # at once (port.NetworkPort): only the hand-off below leaves this node now.
        self.outbound.begin_leaving()
        slow_peers = await self._settle_or_cancel()
        # Every parameter write stays on the replica's own thread: these requests run
        # there, after the outcomes the cancelled pushes just posted.
        heirs = self._heirs(slow_peers)
        # Weight can come back after a hand-off: a push the core made meanwhile (a timer,
        # a deferred push) folds back once its outcome lands. Hand off what came back too.
        for _ in range(HAND_OFF_ROUNDS):
            await self._until_no_push_outstanding(self.shutdown_timeout_s / 4)
            if not any(self.replica.summary.weights) or not await self._hand_off(heirs):
                break
        # Suspected peers too: a peer whose pushes to this node failed of late is the one
        # most likely to hold a push it does not know was merged (tried in parallel, so
        # an unreachable one costs no more than the live ones' deadline).
        peers = self.membership.live() + self.membership.suspected()
        receipts = await self._receipts(tuple(s.node_id for s in peers))
        clients = [self.channels.client(s.address, s.node_id) for s in peers]
        results = await asyncio.gather(
            *(
                c.leave(RPC_TIMEOUT_S, receipts.get(s.node_id, ()))
                for c, s in zip(clients, peers, strict=True)
            ),
            return_exceptions=True,
        )
        for client, result in zip(clients, results, strict=True):
            if isinstance(result, BaseException):
                log.debug("Leave to %s failed: %s", client.address, result)

    async def _receipts(self, peers: tuple[str, ...]) -> dict[str, list[Receipts]]:
        """What this node merged of each peer's pushes, to send it with the Leave (none if
        the trainer's thread does not answer in time: the peers then settle as before)."""
        try:
            return await asyncio.wait_for(
                asyncio.wrap_future(self.replica.request_receipts(peers, SEQUENCES_SAID)),
                RPC_TIMEOUT_S,
            )
        except TimeoutError:
            log.warning(
                "leaving without telling peers which of their pushes this node merged (the "
                "trainer's thread did not answer within %.0f s): a push whose answer was lost "
                "folds back at its sender, which counts its weight twice",
                RPC_TIMEOUT_S,
            )
            return {}

    async def _settle_or_cancel(self) -> set[str]:
        """Let pushes in flight settle; cancel those to peers gone or too slow, which fold
        back. Returns the peers whose pushes stalled."""
        budget_s = self.shutdown_timeout_s
        settle_s = min(self.gossip.progress_timeout_s + 1.0, budget_s / 3)
        peer_of = self.outbound.in_flight()
        pending = set(peer_of)
        slow_peers: set[str] = set()
        if pending:
            _, pending = await asyncio.wait(pending, timeout=settle_s)
            live = {p.node_id for p in self.membership.live()}
            stalled = {t for t in pending if peer_of[t] not in live}
            if pending - stalled:
                _, slow = await asyncio.wait(pending - stalled, timeout=budget_s / 2 - settle_s)
                stalled |= slow
            for task in stalled:
                task.cancel()
                slow_peers.add(peer_of[task])
            await asyncio.gather(*stalled, return_exceptions=True)
        return slow_peers

    async def _until_no_push_outstanding(self, within_s: float) -> None:
        """Wait until every push the core made has settled on the replica's thread.

        A timer can fire between the settle and the hand-off: its push reserves weight,
        and its fold-back (at once, since this node is leaving) reaches the replica a
        moment later. Handing off before that fold-back lands would hand off only the
        rest and leave the reserved weight stranded here in the final checkpoint.
        """
        deadline = asyncio.get_running_loop().time() + within_s
        while outstanding := await asyncio.wrap_future(self.replica.barrier()):
            if asyncio.get_running_loop().time() >= deadline:
                log.warning(
                    "leaving with %d push(es) still unsettled after %.1f s: the weight they "
                    "carry stays in this node's final checkpoint instead of being handed off",
                    outstanding,
                    within_s,
                )
                return

    def _heirs(self, slow_peers: set[str]) -> list[str]:
        """Whom to hand the weight to, best first.

        A peer that answers: one that did not just stall a push and has no failure on
        record, then the others by fewest failures on record. A hand-off cut off by the
        shutdown deadline has an unknown outcome, and folding it back while the receiver
        merged it makes mass, so a slow receiver is the last choice. Ties are shuffled
        (seeded), so leavers do not all pick the same heir.
        """
        live = sorted(
            (s for s in self.membership.live() if s.node_id in self.replica.summary.peers),
            key=lambda s: s.node_id,
        )
        self.rng.shuffle(live)
        live.sort(key=lambda s: (s.node_id in slow_peers, s.failures))  # stable: ties shuffled
        return [s.node_id for s in live]

    async def _hand_off(self, candidates: list[str]) -> bool:
        """Hand all weight to the candidates in turn; True once none is left here.

        Each takes what its credit admits (``limits.peer_credit``: a peer may bring at
        most what it took plus its credit and a founding member's weight), so a site
        holding more than one peer admits hands the rest to the next. A hand-off that
        surely merged nothing (the peer died since it was last heard from, or answered
        that it is leaving too, as when a whole mesh stops at once) goes to the next
        candidate; one that may have merged ends the tries.
        """
        replica = self.replica
        for peer in candidates:
            if not any(replica.summary.weights):
                return True
            out = await asyncio.wrap_future(replica.request_hand_off(peer))
            if out is None:
                continue  # its credit admits none of it
            delivery = Delivery([], "leaving took too long", exact=False)
            try:
                delivery = await self.outbound.deliver(out, "handoff")
            finally:
                replica.post(PushOutcome(out, tuple(delivery.acks), delivery.error))
            await asyncio.wrap_future(replica.barrier())
            took = len(delivery.acks)
            if delivery.error is None and took == len(out.push.weights):
                log.info(
                    "handed weight to %s (sum-weight %s)",
                    out.push.peer,
                    ", ".join(f"{w:.6g}" for w in out.push.weights.values()),
                )
                continue
            if delivery.error is None:
                # Answered without merging (it is leaving too): exact, so the weight folded
                # back here and may go to the next candidate.
                log.info(
                    "%s took %d of %d segments of the weight hand-off (it is leaving too); "
                    "the rest goes to the next live peer",
                    out.push.peer,
                    took,
                    len(out.push.weights),
                )
                continue
            log.warning("weight hand-off to %s failed: %s", out.push.peer, delivery.error)
            if not delivery.exact:
                return False
        if not any(replica.summary.weights):
            return True
        if candidates:
            log.info(
                "no live peer took the rest of the weight (%s): it stays in this node's final "
                "checkpoint, and comes back to the mesh when this node restarts",
                ", ".join(f"{w:.6g}" for w in replica.summary.weights),
            )
        return False


def warn_unfinished(err: Exception, shutdown_timeout_s: float) -> None:
    """What an operator reads when a stop gave up on its hand-offs: what became of the
    weight, and the setting that gives the peers longer."""
    why = "it timed out" if isinstance(err, TimeoutError) else str(err)
    log.warning(
        "leaving the mesh did not complete (%s): the weight not handed off stays with "
        "this site and returns to the mesh only if the site restarts from its checkpoint; "
        "give slow peers longer with shutdown_timeout_s (now %g s)",
        why,
        shutdown_timeout_s,
    )
