"""A test-only protocol core that pulls every round: the pull path, exercised by every driver.

Every ``round_steps`` steps it pulls the whole model of the next peer in rank order,
to start ``delay_s`` after the step ended, and averages with it: x ← (x + x_peer)/2.
With ``via_timer`` it asks for a timer at that moment instead and pulls when it fires.
It keeps no sum-weights (its status has none), so the mass checks of push protocols
do not apply; what it records (pulls merged and failed, the transfer
times it was told) is what the tests read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gossipd.node.protocols.base import (
    CoreStatus,
    Event,
    GossipProtocol,
    HandOff,
    Merge,
    PayloadArrived,
    PayloadMerged,
    PeerRestarted,
    Pull,
    PullArrived,
    PullFailed,
    PullMerged,
    PushSettled,
    Refused,
    StartTimer,
    StepEnded,
    TimerFired,
    TrainingEnded,
    ViewChanged,
    ranked,
)

NAME = "test-pull"


class PullEveryRound(GossipProtocol):
    name = NAME

    def __init__(
        self,
        node_id: str,
        num_segments: int,
        *,
        round_steps: int = 1,
        delay_s: float = 0.0,
        via_timer: bool = False,
    ) -> None:
        self.via_timer = via_timer
        self.timer_fired_at: list[float] = []
        self.node_id = node_id
        self.num_segments = num_segments
        self.round_steps = round_steps
        self.delay_s = delay_s
        self.view = ranked(frozenset({node_id}))
        self.round = 0
        self.pulling: Pull | None = None
        self.merged: list[PullArrived] = []
        self.failed: list[PullFailed] = []

    def handle(self, event: Event) -> list[Any]:
        match event:
            case ViewChanged(members=members):
                self.view = ranked(members | {self.node_id})
            case StepEnded(step=step, time_s=time_s):
                return self._maybe_pull(step, time_s)
            case PullArrived(weights=weights):
                return [Merge(s, 0.5, 1.0) for s in sorted(weights)]
            case PullMerged(pull=arrival):
                self.merged.append(arrival)
                self.pulling = None
            case PullFailed():
                self.failed.append(event)
                self.pulling = None
            case PayloadArrived() | PayloadMerged():
                raise Refused(f"protocol {NAME} only pulls; a pushed payload is not merged")
            case TimerFired(time_s=time_s) if self.via_timer and self.pulling is not None:
                self.timer_fired_at.append(time_s)
                self.pulling = Pull(self.pulling.peer, self.round, self.pulling.segments, time_s)
                return [self.pulling]
            case PushSettled() | HandOff() | TrainingEnded() | TimerFired() | PeerRestarted():
                pass
            case _:
                raise TypeError(f"not a protocol event: {event!r}")
        return []

    def _maybe_pull(self, step: int, time_s: float) -> list[Any]:
        if step % self.round_steps or self.pulling is not None:
            return []
        peers = [m for m in self.view.members if m != self.node_id]
        if not peers:
            return []
        self.round += 1
        mine = self.view.rank_of[self.node_id]
        peer = peers[mine % len(peers)]
        at_s = time_s + self.delay_s
        self.pulling = Pull(peer, self.round, tuple(range(self.num_segments)), at_s)
        return [StartTimer(at_s, f"pull-{self.round}")] if self.via_timer else [self.pulling]

    def status(self) -> CoreStatus:
        return CoreStatus(
            protocol=NAME,
            round=self.round,
            epoch=self.view.epoch,
            in_flight=int(self.pulling is not None),
            peers=frozenset(self.view.members) - {self.node_id},
        )

    def state_dict(self) -> dict[str, Any]:
        return {"protocol": NAME, "round": self.round}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.round = int(state["round"])
