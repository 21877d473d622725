"""Datasets that need no download, and (in sub-modules) encoding, sampling and prefetching."""

from .datasets import (
    ImageSet, data_dir, load_cifar10, load_cifar100, load_digits, load_mnist, make_loader,
    normalize, synthetic_images,
)

__all__ = [
    "ImageSet", "data_dir", "load_cifar10", "load_cifar100", "load_digits", "load_mnist",
    "make_loader", "normalize", "synthetic_images",
]
