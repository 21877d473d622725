"""Datasets that need no download, readers for real CIFAR and MNIST files, and (in sub-modules) encoding,
sampling and prefetching."""

from .datasets import ImageSet, data_dir, load_digits, make_loader, normalize, synthetic_images
from .loading import DATASETS, load
from .readers import load_cifar10, load_cifar100, load_mnist

__all__ = [
    "DATASETS", "load",
    "ImageSet", "data_dir", "load_cifar10", "load_cifar100", "load_digits", "load_mnist",
    "make_loader", "normalize", "synthetic_images",
]
