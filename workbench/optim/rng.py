"""Random bits for stochastic rounding: a counter-based hash of (key, index), and torch-drawn noise.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1 (stochastic
rounding when splitting the full precision value, with one extra stored bit to "un-round" it).

:func:`hash_noise` gives 32 random bits per value as a pure function of (key, index): the compiled
update draws them in registers, the eager update per chunk, both the same bits, and neither
allocates a noise buffer the size of the tensor. :func:`mix_key` folds (seed, group, step) into a
key; :func:`shift_key` moves a key along its stream, so a parameter stepped alone draws the bits it
would draw inside its group's fused flat stream. :func:`sr_noise` draws the uniform noise
``workbench.optim.split_merge.split`` rounds with from torch's generator.
"""

from __future__ import annotations

import torch

from .formats import max_extra_bits

__all__ = ["hash_noise", "mix_key", "shift_key", "sr_noise"]

# NOTE: a counter-based generator (the murmur3 32-bit finaliser over index * golden ratio + key):
# each value's random bits are a pure function of (key, index), so the compiled kernel draws them in
# registers and the eager path per chunk, both giving the same bits, with no noise buffer. int32
# multiplication wraps (two's complement) in eager torch and in inductor's vectorised code; a test
# checks the compiled stream against the eager one.
_GOLDEN, _M1, _M2 = -1640531535, -2048144789, -1028477387  # 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35
_GOLDEN_U32 = 0x9E3779B1


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


def sr_noise(
    n: int, dtype: torch.dtype, *, device: torch.device | str = "cpu", generator=None
) -> torch.Tensor:
    """Uniform int32 noise in [0, 2**W) for stochastic rounding of n values to ``dtype``."""
    full = max_extra_bits(dtype)
    return torch.randint(0, 2**full, (n,), dtype=torch.int32, device=device, generator=generator)


def shift_key(key: int, offset: int) -> int:
    """The key whose stream at index i equals ``key``'s stream at index offset + i."""
    k = (key + offset * _GOLDEN_U32) & 0xFFFFFFFF
    return k - (1 << 32) if k >= 1 << 31 else k
