"""Outbound pushes: deliver each one until it is answered, settle it exactly once.

A push's outcome is known when the receiver answers (acknowledged, or refused
before merging anything) and unknown when the connection breaks, a deadline
passes or nothing moves for ``gossip.progress_timeout_s``. Unknown outcomes are
retried with the same sequence, so the receiver's de-duplication turns a lost
acknowledgement into a DUPLICATE that commits. Only a refusal, or a receiver
declared dead, folds the weight back. A receiver that restarted is retried too:
the windows it restored from its checkpoint say whether its model holds the push.

A DUPLICATE answer for a segment this node had never sent before cannot be true:
the receiver's record of our pushes disagrees with ours. It is counted
(``gossipd_mass_inconsistencies_total``), logged at INFO, and treated as not
acknowledged, so the weight folds back instead of vanishing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from gossipd.node.errors import GossipdError, InvalidFrame, PeerUnreachable, StaleReference
from gossipd.node.net.dial.channels import RPC_TIMEOUT_S
from gossipd.node.net.dial.client import OutcomeUnknown, PartialPush
from gossipd.node.net.limits.cpu_budget import HOLD_POLL_S, CpuBudget
from gossipd.node.net.wire.lastwords import SEQUENCES_SAID, LastWords
from gossipd.node.shared.rejections import Throttle
from gossipd.node.shared.tls import NotAllowed
from gossipd.node.trainer.messages import Ack, OutboundPush, PushOutcome

if TYPE_CHECKING:
    import torch

    from gossipd.node.net.dial.channels import PeerChannels
    from gossipd.node.net.peers.health import PeerHealth
    from gossipd.node.net.peers.membership import PeerState
    from gossipd.node.net.telemetry.metrics import NodeMetrics
    from gossipd.node.net.wire.tasks import LoopTasks
    from gossipd.node.protocols.base import Receipts
    from gossipd.node.shared.config import GossipConfig
    from gossipd.node.trainer.messages import ReplicaLink

log = logging.getLogger(__name__)
INCONSISTENCY_LOG_EVERY_S = 60.0  # one INFO line per peer per minute, with the count since
MAX_HOLD_S = 5.0  # the longest a push waits for gossip's CPU budget
HAND_OFF_ROUNDS = 3  # hand-offs per leave: weight a late fold-back returns goes too


class Delivery(NamedTuple):
    """How a push ended: what the receiver acknowledged, and why the rest did not go.

    ``exact``: the acknowledgements are all the receiver can ever have merged (every
    failed attempt is known to have merged nothing), so the rest may go elsewhere.
    """

    acks: list[Ack]
    error: str | None
    exact: bool = True


@dataclass
class _Tries:
    """What the attempts of one push have established so far."""

    acked: list[Ack] = field(default_factory=list)  # final: never sent again
    sent: set[int] = field(default_factory=set)  # segments some attempt carried
    uncertain: bool = False  # some earlier attempt may yet be merged
    last_error: str = "no attempt made"
    incarnation: int | None = None  # the receiver's the last attempt was addressed to


class Outbound:
    def __init__(
        self,
        *,
        gossip: GossipConfig,
        shutdown_timeout_s: float,
        replica: ReplicaLink,
        budget: CpuBudget,
        health: PeerHealth,
        channels: PeerChannels,
        metrics: NodeMetrics,
        tasks: LoopTasks,
    ) -> None:
        """``health`` is told how each peer answered and names the live ones; ``tasks`` runs
        each push in a task the node keeps until it closes."""
        self.gossip = gossip
        self.shutdown_timeout_s = shutdown_timeout_s
        self.replica = replica
        self.budget = budget
        self.health = health
        self.membership = health.membership
        self.retries = health.retries
        self.channels = channels
        self.metrics = metrics
        self.tasks = tasks
        self.stopping = tasks.stopping
        self.rng = random.Random(gossip.seed ^ 0x5EED)
        self.leaving = False  # set by leave_mesh: only the hand-off leaves from then on
        self.mass_inconsistencies = 0
        self._inconsistency_log = Throttle(INCONSISTENCY_LOG_EVERY_S)
        self._stale_log = Throttle(INCONSISTENCY_LOG_EVERY_S)
        self._pushes: dict[str, set[asyncio.Future[Any]]] = {}  # peer -> its pushes' tasks
        self.last_words = LastWords()  # what peers that left said they merged of ours

    def start(self, out: OutboundPush) -> None:
        """Deliver ``out`` in a task of its own, kept under its peer until it settles."""
        peer = out.push.peer
        task = self.tasks.spawn(self.push(out), f"push:{peer}")
        self._pushes.setdefault(peer, set()).add(task)
        task.add_done_callback(lambda t: self._forget(peer, t))

    def _forget(self, peer: str, task: asyncio.Future[Any]) -> None:
        tasks = self._pushes.get(peer)
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._pushes[peer]

    async def push(self, out: OutboundPush) -> None:
        """Deliver one push; whatever ends it (outcome, error, cancellation) settles it once."""
        acks: list[Ack] = []
        error: str | None = "the node stopped before the push was acknowledged"
        started = time.monotonic()
        try:
            await self._within_budget()
            acks, error, _ = await self.deliver(out)
        finally:
            rebuilt = self._settle_copies(out, acks)
            self.replica.post(PushOutcome(out, tuple(acks), error, rebuilt))
            self.metrics.push_seconds.observe(time.monotonic() - started)

    def _settle_copies(self, out: OutboundPush, acks: list[Ack]) -> dict[int, torch.Tensor]:
        """Error feedback: the copies the receiver kept become ours, the rest are forgotten;
        per acknowledged segment, what the receiver merged in place of the snapshot."""
        feedback = self.channels.feedback
        if feedback is None:
            return {}
        peer, sequence = out.push.peer, out.push.sequence
        rebuilt = {}
        for ack in acks:
            values = feedback.rebuilt(peer, ack.segment, sequence)
            if values is not None:
                rebuilt[ack.segment] = values
        kept = {a.segment for a in acks if a.kept}
        feedback.settled(peer, sequence, kept, set(out.push.weights))
        return rebuilt

    def _stale_copies(self, peer: str, err: GossipdError) -> None:
        """The receiver lacked a copy a difference was taken from: send whole from now on."""
        errors = err.errors if isinstance(err, PartialPush) else [err]
        if self.channels.feedback is not None and any(
            isinstance(e, StaleReference) for e in errors
        ):
            self.channels.feedback.forget(peer)
            count = self._stale_log.admit(peer)
            if count is not None:
                log.info(
                    "%s did not hold the copy a difference was taken from (%d more times "
                    "since the last line): it forgot it, or a message in between was lost; "
                    "nothing merged, and this node sends it whole segments next. If it "
                    "repeats, raise gossip.feedback_peers on both to the number of peers "
                    "they exchange with",
                    peer,
                    count,
                )

    async def _within_budget(self) -> None:
        """Wait while gossip is in debt to its CPU share (``gossip.cpu_share``, see
        :meth:`CpuBudget.wait_s`), at most ``MAX_HOLD_S``. A leaving or stopping node
        never waits."""
        budget = self.budget
        started = time.monotonic()
        held_until = started + MAX_HOLD_S
        waited = False
        while not (self.leaving or self.stopping.is_set()):
            wait_s = min(budget.wait_s(), held_until - time.monotonic())
            if wait_s <= 0:
                break
            waited = True
            await asyncio.sleep(min(wait_s, HOLD_POLL_S))
        budget.released()
        if waited:
            budget.held()
            self.metrics.pushes_held.inc()
            self.metrics.push_held_seconds.inc(time.monotonic() - started)

    async def deliver(self, out: OutboundPush, kind: str = "push") -> Delivery:
        """Retry with the same sequence until the receiver answers or is declared dead.

        The receiver de-duplicates, so a retry after a lost acknowledgement is
        answered DUPLICATE and committed: folding the weight back while the
        receiver might have merged it would create mass. For the same reason a
        refusal (busy, leaving) settles the push only while every earlier attempt
        is known not to have merged; after an attempt with an unknown outcome,
        only an acknowledgement, a validation refusal, or the receiver's death
        does.
        """
        peer, gossip = out.push.peer, self.gossip
        if peer not in self.membership.peers:
            return Delivery([], f"peer {peer} left the view")
        nbytes = sum(t.numel() * t.element_size() for t in out.snapshot.values())
        delay_s = min(0.5, gossip.retry_max_s)
        tries = _Tries()
        while True:
            state = self.membership.peers.get(peer)
            if state is None:
                settled = self._by_last_word(out, tries)
                if settled is not None:
                    return settled
                return Delivery(
                    tries.acked,
                    f"{peer} was declared dead before acknowledging push "
                    f"#{out.push.sequence}; last attempt: {tries.last_error}",
                    exact=not tries.uncertain,
                )
            settled = await self._attempt(out, state, kind, nbytes, tries)
            if settled is not None:
                return settled
            self.metrics.messages.labels("sent", kind, "retry").inc()
            # While leaving, retry at once: a receiver that just came back answers
            # DUPLICATE for what it merged, and only an answer settles exactly.
            await self.retries.wait(0.1 if self.leaving else delay_s)
            if self.stopping.is_set():
                return Delivery(tries.acked, tries.last_error, exact=not tries.uncertain)
            delay_s = min(delay_s * 2, gossip.retry_max_s)

    async def _attempt(
        self, out: OutboundPush, state: PeerState, kind: str, nbytes: int, tries: _Tries
    ) -> Delivery | None:
        """One attempt at what is not yet acknowledged: the delivery that settles the
        push, or None to retry (``tries`` records what this attempt established).

        The push names the receiver's incarnation this node verified: a receiver that
        restarted since refuses it until this node has verified the new one, so an
        acknowledgement is never booked (``exchanged``) against the incarnation that
        did not give it, which a restarted site's audit reads."""
        peer, gossip = out.push.peer, self.gossip
        remaining = sorted(set(out.push.weights) - {a.segment for a in tries.acked})
        never_sent = set(remaining) - tries.sent
        tries.sent |= never_sent
        tries.incarnation = state.incarnation
        try:
            acks = await self.channels.client(state.address, peer).push(
                out, gossip.push_timeout_s, gossip.progress_timeout_s, remaining, state.incarnation
            )
            self.metrics.messages.labels("sent", kind, "ok").inc()
            self.metrics.bytes.labels("sent", kind, "ok").inc(nbytes)
            self.health.succeeded(peer)
            return Delivery(tries.acked + self._credible(out, acks, never_sent), None)
        except OutcomeUnknown as err:
            tries.last_error, tries.uncertain = str(err), True
            self.health.failed(peer, err)
        except PartialPush as err:
            self._stale_copies(peer, err)
            tries.acked += self._credible(out, err.acks, never_sent)
            tries.last_error = str(err)
            if any(isinstance(e, OutcomeUnknown) for e in err.errors):
                tries.uncertain = True
            elif not tries.uncertain or all(isinstance(e, InvalidFrame) for e in err.errors):
                return self._refused(tries, nbytes, err, kind)  # commit what merged
        except InvalidFrame as err:  # refused by validation, as any attempt would be
            return self._refused(tries, nbytes, err, kind)
        except GossipdError as err:
            self._stale_copies(peer, err)
            if isinstance(err, (NotAllowed, PeerUnreachable)):  # counts against the peer
                self.health.failed(peer, err)
            # Busy, not (yet) a verified peer, leaving, not reached: this attempt merged
            # nothing. That settles the push only if no earlier attempt is still
            # unaccounted for: one may sit in the receiver's inbox and be merged after all.
            if not tries.uncertain:
                return self._refused(tries, nbytes, err, kind)
            tries.last_error = str(err)
        return None

    def _by_last_word(self, out: OutboundPush, tries: _Tries) -> Delivery | None:
        """Settle a push whose receiver left before answering from what it said, in its
        Leave, it merged (:mod:`..wire.lastwords`); None when it said nothing that settles it."""
        push = out.push
        if not tries.uncertain or tries.incarnation is None:
            return None  # every attempt's outcome is known already
        word = self.last_words.of(push.peer, tries.incarnation)
        if word is None:
            return None
        assert self.channels.identity is not None
        pending = sorted(set(push.weights) - {a.segment for a in tries.acked})
        merged = word.merged(
            self.channels.identity.incarnation, push.sequence_base, push.sequence, pending
        )
        if merged is None:
            return None
        log.info(
            "push #%d to %s settled from what %s said it merged when it left: segments %s "
            "merged (committed), %s not (folded back)",
            push.sequence,
            push.peer,
            push.peer,
            merged,
            sorted(set(pending) - set(merged)),
        )
        # Its weight now is unknown (NaN: the weight balance hears nothing of it).
        acks = [Ack(segment, duplicate=True, receiver_weight=math.nan) for segment in merged]
        return Delivery(tries.acked + acks, f"{push.peer} left before answering", exact=True)

    def _credible(self, out: OutboundPush, acks: list[Ack], never_sent: set[int]) -> list[Ack]:
        """``acks`` less DUPLICATE answers for segments no earlier attempt carried."""
        false = sorted(a.segment for a in acks if a.duplicate and a.segment in never_sent)
        if not false:
            return acks
        self.mass_inconsistencies += 1
        self.metrics.mass_inconsistencies.labels("duplicate_never_sent").inc()
        peer = out.push.peer
        count = self._inconsistency_log.admit(peer)
        if count is not None:
            log.info(
                "%s answered DUPLICATE for segments %s of push #%d, which this node had never "
                "sent it (%d more such answers since the last line): its record of our pushes "
                "disagrees with ours, after a restore from a checkpoint or from a lying peer. "
                "Kept as not acknowledged, so the weight folds back here instead of vanishing; "
                "if it repeats, check that every site runs the same gossipd release",
                peer,
                false,
                out.push.sequence,
                count,
            )
        return [a for a in acks if a.segment not in false]

    def _refused(self, tries: _Tries, nbytes: int, err: GossipdError, kind: str) -> Delivery:
        self.metrics.messages.labels("sent", kind, "failed").inc()
        self.metrics.bytes.labels("sent", kind, "failed").inc(nbytes)
        return Delivery(tries.acked, str(err), exact=not tries.uncertain)

    async def settle_pushes_to(self, peer: str, timeout_s: float) -> None:
        """Retry the pushes to ``peer`` at once and wait (bounded) for them to settle."""
        pending = set(self._pushes.get(peer, ()))
        if pending:
            self.retry_now()
            await asyncio.wait(pending, timeout=timeout_s)

    def retry_now(self) -> None:
        """Cut short the waits between retries (a peer came back, or this node leaves)."""
        self.retries.fire()

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
        self.leaving = True
        self.retry_now()
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
        peer_of = {task: peer for peer, tasks in self._pushes.items() for task in tasks}
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
                delivery = await self.deliver(out, "handoff")
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
