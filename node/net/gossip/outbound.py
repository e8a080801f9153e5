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
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from gossipd.node.errors import GossipdError, InvalidFrame, PeerUnreachable, StaleReference
from gossipd.node.net.dial.client import OutcomeUnknown, PartialPush
from gossipd.node.net.limits.cpu_budget import HOLD_POLL_S, CpuBudget
from gossipd.node.net.wire.lastwords import LastWords
from gossipd.node.protocols.base import Push, Settle
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
    from gossipd.node.shared.config import GossipConfig
    from gossipd.node.trainer.messages import ReplicaLink

log = logging.getLogger(__name__)
INCONSISTENCY_LOG_EVERY_S = 60.0  # one INFO line per peer per minute, with the count since
MAX_HOLD_S = 5.0  # the longest a push waits for gossip's CPU budget
SETTLE_TRIES = 8  # deliveries of a settle its receiver refused, before it is given up


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
        self.leaving = False  # set by begin_leaving: only the hand-off leaves from then on
        self.mass_inconsistencies = 0
        self._inconsistency_log = Throttle(INCONSISTENCY_LOG_EVERY_S)
        self._stale_log = Throttle(INCONSISTENCY_LOG_EVERY_S)
        self._pushes: dict[str, set[asyncio.Future[None]]] = {}  # peer -> its pushes' tasks
        self.last_words = LastWords()  # what peers that left said they merged of ours

    def start(self, out: OutboundPush) -> None:
        """Deliver ``out`` in a task of its own, kept under its peer until it settles."""
        peer = out.push.peer
        task = self.tasks.spawn(self.push(out), f"push:{peer}")
        self._pushes.setdefault(peer, set()).add(task)
        task.add_done_callback(lambda t: self._forget(peer, t))

    def start_settle(self, settle: Settle) -> None:
        """Deliver ``settle`` in a task of its own, on the push path (a push with no segments
        that ``closes`` its numbering). Nothing is booked: the core forgot the numbering
        when it sent it."""
        push = Push(settle.peer, settle.up_to, {}, 0, settle.sequence_base, settle.up_to)
        self.tasks.spawn(self._settle(OutboundPush(push, {}, closes=True)), f"settle:{push.peer}")

    async def _settle(self, out: OutboundPush) -> None:
        """Retried as a push is until answered; a refusal (a full inbox, a leaving peer) is
        tried again, backing off, at most ``SETTLE_TRIES`` times while the peer stays in
        the view: a peer that keeps refusing keeps a window it does not need, no weight."""
        delay_s = min(0.5, self.gossip.retry_max_s)
        for _ in range(SETTLE_TRIES):
            delivery = await self.deliver(out, "settle")
            if delivery.error is None or out.push.peer not in self.membership.peers:
                return
            await self.retries.wait(delay_s)
            if self.stopping.is_set():
                return
            delay_s = min(delay_s * 2, self.gossip.retry_max_s)

    def _forget(self, peer: str, task: asyncio.Future[None]) -> None:
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
        if self.channels.routes.cut_off(address := self.membership.peers[peer].address):
            # Nothing sent, so refused exactly; a push already under way (a retry below)
            # still crosses the leaving relay, which joins connections until it stops.
            return Delivery([], f"every relay of {peer} is leaving ({address})")
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

    def begin_leaving(self) -> None:
        """From now on no push waits for the CPU budget and retries go at once: a leaving
        node settles what is in flight, then only its hand-off leaves it."""
        self.leaving = True
        self.retry_now()

    def in_flight(self) -> dict[asyncio.Future[None], str]:
        """Each push still running, and the peer it goes to."""
        return {task: peer for peer, tasks in self._pushes.items() for task in tasks}
