"""Encoded batches: several uint8 images packed into one tensor element (OpTorch E-D).

Paper: Ahmed & Naveed, "OpTorch" (arXiv 2105.00619), Sec. II-A-1 (Algorithm 1, encode:
``A = sum_i X_i * 256**i``), II-A-2 (Algorithm 3, the decode layer: ``X_i = A mod 256;
A = A div 256``) and II-A-3 (Algorithm 4, "loss-less forced encoding": 7-bit values plus an
odd/even offset array).

Schemes (``SCHEMES``):

* ``float64``: Algorithm 1 in float64. A float64 holds integers exactly only up to 2**53, so
  6 images (48 bits) are the most that round-trip; the paper's "16 images" cannot be exact
  A 7th image raises ValueError unless ``allow_lossy=True``.
* ``float64-7bit``: Algorithm 4 as written: ``A = sum_i (X_i div 2) * 128**i`` plus a boolean
  offset array ``X_i mod 2`` (one byte per pixel per image, as the paper's "Boolean array of
  size HxWxCxB"). Exact up to 7 images (49 bits), not the paper's 32.
* ``int64``: exact packing of 8 uint8 images per int64 word, byte ``i`` of each word holding
  image ``i``. It is exactly the size of the uint8 batch (1 byte per pixel per image, for
  batches that are a multiple of 8; zero-padded otherwise): E-D's memory saving over a float32
  batch is the saving of shipping uint8, 4x, never the paper's 16x. Packing and unpacking are
  byte views of one buffer (no per-image int64 planes), so decoding allocates only the float
  batch it returns.
* ``float32``: Algorithm 1 in float32, for the capacity study only (exact up to 3 images).

The compact form is what crosses to the device; :class:`DecodeLayer` unpacks it there and
returns the normalised float batch ``(x/255 - 0.5)/0.5``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import pandas as pd
import torch
from torch import nn

from .datasets import normalize

__all__ = [
    "CAPACITY",
    "SCHEMES",
    "DecodeLayer",
    "EncodedBatch",
    "capacity_study",
    "decode",
    "encode",
]

SCHEMES = ("float64", "float64-7bit", "int64", "float32")
# images per element that round-trip exactly (mantissa bits // bits per image; int64: 64 // 8)
CAPACITY = {"float64": 6, "float64-7bit": 7, "int64": 8, "float32": 3}
_MANTISSA = {"float64": 53, "float32": 24}
_DTYPES = {"float64": torch.float64, "float64-7bit": torch.float64, "int64": torch.int64, "float32": torch.float32}


@dataclass(frozen=True)
class EncodedBatch:
    """A batch of ``count`` uint8 images of ``image_shape`` packed ``per_element`` per word.

    ``data`` is ``[ceil(count / per_element), C, H, W]`` of the scheme's dtype (``_DTYPES``);
    ``offsets`` (float64-7bit only) is the boolean odd/even array ``[count, C, H, W]``. Move it
    with ``.to(device)``. A batch built by hand is checked here (scheme, dtypes, shapes, counts);
    :func:`decode` also checks that float words hold what an encoding can produce.
    """

    data: torch.Tensor
    scheme: str
    count: int
    per_element: int
    offsets: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"EncodedBatch scheme must be one of {SCHEMES}, got {self.scheme!r}")
        top = 8 if self.scheme == "int64" else 64
        for name, value, low in (("count", self.count, 1), ("per_element", self.per_element, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"EncodedBatch {name} must be an int >= {low}, got {value!r}")
        if self.per_element > top:
            raise ValueError(f"EncodedBatch per_element must be in 1..{top} for {self.scheme}, got {self.per_element}")
        want = _DTYPES[self.scheme]
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != want or self.data.ndim != 4:
            got = (f"{self.data.dtype} {tuple(self.data.shape)}" if isinstance(self.data, torch.Tensor)
                   else type(self.data).__name__)
            raise ValueError(f"EncodedBatch data for scheme {self.scheme!r} must be a 4-D {want} tensor "
                             f"[groups, C, H, W], got {got}")
        groups = -(-self.count // self.per_element)
        if self.data.shape[0] != groups:
            raise ValueError(f"EncodedBatch of {self.count} images at {self.per_element} per element needs "
                             f"{groups} words per pixel (data.shape[0]), got {self.data.shape[0]}")
        if self.scheme != "float64-7bit":
            if self.offsets is not None:
                raise ValueError(f"EncodedBatch offsets belong to scheme 'float64-7bit' only, not {self.scheme!r}")
            return
        shape = (self.count, *self.data.shape[1:])
        if (not isinstance(self.offsets, torch.Tensor) or self.offsets.dtype != torch.bool
                or tuple(self.offsets.shape) != shape):
            got = (f"{self.offsets.dtype} {tuple(self.offsets.shape)}" if isinstance(self.offsets, torch.Tensor)
                   else repr(self.offsets))
            raise ValueError(f"EncodedBatch 'float64-7bit' needs bool offsets of shape {shape}, got {got}")

    @property
    def nbytes(self) -> int:
        """Bytes the batch occupies (packed words plus offsets)."""
        total = self.data.numel() * self.data.element_size()
        if self.offsets is not None:
            total += self.offsets.numel() * self.offsets.element_size()
        return total

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape[1:])

    @property
    def device(self) -> torch.device:
        return self.data.device

    def to(self, device: torch.device | str, *, non_blocking: bool = False, copy: bool = False) -> EncodedBatch:
        """The batch on ``device``; ``copy=True`` copies even when it is already there (so a
        measured region counts what crosses to the device, as it does for a float batch)."""
        offsets = (self.offsets.to(device, non_blocking=non_blocking, copy=copy)
                   if self.offsets is not None else None)
        return replace(self, data=self.data.to(device, non_blocking=non_blocking, copy=copy),
                       offsets=offsets)

    def pin_memory(self) -> EncodedBatch:
        offsets = self.offsets.pin_memory() if self.offsets is not None else None
        return replace(self, data=self.data.pin_memory(), offsets=offsets)

    def __len__(self) -> int:
        return self.count


def _check_images(images: torch.Tensor) -> None:
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a torch.Tensor, got {type(images).__name__}")
    if images.dtype != torch.uint8:
        raise TypeError(
            f"images must be uint8 in [0, 255], got dtype {images.dtype}; convert with "
            f"images.round().clamp(0, 255).to(torch.uint8) if they are integer-valued")
    if images.ndim != 4 or images.shape[0] < 1:
        raise ValueError(f"images must be [B, C, H, W] with B >= 1, got shape {tuple(images.shape)}")


def encode(
    images: torch.Tensor, *, scheme: str = "int64", per_element: int | None = None,
    allow_lossy: bool = False,
) -> EncodedBatch:
    """Pack a uint8 batch ``[B, C, H, W]``; ``per_element`` defaults to the scheme's capacity.

    Packing more images per element than the scheme holds exactly raises ValueError unless
    ``allow_lossy=True`` (used by :func:`capacity_study` to measure where it breaks).
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    _check_images(images)
    cap = CAPACITY[scheme]
    if per_element is not None and (isinstance(per_element, bool) or not isinstance(per_element, int)):
        raise TypeError(f"per_element must be an int in [1, 64] (int64: [1, 8]), got {per_element!r}")
    if not isinstance(allow_lossy, bool):
        raise TypeError(f"allow_lossy must be a bool, got {allow_lossy!r}")
    k = cap if per_element is None else per_element
    if scheme == "int64" and not 1 <= k <= 8:
        raise ValueError(f"int64 holds 1 to 8 uint8 images per word, got per_element={k}")
    if not 1 <= k <= 64:
        raise ValueError(f"per_element must be in [1, 64], got {k}")
    if k > cap and not allow_lossy:
        bits = 7 if scheme == "float64-7bit" else 8
        raise ValueError(
            f"{scheme} holds at most {cap} images per element exactly: {k} images need "
            f"{bits * k} bits but a {scheme.split('-')[0]} represents integers exactly only up "
            f"to 2**{_MANTISSA.get(scheme.split('-')[0], 64)} ({bits} bits per image); use "
            f"per_element <= {cap}, scheme='int64', or allow_lossy=True to measure the error")
    count = images.shape[0]
    groups = -(-count // k)
    if groups * k == count:
        padded = images.contiguous()
    else:
        padded = torch.zeros((groups * k, *images.shape[1:]), dtype=torch.uint8, device=images.device)
        padded[:count] = images
    planes = padded.view(groups, k, *images.shape[1:])
    offsets = None
    if scheme == "int64":
        return EncodedBatch(_pack_bytes(planes), scheme, count, k)
    dtype = torch.float64 if scheme.startswith("float64") else torch.float32
    if scheme == "float64-7bit":
        base = 128.0
        offsets = (images & 1).bool()
        planes = planes >> 1
    else:
        base = 256.0
    # NOTE: accumulate as in Algorithm 1 (A = A + img * 256**i) in the target dtype, so the
    # rounding beyond capacity is exactly what the paper's scheme does.
    acc = torch.zeros((groups, *images.shape[1:]), dtype=dtype, device=images.device)
    for i in range(k):
        acc += planes[:, i].to(dtype) * (base ** i)
    return EncodedBatch(acc, scheme, count, k, offsets)


# NOTE: byte i of a little-endian int64 word is bits 8i..8i+7, the "shift by 8i" of the packing.
# On a big-endian host the byte order within the word is reversed; index it accordingly.
_BYTE = (lambda i: i) if sys.byteorder == "little" else (lambda i: 7 - i)


def _pack_bytes(planes: torch.Tensor) -> torch.Tensor:
    """``[groups, k, C, H, W]`` uint8 -> ``[groups, C, H, W]`` int64 words, byte i = image i."""
    groups, k = planes.shape[:2]
    word_bytes = torch.zeros((groups, *planes.shape[2:], 8), dtype=torch.uint8, device=planes.device)
    for i in range(k):
        word_bytes[..., _BYTE(i)] = planes[:, i]
    return word_bytes.view(torch.int64).squeeze(-1)


def _word_bytes(words: torch.Tensor, k: int) -> torch.Tensor:
    """The images held by int64 words as a zero-copy uint8 view ``[groups, k, C, H, W]``."""
    as_bytes = words.contiguous().view(torch.uint8).unflatten(-1, (words.shape[-1], 8))
    order = [_BYTE(i) for i in range(k)]
    picked = as_bytes[..., :k] if order == list(range(k)) else as_bytes[..., order]
    return picked.movedim(-1, 1)


def _images_from_words(words: torch.Tensor, k: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``[count, C, H, W]`` of ``dtype`` read from the words' bytes: one allocation, the result."""
    view = _word_bytes(words, k)
    out = torch.empty((count, *words.shape[1:]), dtype=dtype, device=words.device)
    full = count // k
    if full:
        out[: full * k].view(full, k, *words.shape[1:]).copy_(view[:full])
    if count > full * k:
        out[full * k:].copy_(view[full, : count - full * k])
    return out


def _unpack(encoded: EncodedBatch) -> torch.Tensor:
    """uint8 images ``[count, C, H, W]`` (Algorithm 3; for int64 a byte view of the words)."""
    data, k = encoded.data, encoded.per_element
    if encoded.scheme == "int64":
        return _images_from_words(data, k, encoded.count, torch.uint8)
    base = 128.0 if encoded.scheme == "float64-7bit" else 256.0
    planes, acc = [], data
    for _ in range(k):
        planes.append(torch.remainder(acc, base))
        acc = torch.div(acc, base, rounding_mode="floor")
    out = torch.stack(planes, dim=1).flatten(0, 1)[: encoded.count]
    if encoded.scheme == "float64-7bit":
        out = out * 2 + encoded.offsets.to(out.dtype)
    # beyond capacity rounding can push a digit past 255; clamp so the result stays uint8
    return out.clamp_(0, 255).to(torch.uint8)


def _check_words(encoded: EncodedBatch) -> None:
    """Float words must be what Algorithm 1 can produce: integers >= 0 below base**k.

    Beyond capacity (``allow_lossy``) the sum may round up to base**k or overflow (inf, and NaN
    where a zero pixel meets an infinite place value); only negative and fractional words are
    refused there.
    """
    if encoded.scheme == "int64":  # every int64 word is 8 valid bytes
        return
    data, k = encoded.data, encoded.per_element
    base = 128.0 if encoded.scheme == "float64-7bit" else 256.0
    if k <= CAPACITY[encoded.scheme]:
        bad = (data < 0) | (data != data.floor()) | (data >= base ** k)  # NaN != NaN
    else:
        bad = (data < 0) | (data.isfinite() & (data != data.floor()))
    if bool(bad.any()):
        value = float(data[bad].flatten()[0])
        limit = f" below {base:g}**{k}" if k <= CAPACITY[encoded.scheme] else ""
        raise ValueError(f"EncodedBatch {encoded.scheme} words must be integers >= 0{limit} (what encode "
                         f"writes for {k} images per element), found {value!r}")


def decode(encoded: EncodedBatch) -> torch.Tensor:
    """The uint8 images ``[count, C, H, W]`` back from an :class:`EncodedBatch`."""
    if not isinstance(encoded, EncodedBatch):
        raise TypeError(f"decode expects an EncodedBatch, got {type(encoded).__name__}")
    _check_words(encoded)
    return _unpack(encoded)


class DecodeLayer(nn.Module):
    """OpTorch's custom decode layer: EncodedBatch in, normalised float batch out.

    Put it first in the model; the encoded batch is moved to the model's device and unpacked
    there. Plain tensors pass through unchanged (so one model serves both pipelines).
    """

    def __init__(self, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"DecodeLayer: dtype must be a floating torch.dtype, got {dtype!r}")
        self.dtype = dtype

    def forward(self, x: EncodedBatch | torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            return x
        if x.scheme == "int64":
            # NOTE: the float batch is filled straight from a byte view of the words, then
            # mapped to [-1, 1] in place with normalize's own two operations (a test holds the
            # two equal bit for bit): decoding allocates the float batch and nothing else.
            out = _images_from_words(x.data, x.per_element, x.count, self.dtype)
            return out.div_(127.5).sub_(1.0)
        _check_words(x)
        return normalize(_unpack(x), dtype=self.dtype)


def capacity_study(
    images: torch.Tensor, *, schemes: tuple[str, ...] = ("float32", "float64", "float64-7bit",
                                                         "int64"),
    max_per_element: int = 32,
) -> pd.DataFrame:
    """Reconstruction error against images per element for each scheme.

    One row per (scheme, per_element): max and mean absolute pixel error, the fraction of
    pixels exact, whether the round trip is exact, and bytes per image (offsets included).
    int64 stops at 8 (it cannot hold more than 64 bits).
    """
    _check_images(images)
    if isinstance(max_per_element, bool) or not isinstance(max_per_element, int) or not 1 <= max_per_element <= 64:
        raise ValueError(f"capacity_study: max_per_element must be an int in [1, 64], got {max_per_element!r}")
    if isinstance(schemes, str) or not isinstance(schemes, (tuple, list)) or not schemes:
        raise ValueError(f"capacity_study: schemes must be a non-empty tuple of {SCHEMES}, got {schemes!r}")
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        raise ValueError(f"capacity_study: schemes must be among {SCHEMES}, got {bad}")
    rows = []
    for scheme in schemes:
        top = min(max_per_element, 8) if scheme == "int64" else max_per_element
        for k in range(1, top + 1):
            batch = images[: max(k, 1)]
            if batch.shape[0] < k:
                reps = -(-k // batch.shape[0])
                batch = batch.repeat(reps, 1, 1, 1)[:k]
            enc = encode(batch, scheme=scheme, per_element=k, allow_lossy=True)
            err = (decode(enc).int() - batch.int()).abs()
            rows.append({
                "scheme": scheme, "per_element": k, "max_abs_error": int(err.max()),
                "mean_abs_error": float(err.float().mean()),
                "exact_fraction": float((err == 0).float().mean()),
                "exact": bool((err == 0).all()), "capacity": CAPACITY[scheme],
                "bytes_per_image": enc.nbytes / k,
                "bytes_per_pixel": enc.nbytes / k / batch[0].numel(),
            })
    return pd.DataFrame(rows)
