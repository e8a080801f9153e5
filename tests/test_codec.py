"""Codecs (node/compression/codecs.py).

Protects docs/design.md §4: an exact raw codec, half codecs within their precision, int8
and int4 within half a block's scale, and a decode that refuses NaN, infinity, a bad scale
and a wrong length, naming the bad value.
"""

from __future__ import annotations

import math

import pytest
import torch

from gossipd.node.compression import codecs as wirecodec
from gossipd.node.compression.codecs import Codec
from gossipd.node.errors import (
    GossipdError,
    InvalidFrame,
    MeshMismatch,
    NonFinitePayload,
    PayloadTooLarge,
)
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
    assert len(data) == x.numel() * 2 == wirecodec.encoded_nbytes(codec, dtype, x.numel())
    y = wirecodec.decode(bytearray(data), codec, dtype, x.numel())
    assert y.dtype == dtype
    torch.testing.assert_close(y, x, rtol=rtol, atol=1e-4)


@pytest.mark.parametrize(("codec", "levels"), [(Codec.INT8, 127), (Codec.INT4, 7)])
@pytest.mark.parametrize("numel", [1, 255, 256, 257, 1001])
@pytest.mark.parametrize("dtype", [F32, F64, F16, BF16])
def test_int_codecs_err_by_at_most_half_a_blocks_scale(codec, levels, numel, dtype):
    x = seeded_values(F32, numel).to(dtype)
    x[numel // 2] = 50.0  # an outlier coarsens its own block only
    data = wirecodec.encode(x, codec)
    assert len(data) == wirecodec.encoded_nbytes(codec, dtype, numel)
    y = wirecodec.decode(bytearray(data), codec, dtype, numel)
    assert y.dtype == dtype and y.shape == x.shape
    blocks = -(-numel // wirecodec.BLOCK)
    for b in range(blocks):
        part = slice(b * wirecodec.BLOCK, (b + 1) * wirecodec.BLOCK)
        exact = x[part].float()
        scale = exact.abs().max() / levels
        # Half a step, with the bfloat16 rounding of the scale and the dtype's own rounding.
        bound = 0.5 * scale * (1 + 2**-7) + exact.abs().max() * 2**-7 + 1e-12
        assert (y[part].float() - exact).abs().max() <= bound, b


def test_int_codecs_send_a_quarter_and_an_eighth_of_float32_plus_the_scales():
    n = 4 << 20
    assert wirecodec.encoded_nbytes(Codec.INT8, F32, n) == n + n // 128
    assert wirecodec.encoded_nbytes(Codec.INT4, F32, n) == n // 2 + n // 128
    assert 4 * n / wirecodec.encoded_nbytes(Codec.INT8, F32, n) > 3.96
    assert 4 * n / wirecodec.encoded_nbytes(Codec.INT4, F32, n) > 7.87
    assert wirecodec.encoded_nbytes(Codec.INT4, F32, 3) == 2 + 2  # one scale, one and a half bytes


def test_int_codecs_keep_zeros_exact_and_code_an_all_zero_block_with_scale_zero():
    x = torch.zeros(600)
    x[300] = 3.0
    for codec in (Codec.INT8, Codec.INT4):
        y = wirecodec.decode(bytearray(wirecodec.encode(x, codec)), codec, F32, 600)
        assert torch.equal(y[x == 0], x[x == 0])
        assert y[300] == pytest.approx(3.0, rel=2**-7)


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4])
@pytest.mark.parametrize("scale", [math.nan, math.inf, -1.0])
def test_int_decode_refuses_a_scale_that_is_not_finite_or_is_negative(codec, scale):
    data = bytearray(wirecodec.encode(seeded_values(F32, 300), codec))
    data[2:4] = torch.tensor([scale], dtype=BF16).view(torch.uint8).numpy().tobytes()
    with pytest.raises(NonFinitePayload, match=f"{codec.name.lower()} payload has a scale"):
        wirecodec.decode(data, codec, F32, 300)


@pytest.mark.parametrize("codec", [Codec.INT8, Codec.INT4])
def test_int_decode_refuses_values_that_overflow_the_models_dtype(codec):
    data = bytearray(wirecodec.encode(torch.full((10,), 60000.0), codec))
    data[0:2] = torch.tensor([3e38], dtype=BF16).view(torch.uint8).numpy().tobytes()
    with pytest.raises(NonFinitePayload, match="NaN or infinite values out of 10"):
        wirecodec.decode(data, codec, F16, 10)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("codec", [Codec.RAW, Codec.FP16, Codec.BF16])
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
    assert Codec.parse("int8") is Codec.INT8 and Codec.parse("int4") is Codec.INT4
    with pytest.raises(ValueError, match=r"'int2'.*raw, fp16, bf16, int8, int4"):
        Codec.parse("int2")


def test_every_codec_error_is_a_gossipd_error():
    for err in (InvalidFrame, NonFinitePayload, PayloadTooLarge, MeshMismatch):
        assert issubclass(err, GossipdError)
