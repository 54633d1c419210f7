"""comm/codec.py: block-wise int8/int4 codes with one fp32 scale per block.

Every decoded value must lie within its block's bound (half a step, plus 2^-16 of a step for
the fp32 roundings) of the value encoded, also for all-zero, constant, huge and subnormal
blocks; a block with NaN or Inf must decode to NaN throughout (never a finite number); the
packed bytes are the scales, then the codes (two per byte for int4); error feedback's residual
is exactly what decoding loses.
"""
from __future__ import annotations

import math

import pytest
import torch

from zerompi.comm.codec import BlockCodec

FLT_MAX = torch.finfo(torch.float32).max
TINY = torch.finfo(torch.float32).smallest_normal
CODECS = [BlockCodec(8, 256), BlockCodec(4, 256), BlockCodec(8, 64), BlockCodec(4, 2), BlockCodec(8, 6)]
IDS = [f"{c.name}-b{c.block}" for c in CODECS]


def round_trip(codec: BlockCodec, x: torch.Tensor, chunk: int):
    packed = codec.encode(x, chunk)
    return packed, codec.decode(packed, chunk).reshape(-1), codec.bound(packed, chunk).reshape(-1)


def step_of(codec: BlockCodec, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per element, the step of its block computed here from the data: max|x| / qmax."""
    k = x.numel() // chunk
    blocks = torch.nn.functional.pad(x.view(k, chunk).double().abs(), (0, codec.blocks(chunk) * codec.block - chunk))
    amax = blocks.view(k, -1, codec.block).amax(-1)
    return (amax / codec.qmax).repeat_interleave(codec.block, 1)[:, :chunk].reshape(-1)


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
@pytest.mark.parametrize("chunk,k", [(1000, 3), (1024, 2), (7, 5), (257, 1), (1, 4)])
def test_round_trip_within_half_a_step(codec, chunk, k):
    g = torch.Generator().manual_seed(chunk * 31 + k)
    x = torch.randn(chunk * k, generator=g) * torch.logspace(-30, 30, chunk * k).roll(chunk // 3)
    packed, y, bound = round_trip(codec, x, chunk)
    err = (x.double() - y.double()).abs()
    assert packed.numel() == k * codec.nbytes(chunk)
    assert bool((err <= bound.double()).all()), float((err / bound.double()).max())
    # the scales are the data's: the bound is half the step max|x|/qmax, up to an ulp and 2^-16 of it
    step = step_of(codec, x, chunk)
    assert bool((bound.double() <= step * (0.5 + 2**-15) + 1e-45).all())


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_all_zero_block_is_exact(codec):
    x = torch.zeros(3 * codec.block)
    x[2 * codec.block:] = torch.linspace(-1, 1, codec.block)
    packed, y, bound = round_trip(codec, x, x.numel())
    assert torch.equal(y[:2 * codec.block], x[:2 * codec.block]) and bool((bound[:2 * codec.block] == 0).all())


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
@pytest.mark.parametrize("value", [1.0, -3.5, 1e-3, 123456.7, 1e-42, -FLT_MAX, 2.0**-140])
def test_constant_block(codec, value):
    x = torch.full((2 * codec.block + 1,), value)
    _, y, bound = round_trip(codec, x, x.numel())
    assert bool(((x.double() - y.double()).abs() <= bound.double()).all())
    assert bool(torch.isfinite(y).all()) and bool((y.sign() == x.sign()).all())


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_huge_block_stays_finite(codec):
    x = torch.tensor([FLT_MAX, -FLT_MAX, 3e38, -1e38, 1.0, 0.0] * codec.block)
    _, y, bound = round_trip(codec, x, x.numel())
    assert bool(torch.isfinite(y).all()), "a finite block decoded to Inf"
    assert bool(((x.double() - y.double()).abs() <= bound.double()).all())


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_subnormal_block(codec):
    # steps of a few subnormal ulps: the scale must be rounded up, not down, to keep the bound
    subnormals = torch.tensor([1e-45, 3e-45, 7e-45, 1.1e-44, 1e-40, 2.5e-39, TINY / 3, -1e-44])
    for values in (subnormals, subnormals[:4], subnormals[4:]):
        x = values.repeat(codec.block)[:2 * codec.block + 3]
        _, y, bound = round_trip(codec, x, x.numel())
        assert bool(((x.double() - y.double()).abs() <= bound.double()).all()), (values, x - y, bound)


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_block_decodes_to_nan_and_others_stay(codec, bad):
    n = 3 * codec.block
    x = torch.linspace(-2, 2, n)
    x[codec.block + 1] = bad  # block 1 only
    residual = torch.full((n,), 7.0)
    packed = codec.encode(x, n, residual)
    y = codec.decode(packed, n).reshape(-1)
    one = slice(codec.block, 2 * codec.block)
    assert bool(torch.isnan(y[one]).all()), "a non-finite value was hidden by its block's scale"
    others = torch.cat([y[:codec.block], y[2 * codec.block:]])
    assert bool(torch.isfinite(others).all())
    assert bool((residual[one] == 0).all()), "a non-finite block must leave no residual"
    assert bool(torch.isfinite(residual).all())


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
def test_residual_is_what_decoding_loses(codec):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4 * 300, generator=g)
    residual = torch.empty_like(x)
    y = codec.decode(codec.encode(x, 300, residual), 300).reshape(-1)
    assert torch.equal(residual, x - y)


@pytest.mark.parametrize("codec", [BlockCodec(4, 256), BlockCodec(8, 256)], ids=["int4", "int8"])
def test_error_feedback_keeps_the_sum_of_what_was_sent_close(codec):
    """Sending the same x for T steps with the residual carried: the sum of what was decoded stays
    within one block's bound of T x (the error does not grow with T); without feedback it grows."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1024, generator=g)
    residual = torch.zeros_like(x)
    sent = torch.zeros(1024, dtype=torch.float64)
    plain = codec.decode(codec.encode(x, 1024), 1024).reshape(-1).double()
    for _ in range(50):
        sent += codec.decode(codec.encode(x + residual, 1024, residual), 1024).reshape(-1).double()
    with_feedback = (sent - 50 * x.double()).abs().max()
    without = (50 * plain - 50 * x.double()).abs().max()
    bound = codec.bound(codec.encode(x * 1.1, 1024), 1024).max()
    assert with_feedback <= bound * 1.01 and without > 10 * with_feedback


def test_packed_layout_scales_then_codes():
    codec = BlockCodec(8, 4)
    x = torch.tensor([1.0, -2.0, 0.5, 0.0, 127.0, 0.0, 0.0, 0.0, 3.0])
    packed = codec.encode(x, 9)
    assert packed.numel() == 4 * 3 + 9
    scales = packed[:12].clone().view(torch.float32)
    assert torch.equal(scales, torch.tensor([2.0 / 127, 1.0, 3.0 / 127]))
    assert packed[12:].view(torch.int8).tolist() == [64, -127, 32, 0, 127, 0, 0, 0, 127]


def test_int4_packs_two_codes_a_byte_low_nibble_first():
    codec = BlockCodec(4, 16)
    x = torch.arange(-7, 8, dtype=torch.float32)  # codes -7..7 with scale 1
    packed = codec.encode(x, 15)
    assert packed.numel() == 4 + 8 and packed[:4].clone().view(torch.float32).item() == 1.0
    low, high = (packed[4:] & 15).tolist(), (packed[4:] >> 4).tolist()
    assert low == [1, 3, 5, 7, 9, 11, 13, 15] and high == [2, 4, 6, 8, 10, 12, 14, 8]  # code + 8; pad 8 (0)
    assert torch.equal(codec.decode(packed, 15).reshape(-1), x)


@pytest.mark.parametrize("codec", CODECS, ids=IDS)
@pytest.mark.parametrize("n", [1, 2, 255, 256, 257, 1000, 4096])
def test_nbytes_formula(codec, n):
    codes = n if codec.bits == 8 else (n + 1) // 2
    assert codec.nbytes(n) == 4 * math.ceil(n / codec.block) + codes
    assert codec.encode(torch.ones(n), n).numel() == codec.nbytes(n)


def test_int8_block_256_costs_one_and_four_256ths_bytes_per_element():
    assert BlockCodec(8, 256).nbytes(256 * 1000) == 256 * 1000 * (1 + 4 / 256)
    assert BlockCodec(4, 256).nbytes(256 * 1000) == 256 * 1000 * (0.5 + 4 / 256)


def test_16bit_input_and_determinism():
    x = torch.randn(777, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    codec = BlockCodec(8, 256)
    a, b = codec.encode(x, 777), codec.encode(x.clone(), 777)
    assert torch.equal(a, b)
    y = codec.decode(a, 777).reshape(-1)
    assert bool(((x.double() - y.double()).abs() <= codec.bound(a, 777).reshape(-1).double()).all())


@pytest.mark.parametrize("bits,block", [(2, 256), (16, 256), (8, 3), (8, 0), (4, 1)])
def test_bad_codec(bits, block):
    with pytest.raises(ValueError):
        BlockCodec(bits, block)


def test_chunks_must_divide():
    codec = BlockCodec(8, 256)
    with pytest.raises(ValueError, match="chunks of 7"):
        codec.encode(torch.ones(10), 7)
    with pytest.raises(ValueError, match="packed chunks"):
        codec.decode(torch.zeros(10, dtype=torch.uint8), 7)
