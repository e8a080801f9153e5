"""Periodic global averaging (PerSyn of GoSGD, Blot et al. 2019; the inter-node average
every K′ steps and at each epoch end of Moreno-Álvarez et al., IEEE TNNLS 2023),
without a central node.

A burst of R = ⌈log2 N⌉ sub-rounds of the exponential-graph exchange starts at every
step that is a positive multiple of ``average_every_steps`` (K′) and, where
``epoch_steps`` (E, this site's local steps per epoch) is set, at every positive
multiple of E too: the node-based mode averages between sites at each epoch end as
well as every K′ steps. At sub-round j of a burst (j < R; the pacing is under
Exactness below) the node of rank i pushes half of its available weight, every
segment, to rank (i + 2^j) mod N. Local training goes on between sub-rounds.
PerSyn's master would collect and broadcast; here the butterfly does it with one push
per node per sub-round, and no node is special.

Where bursts start is a function of the step count: the round is the number of bursts
started by then (t // K′ + t // E − t // lcm(K′, E) at step t), which strictly increases
from burst to burst. Sites step at their own pace, so by their own counts alone a site
at 200 steps a second and one at 300 drift a round apart every 150 steps, and their
bursts never meet again (a 2-rank mnist1d site beside single-rank ones: the outer step
then averaged whatever had arrived, and the mesh diverged to NaN). So a node that merges
a push of a later round whose start is more than half a period past its own count
catches up: it moves its count (t above is its step plus a lead that only grows) to the
start of that round, and its burst begins at the next step, or once its own burst under
way has sent its sub-rounds (see :meth:`PerSyn._catch_up`). A peer less ahead is paired
with as it is (its pushes count for this node's next burst). The fastest site sets the
pace; a slower one takes fewer local steps between averages, as its compute allows. A
burst that starts while another is under way (an epoch end two steps after a K′
multiple, a catch-up past its deadlines) restarts the sub-rounds at 0: the earlier burst's remaining
sub-rounds are dropped, not queued. With E = 0 bursts come every K′ steps only, and the
round is t // K′.

Exactness: if N is a power of two and every node merges sub-round j − 1's push
before it sends sub-round j's (synchronous sub-rounds), the product of the R
matrices (I + P_j)/2 is J/N and every model ends at the exact average. So a
sub-round j ≥ 1 goes at the first step after the node merged its sub-round j − 1
push (from rank i − 2^(j−1)), and at the latest W = max(1, ⌊(K′ − 1)/R⌋) steps per
sub-round into the burst (a peer slow, dead or busy does not hold the burst past
the next one); training never waits. Over a wide-area link a push takes several
steps to land: going a step per sub-round, as a burst of synchronous sub-rounds
would, the later sub-rounds sent models that had not merged the earlier ones, and
the outer step below averaged little. Otherwise (N not a power of two, a deadline
passed) each sub-round is still a doubly stochastic, contracting mix, so
disagreement shrinks but the burst is not an exact average; the next burst shrinks
it again.

Invariant: the sum of weights is constant whatever arrives (the ledger's job);
a destination still busy with an earlier push is skipped, never queued.

When training ends, the node runs one more burst, paced by timers instead of
steps: sub-round 0 at once, sub-round j about j step-times later (step time
estimated from ``StepEnded.time_s``), so models leave training averaged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import Field

from gossipd.node.protocols.base import (
    Action,
    Event,
    OuterStep,
    PayloadArrived,
    PayloadMerged,
    Push,
    StartTimer,
    StepEnded,
    TimerFired,
    TrainingEnded,
)
from gossipd.node.protocols.credit import HALF_PUSH_CREDIT
from gossipd.node.protocols.ledger import SumWeightLedger
from gossipd.node.protocols.settings import CoreSettings, ProtocolSettings
from gossipd.node.protocols.topology import (
    ceil_log2,
    cycle_backward,
    exponential_neighbours,
    exponential_peer,
)

DEFAULT_STEP_TIME_S = 0.1
# Weight of the newest step time in the moving average: a few steps settle it, and
# one slow step (a checkpoint, a merge of a big payload) does not dominate it.
STEP_TIME_SMOOTHING = 0.2
FINAL_BURST_TAG = "persyn-final"
# A round from a peer above this is not caught up with: the round travels as a uint64,
# and a member that sent 2^64 − 1 would otherwise leave every node unable to number its
# next burst. Honest rounds stay far below (a burst a millisecond for 285,000 years).
MAX_ROUND = 2**53


class PerSynSettings(ProtocolSettings):
    """``[gossip.persyn]``"""

    average_every_steps: int = Field(
        50, ge=1, description="local steps between global averages (K′)"
    )
    epoch_steps: int = Field(
        0,
        ge=0,
        description="local steps in one epoch of this site's data; a global average also "
        "starts at every multiple of it (0: only every average_every_steps)",
    )
    outer_learning_rate: float = Field(
        1.0,
        gt=0,
        description="DiLoCo's outer step after each burst whose pushes all merged: the "
        "learning rate of its Nesterov SGD on (model before the burst's steps − the burst's "
        "average); 1 with "
        "outer_momentum 0 (the defaults): no outer step, the average itself",
    )
    outer_momentum: float = Field(
        0.0, ge=0, lt=1, description="the outer step's Nesterov momentum (DiLoCo: 0.9)"
    )


def burst_position(step: int, average_every_steps: int, epoch_steps: int = 0) -> tuple[int, int]:
    """(round, sub-round) at local step ``step``: the number of bursts started at or before
    it, and how many steps ago the latest of them started (round 0: none started yet).

    A pure function of the step, so every node places the same burst at the same step and
    numbers it alike; a node passes it its step plus the lead it took catching up."""
    period, epoch = average_every_steps, epoch_steps
    start = step - step % period
    bursts = step // period
    if epoch:
        start = max(start, step - step % epoch)
        bursts += step // epoch - step // math.lcm(period, epoch)
    return bursts, step - start


def burst_start(round_: int, average_every_steps: int, epoch_steps: int = 0) -> int:
    """The first step at which burst ``round_`` has started (the inverse of
    :func:`burst_position`'s round, which never falls as the step grows)."""
    low, high = 0, round_ * average_every_steps  # by then at least round_ bursts started
    while low < high:
        middle = (low + high) // 2
        if burst_position(middle, average_every_steps, epoch_steps)[0] >= round_:
            high = middle
        else:
            low = middle + 1
    return low


class PerSyn(SumWeightLedger):
    name = "persyn"
    default_peer_credit = HALF_PUSH_CREDIT  # its exact average needs whole half pushes
    Settings = PerSynSettings

    @classmethod
    def from_settings(cls, common: CoreSettings, own: PerSynSettings) -> PerSyn:
        return cls(
            **common.ledger(),
            average_every_steps=own.average_every_steps,
            epoch_steps=own.epoch_steps,
            outer_learning_rate=own.outer_learning_rate,
            outer_momentum=own.outer_momentum,
        )

    def __init__(
        self,
        node_id: str,
        num_segments: int,
        *,
        average_every_steps: int,
        epoch_steps: int = 0,
        outer_learning_rate: float = 1.0,
        outer_momentum: float = 0.0,
        **ledger: Any,
    ) -> None:
        """``ledger``: ``rng`` or ``seed`` and the optional ``SumWeightLedger`` settings."""
        if average_every_steps < 1:
            raise ValueError(f"average_every_steps must be at least 1, got {average_every_steps}")
        if epoch_steps < 0:
            raise ValueError(f"epoch_steps must be 0 (off) or more, got {epoch_steps}")
        super().__init__(node_id, num_segments, **ledger)
        self.average_every_steps = average_every_steps
        self.epoch_steps = epoch_steps
        self.outer_learning_rate = outer_learning_rate
        self.outer_momentum = outer_momentum
        self.step_time_s = DEFAULT_STEP_TIME_S  # until two steps have been seen
        self._step_times_seen = 0
        self._last_step_at_s: float | None = None
        self._step = 0  # the latest local step
        self._lead = 0  # steps added to it by catching up with later rounds (grows only)
        # The latest round seen ahead of this node's, not yet caught up with, the step it
        # was first seen at, and per sub-round the round of a push of it merged here.
        self._later, self._later_at = 0, 0
        self._later_heard: dict[int, int] = {}
        self._burst = 0  # the round of the burst under way
        self._sent = 0  # its sub-rounds gone (sent, or skipped while the peer was busy)
        # Per sub-round j, the step (lead included) at which the push of rank − 2^j last
        # merged here.
        self._heard_at: dict[int, int] = {}
        self._half_period = min(average_every_steps, epoch_steps or average_every_steps) // 2
        self._outer_round = 0  # the round of the last outer step

    def exchange(self, sub_round: int) -> list[Push]:
        """Sub-round ``sub_round`` of this round's burst: half of everything to rank ±
        2^sub_round."""
        n = len(self.view.members)
        if n < 2 or sub_round >= ceil_log2(n):
            return []
        rank = self.view.rank_of[self.node_id]
        backward = cycle_backward(self.round)
        peer = self.view.members[exponential_peer(rank, n, sub_round, backward)]
        if not self.can_push(peer):
            return []  # busy: the weight stays here this sub-round
        push = self.push_share(peer, 0.5)
        return [push] if push else []

    def exchanges_with(self, peer: str) -> bool:
        return exponential_neighbours(self.view, self.node_id, peer)

    def handle(self, event: Event) -> list[Action]:
        actions = super().handle(event)
        if isinstance(event, PayloadMerged):
            self._heard_from(event.payload)
        return actions

    def _heard_from(self, payload: PayloadArrived) -> None:
        """Note when the sub-round whose shift leads from ``payload``'s sender to this node
        last merged here, and the payload's round if it is later than this node's, to
        catch up with (:meth:`_catch_up`). By the step, not the round: over a link slower
        than a burst, the push of sub-round 1 lands in the next burst, and is still what
        the outer step needs."""
        n = len(self.view.members)
        rank = self.view.rank_of.get(payload.sender)
        if n < 2 or rank is None:
            return
        ahead = self._position(self._step)[0] < payload.round <= MAX_ROUND
        if ahead and payload.round > self._later:
            if not self._later:
                self._later_at = self._step
            self._later = payload.round  # caught up with at a step (_catch_up)
        me = self.view.rank_of[self.node_id]
        backward = cycle_backward(payload.round)  # the direction its sender's burst went
        for sub_round in range(ceil_log2(n)):
            if exponential_peer(rank, n, sub_round, backward) == me:
                self._heard_at[sub_round] = self._step + self._lead
                if ahead:
                    self._later_heard[sub_round] = payload.round

    def _catch_up(self, step: int, sub_rounds: int, wait: int) -> None:
        """Move this node's count to the start of the latest later round seen, so that its
        burst begins at this step, once the burst under way has sent every sub-round (or
        the deadlines of all of them have passed since the later round was seen).

        Not at once: a site several times slower than its peers is caught up at nearly
        every step, and cut off there it only ever sent sub-round 0, in the direction of
        the burst it caught up with, which is the direction its faster neighbours reach it
        in. Two such neighbours then pushed only to each other and held nearly all the
        weight (simulated, 4 sites of 1-4 s a step, bursts back to back: 0.01-1.81 of their
        share)."""
        later = self._later
        if not later:
            return
        if self._burst and self._sent < sub_rounds and step - self._later_at < sub_rounds * wait:
            return  # its burst under way sends its sub-rounds first
        heard, self._later, self._later_heard = self._later_heard, 0, {}
        start = burst_start(later, self.average_every_steps, self.epoch_steps)
        # A peer less than half a period ahead is paired with as it is (on_step's since);
        # caught up with, sites of one speed would leapfrog each other by their jitter and
        # burst more often than configured (a 2-rank digits pair: 40 bursts for 34). The
        # later round is not checkpointed: after a restart the next later push brings it.
        if start - (step + self._lead) > self._half_period:
            self._lead = start - step
            for sub_round, round_ in heard.items():  # its pushes count for the burst begun
                if round_ >= later:
                    self._heard_at[sub_round] = step + self._lead

    def _position(self, step: int) -> tuple[int, int]:
        """(round, steps into it) at local step ``step``, caught-up rounds included."""
        return burst_position(step + self._lead, self.average_every_steps, self.epoch_steps)

    def on_step(self, event: StepEnded) -> Iterable[Action]:
        self._observe_step_time(event.time_s)
        self._step = event.step
        sub_rounds = ceil_log2(len(self.view.members))
        wait = max(1, (self.average_every_steps - 1) // max(sub_rounds, 1))
        self._catch_up(event.step, sub_rounds, wait)
        self.round, steps_in = self._position(event.step)
        if self.round == 0:
            return []  # the first burst comes after K′ (or E) steps of local training
        if self.round != self._burst:  # a burst starts (one under way is dropped)
            self._burst, self._sent = self.round, 0
        j = self._sent
        # Sub-round j (or, once all went, the outer step) is due when the push of
        # sub-round j − 1 from rank − 2^(j−1) has merged here during this burst or in
        # the half period before it (a peer a little ahead), or at its deadline.
        since = event.step + self._lead - steps_in - self.average_every_steps // 2
        due = j == 0 or self._heard_at.get(j - 1, -1) >= since or steps_in >= j * wait
        if j < sub_rounds:
            if not due or steps_in < j:
                return []
            self._sent += 1
            return self.exchange(j)
        # The outer step only on a burst whose every push to this node merged: on a
        # partial average its pseudo-gradient holds the sites' disagreement, which the
        # momentum amplifies burst after burst (mnist1d over 80 ms links reached 1e13).
        # A burst left partial by its deadlines is a plain average.
        whole = all(self._heard_at.get(k, -1) >= since for k in range(sub_rounds))
        if self._outer and whole and self._outer_round < self.round:
            self._outer_round = self.round
            return [OuterStep(self.round, self.outer_learning_rate, self.outer_momentum)]
        return []

    @property
    def _outer(self) -> bool:
        return (self.outer_learning_rate, self.outer_momentum) != (1.0, 0.0)

    def on_training_ended(self, event: TrainingEnded) -> Iterable[Action]:
        """One more burst, timed: sub-round 0 now, sub-round j at j estimated step-times."""
        self.round = self._position(event.step)[0] + 1
        actions: list[Action] = list(self.exchange(0))
        for j in range(1, ceil_log2(max(len(self.view.members), 1))):
            tag = f"{FINAL_BURST_TAG}:{self.round}:{j}"
            actions.append(StartTimer(event.time_s + j * self.step_time_s, tag))
        return actions

    def on_timer(self, event: TimerFired) -> Iterable[Action]:
        prefix, _, rest = event.tag.partition(":")
        burst, _, sub_round = rest.partition(":")
        if prefix != FINAL_BURST_TAG or int(burst) != self.round:
            return []  # not ours, or a timer of a burst this incarnation did not start
        return self.exchange(int(sub_round))

    def _observe_step_time(self, now_s: float) -> None:
        if self._last_step_at_s is not None and now_s > self._last_step_at_s:
            seen = now_s - self._last_step_at_s
            if self._step_times_seen == 0:
                self.step_time_s = seen  # the first measurement beats the default
            else:
                self.step_time_s += STEP_TIME_SMOOTHING * (seen - self.step_time_s)
            self._step_times_seen += 1
        self._last_step_at_s = now_s

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "step_time_s": self.step_time_s,
            "step_times_seen": self._step_times_seen,
            "burst": [self._burst, self._sent, self._outer_round],
            "lead": self._lead,
            "heard_at": [[j, at] for j, at in sorted(self._heard_at.items())],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.step_time_s = float(state.get("step_time_s", DEFAULT_STEP_TIME_S))
        self._step_times_seen = int(state.get("step_times_seen", 0))
        # Where the burst under way stood (a checkpoint before these keys: none under way).
        self._burst, self._sent, self._outer_round = (int(v) for v in state.get("burst", (0, 0, 0)))
        self._lead = int(state.get("lead", 0))
        self._heard_at = {int(j): int(at) for j, at in state.get("heard_at", ())}
        self._last_step_at_s = None  # the restored clock is not this process's clock
