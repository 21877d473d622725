"""The counter-based random bits of stochastic rounding (Lewandowski & Kosson, 3.1): uniform, a pure
function of (key, index), and movable along the stream. Tests ``workbench.optim.rng``."""

import math

import torch

from workbench.optim.rng import hash_noise, mix_key, shift_key


def test_hash_noise_is_uniform_and_indexed_by_position():
    n = 1 << 16
    h = hash_noise(n, 12345)
    # each of the 32 bits is set about half the time (5 sigma of a fair coin)
    ones = torch.stack([((h >> b) & 1).float().mean() for b in range(32)])
    assert torch.all((ones - 0.5).abs() < 5 * 0.5 / math.sqrt(n))
    # a value depends on (key, index) only: a chunk starting at offset reproduces the slice
    torch.testing.assert_close(hash_noise(100, 12345, 700), h[700:800], rtol=0, atol=0)
    assert not torch.equal(hash_noise(100, 12346), h[:100])
    assert mix_key(1, 2, 3) != mix_key(1, 2, 4)
    assert -(2**31) <= mix_key(2**40, -5) < 2**31


def test_a_shifted_key_draws_the_stream_further_on():
    key = mix_key(3, 1, 4)
    for offset in (0, 32, 700, 123_456):
        torch.testing.assert_close(hash_noise(64, shift_key(key, offset)), hash_noise(64, key, offset),
                                   rtol=0, atol=0)
    assert -(2**31) <= shift_key(2**31 - 1, 10**9) < 2**31
