"""Codecs (node/trainer/codec.py).

Protects docs/design.md §8: an exact raw codec, half codecs within their precision, and
a decode that refuses NaN, infinity and a wrong length, naming the bad value.
"""

from __future__ import annotations

import math

import pytest
import torch

from gossipd.node.errors import (
    GossipdError,
    InvalidFrame,
    MeshMismatch,
    NonFinitePayload,
    PayloadTooLarge,
)
from gossipd.node.trainer import codec as wirecodec
from gossipd.node.trainer.codec import Codec
from tests.tensors import BF16, F16, F32, F64, seeded_values


@pytest.mark.parametrize("dtype", [F32, F64, F16, BF16])
def test_raw_codec_round_trip_is_bit_exact(dtype):
    x = seeded_values(dtype)
    data = wirecodec.encode(x, Codec.RAW)
    assert len(data) == x.numel() * x.element_size()
    y = wirecodec.decode(bytearray(data), Codec.RAW, dtype, x.numel())
    assert y.dtype == dtype
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize(
    ("codec", "rtol"), [(Codec.FP16, 2**-11), (Codec.BF16, 2**-8)], ids=["fp16", "bf16"]
)
@pytest.mark.parametrize("dtype", [F32, F64])
def test_half_codecs_halve_the_bytes_and_round_within_their_precision(codec, rtol, dtype):
    x = seeded_values(dtype)
    data = wirecodec.encode(x, codec)
    assert len(data) == x.numel() * 2 == x.numel() * wirecodec.encoded_itemsize(codec, dtype)
    y = wirecodec.decode(bytearray(data), codec, dtype, x.numel())
    assert y.dtype == dtype
    torch.testing.assert_close(y, x, rtol=rtol, atol=1e-4)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("codec", list(Codec))
def test_decode_refuses_nan_and_infinity_counting_them(bad, codec):
    x = seeded_values(F32, 50)
    x[3] = bad
    x[40] = bad
    data = bytearray(wirecodec.encode(x, codec))
    with pytest.raises(NonFinitePayload, match="2 NaN or infinite values out of 50"):
        wirecodec.decode(data, codec, F32, 50)


def test_fp16_overflow_is_refused_at_decode_instead_of_merged_as_infinity():
    x = torch.tensor([1.0, 70000.0], dtype=F32)  # above fp16's 65504
    data = bytearray(wirecodec.encode(x, Codec.FP16))
    with pytest.raises(NonFinitePayload):
        wirecodec.decode(data, Codec.FP16, F32, 2)


def test_decode_refuses_wrong_length_naming_both_sizes():
    data = bytearray(wirecodec.encode(seeded_values(F32, 10), Codec.RAW))
    with pytest.raises(InvalidFrame, match=r"payload is 40 bytes but 11 elements .* need 44"):
        wirecodec.decode(data, Codec.RAW, F32, 11)


def test_codec_parse_accepts_names_and_refuses_unknown_listing_choices():
    assert Codec.parse("raw") is Codec.RAW
    assert Codec.parse("FP16") is Codec.FP16
    assert Codec.parse("bf16") is Codec.BF16
    with pytest.raises(ValueError, match=r"'int4'.*raw, fp16, bf16"):
        Codec.parse("int4")


def test_every_codec_error_is_a_gossipd_error():
    for err in (InvalidFrame, NonFinitePayload, PayloadTooLarge, MeshMismatch):
        assert issubclass(err, GossipdError)
