"""Merging a payload into the model whole or not at all.

Whatever arrives (a peer's push, a pulled model, our own snapshot folded back after
a failed push, a joiner's bootstrap model) reaches the parameters here. For a push
or a pull the core plans first (``Merge`` and ``Duplicate`` actions, or a refusal);
then every blend it asks for is checked against the payload bound and for finiteness
*before* any segment is written, so a refused payload leaves the model untouched
(docs/design.md §2, docs/reference/config.md `[limits]`). The check needs no blend
computed: the bound's norms
prove it finite (all but models near their dtype's limit), and the commit then adds
the payload's difference in place, one pass per segment. A large payload's segments
are checked and written side by side on the cores the process may use
(:class:`~gossipd.node.model.segments.SegmentWork`); those checks and writes are
:mod:`gossipd.node.trainer.blends`.

The :class:`Merger` writes segments and tells the core what merged (or which pull
failed); it never touches threads, queues or replies. The replica
(``node/trainer/replica.py``) calls it on the trainer thread under its locks, answers the
sender and carries out whatever the core asks next.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gossipd.node.errors import (
    GossipdError,
    InvalidFrame,
    NonFinitePayload,
    OverCredit,
    PayloadOutOfBounds,
    WeightOverCap,
)
from gossipd.node.model.payload_bound import Gauge, PayloadBound
from gossipd.node.model.segments import FlatModel
from gossipd.node.protocols.base import (
    Action,
    CoreStatus,
    Duplicate,
    FoldBack,
    GossipProtocol,
    Merge,
    PayloadArrived,
    PayloadMerged,
    Pull,
    PullArrived,
    PullFailed,
    PullMerged,
    Refused,
    WeightCapExceeded,
)
from gossipd.node.protocols.credit import CreditExceeded
from gossipd.node.shared.rejections import Throttle
from gossipd.node.trainer.blends import Checked, SegmentWrite, write
from gossipd.node.trainer.clip_radius import RecentDistances
from gossipd.node.trainer.messages import Ack, InboundPush, OutboundPush, Pulled
from gossipd.node.trainer.report import MergeRecord, PullRecord

log = logging.getLogger(__name__)

# At most one line per sender and this many seconds says whose payloads were clipped.
CLIP_LOG_INTERVAL_S = 60.0


@dataclass(frozen=True)
class MergePlan:
    """The core's answer to an arrival, with every blend it asks for checked, none applied."""

    actions: list[Action]
    blends: dict[int, SegmentWrite]
    clipped: tuple[int, ...]  # segments the robust merge clipped before blending


class Merger:
    """Plans, checks and commits merges into ``flat`` on behalf of ``core``."""

    def __init__(self, core: GossipProtocol, flat: FlatModel, bound: PayloadBound) -> None:
        self.core = core
        self.flat = flat
        self.bound = bound
        self.recent = RecentDistances(bound.clip_factor is not None)
        self._clip_log = Throttle(CLIP_LOG_INTERVAL_S)
        self._cut_log = Throttle(CLIP_LOG_INTERVAL_S)

    def merge_push(self, item: InboundPush) -> tuple[list[Ack], MergeRecord]:
        """Merge a whole push (or raise, having written nothing); returns its acks.

        Raises :class:`InvalidFrame` (or :class:`WeightOverCap`) when the core refuses
        it, :class:`NonFinitePayload` or ``PayloadOutOfBounds`` when a blend would.
        """
        arrival = PayloadArrived(
            item.sender,
            item.incarnation,
            item.sequence,
            item.round,
            {seg.segment: seg.sum_weight for seg in item.segments},
            item.sequence_base,
            item.settled,
        )
        values = {seg.segment: seg.values for seg in item.segments}
        gauges = {seg.segment: seg.gauge for seg in item.segments if seg.gauge is not None}
        what = f"push {item.sender}#{item.sequence}"
        plan = self.plan(arrival, values, what, merge_new=item.merge_new, gauges=gauges)
        if item.merge_new:
            self.core.handle(PayloadMerged(arrival))
        self.commit(plan.blends)
        weights = self.core.status().weights
        acks = [
            Ack(a.segment, isinstance(a, Duplicate), weights[a.segment] if weights else 0.0)
            for a in plan.actions
            if isinstance(a, Merge | Duplicate)
        ]
        cut = math.fsum(a.cut for a in plan.actions if isinstance(a, Merge))
        if cut > 0:
            self._say_cut(item.sender, cut, weights)
        record = MergeRecord(
            item.sender,
            item.sequence,
            tuple(plan.blends),
            tuple(a.segment for a in plan.actions if isinstance(a, Duplicate)),
            plan.clipped,
        )
        return acks, record

    def _say_cut(self, sender: str, cut: float, weights: Sequence[float]) -> None:
        """One INFO line per sender and minute: whose push met the weight cap, by how much
        (its weight over the cap was cut, not refused: see :mod:`.weight_cap`), and the
        peer that brought this node the most weight, net: a push that meets the cap is as
        often an honest one landing on a site an inflater filled."""
        quieted = self._cut_log.admit(sender)
        if quieted is None:
            return
        status = self.core.status()
        net = {
            p: m.received + m.received_before - m.sent - m.sent_before
            for p, m in status.exchanged.items()
        }
        most = max(net, key=net.__getitem__, default=None)
        log.info(
            "push from %s would have lifted this node's sum-weight over the cap %g: merged the "
            "part that fit, and %.4g of its weight is gone (%s; weights now %s). Honest sites "
            "never reach the cap (twice the founding members): a member is inflating weight, "
            "or limits.max_sum_weight is below the mesh's weight. The peer that brought this "
            "node the most weight: %s. Counted in gossipd_sum_weight_cut",
            sender,
            status.weight_cap,
            cut,
            f"{quieted} more such pushes since the last line" if quieted else "the first",
            " ".join(f"{w:.4g}" for w in weights),
            "none" if most is None else f"{most} ({net[most]:+.4g} net)",
        )

    def merge_pull(
        self, pull: Pull, pulled: Pulled | None, error: str | None
    ) -> tuple[list[Action], PullRecord]:
        """Merge a pulled model whole or not at all, like a push, and tell the core either
        way (a refused model fails the pull); returns what the core asks next and the
        record of the pull."""
        if pulled is not None and error is None:
            arrival = PullArrived(
                pull.peer, pull.round, dict(pulled.weights), pulled.nbytes, pulled.transfer_s
            )
            try:
                plan = self.plan(
                    arrival, pulled.values, f"pull from {pull.peer}", gauges=pulled.gauges
                )
            except (InvalidFrame, NonFinitePayload, PayloadOutOfBounds) as err:
                error = str(err)
            else:
                actions = self.core.handle(PullMerged(arrival))
                self.commit(plan.blends)
                record = PullRecord(
                    pull.peer,
                    pull.round,
                    tuple(plan.blends),
                    pulled.nbytes,
                    arrival.transfer_s,
                    clipped_segments=plan.clipped,
                )
                return actions, record
        record = PullRecord(pull.peer, pull.round, (), error=error)
        return self.core.handle(PullFailed(pull.peer, pull.round, str(error))), record

    def fold_back(self, out: OutboundPush, actions: Sequence[Action]) -> None:
        """Blend the unacknowledged segments of our own push back in, as the core asks."""
        for action in actions:
            if isinstance(action, FoldBack):
                # Our own snapshot coming home: finite, and the blend cannot overflow.
                snapshot = out.snapshot[action.segment]
                blended = self.flat.blend(action.segment, snapshot, action.alpha)
                if blended is not None:
                    self.flat.load_segment(action.segment, blended)

    def keep_dropped(
        self,
        out: OutboundPush,
        rebuilt: Mapping[int, torch.Tensor],
        acked: Sequence[int],
        status: CoreStatus,
    ) -> None:
        """Error feedback: the receiver merged the rebuilt values r, not our snapshot x, so
        Σ w·x moved by w·(r − x). Our own model takes the difference back, spread over the
        weight it still holds: x ← x + (w / available)·(x_sent − r), which keeps Σ w·x
        exact. A segment holding no weight (a hand-off) has nowhere to keep it."""
        for segment in acked:
            values = rebuilt.get(segment)
            factor = status.spread_over_available(segment, out.push.weights.get(segment, 0.0))
            if values is None or not factor:
                continue
            dropped = out.snapshot[segment] - values.to(out.snapshot[segment].dtype)
            if bool(torch.isfinite(dropped).all()):
                device = self.flat.buffers[segment].device  # a GPU model's: snapshots are on host
                self.flat.add_delta(segment, dropped.to(device), factor)

    def adopt(self, peer: str, pulled: Pulled | None, error: str | None) -> None:
        """Load a joiner's bootstrap model whole (its weight is 0: the merge with α = 1)."""
        if pulled is None or error is not None:
            raise GossipdError(f"join: pulling the model from {peer} failed: {error}")
        if sorted(pulled.values) != list(range(len(self.flat.plan))):
            raise GossipdError(f"join: {peer} sent segments {sorted(pulled.values)}, not all")
        for index, values in pulled.values.items():
            self.flat.load_segment(index, values)

    def commit(self, blends: Mapping[int, SegmentWrite]) -> None:
        """Write blends that :meth:`plan` checked."""
        calls = [functools.partial(write, self.flat, segment, w) for segment, w in blends.items()]
        self.flat.work.run(calls, sum(w.values.nbytes for w in blends.values()))

    def plan(
        self,
        arrival: PayloadArrived | PullArrived,
        values: Mapping[int, torch.Tensor],
        what: str,
        *,
        merge_new: bool = True,
        gauges: Mapping[int, Gauge] | None = None,
    ) -> MergePlan:
        """The core's answer to ``arrival``, every blend it asks for (checked against the
        payload bound and for finiteness, none applied) and the segments the robust merge
        clipped.

        A segment with a gauge that the bound admits is blended as it came (one pass at
        commit); the others take the exact path, where the payload bound writes each
        difference over ``values``: a payload is consumed by its plan, merged or refused.
        ``merge_new`` False keeps only the DUPLICATE answers (a leaving node merges
        nothing).
        """
        actions = self._answer(arrival, what, merge_new=merge_new)
        merges = [a for a in actions if isinstance(a, Merge)]
        for action in merges:
            if action.segment not in values:
                raise InvalidFrame(f"{what}: the core merges segment {action.segment}, not sent")
        sender = arrival.sender if isinstance(arrival, PayloadArrived) else arrival.peer
        radii = {a.segment: self.recent.typical(sender, a.segment) for a in merges}
        distances: dict[int, float] = {}
        checked = Checked(self.flat, self.bound, values, what, radii, distances)
        blends = checked.gauged(merges, gauges or {})
        exact = [a for a in merges if a.segment not in blends]
        exact_blends, clipped = checked.exact(exact)
        blends.update(exact_blends)
        for segment, distance in distances.items():  # only once the whole plan stands
            self.recent.record(sender, segment, distance)
        if clipped:
            self._say_clipped(sender, clipped, distances, radii)
        ordered = {a.segment: blends[a.segment] for a in merges}  # in the core's order
        return MergePlan(actions, ordered, tuple(clipped))

    def _say_clipped(
        self,
        sender: str,
        clipped: Sequence[int],
        distances: Mapping[int, float],
        typical: Mapping[int, float | None],
    ) -> None:
        """One INFO line per sender and minute: whose payload was pulled in, how far out."""
        quieted = self._clip_log.admit(sender)
        if quieted is None:
            return
        s = clipped[0]
        others = typical[s]
        log.info(
            "payload from %s: segment %d was %.3g (RMS) from this model, the other senders' "
            "%s; pulled in to limits.clip_factor = %s times that, then merged at its full "
            "weight (%d segment(s) clipped%s). If %s is honest it is far from the mesh (strong "
            "label skew, a much higher learning rate, a healed partition): raise "
            "limits.clip_factor, or set it to inf where every member is trusted",
            sender,
            s,
            distances[s],
            "none on record" if others is None else f"{others:.3g}",
            self.bound.clip_factor,
            len(clipped),
            f", {quieted} more since the last line" if quieted else "",
            sender,
        )

    def _answer(
        self, arrival: PayloadArrived | PullArrived, what: str, *, merge_new: bool
    ) -> list[Action]:
        """The core's actions for ``arrival`` (only its DUPLICATEs unless ``merge_new``);
        a refusal raised as the error the sender is answered with."""
        try:
            actions = self.core.handle(arrival)
        except Refused as err:
            refusal: type[InvalidFrame] = InvalidFrame
            if isinstance(err, WeightCapExceeded):
                refusal = WeightOverCap
            elif isinstance(err, CreditExceeded):
                refusal = OverCredit
            raise refusal(f"{what}: {err}") from None
        if not merge_new:
            actions = [a for a in actions if isinstance(a, Duplicate)]
        return actions
