"""The 16-bit formats a packed optimizer keeps, and how many extra bits complete each to fp32.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 1.1 (Table 1:
fp32 has 1 + 23 significand bits, bf16 1 + 7, fp16 1 + 10) and section 3.1 ("there is therefore
respectively 13 and 16 bits of precision to keep if we want to maintain a full fp32 accuracy"; one
more stored bit with stochastic rounding).

* bf16 is the top half of an fp32 word: 16 extra bits complete it bit for bit.
* fp16 has a 5-bit exponent: 13 extra bits complete its significand, exactly only inside fp16's
  normal range (see ``workbench.optim.split_merge`` for what happens outside it).
* With k < full extra bits, ``|merge(split(x)) - x| <= 2**-(p + k) * |x|`` in the normal range
  (:func:`relative_bound`), p = 7 (bf16) or 10 (fp16).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "SUPPORTED_DTYPES",
    "check_format",
    "max_extra_bits",
    "relative_bound",
    "significand_bits",
    "storage_bits",
]

# dtype -> (bits below the 16-bit value that complete an fp32 significand, stored significand width)
FORMATS: dict[torch.dtype, tuple[int, int]] = {
    torch.bfloat16: (16, 7),
    torch.float16: (13, 10),
}
SUPPORTED_DTYPES = tuple(FORMATS)
# the 16-bit pattern of +inf
INF_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}


def check_format(dtype: torch.dtype, extra_bits: int) -> None:
    """Raise early for a dtype other than fp16/bf16 or an extra-bit count outside its range."""
    if dtype not in FORMATS:
        raise TypeError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    full = FORMATS[dtype][0]
    if isinstance(extra_bits, bool) or not isinstance(extra_bits, int) or not 0 <= extra_bits <= full:
        raise ValueError(f"extra_bits={extra_bits!r} out of range for {dtype}: allowed 0..{full}")


def max_extra_bits(dtype: torch.dtype) -> int:
    """Bits that complete an fp32 significand: 16 for bf16, 13 for fp16."""
    check_format(dtype, 0)
    return FORMATS[dtype][0]


def significand_bits(dtype: torch.dtype) -> int:
    """Stored significand width p of the 16-bit format (7 for bf16, 10 for fp16)."""
    check_format(dtype, 0)
    return FORMATS[dtype][1]


def storage_bits(extra_bits: int, stochastic_rounding: bool = False) -> int:
    """Packed bits per value: k, plus one round-up flag with stochastic rounding."""
    return extra_bits + int(bool(stochastic_rounding))


def relative_bound(dtype: torch.dtype, extra_bits: int) -> float:
    """Bound on |merge(split(x)) - x| / |x| in the normal range: 2**-(p + k)."""
    check_format(dtype, extra_bits)
    return math.ldexp(1.0, -(significand_bits(dtype) + extra_bits))
