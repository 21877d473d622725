"""Readers for real CIFAR-10/100 (python pickle batches) and MNIST (IDX files, optionally gzipped).

Nothing downloads at run time: users drop the files into `data/` (or $WORKBENCH_DATA). The readers
trust nothing in those files and bound what a file may make them build before building it:

- A pickle is read by `batch_pickle.read_batch`: scanned opcode by opcode first, then loaded through
  an unpickler that admits only the numpy helpers real batches name, within a byte budget. `data`
  must come back a numpy array and the labels a flat list, so nothing expands after loading either.
- An IDX file's magic, declared dimensions and shape (28 x 28 images, one label per image) are
  checked from its first bytes, and a gzip may not declare more than MAX_GZIP_RATIO times its own
  size; the body is then decompressed in chunks into the array, up to the declared size and no further.

A garbage, truncated, oversized, empty, wrong-shape or out-of-range file is refused with a
ValueError naming it.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from pathlib import Path

import numpy as np
import torch

from .batch_pickle import MAX_NESTING, MAX_PICKLE_BYTES, read_batch
from .datasets import ImageSet, data_dir

__all__ = ["MAX_GZIP_RATIO", "MAX_IDX_BYTES", "MAX_NESTING", "MAX_PICKLE_BYTES", "load_cifar10", "load_cifar100",
           "load_mnist"]

MAX_IDX_BYTES = 2**30  # largest IDX body accepted, from its declared dims (MNIST train images: 47 MB)
MAX_GZIP_RATIO = 64  # most a gzipped IDX body may expand, plus 1 MiB (real MNIST files: about 5)
_CHUNK = 2**20  # bytes read at a time into an IDX array


def _folder(root, sub: str) -> Path:
    """`<root>/<sub>` (root None: `data_dir()`), refused naming `root` when no folder can be there: not a path, a
    NUL byte, a name too long, a loop of links, or a file where the folder should be."""
    if root is None or root == "":
        root = data_dir()
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root must be a folder (str or Path) or None, got {root!r} ({type(root).__name__})")
    if "\0" in str(root):
        raise ValueError(f"root={str(root)!r} holds a NUL byte, which no path can hold")
    root = Path(root)
    for path in (root, root / sub):
        try:
            os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            continue  # missing: the file's own error says where to put it
        except OSError as exc:  # a name too long, a loop of links
            raise ValueError(f"root={str(root)!r}: {path}: {exc.strerror or exc}") from None
        if not path.is_dir():
            raise ValueError(f"root={str(root)!r}: {path} is not a folder (the data sets live in <root>/{sub}/)")
    return root / sub


def _require(path: Path, what: str) -> Path:
    if os.path.lexists(path) and not path.exists():
        raise ValueError(f"{path}: a symbolic link that leads nowhere (dangling, or a loop); {what} must be a file")
    if not path.exists():
        raise FileNotFoundError(
            f"{what} not found at {path}. Download it yourself and place it there "
            f"(or set WORKBENCH_DATA to the folder that holds it); nothing is downloaded at run time."
        )
    return path


def _integers(path: Path, value, what: str) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype.kind not in "iu":
        raise ValueError(f"{path}: {what} must be integers, got dtype {array.dtype}")
    return array


def _label_list(path: Path, value, what: str, n: int) -> np.ndarray:
    """Labels as a 1-D integer array, checked flat and `n` long before numpy sees them."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{path}: expected {n} labels (one per image), got {len(value)}")
        if not all(isinstance(v, (int, np.integer)) for v in value):
            bad = next(v for v in value if not isinstance(v, (int, np.integer)))
            raise ValueError(f"{path}: {what} must be integers, found a {type(bad).__name__}")
    elif not isinstance(value, np.ndarray):
        raise ValueError(f"{path}: {what} must be a list or numpy array of integers, got {type(value).__name__}")
    return _integers(path, value, what)


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
            batch = read_batch(path)
            missing = [k for k in ("data", label_key) if k not in batch]
            if missing:
                raise ValueError(f"{path}: CIFAR batch lacks {missing}; it has {sorted(map(str, batch))}")
            if not isinstance(batch["data"], np.ndarray):  # a nested list of references could expand
                raise ValueError(f"{path}: 'data' must be a numpy array, got {type(batch['data']).__name__}")
            data = _integers(path, batch["data"], "'data'")
            if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
                raise ValueError(f"{path}: 'data' must be [N, 3072] (3x32x32 pixels per row), got {data.shape}")
            if not len(data):
                raise ValueError(f"{path}: holds no images ('data' has shape {data.shape})")
            if data.min() < 0 or data.max() > 255:
                raise ValueError(f"{path}: pixel values must be in 0..255, found {data.min()}..{data.max()}")
            batch_labels = _label_list(path, batch[label_key], repr(label_key), len(data))
            _check_labels(path, batch_labels, len(data), classes)
            images.append(data.astype(np.uint8).reshape(-1, 3, 32, 32))
            labels.append(batch_labels.astype(np.int64))
        sets.append(ImageSet(torch.from_numpy(np.concatenate(images)), torch.from_numpy(np.concatenate(labels)),
                             classes, name))
    return tuple(sets)


def load_cifar10(root: str | Path | None = None) -> tuple[ImageSet, ImageSet]:
    """CIFAR-10 python batches from `<root>/cifar-10-batches-py/` (data_batch_1..5, test_batch)."""
    folder = _folder(root, "cifar-10-batches-py")
    files = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
    return _cifar(folder, files, "labels", 10, "cifar10")


def load_cifar100(root: str | Path | None = None) -> tuple[ImageSet, ImageSet]:
    """CIFAR-100 python files from `<root>/cifar-100-python/` (train, test; fine labels)."""
    folder = _folder(root, "cifar-100-python")
    return _cifar(folder, {"train": ["train"], "test": ["test"]}, "fine_labels", 100, "cifar100")


def _read_idx(path: Path, shape: tuple[int | None, ...], what: str) -> np.ndarray:
    """An unsigned-byte IDX array of `shape` (None: any count >= 1), described to the user as `what`;
    ValueError naming `path` otherwise.

    The header is checked first (dimensions, shape, size, and for a gzip how far it would expand); the body
    is then read in chunks into the array, up to its declared size plus one byte (to tell a padded file),
    so a gzip bomb is decompressed no further than the header allows and nothing is held twice.
    """
    if not path.is_file():  # a folder, a named pipe (open would wait for a writer forever), a device
        raise ValueError(f"{path}: not an IDX file (a regular file is needed)")
    ndim, packed = len(shape), path.stat().st_size
    gzipped = path.suffix == ".gz"
    try:
        with (gzip.open if gzipped else open)(path, "rb") as f:
            magic = f.read(4)
            if len(magic) < 4 or magic[:3] != b"\x00\x00\x08":
                raise ValueError(f"{path} is not an unsigned-byte IDX file (magic {magic.hex()})")
            if magic[3] != ndim:
                raise ValueError(f"{path}: expected a {ndim}-dimensional IDX array, the header says {magic[3]}")
            header = f.read(4 * ndim)
            if len(header) < 4 * ndim:
                raise ValueError(f"{path}: truncated header ({4 + len(header)} bytes)")
            dims = tuple(int(d) for d in np.frombuffer(header, dtype=">u4"))
            if 0 in dims:
                raise ValueError(f"{path}: header declares shape {dims}; an MNIST file holds at least one "
                                 f"example of at least one value")
            if any(want is not None and got != want for got, want in zip(dims, shape, strict=True)):
                raise ValueError(f"{path}: header declares shape {dims}; expected {what}")
            size = math.prod(dims)
            if size > MAX_IDX_BYTES:
                raise ValueError(f"{path}: header declares shape {dims} ({size:,} bytes), over "
                                 f"MAX_IDX_BYTES={MAX_IDX_BYTES:,}")
            if gzipped and size > MAX_GZIP_RATIO * packed + 2**20:
                raise ValueError(f"{path}: header declares shape {dims} ({size:,} bytes) from a {packed:,}-byte "
                                 f"gzip, more than MAX_GZIP_RATIO={MAX_GZIP_RATIO} times its size plus 1 MiB "
                                 f"(MNIST files expand about 5 times)")
            array = np.empty(dims, dtype=np.uint8)
            view, done = memoryview(array.reshape(-1)), 0
            while done < size:
                got = f.readinto(view[done:done + _CHUNK])
                if not got:
                    break
                done += got
            extra = f.read(1)
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path}: cannot read the file (corrupt or truncated: {exc})") from None
    if done != size or extra:
        held = f"{done}" if done < size else f"more than {size}"
        raise ValueError(f"{path}: header says {dims} but holds {held} bytes (truncated or padded)")
    return array


def load_mnist(root: str | Path | None = None) -> tuple[ImageSet, ImageSet]:
    """MNIST IDX files (optionally .gz) from `<root>/mnist/`: 28 x 28 images, one label in 0..9 per image."""
    folder = _folder(root, "mnist")
    sets = []
    for prefix in ("train", "t10k"):
        paths = []
        for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
            plain = folder / f"{prefix}-{kind}"
            path = plain if os.path.lexists(plain) else plain.with_name(plain.name + ".gz")
            paths.append(_require(path, f"MNIST file {plain.name}[.gz]"))
        images = _read_idx(paths[0], (None, 28, 28), "N x 28 x 28 (28 x 28-pixel images)")
        labels = _read_idx(paths[1], (len(images),), f"{len(images)} labels (one per image)")
        _check_labels(paths[1], labels, len(images), 10)
        sets.append(ImageSet(torch.from_numpy(images)[:, None], torch.from_numpy(labels), 10, "mnist"))
    return tuple(sets)
