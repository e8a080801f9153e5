"""What one payload may do to the model: a sanity bound, a relative clip, a fixed clip on request.

mTLS says who may speak, not that a member is honest: one push of finite 1e30 values
at weight 1 used to leave every model of the mesh at about 1e29. Honest payloads are
estimates of the same average as ours, so their distance from our own segment is of
the order of the segment itself (about 1.4x its RMS between two random
initialisations, and shrinking as the mesh agrees). A payload far beyond that is not
an estimate of anything:

* **bound** (default): a segment whose RMS distance from ours exceeds
  ``limits.max_payload_distance`` times ``max(RMS of ours, limits.payload_scale_floor)``
  refuses the whole payload (:class:`PayloadOutOfBounds`), before anything is merged:
  the model stays bit-for-bit as it was and the sender folds its weight back.
* **relative clip** (``limits.clip_factor``, default 10, ``inf`` off): the radius is set by
  what the other senders' payloads had (``trainer/clip_radius.py``), and a farther segment is
  pulled in to it as below.
* **clip** (``limits.merge_clip``, opt-in): a segment farther than ``merge_clip`` times
  that scale is pulled toward ours along the line between them until it is exactly
  that far, then merged at its full weight. The weights stay exact; the values do not:
  an honest segment farther than the radius is merged short, which biases the mesh's
  average (and slows agreement) by what was cut, so pick the radius above the honest
  distances ``gossipd_merges_clipped_total`` should stay at 0 for.

Both measure the same distance. A pushed or pulled payload is measured when it arrives,
in the receiving worker while the rest is still on the wire (:meth:`PayloadBound.gauge`:
three dot products, ‖v‖², v·x and ‖x‖², against our segment as it is then); its merge at
the trainer's step boundary then only checks those numbers and blends, one pass
(:meth:`PayloadBound.admits`). A payload without a gauge (a GPU model, values whose
squares overflow), one a clip must pull in, or a model near its dtype's limit takes
the exact path at merge time: one subtraction, written over the payload itself, and
two norms, which also prove the merge finite before it is written
(:meth:`Delta.blend_is_finite`). The
scale is ours, so what one sender can do compounds: each merge can move a segment
by at most ``alpha * merge_clip`` (or ``alpha * max_payload_distance``) times its scale,
where ``alpha`` is the sender's share of the merged weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gossipd.node.errors import PayloadOutOfBounds
from gossipd.node.shared.config import LimitsConfig


@dataclass(frozen=True)
class PayloadBound:
    """The bound and the optional clip radius, in multiples of a segment's own scale."""

    max_distance: float = LimitsConfig.model_fields["max_payload_distance"].default
    scale_floor: float = LimitsConfig.model_fields["payload_scale_floor"].default
    clip: float | None = None
    # The radius factor of ``trainer/clip_radius.py`` (None: no radius from the others).
    clip_factor: float | None = LimitsConfig.model_fields["clip_factor"].default

    @classmethod
    def from_limits(cls, limits: LimitsConfig) -> PayloadBound:
        return cls(
            limits.max_payload_distance,
            limits.payload_scale_floor,
            limits.merge_clip,
            limits.clip_factor if math.isfinite(limits.clip_factor) else None,
        )

    def delta(
        self,
        own: torch.Tensor,
        values: torch.Tensor,
        what: str,
        segment: int,
        radius: float | None = None,
    ) -> Delta:
        """What merging ``values`` would move ``own`` by at full weight (incoming − own,
        pulled in when clipping); raises :class:`PayloadOutOfBounds` beyond the bound.
        ``radius``: the other senders' typical RMS distance (``trainer/clip_radius.py``; None:
        none), which sets a clip radius of its own.

        The difference is written over ``values`` when they are already ``own``'s dtype and
        device: a received payload is a buffer of its own that nothing reads after its
        merge, and a fresh 16 MiB temporary per segment page-faults its way through memory.
        """
        with torch.no_grad():
            if values.dtype == own.dtype and values.device == own.device:
                diff = values.sub_(own)
            else:
                diff = values.to(own.device, own.dtype) - own
            distance_norm = _norm(diff)
            own_norm = _norm(own)
            root_n = math.sqrt(max(own.numel(), 1))
            distance, scale = distance_norm / root_n, max(own_norm / root_n, self.scale_floor)
            self._refuse_beyond(distance, scale, what, segment)
            limit = self._clip_radius(scale, radius)
            if limit is None or distance <= limit:
                return Delta(diff, False, own_norm, distance_norm, distance)
            factor = limit / distance
            return Delta(diff.mul_(factor), True, own_norm, distance_norm * factor, distance)

    def gauge(
        self,
        own: torch.Tensor,
        values: torch.Tensor,
        each: Callable[[torch.Tensor], None] | None = None,
    ) -> Gauge | None:
        """``values``' squared norms against ``own`` as it is now, or None when they cannot
        stand in for the exact path (another dtype or device, or a square that overflowed).

        Runs in a receiving worker, not on the trainer thread: ``own`` may change while it
        is read (a step, even mid-block), so the numbers describe our segment within a
        step or two of the merge. That is what a sanity bound needs; the blend itself is
        computed at merge time from the segment as it is then. A finite ‖v‖² also proves
        every value finite, so the receiver's separate finiteness pass is not needed.
        ``each`` is handed every block of ``values`` first, in order (the receiver
        hashes it while the block is in cache).
        """
        if (
            values.dtype != own.dtype
            or own.dtype not in (torch.float32, torch.float64)
            or own.device.type != "cpu"
            or values.device.type != "cpu"
            or values.shape != own.shape
        ):
            return None
        vv = vo = oo = 0.0
        with torch.no_grad():
            # Blocks that stay in cache: each is read from memory once for all three dots.
            for start in range(0, values.numel(), _GAUGE_BLOCK):
                v, o = values[start : start + _GAUGE_BLOCK], own[start : start + _GAUGE_BLOCK]
                if each is not None:
                    each(v)
                vv += float(torch.dot(v, v))
                vo += float(torch.dot(v, o))
                oo += float(torch.dot(o, o))
        if not (math.isfinite(vv) and math.isfinite(vo) and math.isfinite(oo)):
            return None
        return Gauge(vv, vo, oo, values.numel(), torch.finfo(own.dtype).max)

    def admits(
        self, gauge: Gauge, alpha: float, what: str, segment: int, radius: float | None = None
    ) -> bool:
        """Whether a gauged segment may be blended as it is (``x.lerp_(values, alpha)``);
        raises :class:`PayloadOutOfBounds` beyond the bound. False: the exact path must
        decide (a clip pulls it in, or its finiteness is not proven)."""
        root_n = math.sqrt(max(gauge.numel, 1))
        scale = max(math.sqrt(gauge.own_sq) / root_n, self.scale_floor)
        distance = gauge.distance
        self._refuse_beyond(distance, scale, what, segment)
        limit = self._clip_radius(scale, radius)
        if limit is not None and distance > limit:
            return False
        return gauge.blend_is_finite(alpha)

    def _clip_radius(self, scale: float, typical: float | None) -> float | None:
        """The RMS distance a payload is pulled in to: the smaller of ``merge_clip`` times
        our scale and ``clip_factor`` times the other senders' ``typical`` distance (at
        least ``RADIUS_FLOOR`` of our scale: near consensus the distances shrink to
        rounding, and how far apart they are there says nothing); None: neither applies."""
        fixed = None if self.clip is None else self.clip * scale
        relative = None
        if typical is not None and self.clip_factor is not None:
            relative = self.clip_factor * max(typical, RADIUS_FLOOR * scale)
        limits = [r for r in (relative, fixed) if r is not None]
        return min(limits) if limits else None

    def _refuse_beyond(self, distance: float, scale: float, what: str, segment: int) -> None:
        if not distance <= self.max_distance * scale:  # inf and nan refused as well
            raise PayloadOutOfBounds(
                f"segment {segment} of {what} is {distance:.3g} (RMS) from this node's own, "
                f"over limits.max_payload_distance = {self.max_distance:g} times its scale "
                f"{scale:.3g}; refused whole, nothing merged, the sender keeps its weight. "
                "If honest sites hit this, their models diverged: raise the limit"
            )


# The least typical distance a relative clip radius is computed from, as a share of the
# segment's scale: 1% (a model 1% of its own RMS from the others' is in consensus).
RADIUS_FLOOR = 0.01

# 512K elements: the three dots of 256 MiB took 32.5 ms on the 2-core VM (best of 5,
# interleaved), against 39.7 with 1M-element blocks and 35.2 with 256K; a finite-sum pass
# alone takes about a third of that.
_GAUGE_BLOCK = 1 << 19


@dataclass(frozen=True)
class Gauge:
    """A payload's squared norms against our segment, taken when it arrived.

    The distance comes from ‖v − x‖² = ‖v‖² − 2 v·x + ‖x‖². That loses the digits
    of a tiny distance to cancellation (about 5e-4 of the segment's RMS at 4M
    elements), far below any bound worth setting (the default is 100 times it).
    """

    values_sq: float
    cross: float
    own_sq: float
    numel: int
    dtype_max: float

    @property
    def distance_sq(self) -> float:
        return max(self.values_sq - 2.0 * self.cross + self.own_sq, 0.0)

    @property
    def distance(self) -> float:
        """The RMS distance of the payload from our segment."""
        return math.sqrt(self.distance_sq) / math.sqrt(max(self.numel, 1))

    def blend_is_finite(self, alpha: float) -> bool:
        """Whether ``x.lerp_(values, alpha)`` stays finite. Every element of either vector is
        bounded by its norm, so only the difference inside lerp can overflow, and not while
        the norms sum to under a quarter of the dtype's maximum: that leaves our segment
        room to double its norm between arrival and merge, which no trainer that has not
        diverged already does in a step or two."""
        bound = math.sqrt(self.values_sq) + math.sqrt(self.own_sq)
        return 0.0 <= alpha <= 1.0 and bound <= self.dtype_max / 4


@dataclass(frozen=True)
class Delta:
    """A payload's difference from our own segment, within the bound, with both L2 norms."""

    values: torch.Tensor
    clipped: bool
    own_norm: float
    norm: float
    distance: float  # RMS, before any clipping

    def blend_is_finite(self, alpha: float) -> bool:
        """Whether own + α·delta is finite in every element, proven from the norms alone.

        Every element is bounded by its vector's L2 norm, so no element of the blend
        exceeds ``own_norm + norm`` (α ≤ 1); half the dtype's maximum leaves room for the
        rounding of the norms and of the blend. False means "not proven" (a model near the
        dtype's limit): then the blend itself must be computed and checked.
        """
        limit = torch.finfo(self.values.dtype).max / 2
        return 0.0 <= alpha <= 1.0 and self.own_norm + alpha * self.norm <= limit


def _norm(t: torch.Tensor) -> float:
    """L2 norm, in the tensor's own dtype first: a float64 norm of a float32 segment
    converts every element and cost 40x as much (a 256 MiB push went from 0.12 to 0.33 s).
    A float32 sum of squares overflows long before the values do, so a result that is
    not finite is computed again in float64, which is exact enough."""
    norm = float(torch.linalg.vector_norm(t))
    if not math.isfinite(norm):
        norm = float(torch.linalg.vector_norm(t, dtype=torch.float64))
    return norm
