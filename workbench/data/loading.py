"""Datasets by name: real files when the user dropped them into `data/`, else a stated stand-in.

Nothing downloads at run time. `load` is the one place that picks a dataset by name, cuts it to the
sizes asked for and, with `fallback=True`, replaces a missing real dataset by the bundled digits
(when they are enough) or a seeded synthetic set of the same shape; the returned set's `name` says
which was used.
"""

from __future__ import annotations

import os
from numbers import Integral

import torch

from .datasets import ImageSet, _resize, load_digits, seeded, synthetic_images
from .readers import load_cifar10, load_cifar100, load_mnist

__all__ = ["DATASETS", "load"]

# name -> (reader of real files, image shape, classes, (train, test) images in the published files)
_REAL = {"mnist": (load_mnist, (1, 28, 28), 10, (60_000, 10_000)),
         "cifar10": (load_cifar10, (3, 32, 32), 10, (50_000, 10_000)),
         "cifar100": (load_cifar100, (3, 32, 32), 100, (50_000, 10_000))}
DATASETS = (*_REAL, "digits", "synthetic")
_DIGITS = 1797  # scikit-learn's bundled digits


def load(
    name: str, n_train: int, n_test: int, *, seed: int = 0, shape: tuple[int, int, int] | None = None,
    num_classes: int = 10, fallback: bool = False,
) -> tuple[ImageSet, ImageSet]:
    """(train, test) of `name` (one of `DATASETS`), at most `n_train` and `n_test` examples.

    `shape` (C, H, W) is the image shape for "digits" (upscaled from 8x8) and "synthetic" (default:
    the real set's shape, else 1x28x28). A real set whose files are missing raises FileNotFoundError
    naming where to put them, unless `fallback`: then the digits stand in when `n_train + n_test`
    fits in their 1797 images, else a seeded synthetic set.

    A real set or the digits resized to `shape` take 1 or 3 channels and square images (H == W), and the
    resizing must fit in half this machine's memory (checked before any file is read, and again with the
    images the files hold); only the images kept are resized. ValueError naming `shape` otherwise.
    """
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {list(DATASETS)}, got {name!r}")
    seeded(seed)
    if not isinstance(fallback, bool):
        raise TypeError(f"fallback must be True or False, got {fallback!r}")
    for what, value in (("n_train", n_train), ("n_test", n_test)):
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
            raise ValueError(f"{what} must be a whole number >= 1, got {value!r}")
    if shape is not None:
        shape = _checked_shape(shape, square=name != "synthetic")
    if name in _REAL:
        reader, real_shape, num_classes, (most_train, most_test) = _REAL[name]
        shape = shape or real_shape
        if shape != real_shape:
            _check_fits(name, min(n_train, most_train) + min(n_test, most_test), shape, real_shape[0])
        try:
            train, test = reader()
        except FileNotFoundError:
            if not fallback:
                raise
            name = "digits" if n_train + n_test <= _DIGITS else "synthetic"
        else:
            train, test = train.subset(min(n_train, len(train))), test.subset(min(n_test, len(test)))
            if shape != real_shape:  # only the images kept are resized
                _check_fits(name, len(train) + len(test), shape, real_shape[0])
                train, test = _reshaped(train, shape), _reshaped(test, shape)
            return train, test
    shape = tuple(shape or (1, 28, 28))
    if name == "digits":
        if n_train + n_test > _DIGITS:
            raise ValueError(f"digits has {_DIGITS} images; asked for {n_train} + {n_test}")
        full = load_digits(shape[1], shape[0])
        train, test = full.split(n_test / len(full), seed=seed)
        return train.subset(min(n_train, len(train))), test
    full = synthetic_images(n_train + n_test, shape, num_classes, seed=seed)
    tail = ImageSet(full.images[-n_test:], full.labels[-n_test:], full.num_classes, full.name)
    return full.subset(n_train), tail


def _checked_shape(shape, *, square: bool) -> tuple[int, int, int]:
    """`shape` as a tuple (C, H, W) of whole numbers >= 1; C in 1 or 3 and H == W when `square` (the digits and
    the real sets, which are resized to square images of 1 or 3 channels). ValueError naming it otherwise."""
    if not isinstance(shape, (tuple, list, torch.Size)) or len(shape) != 3:
        raise ValueError(f"shape={shape!r}: must be (C, H, W), a tuple of 3 whole numbers >= 1")
    if not all(isinstance(d, Integral) and not isinstance(d, bool) and d >= 1 for d in shape):
        raise ValueError(f"shape={tuple(shape)!r}: must be (C, H, W), 3 whole numbers >= 1")
    shape = tuple(int(d) for d in shape)
    if square and shape[0] not in (1, 3):
        raise ValueError(f"shape={shape}: images are made with 1 or 3 channels (C), got C={shape[0]}")
    if square and shape[1] != shape[2]:
        raise ValueError(f"shape={shape}: images are resized to squares, so H must equal W (got {shape[1]} x "
                         f"{shape[2]})")
    return shape


def _memory_bytes() -> int:
    """This machine's physical memory in bytes (8 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 8 * 2**30


def _check_fits(name: str, n: int, shape: tuple[int, int, int], channels: int) -> None:
    """ValueError naming `shape` and the bytes when resizing `n` images of `channels` channels to `shape` would
    take more than half this machine's memory: the uint8 result plus, when the size changes, a float32 copy of
    the planes resized (one for grey, else every channel) and their uint8 rounding."""
    c, h, w = shape
    planes = 1 if c == 1 else channels
    need = n * h * w * (c + 5 * planes)
    budget = _memory_bytes() // 2
    if need > budget:
        raise ValueError(f"shape={shape}: resizing {n:,} {name} images to {c}x{h}x{w} would take about "
                         f"{need:,} bytes (the uint8 images plus a float32 working copy), more than half this "
                         f"machine's memory ({budget:,} of {2 * budget:,} bytes); ask for a smaller shape or "
                         f"fewer images")


def _reshaped(images: ImageSet, shape) -> ImageSet:
    pixels = images.images
    if shape[0] == 1 and pixels.shape[1] != 1:  # colour to grey: the mean of the planes
        pixels = pixels.float().mean(1, keepdim=True).round().to(torch.uint8)
    resized = _resize(pixels, shape[1], shape[0])
    return ImageSet(resized, images.labels, images.num_classes, images.name)
