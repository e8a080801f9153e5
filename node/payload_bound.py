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

Both measure the same distance: one subtraction and two norms per merged segment
(a pass over it twice more than the blend itself), nothing kept between payloads. The
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

    def delta(
        self, own: torch.Tensor, values: torch.Tensor, what: str, segment: int
    ) -> tuple[torch.Tensor, bool]:
        """What merging ``values`` would move ``own`` by at full weight (incoming − own, a
        new tensor the caller may overwrite; pulled in when clipping) and whether it was
        clipped; raises :class:`PayloadOutOfBounds` beyond the bound. Within the bound
        it is finite, so a blend may start from it (:meth:`FlatModel.blend_delta`)."""
        with torch.no_grad():
            delta = values.to(own.device, own.dtype) - own
            distance = _rms(delta)
            scale = max(_rms(own), self.scale_floor)
            if not distance <= self.max_distance * scale:  # inf and nan refused as well
                raise PayloadOutOfBounds(
                    f"segment {segment} of {what} is {distance:.3g} (RMS) from this node's own, "
                    f"over limits.max_payload_distance = {self.max_distance:g} times its scale "
                    f"{scale:.3g}; refused whole, nothing merged, the sender keeps its weight. "
                    "If honest sites hit this, their models diverged: raise the limit"
                )
            if self.clip is None or distance <= self.clip * scale:
                return delta, False
            return delta.mul_(self.clip * scale / distance), True


def _rms(t: torch.Tensor) -> float:
    """Root mean square, in the tensor's own dtype first: a float64 norm of a float32
    segment converts every element and cost 40x as much (a 256 MiB push went from 0.12
    to 0.33 s). A float32 sum of squares overflows long before the values do, so a
    result that is not finite is computed again in float64, which is exact enough."""
    n = max(t.numel(), 1)
    norm = float(torch.linalg.vector_norm(t))
    if not math.isfinite(norm):
        norm = float(torch.linalg.vector_norm(t, dtype=torch.float64))
    return norm / math.sqrt(n)
