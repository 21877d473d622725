"""Split/merge exactness, bounds, stochastic rounding and master rounding (Lewandowski & Kosson, 3.1).

Tests ``workbench.optim.split_merge`` (and the format facts of ``workbench.optim.formats``).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.optim.formats import max_extra_bits, relative_bound, significand_bits, storage_bits
from workbench.optim.packing import decode, packed_words, unpack
from workbench.optim.rng import hash_noise
from workbench.optim.split_merge import merge, merge_values, split, split_values, stochastic_round

BF16, FP16 = torch.bfloat16, torch.float16
SPECIALS = [0.0, -0.0, math.inf, -math.inf, math.nan, 1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38]


def _roundtrip(x, dtype, k, sr=False, generator=None):
    half, extra = split(x, dtype=dtype, extra_bits=k, stochastic_rounding=sr, generator=generator)
    return half, extra, merge(half, extra, extra_bits=k, stochastic_rounding=sr)


def _bits(x):
    return x.contiguous().view(torch.int32)


def test_bf16_plus_16_reproduces_every_fp32_pattern():
    patterns = torch.randint(-(2**31), 2**31 - 1, (200_000,), dtype=torch.int32)
    x = torch.cat([patterns.view(torch.float32), torch.tensor(SPECIALS)])
    half, extra, y = _roundtrip(x, BF16, 16)
    assert half.dtype == BF16 and extra.dtype == torch.int32
    torch.testing.assert_close(_bits(y), _bits(x), rtol=0, atol=0)
    # bf16 is the top half of the fp32 word: the split rounds toward zero
    torch.testing.assert_close(_bits(half.float()), _bits(x) & ~0xFFFF, rtol=0, atol=0)


@given(st.integers(min_value=-(2**31), max_value=2**31 - 1))
@settings(max_examples=300, deadline=None)
def test_bf16_plus_16_exact_property(pattern):
    x = torch.tensor([pattern], dtype=torch.int32).view(torch.float32)
    _, _, y = _roundtrip(x, BF16, 16)
    assert _bits(y).item() == pattern


def test_fp16_plus_13_exact_in_normal_range():
    x = torch.randn(100_000) * 2.0 ** torch.randint(-14, 15, (100_000,)).float()
    x = x[(x.abs() >= 2**-14) & (x.abs() < 2**16)]
    x = torch.cat([x, torch.tensor([2.0**-14, -(2.0**-14), 65504.0, 65535.99, -65535.99])])
    half, _, y = _roundtrip(x, FP16, 13)
    torch.testing.assert_close(_bits(y), _bits(x), rtol=0, atol=0)
    assert torch.all(half.float().abs() <= x.abs())  # toward zero


def test_fp16_outside_normal_range_documented_behaviour():
    big = torch.tensor([65536.0, 1e6, -3e38])
    half, _, y = _roundtrip(big, FP16, 13)
    # overflow saturates (IEEE round-toward-zero): largest fp16 and all extra bits set
    torch.testing.assert_close(half.float(), torch.tensor([65504.0, 65504.0, -65504.0]))
    top = (2 - 2.0**-23) * 2.0**15
    torch.testing.assert_close(y, torch.tensor([top, top, -top]), rtol=0, atol=0)
    # inf and NaN
    _, _, y = _roundtrip(torch.tensor([math.inf, -math.inf, math.nan]), FP16, 5)
    assert y[0] == math.inf and y[1] == -math.inf and torch.isnan(y[2])
    # below the normal range: exact on the extended subnormal grid 2**-(24+k), flush below it
    grid = torch.arange(-5000, 5000, dtype=torch.float32) * 2.0**-37 * 97
    grid = grid[grid.abs() < 2**-14]
    _, _, y = _roundtrip(grid, FP16, 13)
    torch.testing.assert_close(y, grid, rtol=0, atol=0)
    tiny = torch.tensor([2.0**-38, -(2.0**-38), 0.0, -0.0])
    _, _, y = _roundtrip(tiny, FP16, 13)
    assert torch.all(y == 0)
    torch.testing.assert_close(torch.signbit(y), torch.tensor([False, True, False, True]))
    half, _, y = _roundtrip(torch.tensor([3 * 2.0**-26, -(2.0**-24) * 1.75]), FP16, 2)
    torch.testing.assert_close(y, torch.tensor([3 * 2.0**-26, -(2.0**-24) * 1.75]), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_zero_signs_and_nan_survive_every_k(dtype):
    x = torch.tensor([0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf])
    x = torch.cat([x, torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)])
    for k in range(max_extra_bits(dtype) + 1):
        _, _, y = _roundtrip(x, dtype, k)
        torch.testing.assert_close(torch.signbit(y[:2]), torch.tensor([False, True]))
        assert torch.isnan(y[[2, 3, 6]]).all(), k
        assert y[4] == math.inf and y[5] == -math.inf


@given(
    st.sampled_from([(BF16, k) for k in range(16)] + [(FP16, k) for k in range(13)]),
    st.lists(st.floats(min_value=2**-14, max_value=6e4), min_size=1, max_size=40),
    st.booleans(),
)
@settings(max_examples=200, deadline=None)
def test_truncation_bound(fmt, values, negative):
    dtype, k = fmt
    x = torch.tensor(values, dtype=torch.float32) * (-1 if negative else 1)
    _, extra, y = _roundtrip(x, dtype, k)
    assert extra.numel() == packed_words(x.numel(), k)
    assert torch.all((y - x).abs() <= relative_bound(dtype, k) * x.abs())
    assert torch.all(y.abs() <= x.abs()) and torch.all(torch.sign(y) == torch.sign(x))


def test_bad_input_raises_with_value_and_range():
    x = torch.randn(4)
    with pytest.raises(ValueError, match=r"extra_bits=17.*0\.\.16"):
        split(x, dtype=BF16, extra_bits=17)
    with pytest.raises(ValueError, match=r"extra_bits=14.*0\.\.13"):
        split(x, dtype=FP16, extra_bits=14)
    with pytest.raises(ValueError, match=r"extra_bits=-1"):
        split(x, dtype=FP16, extra_bits=-1)
    with pytest.raises(TypeError, match="float32"):
        split(x, dtype=torch.float32, extra_bits=0)
    with pytest.raises(TypeError, match="float32"):
        split(x.double(), dtype=BF16, extra_bits=0)


@pytest.mark.parametrize(("dtype", "k"), [(BF16, 8), (FP16, 8), (FP16, 13), (BF16, 0)])
def test_stochastic_rounding_unround_is_exact(dtype, k):
    x = torch.randn(5000) * 3
    g = torch.Generator().manual_seed(0)
    half, extra, y = _roundtrip(x, dtype, k, sr=True, generator=g)
    _, _, truncated = _roundtrip(x, dtype, k)
    torch.testing.assert_close(_bits(y), _bits(truncated), rtol=0, atol=0)
    assert extra.numel() == packed_words(x.numel(), k + 1)
    # the 16-bit value is the truncation or the next value away from zero
    trunc_half = split(x, dtype=dtype, extra_bits=0)[0]
    diff = half.view(torch.int16).int() - trunc_half.view(torch.int16).int()
    assert set(diff.unique().tolist()) == {0, 1}


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_stochastic_rounding_is_unbiased(dtype):
    # powers of two (ulp = |base| * 2**-p) plus 0.1, 0.5 and 0.9 of an ulp, both signs
    base = torch.tensor([1.0, -2.0, 0.25, -256.0])
    ulp = base.abs() * 2.0 ** -significand_bits(dtype)
    n = 20_000
    g = torch.Generator().manual_seed(1)
    for frac in (0.1, 0.5, 0.9):
        x = base + torch.sign(base) * frac * ulp
        r = stochastic_round(x.repeat(n), dtype, generator=g).float().view(n, -1)
        # each draw is base or base + ulp (Bernoulli(frac)): the mean is within 5 sigma of x
        sigma = ulp * math.sqrt(frac * (1 - frac) / n)
        assert torch.all((r.mean(0) - x).abs() < 5 * sigma), (frac, r.mean(0) - x)
        assert set(torch.unique(r).tolist()) == set((base).tolist()) | set((base + torch.sign(base) * ulp).tolist())
    # round-to-nearest is biased on the same input: it always returns base
    x = base + torch.sign(base) * 0.1 * ulp
    assert torch.all(x.to(dtype).float() == base)


def test_stochastic_rounding_never_overflows():
    x = torch.tensor([65535.0, -65535.0, 3.3e38, -3.3e38])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert torch.isfinite(stochastic_round(x[:2], FP16, generator=g).float()).all()
        assert torch.isfinite(stochastic_round(x[2:], BF16, generator=g).float()).all()


ALIGNED = [(BF16, 8, False), (BF16, 16, False), (FP16, 8, False), (BF16, 7, True), (FP16, 7, True),
           (BF16, 15, True)]


@pytest.mark.parametrize(("dtype", "k", "sr"), ALIGNED)
def test_byte_planes_hold_the_same_bits_as_dense_words(dtype, k, sr):
    x = torch.cat([torch.randn(1000) * 3, torch.tensor(SPECIALS)])
    width = storage_bits(k, sr)
    dense = split(x, dtype=dtype, extra_bits=k, stochastic_rounding=sr, generator=torch.Generator().manual_seed(0))
    planes = split(x, dtype=dtype, extra_bits=k, stochastic_rounding=sr,
                   generator=torch.Generator().manual_seed(0), aligned=True)
    assert planes[1].dtype == torch.uint8 and planes[1].shape == (width // 8, x.numel())
    assert 0 <= dense[1].nbytes - planes[1].nbytes < 4  # same density: width / 8 bytes per value
    assert torch.equal(planes[0].view(torch.int16), dense[0].view(torch.int16))
    torch.testing.assert_close(decode(planes[1], width, x.numel()), unpack(dense[1], width, x.numel()),
                               rtol=0, atol=0)
    a = merge(*dense, extra_bits=k, stochastic_rounding=sr)
    b = merge(*planes, extra_bits=k, stochastic_rounding=sr)
    assert torch.equal(_bits(a), _bits(b))


def test_split_and_merge_reject_non_tensors():
    with pytest.raises(TypeError, match="list"):
        split([1.0, 2.0], dtype=BF16, extra_bits=8)
    with pytest.raises(TypeError, match="float"):
        split(1.0, dtype=BF16, extra_bits=8)
    with pytest.raises(TypeError, match="ndarray"):
        stochastic_round(torch.zeros(2).numpy(), BF16)
    with pytest.raises(TypeError, match="torch.Tensors"):
        merge([0.0], torch.zeros(1, dtype=torch.int32), extra_bits=8)


@pytest.mark.parametrize(("dtype", "k"), [(BF16, 0), (BF16, 4), (FP16, 3), (BF16, 8)])
def test_master_stochastic_rounding_is_unbiased_at_the_lowest_kept_bit(dtype, k):
    n = 40_000
    p = significand_bits(dtype) + k
    ulp = 2.0**-p
    x = torch.full((n,), 1.0 + 0.3 * ulp)
    half, values = split_values(x, dtype=dtype, extra_bits=k, master_noise=hash_noise(n, 7))
    y = merge_values(half, values, extra_bits=k)
    assert set(torch.unique(y).tolist()) == {1.0, 1.0 + ulp}
    sigma = ulp * math.sqrt(0.3 * 0.7 / n)
    assert abs(y.double().mean().item() - (1.0 + 0.3 * ulp)) < 5 * sigma
    # truncation (the paper's split) always drops the 0.3 ulp
    half_t, values_t = split_values(x, dtype=dtype, extra_bits=k)
    assert torch.all(merge_values(half_t, values_t, extra_bits=k) == 1.0)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_master_stochastic_rounding_keeps_specials(dtype):
    top = 3.3895314e38 if dtype == BF16 else 65504.0 + 31.0
    x = torch.tensor([top, -top, math.inf, -math.inf, math.nan, 0.0, -0.0] * 200)
    x = torch.cat([x, torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)])
    for k in (0, 5):
        half, values = split_values(x, dtype=dtype, extra_bits=k,
                                    master_noise=hash_noise(x.numel(), 3))
        y = merge_values(half, values, extra_bits=k)
        assert torch.isnan(y[-1])  # NaN whose payload sat only in dropped bits
        y = y[:-1].view(200, 7)
        assert torch.isfinite(y[:, :2]).all()  # the largest finite values never round to inf
        assert (y[:, 2] == math.inf).all() and (y[:, 3] == -math.inf).all() and torch.isnan(y[:, 4]).all()
        assert (y[:, 5:] == 0).all() and not torch.signbit(y[:, 5]).any() and torch.signbit(y[:, 6]).all()

