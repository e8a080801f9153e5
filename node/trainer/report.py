"""What a replica tells its caller and its readers: a report per step, a summary always.

:class:`StepReport` is what gossip did since the previous step, returned by every
``Replica.step`` so a caller sees merges, pushes, pulls and refusals in its own loop.
:class:`Summary` is one consistent copy of the replica's state, replaced whole at each
step boundary: status, metrics and health read it on other threads without ever
taking the trainer's lock.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gossipd.node.protocols.base import PeerMass

if TYPE_CHECKING:
    from gossipd.node.trainer.replica import Replica

log = logging.getLogger("gossipd.node.trainer.report")


@dataclass(frozen=True)
class MergeRecord:
    sender: str
    sequence: int
    merged_segments: tuple[int, ...]
    duplicate_segments: tuple[int, ...]
    # pulled in by the clip (limits.clip_factor, limits.merge_clip), then merged
    clipped_segments: tuple[int, ...] = ()


@dataclass(frozen=True)
class PushRecord:
    peer: str
    sequence: int
    acked_segments: tuple[int, ...]
    error: str | None = None


@dataclass(frozen=True)
class PullRecord:
    peer: str
    round: int
    merged_segments: tuple[int, ...]
    nbytes: int = 0
    transfer_s: float = 0.0
    error: str | None = None
    clipped_segments: tuple[int, ...] = ()  # as a push's (MergeRecord)


@dataclass(frozen=True)
class Rejection:
    peer: str
    reason: str
    detail: str


@dataclass
class StepReport:
    """What gossip did since the previous step; ``ok`` is False if anything failed."""

    step: int
    merged: list[MergeRecord] = field(default_factory=list)
    pushed: list[PushRecord] = field(default_factory=list)
    failed: list[PushRecord] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    pulled: list[PullRecord] = field(default_factory=list)
    started_push_to: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failed and not self.rejected and all(p.error is None for p in self.pulled)


@dataclass(frozen=True)
class Summary:
    """A consistent copy of replica state, replaced whole at each step boundary."""

    steps: int
    loss: float
    protocol: str
    round: int
    epoch: int
    weights: tuple[float, ...]
    reserved: tuple[float, ...]
    in_flight: int
    pushes_acked: int
    pushes_failed: int
    pushes_merged: int
    peers: frozenset[str]
    exchanged: Mapping[str, PeerMass]
    sinks: frozenset[str] = frozenset()  # peers suspected of sinking weight (no pushes to them)
    weight_cap: float = math.inf  # the most sum-weight a segment may hold after a merge
    weight_cut: float = 0.0  # sum-weight received that did not fit under the cap, since start
    balance_factors: tuple[float, ...] = ()  # per segment, the weight balance's (empty: off)
    wait_s: float = 0.0  # the trainer's waits at step boundaries for due pulls
    wait_fraction: float = 0.0  # wait_s over the wall time since the first step ended
    scheduling: str = ""  # who picks this node's pulls: coordinator, decentralized, or ""
    pulls: Mapping[str, int] = field(default_factory=dict)  # a pulling core's, by outcome

    @classmethod
    def of(cls, replica: Replica) -> Summary:
        core = replica.core.status()
        return cls(
            steps=replica.steps,
            loss=replica.last_loss,
            protocol=core.protocol,
            round=core.round,
            epoch=core.epoch,
            weights=core.weights,
            reserved=core.reserved,
            in_flight=core.in_flight,
            pushes_acked=replica.pushes_acked,
            pushes_failed=replica.pushes_failed,
            pushes_merged=replica.pushes_merged,
            peers=core.peers,
            exchanged=core.exchanged,
            sinks=core.sinks,
            weight_cap=core.weight_cap,
            weight_cut=core.weight_cut,
            balance_factors=core.balance_factors,
            wait_s=replica.wait_s,
            wait_fraction=replica.wait_fraction(),
            scheduling=core.scheduling,
            pulls=core.pulls,
        )


class SinkLog:
    """Tells the operator when a peer starts or stops being suspected of sinking weight.

    It compares with what it said last, not with the previous summary: settles and merges
    publish summaries between step boundaries too, so a sink that crossed the bound on a
    settle was already in the summary the boundary compared with, and the WARNING naming
    it was never logged (found by an insider test: only the gauge showed it).
    """

    def __init__(self) -> None:
        self.said: frozenset[str] = frozenset()

    def update(self, sinks: frozenset[str]) -> None:
        for peer in sorted(sinks - self.said):
            log.warning(
                "peer %s took this node's weight and gave none back (sink score over "
                "limits.sink_score_bound, or all the limits.peer_credit this node gives it): no "
                "more pushes to it until it pushes weight back; "
                "if it is a member you trust, check its logs: it acknowledges pushes but never "
                "pushes",
                peer,
            )
        for peer in sorted(self.said - sinks):
            log.info("peer %s pushed weight back: no longer suspected of sinking weight", peer)
        self.said = sinks


class BalanceLog:
    """Tells the operator when the weight balance shrinks this site's pushes, and when
    they are whole again: small pushes are what a fast site's balance is for, and what
    peers lying about their weight would cause, so the line says which to look for."""

    SMALL = 0.5  # under this factor (in some segment) it says so
    WHOLE = 0.9  # and once every factor is back over this, that they are whole again

    def __init__(self) -> None:
        self.small = False

    def update(self, factors: tuple[float, ...]) -> None:
        least = min(factors, default=1.0)
        if not self.small and least < self.SMALL:
            self.small = True
            log.info(
                "this site's pushes carry %.2f of their protocol's share (gossip.weight_balance):"
                " it held less weight than the mesh's per site, as a site that steps or pushes "
                "faster than its peers does, so its data still counts alike; if every site "
                "steps alike, a peer may report more weight than it holds: check "
                "gossipd_weight_sinks and the peers' logs",
                least,
            )
        elif self.small and least > self.WHOLE:
            self.small = False
            log.info("this site's pushes carry their protocol's whole share again")
