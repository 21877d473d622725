"""Exploration probes, family `data`: the CIFAR (pickle) and MNIST (IDX) readers on crafted files (see explore.py).
A bad file must be refused with ValueError naming it, before a crash, a hang or a runaway allocation; real
batches (every protocol, bytes or text keys) must load."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
import zlib

import numpy as np

from explore import cases, refusal, works

CIFAR10 = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
CORE = getattr(np, "_core", None) or np.core


class _Reduce:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _batch(n=2, **changes):
    batch = {"data": np.zeros((n, 3072), np.uint8), "labels": [0] * n}
    batch.update(changes)
    return {k: v for k, v in batch.items() if v is not None}


def _pickled(obj, protocol=2):
    return pickle.dumps(obj, protocol=protocol)


def _nested_lists(n):
    return b"\x80\x02" + b"(" * n + b"l" * n + b"."


BAD_CIFAR = {
    "key 200000 tuples deep": b"\x80\x02}(" + b")" + b"\x85" * 200_000 + b"K\x01u.",
    "key 101 tuples deep": b"\x80\x02}(" + b")" + b"\x85" * 101 + b"K\x01u.",
    "list 100000 deep": _nested_lists(100_000), "list 500 deep": _nested_lists(500),
    "frozenset 100000 deep": b"\x80\x04" + b"(" * 100_000 + b"\x91" * 100_000 + b".",
    "a list holding itself": b"\x80\x02}(X\x04\x00\x00\x00data]q\x00h\x00a" + b"u.",
    "memo get unset": b"\x80\x02h\x05.", "memo index huge": b"\x80\x02N" + b"r" + struct.pack("<I", 2**30) + b".",
    "unicode length 2**60": b"\x80\x04\x8d" + struct.pack("<Q", 2**60) + b".",
    "bytes length 2**40": b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b".",
    "frame past the end": b"\x80\x04\x95" + struct.pack("<Q", 2**40) + b".",
    "long4 length 2**31": b"\x80\x02\x8b" + struct.pack("<I", 2**31 - 1) + b".",
    "long text of 5000 digits": b"L" + b"9" * 5000 + b"L\n.",
    "int text of 5000 digits": b"I" + b"9" * 5000 + b"\n.",
    "top a list": _pickled([1, 2]), "top None": _pickled(None), "top an int": _pickled(5),
    "no data": _pickled(_batch(data=None)), "no labels": _pickled(_batch(labels=None)),
    "data floats": _pickled(_batch(data=np.zeros((2, 3072), np.float32))),
    "data bool": _pickled(_batch(data=np.zeros((2, 3072), bool))),
    "data past 255": _pickled(_batch(data=np.full((2, 3072), 256, np.int64))),
    "data negative": _pickled(_batch(data=np.full((2, 3072), -1, np.int16))),
    "data 3071 wide": _pickled(_batch(data=np.zeros((2, 3071), np.uint8))),
    "data 3-D": _pickled(_batch(data=np.zeros((2, 3, 1024), np.uint8))),
    "data empty": _pickled(_batch(n=0)), "data a list": _pickled(_batch(data=[[0] * 3072] * 2)),
    "data objects": _pickled(_batch(data=np.array([1, 2], dtype=object))),
    "data strings": _pickled(_batch(data=np.array(["a", "b"]))),
    "data complex": _pickled(_batch(data=np.zeros((2, 3072), np.complex64))),
    "data structured": _pickled(_batch(data=np.zeros(2, dtype=[("a", "u1")]))),
    "labels floats": _pickled(_batch(labels=[0.5, 1.0])), "labels negative": _pickled(_batch(labels=[-1, 0])),
    "labels 10": _pickled(_batch(labels=[10, 0])), "labels too few": _pickled(_batch(labels=[0])),
    "labels nested": _pickled(_batch(labels=[[0], [1]])), "labels 2-D array": _pickled(
        _batch(labels=np.zeros((2, 1), np.int64))),
    "labels text": _pickled(_batch(labels="00")), "labels huge int": _pickled(_batch(labels=[10**100, 0])),
    "array of 2**40 elements": _pickled({"data": _Reduce(CORE.multiarray._reconstruct, np.ndarray, (2**40,), b"b")}),
    "os.system": _pickled({"data": _Reduce(os.system, "true")}),
    "eval": _pickled({"data": _Reduce(eval, "1+1")}),
    "getattr chain": _pickled({"data": _Reduce(getattr, np.ndarray, "tofile")}),
    "empty file": b"", "one byte": b"\x80", "garbage": bytes(range(256)) * 4,
    "a gzip of a batch": gzip.compress(_pickled(_batch())), "truncated batch": _pickled(_batch())[:-40],
    "text not a pickle": b"data: [1, 2, 3]\n",
}
GOOD_CIFAR = {f"protocol {p}": p for p in range(6)} | {"bytes keys": "bytes", "numpy labels": "numpy",
                                                         "fortran order": "fortran", "extra keys": "extra"}


def _cifar_folder(sb, bad: bytes | None = None, name: str = "data_batch_1"):
    folder = sb.root / "data" / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    for file in CIFAR10:
        (folder / file).write_bytes(_pickled(_batch()))
    if bad is not None:
        (folder / name).write_bytes(bad)
    return folder / name


@cases("data", "CIFAR refuses", BAD_CIFAR)
def cifar_bad(sb, raw):
    from workbench.data import load_cifar10

    path = _cifar_folder(sb, raw)
    return refusal(lambda: load_cifar10(sb.root / "data"), str(path), types=(ValueError,))


@cases("data", "CIFAR reads", GOOD_CIFAR)
def cifar_good(sb, kind):
    from workbench.data import load_cifar10

    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, (3, 3072), dtype=np.uint8)
    labels = [3, 1, 4]
    batch = {"data": data, "labels": labels, "filenames": [b"a.png", b"b.png", b"c.png"], "batch_label": "x"}
    if kind == "bytes":
        batch = {k.encode(): v for k, v in batch.items()}
    elif kind == "numpy":
        batch["labels"] = np.array(labels, dtype=np.int64)
    elif kind == "fortran":
        batch["data"] = np.asfortranarray(data)
    elif kind == "extra":
        batch["coarse_labels"] = [0, 0, 0]
    raw = pickle.dumps(batch, protocol=kind if isinstance(kind, int) else 2)
    _cifar_folder(sb, raw)

    def check(sets):
        train, _ = sets
        return train.images[:3].reshape(3, -1).numpy().tolist() == data.tolist() and train.labels[:3].tolist() == labels
    return works(lambda: load_cifar10(sb.root / "data"), check)


FILE_KINDS = ["a named pipe", "/dev/zero", "a folder", "a sparse 600 MB file", "a link loop"]


@cases("data", "CIFAR file not a batch", {k: k for k in FILE_KINDS})
def cifar_kind(sb, kind):
    from workbench.data import load_cifar10

    path = _cifar_folder(sb)
    path.unlink()
    if kind == "a named pipe":
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "a folder":
        path.mkdir()
    elif kind == "a link loop":
        path.symlink_to(path)
    else:
        with open(path, "wb") as f:
            f.truncate(600 * 2**20)
    return refusal(lambda: load_cifar10(sb.root / "data"), str(path), types=(ValueError,))


# ------------------------------------------------------------------ MNIST


def _idx(dims, body=None, kind=8):
    head = bytes([0, 0, kind, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims)
    return head + (bytes(int(np.prod(dims))) if body is None else body)


def _zeros_gzip(dims) -> bytes:
    """A gzip of an IDX file of zeros, written in chunks (the whole body is never held)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [packer.compress(_idx(dims, b""))]
    left = int(np.prod(dims))
    while left:
        parts.append(packer.compress(bytes(min(left, 2**22))))
        left -= min(left, 2**22)
    return b"".join(parts) + packer.flush()


def _mnist_folder(sb, images=None, labels=None, *, gz=False, name="train-images-idx3-ubyte"):
    folder = sb.root / "data" / "mnist"
    folder.mkdir(parents=True, exist_ok=True)
    files = {"train-images-idx3-ubyte": _idx((2, 28, 28)), "train-labels-idx1-ubyte": _idx((2,), bytes([1, 2])),
             "t10k-images-idx3-ubyte": _idx((2, 28, 28)), "t10k-labels-idx1-ubyte": _idx((2,), bytes([3, 4]))}
    if callable(images):
        images = images()
    if images is not None:
        files["train-images-idx3-ubyte"] = images
    if labels is not None:
        files["train-labels-idx1-ubyte"] = labels
    for file, data in files.items():
        if gz and file == name:
            (folder / f"{file}.gz").write_bytes(data if isinstance(data, bytes) and data[:2] == b"\x1f\x8b"
                                                else gzip.compress(data))
        else:
            (folder / file).write_bytes(data)
    return folder / (name + (".gz" if gz else ""))


BAD_MNIST = {  # (images, labels, gz, the file named)
    "signed bytes": (_idx((2, 28, 28), kind=9), None, False, "images"),
    "four dimensions": (_idx((2, 1, 28, 28)), None, False, "images"),
    "no images": (_idx((0, 28, 28)), None, False, "images"), "3 x 5 images": (_idx((2, 3, 5)), None, False, "images"),
    "28 x 27 images": (_idx((2, 28, 27)), None, False, "images"),
    "a 4 MB image, gzipped": (_idx((1, 2048, 2048)), None, True, "images"),
    "declares 2**40 bytes": (_idx((2**20, 2**10, 2**10), b""), None, False, "images"),
    "declares 256 MiB from 250 KB": (lambda: _zeros_gzip((342_000, 28, 28)), None, True, "images"),
    "truncated body": (_idx((2, 28, 28))[:-10], None, False, "images"),
    "padded body": (_idx((2, 28, 28)) + b"\x00", None, False, "images"),
    "truncated header": (_idx((2, 28, 28))[:9], None, False, "images"),
    "empty file": (b"", None, False, "images"), "gzip truncated": (gzip.compress(_idx((2, 28, 28)))[:30], None, True,
                                                                    "images"),
    "gzip then garbage": (gzip.compress(_idx((2, 28, 28))) + b"garbage", None, True, "images"),
    "not gzip at all": (b"plain bytes", None, True, "images"),
    "labels for 3 images": (None, _idx((3,), bytes(3)), False, "labels"),
    "label 10": (None, _idx((2,), bytes([10, 0])), False, "labels"),
    "label 255": (None, _idx((2,), bytes([255, 0])), False, "labels"),
    "labels 2-D": (None, _idx((2, 1), bytes(2)), False, "labels"),
    "no labels": (None, _idx((0,)), False, "labels"),
}


@cases("data", "MNIST refuses", BAD_MNIST)
def mnist_bad(sb, case):
    from workbench.data import load_mnist

    images, labels, gz, which = case
    name = "train-images-idx3-ubyte" if which == "images" else "train-labels-idx1-ubyte"
    path = _mnist_folder(sb, images, labels, gz=gz, name=name)
    return refusal(lambda: load_mnist(sb.root / "data"), str(path), types=(ValueError,))


@cases("data", "MNIST file not a file", {k: k for k in ("a named pipe", "/dev/zero", "a folder", "a link loop")})
def mnist_kind(sb, kind):
    from workbench.data import load_mnist

    path = _mnist_folder(sb)
    path.unlink()
    if kind == "a named pipe":
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "a folder":
        path.mkdir()
    else:
        path.symlink_to(path)
    return refusal(lambda: load_mnist(sb.root / "data"), str(path), types=(ValueError,))


@cases("data", "MNIST reads", {"plain": False, "gzipped": True})
def mnist_good(sb, gz):
    from workbench.data import load_mnist

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (5, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 5, dtype=np.uint8)
    _mnist_folder(sb, _idx((5, 28, 28), pixels.tobytes()), _idx((5,), labels.tobytes()), gz=gz)

    def check(sets):
        train, test = sets
        return (train.images[:, 0].numpy() == pixels).all() and train.labels.tolist() == labels.tolist() and len(
            test) == 2
    return works(lambda: load_mnist(sb.root / "data"), check)


@cases("data", "load by name with broken files", {"cifar10": "cifar10", "mnist": "mnist"})
def load_broken(sb, name):
    from workbench.data import load

    if name == "cifar10":
        path = _cifar_folder(sb, b"garbage")
    else:
        path = _mnist_folder(sb, b"garbage")
    os.environ["WORKBENCH_DATA"] = str(sb.root / "data")
    return refusal(lambda: load(name, 2, 2, fallback=True), str(path), types=(ValueError,))
