"""Sparse differences: the ``topk2`` and ``topk4`` codecs send the k largest entries of a
segment's difference from a copy both ends hold (SparseLoCo's top-k at 2 bits), and
error feedback (:mod:`gossipd.node.compression.feedback`) sends what they
left out later. They have no meaning for values whole: a sender sends those dense.

Layout, little-endian, every field's size following from the ones before it, so a payload
is checked to the byte before anything is allocated from it:

- ``k`` (uint32), the Rice parameter ``b`` (uint8), ``unary_bits`` (uint32);
- per group of :data:`GROUP` sent values, two magnitudes as bfloat16, lo and hi;
- the values: a sign bit and a magnitude level between lo and hi (one bit for ``topk2``,
  three for ``topk4``), four or two to a byte;
- the indices, ascending, as Rice codes of their gaps g ≥ 1 (the first from −1): the low
  ``b`` bits of g − 1 for every index, packed; then the high part, q = (g − 1) >> b, in
  unary (q one bits and a zero) for every index, ``unary_bits`` in all.

Rice coding with b ≈ log2 of the mean gap is within a bit of the gaps' entropy: about 8.6
bits an index at 1% of the entries, 7 at 3%, against 17-32 for plain positions; a sent
entry of ``topk2`` costs about 10.6 bits in all at 1%, a 300th of float32's 32 a parameter.
Both halves decode as whole-array operations: the unary stream's zeros are where its codes
end.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from gossipd.node.errors import InvalidFrame, NonFinitePayload

GROUP = 256  # sent values per set of scales
HEADER = struct.Struct("<IBI")  # k, Rice parameter, unary bits
MAX_FRACTION = 0.25  # past it a dense codec costs less; and the size bound below holds
MAX_RICE = 30


def fraction_error(fraction: float) -> str | None:
    """Why ``fraction`` is no share of entries to send (None: it is one)."""
    if not 0 < fraction <= MAX_FRACTION:
        return (
            f"the share of entries sent must be over 0 and at most {MAX_FRACTION}, not {fraction}"
        )
    return None


def entries(numel: int, fraction: float) -> int:
    """How many entries of ``numel`` a payload at ``fraction`` sends: at least one."""
    return min(numel, max(1, math.ceil(numel * fraction)))


def max_nbytes(numel: int) -> int:
    """The most bytes a payload for ``numel`` entries may take: a bound a receiver checks
    before it allocates. At MAX_FRACTION an entry costs at most 9 bits of index and 4 of
    value, 13 bits of every 4 entries: well under a byte an entry."""
    return HEADER.size + 16 + numel


def encode(flat: torch.Tensor, bits: int, fraction: float) -> memoryview:
    """The top ``fraction`` of ``flat``'s entries by magnitude, ``bits`` (2 or 4) each."""
    values = flat.detach().to("cpu", torch.float32).reshape(-1)
    numel = values.numel()
    k = entries(numel, fraction)
    index = torch.topk(values.abs(), k, sorted=False).indices.sort().values
    picked = values[index]
    scales, packed = _quantise(picked, bits)
    gaps = np.diff(index.numpy().astype(np.int64), prepend=-1) - 1
    rice = _rice_parameter(numel, k)
    high = gaps >> rice
    unary_bits = int(high.sum()) + k
    low_bits = _bits_of(gaps & ((1 << rice) - 1), rice)
    unary = np.ones(unary_bits, dtype=np.uint8)
    unary[np.cumsum(high + 1) - 1] = 0
    out = b"".join(
        (
            HEADER.pack(k, rice, unary_bits),
            scales.view(torch.uint8).numpy().tobytes(),
            packed.numpy().tobytes(),
            np.packbits(low_bits, bitorder="little").tobytes(),
            np.packbits(unary, bitorder="little").tobytes(),
        )
    )
    assert len(out) <= max_nbytes(numel), "a payload over its own bound"
    return memoryview(out)


def decode(data: bytes | bytearray | memoryview, bits: int, numel: int) -> torch.Tensor:
    """A payload to a dense float32 tensor of ``numel`` entries, zero where none was sent.

    Every field is checked against the others and against ``numel``; a payload that is
    not one this module writes raises :class:`InvalidFrame` (or :class:`NonFinitePayload`
    for a scale that is NaN, infinite or negative) and allocates nothing from its own
    claims."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise InvalidFrame(f"sparse payload of {len(view)} bytes is shorter than its header")
    k, rice, unary_bits = HEADER.unpack_from(view)
    if not 1 <= k <= numel or rice > MAX_RICE or not k <= unary_bits <= 8 * len(view):
        raise InvalidFrame(
            f"sparse payload claims {k} entries of {numel}, Rice parameter {rice} and "
            f"{unary_bits} unary bits: not a payload for this segment"
        )
    groups = -(-k // GROUP)
    sizes = (groups * 4, -(-k * bits // 8), -(-k * rice // 8))
    expected = HEADER.size + sum(sizes) + -(-unary_bits // 8)
    if len(view) != expected:
        raise InvalidFrame(
            f"sparse payload is {len(view)} bytes but {k} entries at {bits} bits with Rice "
            f"parameter {rice} and {unary_bits} unary bits take {expected}"
        )
    raw = np.frombuffer(view, dtype=np.uint8)
    at = HEADER.size
    scales = torch.from_numpy(raw[at : at + sizes[0]].copy()).view(torch.bfloat16).float()
    at += sizes[0]
    packed = torch.from_numpy(raw[at : at + sizes[1]].copy())
    at += sizes[1]
    low = np.unpackbits(raw[at : at + sizes[2]], count=k * rice, bitorder="little")
    at += sizes[2]
    unary = np.unpackbits(raw[at:], count=unary_bits, bitorder="little")
    index = _indices(low, unary, k, rice, numel)
    if not math.isfinite(float(scales.sum())) or bool((scales < 0).any()):
        raise NonFinitePayload("sparse payload has a scale that is negative, NaN or infinite")
    out = torch.zeros(numel, dtype=torch.float32)
    out[torch.from_numpy(index)] = _dequantise(scales, packed, bits, k)
    return out


def _rice_parameter(numel: int, k: int) -> int:
    """log2 of the mean gap, rounded down: the Rice code's best parameter within a bit."""
    return min(MAX_RICE, max(0, math.floor(math.log2(numel / k))))


def _bits_of(values: np.ndarray, width: int) -> np.ndarray:
    """``width`` low bits of each value, least significant first, one byte a bit."""
    if width == 0:
        return np.zeros(0, dtype=np.uint8)
    shifts = np.arange(width, dtype=np.int64)
    return ((values[:, None] >> shifts) & 1).astype(np.uint8).reshape(-1)


def _indices(low: np.ndarray, unary: np.ndarray, k: int, rice: int, numel: int) -> np.ndarray:
    ends = np.flatnonzero(unary == 0)
    if len(ends) != k or ends[-1] != len(unary) - 1:
        raise InvalidFrame(
            f"sparse payload's unary codes end {len(ends)} times for {k} entries, or run on "
            "past the last"
        )
    high = np.diff(ends, prepend=-1) - 1
    if int(high.max()) > numel >> rice:  # an index past the segment, before any shift
        raise InvalidFrame(f"sparse payload has a gap past the segment's {numel} entries")
    gaps = high << rice
    if rice:
        gaps += low.reshape(k, rice).astype(np.int64) @ (1 << np.arange(rice, dtype=np.int64))
    index = np.cumsum(gaps + 1) - 1
    if int(index[-1]) >= numel:
        raise InvalidFrame(
            f"sparse payload has an entry at {int(index[-1])}, past the segment's {numel}"
        )
    return index


def _quantise(picked: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales as bfloat16, values packed): the layout in the module's docstring.

    A code is a sign bit and a magnitude level m: the magnitude is lo + m·(hi − lo)/(L − 1)
    with L = 2 levels (``topk2``: lo and hi are the mean magnitudes of the group's values
    below and at or above their mean, one Lloyd step) or 8 (``topk4``: the group's least
    and largest magnitudes). Top-k magnitudes all lie between the k-th largest and the
    largest, so levels spread over that range, not from zero, spend no code on small ones.
    """
    k = picked.numel()
    groups = -(-k // GROUP)
    live = torch.zeros(groups * GROUP, dtype=torch.bool)
    live[:k] = True
    live = live.view(groups, GROUP)
    sizes = torch.zeros(groups * GROUP)
    sizes[:k] = picked.abs()
    sizes = sizes.view(groups, GROUP)
    levels = (1 << (bits - 1)) - 1  # the highest magnitude level
    if bits == 2:
        mean = sizes.sum(dim=1) / live.sum(dim=1)
        high = (sizes >= mean[:, None]) & live
        low = ~high & live
        hi = (sizes * high).sum(dim=1) / high.sum(dim=1).clamp(min=1)
        lo = (sizes * low).sum(dim=1) / low.sum(dim=1).clamp(min=1)
        lo = torch.where(low.any(dim=1), lo, hi)
    else:
        hi = sizes.amax(dim=1)
        lo = torch.where(live, sizes, torch.full_like(sizes, math.inf)).amin(dim=1)
    scales = torch.stack((lo, hi), dim=1).to(torch.bfloat16)
    lo_q, hi_q = scales.float().unbind(dim=1)
    step = (hi_q - lo_q) / levels
    inverse = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    level = ((sizes - lo_q[:, None]) * inverse[:, None]).round_().clamp_(0, levels)
    codes = level.to(torch.uint8).reshape(-1)[:k] << 1 | (picked < 0).to(torch.uint8)
    return scales.reshape(-1), _pack(codes, bits)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    padded = torch.zeros(-(-codes.numel() // per) * per, dtype=torch.uint8)
    padded[: codes.numel()] = codes
    lanes = padded.view(-1, per)
    out = torch.zeros(lanes.shape[0], dtype=torch.uint8)
    for lane in range(per):
        out |= lanes[:, lane] << (lane * bits)
    return out


def _dequantise(scales: torch.Tensor, packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    per, mask = 8 // bits, (1 << bits) - 1
    codes = torch.stack([(packed >> (lane * bits)) & mask for lane in range(per)], dim=1)
    codes = codes.reshape(-1)[:k].to(torch.int64)
    lo, hi = scales.view(-1, 2).unbind(dim=1)
    group = torch.arange(k) // GROUP
    levels = (1 << (bits - 1)) - 1
    size = lo[group] + (codes >> 1).float() * ((hi - lo)[group] / levels)
    return torch.where((codes & 1).bool(), -size, size)
