"""What one payload may do to the model: a sanity bound by default, a clipped merge on request.

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
* **clip** (``limits.merge_clip``, opt-in): a segment farther than ``merge_clip`` times
  that scale is pulled toward ours along the line between them until it is exactly
  that far, then merged at its full weight. The weights stay exact; the values do not:
  an honest segment farther than the radius is merged short, which biases the mesh's
  average (and slows agreement) by what was cut, so pick the radius above the honest
  distances ``gossipd_merges_clipped_total`` should stay at 0 for.

Both measure the same distance: one subtraction, written over the payload itself, and
two norms per merged segment, nothing kept between payloads. The norms also prove the
merge finite before it is written (:meth:`Delta.blend_is_finite`). The
scale is ours, so what one sender can do compounds: each merge can move a segment
by at most ``alpha * merge_clip`` (or ``alpha * max_payload_distance``) times its scale,
where ``alpha`` is the sender's share of the merged weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gossipd.node.config import LimitsConfig
from gossipd.node.errors import PayloadOutOfBounds


@dataclass(frozen=True)
class PayloadBound:
    """The bound and the optional clip radius, in multiples of a segment's own scale."""

    max_distance: float = LimitsConfig.model_fields["max_payload_distance"].default
    scale_floor: float = LimitsConfig.model_fields["payload_scale_floor"].default
    clip: float | None = None

    @classmethod
    def from_limits(cls, limits: LimitsConfig) -> PayloadBound:
        return cls(limits.max_payload_distance, limits.payload_scale_floor, limits.merge_clip)

    def delta(self, own: torch.Tensor, values: torch.Tensor, what: str, segment: int) -> Delta:
        """What merging ``values`` would move ``own`` by at full weight (incoming − own,
        pulled in when clipping); raises :class:`PayloadOutOfBounds` beyond the bound.

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
            if not distance <= self.max_distance * scale:  # inf and nan refused as well
                raise PayloadOutOfBounds(
                    f"segment {segment} of {what} is {distance:.3g} (RMS) from this node's own, "
                    f"over limits.max_payload_distance = {self.max_distance:g} times its scale "
                    f"{scale:.3g}; refused whole, nothing merged, the sender keeps its weight. "
                    "If honest sites hit this, their models diverged: raise the limit"
                )
            if self.clip is None or distance <= self.clip * scale:
                return Delta(diff, False, own_norm, distance_norm)
            factor = self.clip * scale / distance
            return Delta(diff.mul_(factor), True, own_norm, distance_norm * factor)


@dataclass(frozen=True)
class Delta:
    """A payload's difference from our own segment, within the bound, with both L2 norms."""

    values: torch.Tensor
    clipped: bool
    own_norm: float
    norm: float

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
