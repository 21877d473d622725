"""Dense packing of k-bit values into int32 words (Fig 1 of Lewandowski & Kosson, 3.1): density,
layout (LSB-first, values straddle word boundaries) and round trip. Tests ``workbench.optim.packing``."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.optim.packing import pack, unpack
from workbench.optim.split_merge import split

BF16 = torch.bfloat16


@pytest.mark.parametrize("k", range(17))
def test_packing_density(k):
    for n in [1, 5, 31, 32, 33, 100, 1000]:
        x = torch.randn(n)
        _, extra = split(x, dtype=BF16, extra_bits=k)
        assert extra.numel() == math.ceil(n * k / 32)


def _reference_pack(values, b):
    """LSB-first bit stream as one Python integer, cut into 32-bit words."""
    stream = 0
    for i, v in enumerate(values):
        stream |= (v & ((1 << b) - 1)) << (i * b)
    words = [(stream >> (32 * j)) & 0xFFFFFFFF for j in range(math.ceil(len(values) * b / 32))]
    return [w - 2**32 if w >= 2**31 else w for w in words]


@given(st.integers(1, 17), st.lists(st.integers(0, 2**17 - 1), min_size=1, max_size=100))
@settings(max_examples=200, deadline=None)
def test_pack_layout_and_roundtrip(b, raw):
    values = [v % (1 << b) for v in raw]
    v = torch.tensor(values, dtype=torch.int32)
    words = pack(v, b)
    assert words.tolist() == _reference_pack(values, b)
    torch.testing.assert_close(unpack(words, b, len(values)), v)


def test_unpack_names_the_expected_word_count():
    with pytest.raises(ValueError, match="expected 2 int32 words"):
        unpack(torch.zeros(3, dtype=torch.int32), 8, 5)
    with pytest.raises(ValueError, match=r"bits=33 out of range: allowed 0\.\.32"):
        pack(torch.zeros(3, dtype=torch.int32), 33)
