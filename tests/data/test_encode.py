"""Encoded batches: exact round trips within capacity, guards beyond it, the decode layer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.data import normalize
from workbench.data.encode import (
    CAPACITY,
    SCHEMES,
    DecodeLayer,
    EncodedBatch,
    capacity_study,
    decode,
    encode,
)


@st.composite
def uint8_batches(draw, max_batch: int = 20):
    b = draw(st.integers(1, max_batch))
    c = draw(st.integers(1, 3))
    h = draw(st.integers(1, 4))
    w = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (b, c, h, w), dtype=torch.uint8, generator=g)
    if draw(st.booleans()):  # extremes: all-255 and all-0 images carry every bit / none
        x[0] = 255
        x[-1] = 0
    return x


@settings(max_examples=40, deadline=None)
@given(images=uint8_batches(), scheme=st.sampled_from(SCHEMES), data=st.data())
def test_exact_round_trip_within_capacity(images, scheme, data) -> None:
    k = data.draw(st.integers(1, CAPACITY[scheme]))
    enc = encode(images, scheme=scheme, per_element=k)
    assert enc.count == images.shape[0] and enc.data.shape[0] == -(-images.shape[0] // k)
    torch.testing.assert_close(decode(enc), images, rtol=0, atol=0)


@settings(max_examples=20, deadline=None)
@given(images=uint8_batches())
def test_decode_layer_matches_normalize(images) -> None:
    for scheme in ("float64", "float64-7bit", "int64"):
        out = DecodeLayer()(encode(images, scheme=scheme))
        torch.testing.assert_close(out, normalize(images), rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["float64", "float64-7bit", "float32"])
def test_beyond_capacity_raises_and_is_lossy(scheme: str) -> None:
    x = torch.full((CAPACITY[scheme] + 1, 1, 2, 2), 255, dtype=torch.uint8)
    with pytest.raises(ValueError, match=rf"at most {CAPACITY[scheme]} images .*2\*\*"):
        encode(x, scheme=scheme, per_element=CAPACITY[scheme] + 1)
    lossy = encode(x, scheme=scheme, per_element=CAPACITY[scheme] + 1, allow_lossy=True)
    assert not torch.equal(decode(lossy), x)


def test_float64_seventh_image_message_names_53_bits() -> None:
    x = torch.zeros(7, 1, 1, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"56 bits .* 2\*\*53"):
        encode(x, scheme="float64", per_element=7)


def test_int64_is_one_byte_per_pixel_and_uses_the_sign_bit() -> None:
    x = torch.full((16, 3, 5, 5), 255, dtype=torch.uint8)
    enc = encode(x, scheme="int64")
    assert enc.nbytes == x.numel()  # 1 byte per pixel per image
    assert enc.data.dtype == torch.int64 and (enc.data == -1).all()
    with pytest.raises(ValueError, match="1 to 8"):
        encode(x, scheme="int64", per_element=9)


def test_bytes_and_offsets() -> None:
    x = torch.randint(0, 256, (12, 3, 4, 4), dtype=torch.uint8)
    assert encode(x, scheme="float64").nbytes == 2 * 48 * 8
    enc = encode(x, scheme="float64-7bit")
    assert enc.offsets.dtype == torch.bool and enc.offsets.shape == x.shape
    assert enc.nbytes == 2 * 48 * 8 + x.numel()
    # without the offsets only the 7 high bits survive
    no_offsets = EncodedBatch(enc.data, enc.scheme, enc.count, enc.per_element,
                              torch.zeros_like(enc.offsets))
    torch.testing.assert_close(decode(no_offsets), x & 0xFE, rtol=0, atol=0)


def test_to_moves_every_part() -> None:
    x = torch.randint(0, 256, (3, 1, 2, 2), dtype=torch.uint8)
    enc = encode(x, scheme="float64-7bit").to("cpu")
    assert enc.device.type == "cpu" and enc.offsets.device.type == "cpu"
    assert len(enc) == 3 and enc.image_shape == (1, 2, 2)


@pytest.mark.parametrize("bad, error", [
    (torch.zeros(2, 1, 2, 2), TypeError),
    (torch.zeros(2, 1, 2, 2, dtype=torch.int64), TypeError),
    (torch.zeros(1, 2, 2, dtype=torch.uint8), ValueError),
    ([[0]], TypeError),
])
def test_refuses_wrong_dtype_or_shape(bad, error) -> None:
    with pytest.raises(error, match="uint8|shape|Tensor"):
        encode(bad, scheme="int64")


def test_refuses_unknown_scheme_and_bad_count() -> None:
    x = torch.zeros(2, 1, 2, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scheme must be one of"):
        encode(x, scheme="float16")
    with pytest.raises(ValueError, match=r"\[1, 64\], got 0"):
        encode(x, scheme="float64", per_element=0)
    with pytest.raises(TypeError, match="EncodedBatch"):
        decode(x)


def test_capacity_study_finds_the_limits() -> None:
    x = torch.randint(0, 256, (8, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator()
                      .manual_seed(0))
    x[0] = 255
    df = capacity_study(x, max_per_element=16)
    last_exact = df[df.exact].groupby("scheme").per_element.max().to_dict()
    assert last_exact == {"float32": 3, "float64": 6, "float64-7bit": 7, "int64": 8}
    assert not df[(df.scheme == "float64") & (df.per_element == 16)].exact.item()


def test_int64_decode_allocates_only_the_float_batch() -> None:
    from workbench.measure import MemoryMeter

    x = torch.randint(0, 256, (13, 3, 8, 8), dtype=torch.uint8)  # not a multiple of 8: padded word
    enc = encode(x, scheme="int64")
    with MemoryMeter() as meter:
        out = DecodeLayer()(enc)
    assert meter.peak_bytes == out.nbytes == 4 * x.numel()  # no int64 planes, no stack
    torch.testing.assert_close(out, normalize(x), rtol=0, atol=0)
    assert out.is_contiguous()


def test_int64_is_exactly_uint8_size() -> None:
    x = torch.randint(0, 256, (64, 3, 4, 4), dtype=torch.uint8)
    assert encode(x, scheme="int64").nbytes == x.nbytes


@pytest.mark.parametrize("bad", [2.5, True, "2"])
def test_per_element_must_be_an_int(bad) -> None:
    x = torch.zeros(4, 1, 2, 2, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"per_element must be an int in \[1, 64\].*got"):
        encode(x, scheme="float64", per_element=bad)


def test_to_copy_makes_a_new_buffer() -> None:
    enc = encode(torch.zeros(8, 1, 2, 2, dtype=torch.uint8), scheme="int64")
    assert enc.to("cpu").data is enc.data
    moved = enc.to("cpu", copy=True)
    assert moved.data.data_ptr() != enc.data.data_ptr()
    torch.testing.assert_close(moved.data, enc.data)


def _hand_built(**change):
    x = torch.randint(0, 256, (5, 1, 2, 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    enc = encode(x, scheme=change.pop("from_scheme", "int64"))
    parts = {"data": enc.data, "scheme": enc.scheme, "count": enc.count, "per_element": enc.per_element,
             "offsets": enc.offsets}
    parts.update(change)
    return parts


@pytest.mark.parametrize("change, match", [
    ({"scheme": "bogus"}, r"scheme must be one of .*, got 'bogus'"),
    ({"data": torch.rand(1, 1, 2, 2)}, r"data for scheme 'int64' must be a 4-D torch.int64 tensor .*got torch.float32"),
    ({"data": torch.zeros(1, 4, dtype=torch.int64)}, r"\[groups, C, H, W\], got torch.int64 \(1, 4\)"),
    ({"count": 0}, "count must be an int >= 1, got 0"),
    ({"count": 20}, r"20 images at 8 per element needs 3 words per pixel \(data.shape\[0\]\), got 1"),
    ({"per_element": 9}, "per_element must be in 1..8 for int64, got 9"),
    ({"offsets": torch.zeros(5, 1, 2, 2, dtype=torch.bool)}, "offsets belong to scheme 'float64-7bit' only"),
    ({"from_scheme": "float64-7bit", "offsets": None}, r"needs bool offsets of shape \(5, 1, 2, 2\), got None"),
    ({"from_scheme": "float64", "scheme": "int64"}, "must be a 4-D torch.int64 tensor"),
])
def test_hand_built_batch_is_checked_at_construction(change, match) -> None:
    with pytest.raises(ValueError, match=match):
        EncodedBatch(**_hand_built(**change))


@pytest.mark.parametrize("words, match", [
    (torch.full((1, 1, 2, 2), 2.5, dtype=torch.float64), "integers >= 0 below 256\\*\\*6 .*found 2.5"),
    (torch.full((1, 1, 2, 2), -1.0, dtype=torch.float64), "found -1.0"),
    (torch.full((1, 1, 2, 2), float("nan"), dtype=torch.float64), "found nan"),
    (torch.full((1, 1, 2, 2), 2.0**50, dtype=torch.float64), "below 256\\*\\*6"),
])
def test_float_words_an_encoding_cannot_produce_are_refused_at_decode(words, match) -> None:
    enc = EncodedBatch(words, "float64", 5, 6)
    with pytest.raises(ValueError, match=match):
        decode(enc)
    with pytest.raises(ValueError, match=match):
        DecodeLayer()(enc)


def test_lossy_float32_words_that_overflow_still_decode() -> None:
    """Beyond capacity, float32 place values overflow: inf, and NaN where a zero pixel meets them;
    the capacity study measures that error rather than being refused."""
    x = torch.zeros(32, 1, 2, 2, dtype=torch.uint8)
    enc = encode(x, scheme="float32", per_element=32, allow_lossy=True)
    assert torch.isnan(enc.data).any()
    assert decode(enc).shape == x.shape
    bad = EncodedBatch(torch.full((1, 1, 2, 2), -3.0), "float32", 32, 32)
    with pytest.raises(ValueError, match=r"float32 words must be integers >= 0 \(what encode writes for 32"):
        decode(bad)
