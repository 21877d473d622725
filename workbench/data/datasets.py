"""Offline image datasets: the `ImageSet` container, bundled digits and seeded synthetic sets.

Nothing downloads at run time. Readers for real CIFAR-10/100 and MNIST files, which users drop
into `data/` (or $WORKBENCH_DATA), live in `workbench.data.readers`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from numbers import Integral, Real
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ..devices import repo_root

__all__ = ["ImageSet", "MAX_SYNTHETIC_BYTES", "data_dir", "load_digits", "synthetic_images", "normalize",
           "make_loader"]

MAX_SYNTHETIC_BYTES = 2**32  # largest synthetic set built (uint8 pixels): a typo in a size fails fast, not in malloc


@dataclass
class ImageSet:
    """uint8 images [N, C, H, W] with int64 labels [N]."""

    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        for what, value in (("images", self.images), ("labels", self.labels)):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"ImageSet: {what} must be a torch.Tensor, got {type(value).__name__}")
        if not isinstance(self.name, str):
            raise TypeError(f"ImageSet: name must be a str, got {self.name!r}")
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError(
                f"images must be uint8 [N, C, H, W], got {self.images.dtype} {tuple(self.images.shape)}"
            )
        if self.labels.shape != (len(self.images),):
            raise ValueError(f"labels must be [{len(self.images)}], got {tuple(self.labels.shape)}")
        if not len(self.images):
            raise ValueError(f"an ImageSet holds at least one image, got images of shape {tuple(self.images.shape)}")
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, Integral) or self.num_classes < 1:
            raise ValueError(f"num_classes must be a whole number >= 1, got {self.num_classes!r}")
        if self.labels.is_floating_point() or self.labels.is_complex() or self.labels.dtype == torch.bool:
            raise ValueError(f"labels must be class indices (integers), got dtype {self.labels.dtype}")
        low, high = int(self.labels.min()), int(self.labels.max())
        if low < 0 or high >= self.num_classes:
            raise ValueError(f"labels must be in 0..{self.num_classes - 1}, found {low}..{high}")
        self.labels = self.labels.long()

    def __len__(self) -> int:
        return len(self.images)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])

    def subset(self, n: int) -> ImageSet:
        """The first n examples."""
        if not 1 <= n <= len(self):
            raise ValueError(f"subset size must be in 1..{len(self)}, got {n}")
        return ImageSet(self.images[:n], self.labels[:n], self.num_classes, self.name)

    def split(self, test_fraction: float = 0.2, *, seed: int = 0) -> tuple[ImageSet, ImageSet]:
        """A seeded random (train, test) split."""
        if not 0 < test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
        order = torch.randperm(len(self), generator=seeded(seed))
        n_test = max(1, round(len(self) * test_fraction))
        test, train = order[:n_test], order[n_test:]
        return (
            ImageSet(self.images[train], self.labels[train], self.num_classes, self.name),
            ImageSet(self.images[test], self.labels[test], self.num_classes, self.name),
        )


def data_dir() -> Path:
    """Where users drop real datasets: $WORKBENCH_DATA, else `data/` in the checkout."""
    return Path(os.environ.get("WORKBENCH_DATA") or repo_root() / "data")


def _resize(images: torch.Tensor, size: int, channels: int) -> torch.Tensor:
    if size != images.shape[-1]:
        images = F.interpolate(images.float(), size=(size, size), mode="bilinear", align_corners=False)
        images = images.round_().clamp_(0, 255).to(torch.uint8)  # in place: one float copy at a time
    if channels != images.shape[1]:
        images = images.expand(-1, channels, -1, -1).contiguous()
    return images


def load_digits(size: int = 8, channels: int = 1) -> ImageSet:
    """scikit-learn's bundled handwritten digits (1797 real 8x8 images, 10 classes) as uint8.

    `size` upscales bilinearly (e.g. 28 for MNIST-shaped, 32 for CIFAR-shaped); `channels`
    repeats the grey plane (1 or 3).
    """
    from sklearn.datasets import load_digits as sk_load_digits

    if isinstance(size, bool) or not isinstance(size, Integral) or not 4 <= size <= 512:
        raise ValueError(f"size must be in 4..512 (whole pixels), got {size!r}")
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    bunch = sk_load_digits()
    pixels = torch.from_numpy(bunch.images * (255.0 / 16.0)).round().to(torch.uint8)[:, None]
    return ImageSet(_resize(pixels, size, channels), torch.from_numpy(bunch.target), 10, "digits")


def seeded(seed: int, who: str = "seed") -> torch.Generator:
    """A generator seeded with `seed`, a whole number torch takes (-2**63..2**64-1); ValueError naming it."""
    if isinstance(seed, bool) or not isinstance(seed, Integral) or not -(2**63) <= seed < 2**64:
        raise ValueError(f"{who} must be a whole number in -2**63..2**64-1, got {seed!r}")
    return torch.Generator().manual_seed(int(seed))


def synthetic_images(
    n: int, shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10, *,
    seed: int = 0, noise: float = 0.35,
) -> ImageSet:
    """A seeded, learnable synthetic image classification set of any shape.

    Each class has a smooth random prototype (low-frequency noise, upsampled); an example is its
    class prototype, randomly shifted and scaled in contrast, plus pixel noise of relative
    strength `noise`. Larger `noise` makes the set harder.
    """
    for what, value, least in (("n", n, 1), ("num_classes", num_classes, 2)):
        if isinstance(value, bool) or not isinstance(value, Integral) or value < least:
            raise ValueError(f"{what} must be a whole number >= {least}, got {value!r}")
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else shape
    if (not isinstance(shape, tuple) or len(shape) != 3
            or not all(isinstance(d, Integral) and not isinstance(d, bool) and d >= 1 for d in shape)):
        raise ValueError(f"shape must be (C, H, W) with whole positive sizes, got {shape!r}")
    if n * math.prod(shape) > MAX_SYNTHETIC_BYTES:
        raise ValueError(f"synthetic_images: {n} images of shape {shape} would take {n * math.prod(shape):,} bytes, "
                         f"over MAX_SYNTHETIC_BYTES={MAX_SYNTHETIC_BYTES:,}")
    if isinstance(noise, bool) or not isinstance(noise, Real) or not (math.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise must be a finite number >= 0, got {noise!r}")
    if num_classes * math.prod(shape) * 4 > MAX_SYNTHETIC_BYTES:  # the float32 class prototypes
        raise ValueError(f"synthetic_images: num_classes={num_classes} prototypes of shape {shape} would take "
                         f"{num_classes * math.prod(shape) * 4:,} bytes, over "
                         f"MAX_SYNTHETIC_BYTES={MAX_SYNTHETIC_BYTES:,}")
    c, h, w = shape
    gen = seeded(seed)
    coarse = torch.rand(num_classes, c, 4, 4, generator=gen)
    protos = F.interpolate(coarse, size=(h, w), mode="bicubic", align_corners=False)
    labels = torch.randint(num_classes, (n,), generator=gen)
    images = torch.empty(n, c, h, w, dtype=torch.uint8)
    for start in range(0, n, 1024):  # chunks keep float temporaries small for large shapes
        idx = labels[start:start + 1024]
        k = len(idx)
        contrast = 0.7 + 0.6 * torch.rand(k, 1, 1, 1, generator=gen)
        shift = 0.2 * (torch.rand(k, 1, 1, 1, generator=gen) - 0.5)
        x = protos[idx] * contrast + shift + noise * torch.randn(k, c, h, w, generator=gen)
        images[start:start + k] = (x.clamp(0, 1) * 255).round().to(torch.uint8)
    return ImageSet(images, labels, num_classes, f"synthetic{c}x{h}x{w}")


def normalize(images: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [0, 255] -> floating `dtype` in [-1, 1]."""
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"normalize expects a uint8 tensor of images, got {type(images).__name__}")
    if images.dtype != torch.uint8:
        raise TypeError(f"normalize expects uint8 images, got {images.dtype}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"normalize: dtype must be a floating torch.dtype, got {dtype!r}")
    return images.to(dtype).div_(127.5).sub_(1.0)


_normalize = normalize  # make_loader's `normalize` flag shadows the function's name


def make_loader(
    imageset: ImageSet, batch_size: int, *, shuffle: bool = True, seed: int = 0,
    normalize: bool = True, drop_last: bool = False,
) -> DataLoader:
    """A DataLoader of (images, labels); images normalised to float unless `normalize=False`."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be a whole number >= 1, got {batch_size!r}")
    if not isinstance(imageset, ImageSet):
        raise TypeError(f"make_loader: imageset must be an ImageSet (workbench.data.load), "
                        f"got {type(imageset).__name__}")
    for what, flag in (("shuffle", shuffle), ("normalize", normalize), ("drop_last", drop_last)):
        if not isinstance(flag, bool):
            raise TypeError(f"make_loader: {what} must be True or False, got {flag!r}")
    generator = seeded(seed)
    images = _normalize(imageset.images) if normalize else imageset.images
    return DataLoader(
        TensorDataset(images, imageset.labels), batch_size=batch_size, shuffle=shuffle,
        drop_last=drop_last, generator=generator,
    )

