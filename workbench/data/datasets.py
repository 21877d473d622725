"""Offline image datasets: bundled digits, seeded synthetic sets, CIFAR and MNIST readers.

Nothing downloads at run time. Real CIFAR-10/100 (python pickle batches) and MNIST (IDX files,
optionally gzipped) are read from `data/` (or $WORKBENCH_DATA) when a user drops them there.
The readers trust nothing in those files: pickles load through an unpickler that admits only
what the real batches hold (no code runs from a data file), and a garbage, truncated,
wrong-shape or out-of-range file is refused with a ValueError naming it.
"""

from __future__ import annotations

import codecs
import gzip
import math
import os
import pickle
import zlib
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


def _pickle_allowed() -> dict[tuple[str, str], object]:
    """The globals a CIFAR batch may name: numpy array reconstruction and latin-1 bytes, nothing else."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 moved numpy.core to numpy._core
    reconstruct, frombuffer = core.multiarray._reconstruct, core.numeric._frombuffer
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype,
               ("_codecs", "encode"): codecs.encode}
    for package in ("numpy.core", "numpy._core"):  # files written under numpy 1 and numpy 2
        allowed[(f"{package}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{package}.multiarray", "scalar")] = core.multiarray.scalar
        allowed[(f"{package}.numeric", "_frombuffer")] = frombuffer
    return allowed


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, bytes, str, numbers and numpy arrays; refuses every other global.

    # NOTE: `pickle.load` calls any importable callable a file names (`os.system` included); a data
    # file is input, so only the handful of numpy helpers the real CIFAR batches use are admitted.
    """

    def __init__(self, file, path: Path) -> None:
        super().__init__(file, encoding="latin1")
        self.path = path
        self.allowed = _pickle_allowed()

    def find_class(self, module: str, name: str):
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"{self.path}: refused to load {module}.{name}; a CIFAR batch holds only dicts, lists, "
                f"bytes, str, ints and numpy arrays"
            ) from None


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            batch = _BatchUnpickler(f, path).load()
    except pickle.UnpicklingError as exc:
        text = str(exc)
        raise ValueError(text if text.startswith(str(path)) else f"{path}: not a CIFAR python batch ({text})") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError, OverflowError, MemoryError,
            UnicodeDecodeError, RecursionError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
        raise ValueError(f"{path}: not a CIFAR python batch (truncated or corrupt: {problem})") from None
    if not isinstance(batch, dict):
        raise ValueError(f"{path}: expected a CIFAR batch (a dict with 'data' and labels), got {type(batch).__name__}")
    return {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in batch.items()}


def _integers(path: Path, value, what: str) -> np.ndarray:
    try:
        array = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {what} is not an array of integers ({exc})") from None
    if array.dtype.kind not in "iu":
        raise ValueError(f"{path}: {what} must be integers, got dtype {array.dtype}")
    return array


def _check_labels(path: Path, labels: np.ndarray, n: int, classes: int) -> None:
    if labels.ndim != 1 or len(labels) != n:
        raise ValueError(f"{path}: expected {n} labels (one per image), got shape {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() >= classes):
        raise ValueError(f"{path}: labels must be in 0..{classes - 1}, found {labels.min()}..{labels.max()}")


def _cifar(folder: Path, files: dict[str, list[str]], label_key: str, classes: int, name: str):
    sets = []
    for split in ("train", "test"):
        images, labels = [], []
        for fname in files[split]:
            path = _require(folder / fname, f"{name} file {fname!r}")
            batch = _unpickle(path)
            missing = [k for k in ("data", label_key) if k not in batch]
            if missing:
                raise ValueError(f"{path}: CIFAR batch lacks {missing}; it has {sorted(map(str, batch))}")
            data = _integers(path, batch["data"], "'data'")
            if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
                raise ValueError(f"{path}: 'data' must be [N, 3072] (3x32x32 pixels per row), got {data.shape}")
            if data.size and (data.min() < 0 or data.max() > 255):
                raise ValueError(f"{path}: pixel values must be in 0..255, found {data.min()}..{data.max()}")
            batch_labels = _integers(path, batch[label_key], repr(label_key))
            _check_labels(path, batch_labels, len(data), classes)
            images.append(data.astype(np.uint8).reshape(-1, 3, 32, 32))
            labels.append(batch_labels.astype(np.int64))
        sets.append(ImageSet(torch.from_numpy(np.concatenate(images)), torch.from_numpy(np.concatenate(labels)),
                             classes, name))
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


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """An unsigned-byte IDX array of `ndim` dimensions; ValueError naming `path` for anything else."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path}: cannot read the file (corrupt or truncated: {exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (magic {raw[:4].hex()})")
    if raw[3] != ndim:
        raise ValueError(f"{path}: expected a {ndim}-dimensional IDX array, the header says {raw[3]}")
    if len(raw) < 4 + 4 * ndim:
        raise ValueError(f"{path}: truncated header ({len(raw)} bytes)")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != math.prod(dims):
        raise ValueError(f"{path}: header says {dims} but holds {data.size} bytes (truncated or padded)")
    return data.reshape(dims)


def load_mnist(root: str | Path | None = None) -> tuple[ImageSet, ImageSet]:
    """MNIST IDX files (optionally .gz) from `<root>/mnist/`."""
    folder = Path(root or data_dir()) / "mnist"
    sets = []
    for prefix in ("train", "t10k"):
        paths = []
        for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
            plain = folder / f"{prefix}-{kind}"
            path = plain if plain.exists() else plain.with_name(plain.name + ".gz")
            paths.append(_require(path, f"MNIST file {plain.name}[.gz]"))
        images, labels = _read_idx(paths[0], 3), _read_idx(paths[1], 1)
        _check_labels(paths[1], labels, len(images), 10)
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

