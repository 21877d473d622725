"""Datasets that need no download, and (in sub-modules) encoding, sampling and prefetching."""

from .datasets import (
    ImageSet, data_dir, load_cifar10, load_cifar100, load_digits, load_mnist, make_loader,
    normalize, synthetic_images,
)
from .loading import DATASETS, load

__all__ = [
    "DATASETS", "load",
    "ImageSet", "data_dir", "load_cifar10", "load_cifar100", "load_digits", "load_mnist",
    "make_loader", "normalize", "synthetic_images",
]
