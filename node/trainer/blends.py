"""The blends a merge asks for, each checked against the payload bound and for finiteness
before any is written, and the one write per segment that commits a checked blend.

Kept apart from :mod:`gossipd.node.trainer.merging` (which asks the core and tells it what
merged): this is the arithmetic that makes a merge whole or nothing, and it knows nothing
of cores, senders or records.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gossipd.node.errors import NonFinitePayload
from gossipd.node.model.payload_bound import Gauge, PayloadBound
from gossipd.node.model.segments import FlatModel
from gossipd.node.protocols.base import Merge


@dataclass(frozen=True)
class SegmentWrite:
    """What a commit writes into one segment: ``x += alpha * values`` (``values`` is a
    delta), ``x.lerp_(values, alpha)`` when ``lerp`` (``values`` is a gauged payload), or
    ``x = values`` when ``alpha`` is None (a blend computed and checked whole, near the
    dtype's limit)."""

    values: torch.Tensor
    alpha: float | None
    lerp: bool = False


def write(flat: FlatModel, segment: int, blend: SegmentWrite) -> None:
    """Commit one checked blend into ``flat``'s ``segment``."""
    if blend.alpha is None:
        flat.load_segment(segment, blend.values)
    elif blend.lerp:
        flat.lerp(segment, blend.values, blend.alpha)
    else:
        flat.add_delta(segment, blend.values, blend.alpha)


@dataclass(frozen=True)
class Checked:
    """One payload's merges checked against ``bound``: ``values`` by segment, ``what`` names
    the payload in a refusal, ``radii`` the typical distance each segment is clipped to;
    the distance of each checked segment goes into ``distances``."""

    flat: FlatModel
    bound: PayloadBound
    values: Mapping[int, torch.Tensor]
    what: str
    radii: Mapping[int, float | None]
    distances: dict[int, float]

    def gauged(
        self, merges: Sequence[Merge], gauges: Mapping[int, Gauge]
    ) -> dict[int, SegmentWrite]:
        """The merges whose gauge the payload bound admits, blended as they came."""
        blends: dict[int, SegmentWrite] = {}
        for action in merges:
            gauge = gauges.get(action.segment)
            if gauge is None:
                continue
            radius = self.radii[action.segment]
            admitted = self.bound.admits(gauge, action.alpha, self.what, action.segment, radius)
            self.distances[action.segment] = gauge.distance
            if admitted:
                blends[action.segment] = SegmentWrite(
                    self.values[action.segment], action.alpha, lerp=True
                )
        return blends

    def exact(self, exact: Sequence[Merge]) -> tuple[dict[int, SegmentWrite], list[int]]:
        """``exact`` blended from their differences, each bounded and checked finite (side
        by side on the process's cores), and the segments the bound clipped."""
        values, what = self.values, self.what
        deltas = self.flat.work.run(
            [
                functools.partial(
                    self.bound.delta,
                    self.flat.buffers[a.segment],
                    values[a.segment],
                    what,
                    a.segment,
                    self.radii[a.segment],
                )
                for a in exact
            ],
            sum(values[a.segment].nbytes for a in exact),
        )
        blends: dict[int, SegmentWrite] = {}
        clipped: list[int] = []
        for action, delta in zip(exact, deltas, strict=True):
            self.distances[action.segment] = delta.distance
            if delta.clipped:
                clipped.append(action.segment)
            if delta.blend_is_finite(action.alpha):
                blends[action.segment] = SegmentWrite(delta.values, action.alpha)
                continue
            blended = self.flat.blend_delta(action.segment, delta.values, action.alpha)
            if blended is None:
                raise NonFinitePayload(
                    f"merging segment {action.segment} of {what} would make the model "
                    "non-finite; refused, nothing merged"
                )
            blends[action.segment] = SegmentWrite(blended, None)
        return blends, clipped
