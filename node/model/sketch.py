"""A count sketch of a model: how far apart the mesh's models are, without moving them.

`gossipd status --mesh` shows each site's distance from the mesh's mean model. Fetching
every model to compute it would move the whole mesh's parameters over the operator's
link at each look; a sketch of a few thousand numbers per site does instead. Each value
goes into one of ``size`` buckets with a random sign, both drawn from a fixed seed, so
every site with the same model layout hashes alike, and the sketch is linear: the sketch
of a mean is the mean of the sketches, the sketch of a difference the difference. For
any vector v, ‖sketch(v)‖² is an unbiased estimate of ‖v‖² whose relative spread falls
as 1/√size (Charikar, Chen and Farach-Colton 2002): about 2 % at the default 4,096.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# The most buckets a Status request may ask for: a sketch is sent as float32 in one reply.
MAX_SKETCH_SIZE = 65_536
# Values hashed per draw of random buckets and signs: bounds the scratch memory (16 MiB of
# int64 at most) whatever the model's size.
_CHUNK = 1 << 20
_SEED = 0x6F55_1D


def sketch(buffers: Sequence[torch.Tensor], size: int) -> list[float]:
    """The model's count sketch with ``size`` buckets (float64 sums, returned as floats)."""
    if not 0 < size <= MAX_SKETCH_SIZE:
        raise ValueError(f"sketch size {size} is not within 1..{MAX_SKETCH_SIZE}")
    out = torch.zeros(size, dtype=torch.float64)
    generator = torch.Generator()
    for segment, flat in enumerate(buffers):
        values = flat.detach().reshape(-1)
        for start in range(0, values.numel(), _CHUNK):
            chunk = values[start : start + _CHUNK].to("cpu", torch.float64)
            generator.manual_seed(_SEED + (segment << 32) + start)
            buckets = torch.randint(size, (chunk.numel(),), generator=generator)
            signs = torch.randint(2, (chunk.numel(),), generator=generator) * 2 - 1
            out.index_add_(0, buckets, chunk * signs)
    return out.tolist()
