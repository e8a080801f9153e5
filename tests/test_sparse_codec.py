"""The sparse codecs topk2 and topk4 (node/compression/sparse.py): which entries they send,
how close the values come back, what they cost a sent entry, and that a payload that is
not one they write is refused with a clear error and nothing allocated from its claims."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest
import torch

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.compression import sparse
from gossipd.node.compression.codecs import Codec
from gossipd.node.compression.feedback import WHOLE, FeedbackSender
from gossipd.node.errors import InvalidFrame, NonFinitePayload

NUMEL = 100_000


def _values(numel: int = NUMEL, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("fraction", [0.01, 0.03, 0.25])
def test_the_largest_entries_come_back_with_their_signs_and_the_rest_as_zero(bits, fraction):
    x = _values()
    y = sparse.decode(bytes(sparse.encode(x, bits, fraction)), bits, NUMEL)
    k = sparse.entries(NUMEL, fraction)
    top = torch.topk(x.abs(), k).indices
    sent = torch.zeros(NUMEL, dtype=torch.bool)
    sent[top] = True
    assert bool((y[~sent] == 0).all())
    assert bool((torch.sign(y[top]) == torch.sign(x[top])).all())
    error = float((x[top] - y[top]).norm() / x[top].norm())
    # Measured: 2 bits 0.063, 0.079, 0.149; 4 bits 0.025, 0.031, 0.057.
    assert error < (0.16 if bits == 2 else 0.06)


@pytest.mark.parametrize(
    ("bits", "fraction", "most"), [(2, 0.01, 10.5), (2, 0.03, 9.0), (4, 0.01, 12.5)]
)
def test_a_sent_entry_costs_about_ten_bits_index_and_value_and_header_included(
    bits, fraction, most
):
    data = sparse.encode(_values(), bits, fraction)
    k = sparse.entries(NUMEL, fraction)
    # Measured: 10.30, 8.76 and 12.30 bits: a 300th to a 260th of float32's 32 at 1%.
    assert 8 * len(data) / k < most
    assert len(data) <= sparse.max_nbytes(NUMEL)


def test_at_the_largest_fraction_a_payload_stays_under_its_bound_whatever_the_values():
    for seed, numel in ((0, 1), (1, 7), (2, 256), (3, 4097), (4, 65_536)):
        x = _values(numel, seed) * torch.logspace(-30, 30, numel)  # magnitudes far apart
        for bits in (2, 4):
            data = sparse.encode(x, bits, sparse.MAX_FRACTION)
            assert len(data) <= sparse.max_nbytes(numel)
            assert sparse.decode(bytes(data), bits, numel).shape == (numel,)


def test_clustered_entries_and_the_first_and_last_index_decode_exactly():
    x = torch.zeros(5000)
    x[[0, 1, 2, 3, 4999]] = torch.tensor([1.0, -2.0, 3.0, -4.0, 5.0])
    x[1000:1010] = 9.0
    y = sparse.decode(bytes(sparse.encode(x, 4, 15 / 5000)), 4, 5000)
    assert torch.equal(torch.nonzero(y).view(-1), torch.nonzero(x).view(-1))


def test_through_the_codec_table_a_sparse_payload_is_checked_against_its_bound():
    x = _values(1000)
    data = wirecodec.encode(x, Codec.TOPK2, 0.05)
    assert wirecodec.is_sparse(Codec.TOPK2) and not wirecodec.is_sparse(Codec.INT4)
    assert wirecodec.encoded_nbytes(Codec.TOPK2, torch.float32, 1000) == sparse.max_nbytes(1000)
    y = wirecodec.decode(bytearray(data), Codec.TOPK2, torch.float16, 1000)
    assert y.dtype == torch.float16 and int((y != 0).sum()) == 50
    bound = sparse.max_nbytes(1000)
    with pytest.raises(InvalidFrame, match=rf"1000 elements .* in topk2 need at most {bound}"):
        wirecodec.decode(bytes(bound + 1), Codec.TOPK2, torch.float32, 1000)


def test_a_sender_sends_values_whole_dense_and_differences_sparse():
    sender = FeedbackSender(Codec.TOPK2, max_peers=2, fraction=0.01)
    x = _values(10_000)
    first = sender.encode("b", 0, x, sequence=1)
    assert first.base == WHOLE and first.codec == wirecodec.SPARSE_WHOLE
    sender.settled("b", 1, kept={0}, segments={0})
    second = sender.encode("b", 0, x + 0.001 * _values(10_000, 1), sequence=2)
    assert second.base == first.version and second.codec == Codec.TOPK2
    assert len(second.data) < len(first.data) / 20


def _payload() -> bytes:
    return bytes(sparse.encode(_values(4096), 2, 0.02))


def _patched(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize(
    ("broken", "match"),
    [
        (lambda d: d[:5], r"shorter than its header"),
        (lambda d: d[:-1], r"bytes but \d+ entries at 2 bits"),
        (lambda d: d + b"\0", r"bytes but \d+ entries at 2 bits"),
        (lambda d: _patched(d, 0, "<I", 0), r"claims 0 entries of 4096"),
        (lambda d: _patched(d, 0, "<I", 4097), r"claims 4097 entries of 4096"),
        (lambda d: _patched(d, 4, "<B", 31), r"Rice parameter 31"),
        (lambda d: _patched(d, 5, "<I", 2**32 - 1), r"4294967295 unary bits"),
    ],
)
def test_a_header_that_disagrees_with_the_payload_is_refused_naming_it(broken, match):
    with pytest.raises(InvalidFrame, match=match):
        sparse.decode(broken(_payload()), 2, 4096)


def test_unary_codes_that_run_past_the_segment_or_do_not_end_are_refused():
    data = bytearray(_payload())
    data[-1] |= 0x80 >> (8 - (struct.unpack_from("<I", data, 5)[0] % 8 or 8))  # last bit a one
    with pytest.raises(InvalidFrame, match=r"unary codes end"):
        sparse.decode(bytes(data), 2, 4096)
    with pytest.raises(InvalidFrame, match=r"past the segment"):
        sparse.decode(_payload(), 2, 1000)  # the same indices, a smaller segment


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0])
def test_a_scale_that_is_not_finite_or_is_negative_is_refused(scale):
    data = bytearray(_payload())
    data[sparse.HEADER.size : sparse.HEADER.size + 2] = (
        torch.tensor([scale], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    )
    with pytest.raises(NonFinitePayload, match=r"scale that is negative, NaN or infinite"):
        sparse.decode(bytes(data), 2, 4096)


def test_random_corruption_is_refused_or_decodes_within_the_segment_never_anything_else():
    good = _payload()
    rng = random.Random(0)
    refused = 0
    for _ in range(2000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            out = sparse.decode(bytes(data), 2, 4096)
        except (InvalidFrame, NonFinitePayload):
            refused += 1
            continue
        assert out.shape == (4096,) and bool(torch.isfinite(out).all())
    assert refused > 0


def test_a_fraction_past_the_largest_or_not_over_zero_is_named():
    assert sparse.fraction_error(0.01) is None
    assert "at most 0.25, not 0.5" in (sparse.fraction_error(0.5) or "")
    assert "over 0" in (sparse.fraction_error(0.0) or "")
    assert sparse.entries(10, 0.01) == 1 and sparse.entries(3, 0.25) == 1
    assert np.isclose(sparse.entries(NUMEL, 0.01), 1000)
