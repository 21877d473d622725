"""Offline image datasets: bundled digits, seeded synthetic sets, CIFAR and MNIST readers.

Nothing downloads at run time (DESIGN.md, "Data without the internet"). Real CIFAR-10/100
(python pickle batches) and MNIST (IDX files, optionally gzipped) are read from `data/`
(or $WORKBENCH_DATA) when a user drops them there.
"""

from __future__ import annotations

import gzip
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from ..devices import repo_root

__all__ = [
    "ImageSet", "data_dir", "load_digits", "synthetic_images", "load_cifar10", "load_cifar100",
    "load_mnist", "normalize", "make_loader",
]


@dataclass
class ImageSet:
    """uint8 images [N, C, H, W] with int64 labels [N]."""

    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError(
                f"images must be uint8 [N, C, H, W], got {self.images.dtype} {tuple(self.images.shape)}"
            )
        if self.labels.shape != (len(self.images),):
            raise ValueError(f"labels must be [{len(self.images)}], got {tuple(self.labels.shape)}")
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
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
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
        images = images.round().clamp(0, 255).to(torch.uint8)
    if channels != images.shape[1]:
        images = images.expand(-1, channels, -1, -1).contiguous()
    return images


def load_digits(size: int = 8, channels: int = 1) -> ImageSet:
    """scikit-learn's bundled handwritten digits (1797 real 8x8 images, 10 classes) as uint8.

    `size` upscales bilinearly (e.g. 28 for MNIST-shaped, 32 for CIFAR-shaped); `channels`
    repeats the grey plane (1 or 3).
    """
    from sklearn.datasets import load_digits as sk_load_digits

    if not 4 <= size <= 512:
        raise ValueError(f"size must be in 4..512, got {size}")
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    bunch = sk_load_digits()
    pixels = torch.from_numpy(bunch.images * (255.0 / 16.0)).round().to(torch.uint8)[:, None]
    return ImageSet(_resize(pixels, size, channels), torch.from_numpy(bunch.target), 10, "digits")


def synthetic_images(
    n: int, shape: tuple[int, int, int] = (3, 32, 32), num_classes: int = 10, *,
    seed: int = 0, noise: float = 0.35,
) -> ImageSet:
    """A seeded, learnable synthetic image classification set of any shape.

    Each class has a smooth random prototype (low-frequency noise, upsampled); an example is its
    class prototype, randomly shifted and scaled in contrast, plus pixel noise of relative
    strength `noise`. Larger `noise` makes the set harder.
    """
    if n < 1 or num_classes < 2:
        raise ValueError(f"need n >= 1 and num_classes >= 2, got n={n}, num_classes={num_classes}")
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"shape must be (C, H, W) with positive sizes, got {shape}")
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    c, h, w = shape
    gen = torch.Generator().manual_seed(seed)
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


def _require(path: Path, what: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(
            f"{what} not found at {path}. Download it yourself and place it there "
            f"(or set WORKBENCH_DATA to the folder that holds it); nothing is downloaded at run time."
        )
    return path


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="latin1")


def _cifar(folder: Path, files: dict[str, list[str]], label_key: str, classes: int, name: str):
    sets = []
    for split in ("train", "test"):
        images, labels = [], []
        for fname in files[split]:
            batch = _unpickle(_require(folder / fname, f"{name} file {fname!r}"))
            images.append(np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.extend(batch[label_key])
        sets.append(ImageSet(torch.from_numpy(np.concatenate(images)), torch.tensor(labels), classes, name))
    return tuple(sets)


def load_cifar10(root: str | Path | None = None) -> tuple[ImageSet, ImageSet]:
    """CIFAR-10 python batches from `<root>/cifar-10-batches-py/` (data_batch_1..5, test_batch)."""
    folder = Path(root or data_dir()) / "cifar-10-batches-py"
    files = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
    return _cifar(folder, files, "labels", 10, "cifar10")


def load_cifar100(root: str | Path | None = None) -> tuple[ImageSet, ImageSet]:
    """CIFAR-100 python files from `<root>/cifar-100-python/` (train, test; fine labels)."""
    folder = Path(root or data_dir()) / "cifar-100-python"
    return _cifar(folder, {"train": ["train"], "test": ["test"]}, "fine_labels", 100, "cifar100")


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (magic {raw[:4].hex()})")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(int)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {tuple(dims)} but holds {data.size} bytes")
    return data.reshape(dims)


def load_mnist(root: str | Path | None = None) -> tuple[ImageSet, ImageSet]:
    """MNIST IDX files (optionally .gz) from `<root>/mnist/`."""
    folder = Path(root or data_dir()) / "mnist"
    sets = []
    for prefix in ("train", "t10k"):
        arrays = []
        for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
            plain = folder / f"{prefix}-{kind}"
            path = plain if plain.exists() else plain.with_name(plain.name + ".gz")
            arrays.append(_read_idx(_require(path, f"MNIST file {plain.name}[.gz]")))
        images, labels = arrays
        sets.append(ImageSet(torch.from_numpy(images.copy())[:, None], torch.from_numpy(labels.copy()), 10, "mnist"))
    return tuple(sets)


def normalize(images: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [0, 255] -> floating `dtype` in [-1, 1]."""
    if images.dtype != torch.uint8:
        raise TypeError(f"normalize expects uint8 images, got {images.dtype}")
    return images.to(dtype).div_(127.5).sub_(1.0)


_normalize = normalize  # make_loader's `normalize` flag shadows the function's name


def make_loader(
    imageset: ImageSet, batch_size: int, *, shuffle: bool = True, seed: int = 0,
    normalize: bool = True, drop_last: bool = False,
) -> DataLoader:
    """A DataLoader of (images, labels); images normalised to float unless `normalize=False`."""
    if not 1 <= batch_size:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    images = _normalize(imageset.images) if normalize else imageset.images
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        TensorDataset(images, imageset.labels), batch_size=batch_size, shuffle=shuffle,
        drop_last=drop_last, generator=generator,
    )

