"""Datasets by name: real files when the user dropped them into `data/`, else a stated stand-in.

Nothing downloads at run time. `load` is the one place that picks a dataset by name, cuts it to the
sizes asked for and, with `fallback=True`, replaces a missing real dataset by the bundled digits
(when they are enough) or a seeded synthetic set of the same shape; the returned set's `name` says
which was used.
"""

from __future__ import annotations

from numbers import Integral

import torch

from .datasets import ImageSet, _resize, load_digits, seeded, synthetic_images
from .readers import load_cifar10, load_cifar100, load_mnist

__all__ = ["DATASETS", "load"]

# name -> (reader of real files, image shape, classes)
_REAL = {"mnist": (load_mnist, (1, 28, 28), 10), "cifar10": (load_cifar10, (3, 32, 32), 10),
         "cifar100": (load_cifar100, (3, 32, 32), 100)}
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
    """
    if name not in DATASETS:
        raise ValueError(f"dataset must be one of {list(DATASETS)}, got {name!r}")
    seeded(seed)
    for what, value in (("n_train", n_train), ("n_test", n_test)):
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
            raise ValueError(f"{what} must be a whole number >= 1, got {value!r}")
    if name in _REAL:
        reader, real_shape, num_classes = _REAL[name]
        shape = shape or real_shape
        try:
            train, test = reader()
        except FileNotFoundError:
            if not fallback:
                raise
            name = "digits" if n_train + n_test <= _DIGITS else "synthetic"
        else:
            if tuple(shape) != real_shape:
                train, test = _reshaped(train, shape), _reshaped(test, shape)
            return train.subset(min(n_train, len(train))), test.subset(min(n_test, len(test)))
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


def _reshaped(images: ImageSet, shape) -> ImageSet:
    pixels = images.images
    if shape[0] == 1 and pixels.shape[1] != 1:  # colour to grey: the mean of the planes
        pixels = pixels.float().mean(1, keepdim=True).round().to(torch.uint8)
    resized = _resize(pixels, shape[1], shape[0])
    return ImageSet(resized, images.labels, images.num_classes, images.name)
