"""Split an fp32 value into a 16-bit float plus k extra bits, and merge it back (elementwise).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1
("16bits only mixed-precision": keep only the difference between the two formats; saving the first
part of the significand is a round-to-zero; stochastic rounding with one extra bit to un-round).
The formats are in ``workbench.optim.formats``, the packing of the extra bits (Fig 1) in
``workbench.optim.packing``, the random bits in ``workbench.optim.rng``.

* bf16 + 16 extra bits is fp32 bit for bit (every pattern, inf and NaN included). The split keeps
  the top bits, i.e. it rounds toward zero.
* fp16 + 13 extra bits is exact only inside fp16's normal range ``2**-14 <= |x| < 2**16``. Outside
  it ``merge(split(x))`` is ``x`` rounded toward zero onto a float with fp16's exponent range and
  ``10 + k`` fraction bits:

  - ``|x| >= 2**16`` (finite) saturates to the largest such value (IEEE round-toward-zero
    overflow): the half is +-65504 and all extra bits are ones.
  - ``|x| < 2**-14`` continues fp16's subnormal grid: the extra bits extend the subnormal
    significand, so values are exact on the grid ``2**-(24 + k)`` and smaller ones flush to a
    zero that keeps the sign.
  - inf stays inf; NaN stays NaN (quiet; the payload beyond fp16's 10 bits is dropped).

* For k below the full width, ``|merge(split(x)) - x| <= 2**-(p + k) * |x|`` with p = 7 (bf16) or
  10 (fp16), for x in the normal range. For bf16 with k < 16 a NaN whose payload sat only in the
  dropped bits is kept a NaN by setting the quiet bit.

Stochastic rounding (``stochastic_rounding=True``): the master value is still truncated to p + k
bits, but the 16-bit value handed to the model is rounded up (away from zero) with probability
equal to the truncated fp32 remainder divided by one 16-bit ulp, so it is unbiased with respect to
the fp32 value. One extra stored bit per value records the round-up, so ``merge`` recovers the
truncated value exactly ("un-rounds"). Storage width is then k + 1 bits.

Master rounding (``master_noise``): the paper truncates the master value to p + k bits every step,
which loses updates smaller than the lowest kept bit when k is small. Adding uniform noise below
that bit before truncating rounds the master value stochastically there instead (unbiased); the
random bits come from ``rng.hash_noise``, evaluated per element (inside the compiled kernel, or per
chunk eagerly), so no tensor-size noise buffer is allocated.
"""

from __future__ import annotations

import torch

from .formats import FORMATS, INF_BITS, check_format, storage_bits
from .packing import decode, encode
from .rng import sr_noise

__all__ = ["merge", "merge_values", "split", "split_values", "stochastic_round"]



def _half_to_bits(half: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # NOTE: inductor does not vectorize int16, so compiled code reads the pattern through an
        # exact fp32 conversion; identical to the int16 view for every value except NaN payloads.
        f = half.float()
        if half.dtype == torch.bfloat16:
            return (f.view(torch.int32) >> 16) & 0xFFFF
        return _fields(f, torch.float16)[0]
    return half.view(torch.int16).to(torch.int32) & 0xFFFF


def _bits_to_half(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return _compose(bits, torch.zeros_like(bits), dtype).to(dtype)  # exact: value fits dtype
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(dtype)


def _fields(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (16-bit pattern truncated toward zero, full-width remainder) as int32."""
    bits = x.contiguous().view(torch.int32)
    if dtype == torch.bfloat16:
        return (bits >> 16) & 0xFFFF, bits & 0xFFFF
    sign = (bits >> 16) & 0x8000
    mag = bits & 0x7FFFFFFF
    normal = (mag >= 0x38800000) & (mag < 0x47800000)
    small = mag < 0x38800000
    overflow = (mag >= 0x47800000) & (mag < 0x7F800000)
    nan = mag > 0x7F800000
    # below fp16's normal range: fixed point in units of 2**-37 (subnormal grid extended 13 bits);
    # scaling by a power of two is exact and truncation rounds toward zero.
    q = (torch.where(small, x, torch.zeros_like(x)).abs() * 2.0**37).to(torch.int32)
    hb = torch.where(normal, (mag >> 13) - (112 << 10), q >> 13)
    low = torch.where(normal, mag & 0x1FFF, q & 0x1FFF)
    hb = torch.where(overflow, torch.full_like(hb, 0x7BFF), hb)
    low = torch.where(overflow, torch.full_like(low, 0x1FFF), low)
    special = mag >= 0x7F800000
    hb = torch.where(special, 0x7C00 | torch.where(nan, 0x200 | ((mag >> 13) & 0x3FF), 0), hb)
    low = torch.where(special, torch.zeros_like(low), low)
    return sign | hb, low


def _compose(hb: torch.Tensor, low: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(16-bit pattern, full-width remainder) -> fp32; inverse of :func:`_fields`."""
    if dtype == torch.bfloat16:
        return ((hb << 16) | low).view(torch.float32)
    sign = (hb & 0x8000) << 16
    e = hb & 0x7C00
    normal_mag = (((hb & 0x7FFF) << 13) + (112 << 23)) | low
    q = ((hb & 0x3FF) << 13) | low
    small_mag = (q.to(torch.float32) * 2.0**-37).view(torch.int32)
    special_mag = 0x7F800000 | torch.where((hb & 0x3FF) != 0, 0x400000 | ((hb & 0x3FF) << 13), 0)
    mag = torch.where(e == 0, small_mag, torch.where(e == 0x7C00, special_mag, normal_mag))
    return (sign | mag).view(torch.float32)


def split_values(
    x: torch.Tensor,
    *,
    dtype: torch.dtype,
    extra_bits: int,
    stochastic_rounding: bool = False,
    noise: torch.Tensor | None = None,
    master_noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise split: fp32 -> (16-bit tensor, unpacked int32 extra values).

    With stochastic rounding, ``noise`` holds uniform integers in [0, 2**W) (W = 16 for bf16, 13
    for fp16), e.g. from :func:`sr_noise`; the value rounds up when its remainder exceeds the noise.
    ``master_noise`` (random int32 bits, e.g. :func:`hash_noise`) rounds the kept value
    stochastically at its lowest kept bit instead of truncating it; finite values never round to inf.
    """
    full = FORMATS[dtype][0]
    hb, low = _fields(x.float(), dtype)
    nan_bit = None
    if dtype == torch.bfloat16 and extra_bits < full:
        # keep NaN a NaN after dropping bits: the quiet bit, set when |x| > inf
        nan_bit = ((0x7F800000 - (((hb & 0x7FFF) << 16) | low)) >> 31) & 0x40
    if master_noise is not None and extra_bits < full:
        # NOTE: (16-bit magnitude, remainder) read as one integer is monotone in |x| (fp16's
        # subnormal grid included), so adding uniform noise below the lowest kept bit and
        # truncating is stochastic rounding at that bit, with carries into the exponent.
        # NOTE: masks are written as sign bits of int32 differences ((a - b) >> 31 is -1 when
        # a < b), not torch.where: inductor's vectorised bool masks made the fused step ~2x slower.
        sign, mag = hb & 0x8000, hb & 0x7FFF
        z = (mag << full) | low
        r = master_noise & ((1 << (full - extra_bits)) - 1)
        inf = INF_BITS[dtype]
        ok = ((mag - inf) & (((z + r) >> full) - inf)) >> 31  # -1: finite and stays finite
        z = z + (r & ok)
        hb, low = sign | (z >> full), z & ((1 << full) - 1)
        low = (low >> (full - extra_bits)) << (full - extra_bits)
    values = low >> (full - extra_bits)
    if nan_bit is not None:
        hb = hb | nan_bit
    if stochastic_rounding:
        if noise is None:
            raise ValueError("stochastic_rounding=True needs noise (see sr_noise)")
        # round up when remainder > noise, unless that would reach inf (values < 2**16: no overflow)
        up = (((noise - low) & ((hb & 0x7FFF) + 1 - INF_BITS[dtype])) >> 31) & 1
        hb = hb + up
        values = (values << 1) | up
    return _bits_to_half(hb, dtype), values


def merge_values(
    half: torch.Tensor,
    values: torch.Tensor,
    *,
    extra_bits: int,
    stochastic_rounding: bool = False,
) -> torch.Tensor:
    """Elementwise merge: (16-bit tensor, unpacked int32 extra values) -> fp32."""
    dtype = half.dtype
    full = FORMATS[dtype][0]
    hb = _half_to_bits(half)
    if stochastic_rounding:
        hb = hb - (values & 1)  # un-round: recover the truncated 16-bit pattern
        values = values >> 1
    return _compose(hb, values << (full - extra_bits), dtype)


def split(
    x: torch.Tensor,
    *,
    dtype: torch.dtype,
    extra_bits: int,
    stochastic_rounding: bool = False,
    generator: torch.Generator | None = None,
    aligned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split fp32 ``x`` into (``dtype`` tensor of x's shape, packed int32 extra words).

    The extra words hold ``storage_bits(extra_bits, stochastic_rounding)`` bits per value, packed
    into ceil(n * bits / 32) words. The split rounds toward zero (paper 3.1); with
    ``stochastic_rounding`` the returned half is rounded stochastically and the flag bit lets
    :func:`merge` undo it. ``aligned=True`` returns 8- and 16-bit widths as uint8 byte planes
    of shape (bits // 8, n) instead (same bits, see :func:`encode`).
    """
    if not torch.is_tensor(x):
        raise TypeError(f"x must be a float32 torch.Tensor, got {type(x).__name__}")
    check_format(dtype, extra_bits)
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    flat = x.reshape(-1)
    noise = None
    if stochastic_rounding:
        noise = sr_noise(flat.numel(), dtype, device=x.device, generator=generator)
    half, values = split_values(
        flat, dtype=dtype, extra_bits=extra_bits, stochastic_rounding=stochastic_rounding, noise=noise
    )
    return half.view(x.shape), encode(values, storage_bits(extra_bits, stochastic_rounding), aligned=aligned)


def merge(
    half: torch.Tensor, extra: torch.Tensor, *, extra_bits: int, stochastic_rounding: bool = False
) -> torch.Tensor:
    """Rebuild the fp32 value from a 16-bit tensor and its extra bits (int32 words or uint8 planes)."""
    if not torch.is_tensor(half) or not torch.is_tensor(extra):
        raise TypeError(f"half and extra must be torch.Tensors, got {type(half).__name__}, {type(extra).__name__}")
    check_format(half.dtype, extra_bits)
    flat = half.reshape(-1)
    values = decode(extra, storage_bits(extra_bits, stochastic_rounding), flat.numel())
    out = merge_values(
        flat, values, extra_bits=extra_bits, stochastic_rounding=stochastic_rounding
    )
    return out.view(half.shape)


def stochastic_round(
    x: torch.Tensor, dtype: torch.dtype, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Round fp32 ``x`` to ``dtype`` stochastically (unbiased), without keeping extra bits."""
    if not torch.is_tensor(x):
        raise TypeError(f"x must be a float32 torch.Tensor, got {type(x).__name__}")
    half, _ = split(x, dtype=dtype, extra_bits=0, stochastic_rounding=True, generator=generator)
    return half
