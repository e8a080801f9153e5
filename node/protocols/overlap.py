"""Scheduled-overlap pull gossip: pull a peer's model so that it lands as the period ends.

From "scheduled overlap of computation and communication in gossip SGD"
(a paper in Japanese, §3–4; summarised in docs/protocols/overlap.md). Every ``period_steps`` (T)
local steps node i averages with a peer's model that it *pulled*:
x_i ← (x_i + x_j)/2. It predicts when its T steps end from a moving average of
its step time, asks a scheduler (:mod:`gossipd.node.protocols.scheduler`) for a peer j and
a start time ``max(now, end − c_ij)``, and the driver starts the pull then, so
the transfer hides behind the last steps of the period. The pull merges at the
period's last step boundary (``Pull.merge_at_step``); if it has not landed by
then, the trainer waits for it there, which is what ``wait_fraction`` measures.
The measured transfer time goes back to the scheduler (c_ij learns).

Who schedules: with a coordinator (``CoreSettings.coordinator``), the core asks it
(``AskPeer``) and reports to it (``ReportTransfer``); whenever it cannot answer
(the driver says so in ``PeerGranted.error``) the core schedules that period
alone, on its own view and its own c_ij, which it keeps learning from every pull
either way. So losing the coordinator costs no step, and each period has one
scheduler. Alone, a node's queue starts at the peer after it in rank order: with
equal periods the nodes pull in a rotation and rarely pick the same j; when they
do, j serves one pull at a time (:attr:`OverlapGossip.serves_one_pull`) and the
others fail at once and re-pick.

Modes, the paper's baselines: ``none`` pulls when the period's steps are done (the
trainer waits a whole transfer), ``naive`` at the period's start (the model it
averages with is a period old).

Mass: this protocol keeps no sum-weights. An average with a pulled copy changes
only the puller, so the mixing is row- but not column-stochastic and the mesh's
mean moves a little at each merge; there is no weight to conserve or lose, a lost
or refused pull simply merges nothing, and the scheduler's fair queue makes every
node a source equally often, so no node's model counts more than another's over
time (the paper's argument; ``tests/test_overlap_loops.py`` checks consensus).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field

from gossipd.node.protocols.base import (
    Action,
    AskPeer,
    CoreStatus,
    Event,
    GossipProtocol,
    HandOff,
    Merge,
    PayloadArrived,
    PayloadMerged,
    PeerGranted,
    PeerRestarted,
    Pull,
    PullArrived,
    PullFailed,
    PullMerged,
    PushSettled,
    Refused,
    ReportTransfer,
    StartTimer,
    StepEnded,
    TimerFired,
    TrainingEnded,
    ViewChanged,
    ranked,
)
from gossipd.node.protocols.scheduler import (
    DEFAULT_LEASE_S,
    DEFAULT_THRESHOLD,
    Scheduler,
    SchedulerError,
)
from gossipd.node.protocols.settings import CoreSettings, ProtocolSettings

NAME = "overlap"
Mode = Literal["scheduled", "none", "naive"]


class OverlapSettings(ProtocolSettings):
    """``[gossip.overlap]``"""

    period_steps: int = Field(16, ge=1, description="local steps between averages (T)")
    mode: Mode = Field(
        "scheduled",
        description="scheduled: pull to land as the period ends; none: pull after it; "
        "naive: pull at its start",
    )
    step_time_smoothing: float = Field(
        0.2, gt=0.0, le=1.0, description="weight of the newest step in the step-time average"
    )
    threshold: float = Field(
        DEFAULT_THRESHOLD, gt=0.0, lt=1.0, description="θ: relative band for transfer times"
    )
    retry_s: float = Field(
        0.02, gt=0.0, description="wait before asking again when no peer is free"
    )


@dataclass(frozen=True)
class _Period:
    round: int
    due_step: int  # the step whose boundary merges this period's pull
    end_s: float  # predicted end of the period (driver's clock)
    attempts: int = 0  # pulls tried this period (a busy or failed peer is re-picked)
    peer: str | None = None  # pulling from (None: waiting for a grant)
    via_coordinator: bool = False


class OverlapGossip(GossipProtocol):
    name = NAME
    Settings = OverlapSettings
    # A peer pulled by several nodes at once serves one; the others re-pick (docs/design.md §5).
    serves_one_pull: ClassVar[bool] = True
    keeps_weights: ClassVar[bool] = False

    def __init__(self, common: CoreSettings, own: OverlapSettings | None = None) -> None:
        own = own or OverlapSettings.model_validate({})
        self.node_id = common.node_id
        self.num_segments = common.num_segments
        self.period_steps = own.period_steps
        self.mode: Mode = own.mode
        self.step_time_smoothing = own.step_time_smoothing
        self.threshold = own.threshold
        self.retry_s = own.retry_s
        self.use_coordinator = common.coordinator
        self.view = ranked(frozenset({self.node_id}))
        self.scheduler = Scheduler([self.node_id], threshold=own.threshold, lease_s=DEFAULT_LEASE_S)
        self.round = 0
        self.step = 0
        self.done = False
        self.step_s: float | None = None  # moving average of step time
        self._last_step_at: float | None = None
        # A pull of this core ended at the coming boundary: the trainer may have waited
        # for it inside this step, which is no step time (see _stepped).
        self._pull_ended_in_step = False
        self.period: _Period | None = None
        # Who picked the last period's peer: the coordinator, or this node alone.
        self.scheduling = "coordinator" if common.coordinator else "decentralized"
        self.counts = dict.fromkeys(
            ("merged", "failed", "repicked", "skipped", "coordinator", "alone", "fallback"), 0
        )

    @classmethod
    def from_settings(cls, common: CoreSettings, own: OverlapSettings) -> OverlapGossip:
        return cls(common, own)

    # -- events --------------------------------------------------------------------------
    def handle(self, event: Event) -> list[Action]:
        match event:
            case ViewChanged(members=members):
                self._set_view(members)
            case StepEnded(step=step, time_s=time_s):
                return self._stepped(step, time_s)
            case PeerGranted():
                return self._granted(event)
            case TimerFired(tag=tag, time_s=time_s):
                period = self.period
                if period and period.peer is None and tag == f"ask-{period.round}":
                    return self._ask(period, time_s)
            case PullArrived(peer=peer, round=round_, weights=weights):
                period = self.period
                if period is None or (period.peer, period.round) != (peer, round_):
                    raise Refused(f"a pull from {peer} for round {round_} was not asked for")
                if set(weights) != set(range(self.num_segments)):
                    raise Refused(
                        f"the pull from {peer} holds segments {sorted(weights)}, not the "
                        f"whole model of {self.num_segments}"
                    )
                return [Merge(s, 0.5, 0.0) for s in range(self.num_segments)]
            case PullMerged(pull=arrival):
                return self._pull_ended(arrival.peer, arrival.round, arrival.transfer_s)
            case PullFailed(peer=peer, round=round_):
                return self._pull_ended(peer, round_, math.inf)
            case TrainingEnded():
                self.done = True
            case PayloadArrived() | PayloadMerged():
                raise Refused(f"protocol {NAME} only pulls; a pushed payload is not merged")
            case PushSettled() | HandOff() | PeerRestarted() | TimerFired():
                pass
            case _:
                raise TypeError(f"not a protocol event: {event!r}")
        return []

    def _set_view(self, members: frozenset[str]) -> None:
        self.view = ranked(members | {self.node_id})
        order = self.view.members
        mine = self.view.rank_of[self.node_id]
        # Start the queue after this node, so equal nodes pull in a rotation.
        for member in order[mine + 1 :] + order[:mine]:
            self.scheduler.add(member)
        for gone in self.scheduler.members - set(order):
            self.scheduler.remove(gone)

    def _stepped(self, step: int, time_s: float) -> list[Action]:
        # A step whose boundary ended a pull is left out of the average: its time holds
        # the trainer's wait for that pull. Counted, a wait W would predict the next
        # period's end T·smoothing·W late, so its pull would start that much too late and
        # the next wait grow: past T·smoothing > 1 the trainer ends up waiting a whole
        # transfer every period (tests/test_overlap_loops.py, the closed loop).
        if self._last_step_at is not None and not self._pull_ended_in_step:
            took = max(time_s - self._last_step_at, 0.0)
            a = self.step_time_smoothing
            self.step_s = took if self.step_s is None else (1 - a) * self.step_s + a * took
        self._last_step_at = time_s
        self._pull_ended_in_step = False
        self.step = step
        period = self.period
        if period is not None and period.peer is None and step >= period.due_step:
            self.period = None  # no peer was free all period: train on, try the next one
            self.counts["skipped"] += 1
        if self.period is not None or self.done or len(self.view.members) < 2:
            return []
        T = self.period_steps
        if self.mode == "none":
            if step % T:
                return []
            due, end_s = step, time_s  # the period's steps are done: pull now, wait for it
        else:
            due = (step // T + 1) * T
            end_s = time_s if self.mode == "naive" else time_s + (due - step) * (self.step_s or 0.0)
        self.round += 1
        return self._ask(_Period(self.round, due, end_s), time_s)

    def _ask(self, period: _Period, now_s: float) -> list[Action]:
        """Find this period's peer: the coordinator's answer comes as PeerGranted."""
        self.period = period
        if self.use_coordinator:
            return [AskPeer(period.round, max(period.end_s, now_s))]
        return self._alone(period, now_s)

    def _alone(self, period: _Period, now_s: float) -> list[Action]:
        try:
            grant = self.scheduler.start_time(self.node_id, max(period.end_s, now_s), now_s)
        except SchedulerError:
            grant = None  # e.g. a view without this node's peers yet: ask again soon
        if grant is None:
            return [StartTimer(now_s + self.retry_s, f"ask-{period.round}")]
        self.counts["alone"] += 1
        self.scheduling = "decentralized"
        return self._pull(period, grant.peer, grant.start_s, via_coordinator=False)

    def _granted(self, event: PeerGranted) -> list[Action]:
        period = self.period
        if period is None or period.peer is not None or event.round != period.round:
            return []  # an answer for a period that ended (or was scheduled alone)
        now_s = self._last_step_at or 0.0
        if event.error is not None:
            self.counts["fallback"] += 1
            return self._alone(period, max(now_s, event.start_s))
        if event.peer is None or event.peer == self.node_id:
            return [StartTimer(event.start_s + self.retry_s, f"ask-{period.round}")]
        self.counts["coordinator"] += 1
        self.scheduling = "coordinator"
        return self._pull(period, event.peer, event.start_s, via_coordinator=True)

    def _pull(
        self, period: _Period, peer: str, start_s: float, *, via_coordinator: bool
    ) -> list[Action]:
        at_s = period.end_s if self.mode == "none" else start_s
        if self.mode == "naive":
            at_s = min(at_s, period.end_s)
        self.period = _Period(
            period.round, period.due_step, period.end_s, period.attempts + 1, peer, via_coordinator
        )
        segments = tuple(range(self.num_segments))
        return [Pull(peer, period.round, segments, at_s, merge_at_step=period.due_step)]

    def _pull_ended(self, peer: str, round_: int, transfer_s: float) -> list[Action]:
        period = self.period
        if period is None or (period.peer, period.round) != (peer, round_):
            return []
        self._pull_ended_in_step = True
        actions: list[Action] = []
        if period.via_coordinator:
            actions.append(ReportTransfer(peer, transfer_s))
            self.scheduler.observe(self.node_id, peer, transfer_s)
        else:
            try:
                self.scheduler.report(self.node_id, peer, transfer_s)
            except SchedulerError:
                self.scheduler.observe(self.node_id, peer, transfer_s)  # its lease ran out
        if transfer_s != math.inf:
            self.counts["merged"] += 1
            self.period = None
            return actions
        self.counts["failed"] += 1
        retry = _Period(period.round, period.due_step, period.end_s, period.attempts)
        if period.attempts >= len(self.view.members) - 1 or self.done:
            self.period = None  # every peer tried this period: train on
            return actions
        self.counts["repicked"] += 1
        now_s = self._last_step_at or 0.0
        return actions + self._ask(retry, now_s)

    # -- state ---------------------------------------------------------------------------
    def status(self) -> CoreStatus:
        pulls = dict(self.counts)
        return CoreStatus(
            protocol=NAME,
            round=self.round,
            epoch=self.view.epoch,
            in_flight=int(self.period is not None and self.period.peer is not None),
            peers=frozenset(self.view.members) - {self.node_id},
            scheduling=self.scheduling,
            pulls=pulls,
            # What operators are shown of the schedule, the two fields above with it.
            extra={
                "mode": self.mode,
                "period_steps": self.period_steps,
                "step_time_s": self.step_s,
                "pulls": pulls,
                "pulling_from": self.period.peer if self.period else None,
                "scheduling": self.scheduling,
            },
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "protocol": NAME,
            "round": self.round,
            "step_time_s": self.step_s,
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("protocol", NAME) != NAME:
            raise ValueError(f"checkpoint holds protocol {state.get('protocol')!r}, not {NAME}")
        self.round = int(state.get("round", 0))
        step_s = state.get("step_time_s")
        self.step_s = None if step_s is None else float(step_s)
        self.scheduler.load_state_dict(state.get("scheduler", {}))
