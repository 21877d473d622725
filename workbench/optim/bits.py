"""Split an fp32 value into a 16-bit float plus k densely packed extra bits, and merge it back.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1
("16bits only mixed-precision", Fig 1 packing, stochastic rounding with one extra bit).

Format facts (Table 1 of the paper):

* bf16 is the top half of an fp32 word, so bf16 + 16 extra bits is fp32 bit for bit (every pattern,
  inf and NaN included). The split keeps the top bits, i.e. it rounds toward zero.
* fp16 has a 5-bit exponent, so fp16 + 13 extra bits is exact only inside fp16's normal range
  ``2**-14 <= |x| < 2**16``. Outside it ``merge(split(x))`` is ``x`` rounded toward zero onto a
  float with fp16's exponent range and ``10 + k`` fraction bits:

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

Packing (Fig 1): values of ``w`` bits are stored LSB-first in consecutive int32 words, a value
straddling a word boundary continues in the low bits of the next word; n values take
``ceil(n * w / 32)`` words and no bit is wasted.

Byte planes (``aligned=True``, widths 8 and 16 only): the value's byte j is stored in plane j of a
``(w // 8, n)`` uint8 tensor, so merge and split are pure elementwise shifts that a compiler
vectorises, at the same density (1 or 2 bytes per value) as the dense words.

Master rounding (``master_noise``): the paper truncates the master value to p + k bits every step,
which loses updates smaller than the lowest kept bit when k is small. Adding uniform noise below
that bit before truncating rounds the master value stochastically there instead (unbiased); the
random bits come from :func:`hash_noise`, a counter-based hash evaluated per element (inside the
compiled kernel, or per chunk eagerly), so no tensor-size noise buffer is allocated.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "max_extra_bits",
    "significand_bits",
    "storage_bits",
    "packed_words",
    "pack",
    "unpack",
    "is_byte_aligned",
    "extra_storage",
    "encode",
    "decode",
    "hash_noise",
    "split",
    "merge",
    "split_values",
    "merge_values",
    "stochastic_round",
    "sr_noise",
    "mix_key",
    "store_into",
    "check_format",
    "relative_bound",
]

# dtype -> (bits below the 16-bit value that complete an fp32 significand, stored significand width)
_FORMATS: dict[torch.dtype, tuple[int, int]] = {
    torch.bfloat16: (16, 7),
    torch.float16: (13, 10),
}
SUPPORTED_DTYPES = tuple(_FORMATS)
_INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def check_format(dtype: torch.dtype, extra_bits: int) -> None:
    """Raise early for a dtype other than fp16/bf16 or an extra-bit count outside its range."""
    if dtype not in _FORMATS:
        raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    full = _FORMATS[dtype][0]
    if isinstance(extra_bits, bool) or not isinstance(extra_bits, int) or not 0 <= extra_bits <= full:
        raise ValueError(f"extra_bits={extra_bits!r} out of range for {dtype}: allowed 0..{full}")


def max_extra_bits(dtype: torch.dtype) -> int:
    """Bits that complete an fp32 significand: 16 for bf16, 13 for fp16."""
    check_format(dtype, 0)
    return _FORMATS[dtype][0]


def significand_bits(dtype: torch.dtype) -> int:
    """Stored significand width p of the 16-bit format (7 for bf16, 10 for fp16)."""
    check_format(dtype, 0)
    return _FORMATS[dtype][1]


def storage_bits(extra_bits: int, stochastic_rounding: bool = False) -> int:
    """Packed bits per value: k, plus one round-up flag with stochastic rounding."""
    return extra_bits + int(bool(stochastic_rounding))


def packed_words(n: int, bits: int) -> int:
    """int32 words holding n values of ``bits`` bits densely: ceil(n * bits / 32)."""
    return (n * bits + 31) // 32


def is_byte_aligned(bits: int) -> bool:
    """True for storage widths kept as byte planes (8 and 16 bits) rather than dense words."""
    return bits in (8, 16)


def extra_storage(n: int, bits: int, *, aligned: bool) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of the extra bits of n values: byte planes (w // 8, n) uint8, or int32 words."""
    if aligned and is_byte_aligned(bits):
        return (bits // 8, n), torch.uint8
    return (packed_words(n, bits),), torch.int32


# ----------------------------------------------------------------------------------------- packing


def _layout(bits: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Where each of the 32 values of a block (which fills exactly ``bits`` words) lands."""
    off = torch.arange(32, device=device, dtype=torch.int64) * bits
    lo, shift = off // 32, off % 32
    spill = (shift + bits) > 32
    hi = torch.where(spill, lo + 1, lo)
    return lo, shift, hi, spill


def _to_int32(words64: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement wrap)."""
    return torch.where(words64 >= 2**31, words64 - 2**32, words64).to(torch.int32)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack the low ``bits`` bits of each integer in ``values`` into ceil(n*bits/32) int32 words."""
    if not 0 <= bits <= 32:
        raise ValueError(f"bits={bits} out of range: allowed 0..32")
    values = values.reshape(-1)
    n = values.numel()
    nwords = packed_words(n, bits)
    if bits == 0:
        return torch.zeros(0, dtype=torch.int32, device=values.device)
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        # NOTE: when the width divides 32 no value straddles two words: word j is the OR of its
        # 32/bits values shifted into place; int32-only arithmetic keeps inductor's kernels
        # vectorized (it does not vectorize int16).
        per = 32 // bits
        v = values.to(torch.int32) & mask
        if n % per:
            v = torch.cat([v, v.new_zeros(per - n % per)])
        v = v.view(-1, per)
        words = v[:, 0]
        for j in range(1, per):
            words = words | (v[:, j] << (j * bits))
        return words
    blocks = (n + 31) // 32
    v = torch.zeros(blocks * 32, dtype=torch.int64, device=values.device)
    v[:n] = values.to(torch.int64) & mask
    v = v.view(blocks, 32)
    lo, shift, hi, spill = _layout(bits, values.device)
    low_part = (v << shift) & 0xFFFFFFFF
    high_part = torch.where(spill, v >> (32 - shift), torch.zeros_like(v))
    # NOTE: the pieces never overlap, so adding them is the same as OR-ing them.
    words = torch.zeros(blocks, bits, dtype=torch.int64, device=values.device)
    words.index_add_(1, lo, low_part)
    words.index_add_(1, hi, high_part)
    return _to_int32(words.view(-1)[:nwords])


def unpack(words: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: n unsigned values of ``bits`` bits as int32."""
    if not 0 <= bits <= 32:
        raise ValueError(f"bits={bits} out of range: allowed 0..32")
    if words.dtype != torch.int32 or words.numel() != packed_words(n, bits):
        raise ValueError(
            f"expected {packed_words(n, bits)} int32 words for n={n}, bits={bits}; "
            f"got {words.numel()} of {words.dtype}"
        )
    if bits == 0:
        return torch.zeros(n, dtype=torch.int32, device=words.device)
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        per = 32 // bits
        if torch.compiler.is_compiling():
            # NOTE: an indexed load fuses into the consumer's loop; eagerly it would allocate
            # int64 indices, so eager code unpacks with whole-tensor shifts instead.
            i = torch.arange(n, device=words.device)
            return (words[i // per] >> ((i % per) * bits).to(torch.int32)) & mask
        parts = [(words >> (j * bits)) & mask for j in range(per)]
        return torch.stack(parts, dim=1).view(-1)[:n]
    blocks = (n + 31) // 32
    w = torch.zeros(blocks * bits, dtype=torch.int64, device=words.device)
    w[: words.numel()] = words.to(torch.int64) & 0xFFFFFFFF
    w = w.view(blocks, bits)
    lo, shift, hi, spill = _layout(bits, words.device)
    v = w[:, lo] >> shift
    v = v | torch.where(spill, w[:, hi] << (32 - shift), torch.zeros_like(v))
    return (v & mask).view(-1)[:n].to(torch.int32)


# NOTE: byte planes rather than one int16 per value: inductor's C++ backend does not vectorise
# int16 (torch 2.13, VECTORIZABLE_DTYPES), but vectorises uint8 loads/stores, so two uint8 planes
# hold the same 2 bytes per value and keep the fused update one vectorised loop. Planes are passed
# to the compiled update as separate 1-D views, which inductor writes in the same loop.
def encode(values: torch.Tensor, bits: int, *, aligned: bool) -> torch.Tensor:
    """Store n unsigned ``bits``-bit values: byte planes when aligned and 8/16 bits, else :func:`pack`."""
    if aligned and is_byte_aligned(bits):
        v = values.reshape(-1).to(torch.int32)
        return torch.stack([((v >> (8 * j)) & 0xFF).to(torch.uint8) for j in range(bits // 8)])
    return pack(values, bits)


def decode(store: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...], bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`encode`: n values as int32, from byte planes (uint8) or packed words (int32)."""
    if isinstance(store, list | tuple) or store.dtype == torch.uint8:
        planes = list(store)
        if len(planes) != bits // 8 or not is_byte_aligned(bits) or any(p.numel() != n for p in planes):
            raise ValueError(f"expected {bits // 8} byte planes of {n} values for bits={bits}")
        out = planes[0].reshape(-1).to(torch.int32)
        for j in range(1, len(planes)):
            out = out | (planes[j].reshape(-1).to(torch.int32) << (8 * j))
        return out
    return unpack(store, bits, n)


def store_into(store: torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...],
               values: torch.Tensor, bits: int) -> None:
    """Write n values in place into byte planes (a list of 1-D uint8 views, or a 2-D uint8) or words."""
    if isinstance(store, list | tuple) or store.dtype == torch.uint8:
        for j, plane in enumerate(store):
            plane.copy_(((values >> (8 * j)) & 0xFF).to(torch.uint8).view_as(plane))
    else:
        store.copy_(pack(values, bits))


# NOTE: a counter-based generator (the murmur3 32-bit finaliser over index * golden ratio + key):
# each value's random bits are a pure function of (key, index), so the compiled kernel draws them in
# registers and the eager path per chunk, both giving the same bits, with no noise buffer. int32
# multiplication wraps (two's complement) in eager torch and in inductor's vectorised code; a test
# checks the compiled stream against the eager one.
_GOLDEN, _M1, _M2 = -1640531535, -2048144789, -1028477387  # 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35


def hash_noise(n: int, key: torch.Tensor | int, offset: int = 0, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """32 pseudo-random bits (as int32) for indices offset .. offset + n - 1 under ``key``."""
    if torch.is_tensor(key):
        device = key.device
    h = torch.arange(offset, offset + n, dtype=torch.int32, device=device)
    h = h * _GOLDEN + key
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _M1
    h = h ^ ((h >> 13) & 0x7FFFF)
    h = h * _M2
    return h ^ ((h >> 16) & 0xFFFF)


def mix_key(*parts: int) -> int:
    """Fold integers (seed, parameter index, step) into one int32 key for :func:`hash_noise`."""
    h = 0x2545F491
    for x in parts:
        h = (h ^ (int(x) & 0xFFFFFFFF)) * 0x9E3779B1 & 0xFFFFFFFF
        h ^= h >> 15
        h = h * 0x85EBCA6B & 0xFFFFFFFF
        h ^= h >> 13
    return h - (1 << 32) if h >= 1 << 31 else h


# ------------------------------------------------------------------------------ elementwise fields


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
    full = _FORMATS[dtype][0]
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
        inf = _INF_BITS[dtype]
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
        up = (((noise - low) & ((hb & 0x7FFF) + 1 - _INF_BITS[dtype])) >> 31) & 1
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
    full = _FORMATS[dtype][0]
    hb = _half_to_bits(half)
    if stochastic_rounding:
        hb = hb - (values & 1)  # un-round: recover the truncated 16-bit pattern
        values = values >> 1
    return _compose(hb, values << (full - extra_bits), dtype)


# ----------------------------------------------------------------------------------- public API


def sr_noise(
    n: int, dtype: torch.dtype, *, device: torch.device | str = "cpu", generator=None
) -> torch.Tensor:
    """Uniform int32 noise in [0, 2**W) for stochastic rounding of n values to ``dtype``."""
    full = max_extra_bits(dtype)
    return torch.randint(0, 2**full, (n,), dtype=torch.int32, device=device, generator=generator)


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


def relative_bound(dtype: torch.dtype, extra_bits: int) -> float:
    """Bound on |merge(split(x)) - x| / |x| in the normal range: 2**-(p + k)."""
    check_format(dtype, extra_bits)
    return math.ldexp(1.0, -(significand_bits(dtype) + extra_bits))
