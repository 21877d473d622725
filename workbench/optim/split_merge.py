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

Nearest master rounding (the optimizers' ``master_rounding="nearest"``) does two things, both
deterministic. (1) The master value is rounded to nearest at its lowest kept bit (ties away from
zero) instead of truncated: the master-noise step above with the constant half of that bit
(:func:`nearest_offset`) in place of random bits, so the master error halves (at most half a unit of
the lowest kept bit, not one; finite values never round to inf there). (2) ``split_values(nearest=True)``
stores that value in truncate's format bit for bit and changes only the 16-bit value the model sees:
it truncates as above, then where the first dropped bit of the 16-bit truncation (the top extra bit
for k >= 1) is set and the truncation is finite, it stores the 16-bit pattern + 1, the next 16-bit
value away from zero (a carry into the exponent is the right next value; the largest finite value
goes to inf, as IEEE round-to-nearest overflows). So the 16-bit value is within half an ulp of the
master value (ties away from zero), and the extra bits, unchanged, read as the signed remainder
``master - half``. The merge subtracts the 1 again where the top extra bit is set and the 16-bit value
is not a NaN (inf included: only a round-up stores inf with that bit set; a NaN is never rounded), so
``merge_values(split_values(x, nearest=True), nearest=True)`` is truncate's master value of x for every
fp32 x, but one kind of NaN: at bf16+16 the split sets a NaN's quiet bit, as truncate does below 16
extra bits (a NaN whose upper 16 bits read inf would otherwise merge as the largest finite value
rounded up); a NaN the step computes is quiet already. A stored pattern the split never writes (a
zero with the top extra bit set) merges to some value; the kernels take the same integer steps, so
they agree on it. With k = 0 there is no extra bit: (1) alone makes the 16-bit value the fp32 update
rounded to nearest (ties away from zero; a finite value stays finite), and the merge has nothing to
undo. The mean error of the master and of the 16-bit value both halve at the same bytes, and, unlike
truncation toward zero, neither drifts toward zero step after step.
"""

from __future__ import annotations

import torch

from .formats import FORMATS, INF_BITS, check_format, storage_bits
from .packing import decode, encode
from .rng import sr_noise

__all__ = ["merge", "merge_values", "nearest_offset", "split", "split_values", "stochastic_round"]



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


def nearest_offset(dtype: torch.dtype, extra_bits: int) -> int | None:
    """The ``master_noise`` of nearest master rounding: half the lowest kept bit of the remainder (None with
    all bits kept: nothing to round)."""
    full = FORMATS[dtype][0]
    return 1 << (full - extra_bits - 1) if extra_bits < full else None


def split_values(
    x: torch.Tensor,
    *,
    dtype: torch.dtype,
    extra_bits: int,
    stochastic_rounding: bool = False,
    noise: torch.Tensor | None = None,
    master_noise: torch.Tensor | int | None = None,
    nearest: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise split: fp32 -> (16-bit tensor, unpacked int32 extra values).

    With stochastic rounding, ``noise`` holds uniform integers in [0, 2**W) (W = 16 for bf16, 13
    for fp16), e.g. from :func:`sr_noise`; the value rounds up when its remainder exceeds the noise.
    ``master_noise`` (random int32 bits, e.g. :func:`hash_noise`) rounds the kept value
    stochastically at its lowest kept bit instead of truncating it; finite values never round to inf
    (:func:`nearest_offset`'s constant in its place rounds to nearest there).
    ``nearest``: the 16-bit value is rounded to nearest (module docstring), the extra bits stay truncate's.
    """
    full = FORMATS[dtype][0]
    hb, low = _fields(x.float(), dtype)
    nan_bit = None
    if dtype == torch.bfloat16 and (extra_bits < full or nearest):
        # keep NaN a NaN after dropping bits: the quiet bit, set when |x| > inf (nearest at bf16+16: a NaN
        # whose 16 bits read inf would merge as a round-up of the largest finite value)
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
    if nearest:
        if stochastic_rounding:
            raise ValueError("nearest master rounding and stochastic_rounding=True: choose one")
        # +1 where the first dropped bit is set and the pattern is finite (|pattern| < inf)
        hb = hb + (((low >> (full - 1)) & 1) & (((hb & 0x7FFF) - INF_BITS[dtype]) >> 31))
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
    nearest: bool = False,
) -> torch.Tensor:
    """Elementwise merge: (16-bit tensor, unpacked int32 extra values) -> fp32.

    ``nearest``: the 16-bit value was rounded to nearest by :func:`split_values`; undone first."""
    dtype = half.dtype
    full = FORMATS[dtype][0]
    hb = _half_to_bits(half)
    if nearest and extra_bits > 0:
        # -1 where the top extra bit is set and the pattern is not a NaN (|pattern| <= inf)
        hb = hb - (((values >> (extra_bits - 1)) & 1) & (((hb & 0x7FFF) - INF_BITS[dtype] - 1) >> 31))
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
    master_rounding: str = "truncate",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split fp32 ``x`` into (``dtype`` tensor of x's shape, packed int32 extra words).

    The extra words hold ``storage_bits(extra_bits, stochastic_rounding)`` bits per value, packed
    into ceil(n * bits / 32) words. The split rounds toward zero (paper 3.1); with
    ``stochastic_rounding`` the returned half is rounded stochastically and the flag bit lets
    :func:`merge` undo it. ``aligned=True`` returns 8- and 16-bit widths as uint8 byte planes
    of shape (bits // 8, n) instead (same bits, see :func:`encode`). ``master_rounding="nearest"``
    rounds the kept value to nearest at its lowest kept bit and the 16-bit value to nearest over the
    same extra bits (module docstring; "truncate": the paper's split).
    """
    if not torch.is_tensor(x):
        raise TypeError(f"x must be a float32 torch.Tensor, got {type(x).__name__}")
    check_format(dtype, extra_bits)
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    nearest = _nearest(master_rounding, stochastic_rounding)
    flat = x.reshape(-1)
    if master_rounding == "stochastic":
        raise ValueError("split() rounds no master value stochastically: master_rounding 'truncate' or 'nearest'")
    noise = None
    if stochastic_rounding:
        noise = sr_noise(flat.numel(), dtype, device=x.device, generator=generator)
    half, values = split_values(
        flat, dtype=dtype, extra_bits=extra_bits, stochastic_rounding=stochastic_rounding, noise=noise,
        nearest=nearest, master_noise=nearest_offset(dtype, extra_bits) if nearest else None,
    )
    return half.view(x.shape), encode(values, storage_bits(extra_bits, stochastic_rounding), aligned=aligned)


def _nearest(master_rounding: str, stochastic_rounding: bool) -> bool:
    """True for "nearest"; "truncate" (and "stochastic", which stores truncate's format) False."""
    if master_rounding not in ("truncate", "stochastic", "nearest"):
        raise ValueError(f"master_rounding={master_rounding!r}: allowed 'truncate', 'stochastic', 'nearest'")
    if master_rounding == "nearest" and stochastic_rounding:
        raise ValueError("master_rounding='nearest' and stochastic_rounding=True: the 16-bit value is rounded "
                         "either to nearest or stochastically; choose one")
    return master_rounding == "nearest"


def merge(
    half: torch.Tensor, extra: torch.Tensor, *, extra_bits: int, stochastic_rounding: bool = False,
    master_rounding: str = "truncate",
) -> torch.Tensor:
    """Rebuild the fp32 value from a 16-bit tensor and its extra bits (int32 words or uint8 planes);
    ``master_rounding`` as the split was made ("nearest" undoes its round-up)."""
    if not torch.is_tensor(half) or not torch.is_tensor(extra):
        raise TypeError(f"half and extra must be torch.Tensors, got {type(half).__name__}, {type(extra).__name__}")
    check_format(half.dtype, extra_bits)
    nearest = _nearest(master_rounding, stochastic_rounding)
    flat = half.reshape(-1)
    values = decode(extra, storage_bits(extra_bits, stochastic_rounding), flat.numel())
    out = merge_values(
        flat, values, extra_bits=extra_bits, stochastic_rounding=stochastic_rounding, nearest=nearest
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
