"""The CIFAR and MNIST readers bound what a file makes them build before building it.

Each bomb here is small and would expand to tens of MB unchecked; the tests assert the refusal
and that the traced peak stays far below that expansion (tracemalloc sees numpy's buffers too).
"""

import codecs
import gzip
import pickle
import re
import struct
import tracemalloc

import numpy as np
import pytest

from workbench.data import batch_pickle, load_cifar10, load_mnist, readers

CIFAR10 = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
MB = 2**20


def _cifar(tmp_path, bad: bytes | None = None, n: int = 2):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    for name in CIFAR10:
        batch = {"data": np.zeros((n, 3072), dtype=np.uint8), "labels": [0] * n}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    if bad is not None:
        (folder / "data_batch_2").write_bytes(bad)
    return folder / "data_batch_2"


def _peak_of(call):
    """The traced peak bytes while `call` runs, and the exception it raised."""
    tracemalloc.start()
    try:
        call()
    except ValueError as exc:
        raised = exc
    else:
        raised = None
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, raised


class _Reduce:
    """Pickles as `func(*args)`: how a crafted file names a callable."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def _nested_rows(levels: int) -> list:
    row = [0] * 10
    for _ in range(levels):
        row = [row] * 10  # the same list referenced ten times: the pickle stays tiny
    return row


CORE = getattr(np, "_core", None) or np.core
BOMBS = {
    # 9 bytes: the C unpickler sizes its memo by the largest index, 2**22 -> 32 MB of pointers
    "memo index": (b"\x80\x02N" + b"r" + struct.pack("<I", 2**22) + b".", "memo index"),
    # ~200 bytes that numpy would expand into 10**7 int64s (80 MB)
    "nested list": (pickle.dumps({"data": _nested_rows(6), "labels": [0]}, protocol=2), "must be a numpy array"),
    # numpy's own helper allocating an empty 40 MB array
    "empty array": (pickle.dumps({"data": _Reduce(CORE.multiarray._reconstruct, np.ndarray, (40 * MB,), b"b")}),
                    "would take the bytes built past"),
    # hex-encoding doubles the bytes at each step; only latin-1 text is admitted
    "codec chain": (pickle.dumps({"data": _Reduce(codecs.encode, b"x" * 64, "hex")}), "only latin-1 text"),
    # 20 bytes declaring a 1 TB bytearray
    "length field": (b"\x80\x05\x96" + struct.pack("<Q", 2**40) + b".", "truncated"),
    "object array": (pickle.dumps({"data": np.array([1, 2], dtype=object)}, protocol=2), "refused dtype"),
    "object built by class": (pickle.dumps({"data": _Reduce(np.ndarray, (40 * MB,))}, protocol=2),
                              "refused to call numpy.ndarray"),
}


@pytest.mark.parametrize("case", list(BOMBS))
def test_cifar_bombs_are_refused_before_they_expand(tmp_path, case):
    blob, match = BOMBS[case]
    assert len(blob) < 10_000
    bad = _cifar(tmp_path, blob)
    peak, raised = _peak_of(lambda: load_cifar10(tmp_path))
    assert raised is not None and str(bad) in str(raised)
    assert re.search(match, str(raised)), str(raised)
    assert peak < 4 * MB, f"{case}: peaked at {peak / MB:.1f} MB before refusing"


def test_newobj_and_oversized_files_are_refused(tmp_path, monkeypatch):
    newobj = b"\x80\x02cnumpy\nndarray\nK\x01\x85\x81."  # ndarray.__new__(ndarray, 1) by NEWOBJ
    bad = _cifar(tmp_path, newobj)
    with pytest.raises(ValueError, match="refused opcode NEWOBJ") as info:
        load_cifar10(tmp_path)
    assert str(bad) in str(info.value)
    bad = _cifar(tmp_path)
    monkeypatch.setattr(batch_pickle, "MAX_PICKLE_BYTES", 1000)
    with pytest.raises(ValueError, match=r"data_batch_1: .*MAX_PICKLE_BYTES=1,000"):
        load_cifar10(tmp_path)


def test_real_format_batches_still_load_with_numpy_scalars_and_arrays(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _cifar(tmp_path)
    batch = {b"data": np.full((3, 3072), 7, dtype=np.uint8), b"labels": np.array([1, 2, 3]),
             b"filenames": [b"a.png", b"b.png", b"c.png"], b"batch_label": "testing batch 1 of 1"}
    for protocol in (2, 5):
        (folder / "test_batch").write_bytes(pickle.dumps(batch, protocol=protocol))
        _, test = load_cifar10(tmp_path)
        assert test.labels.tolist() == [1, 2, 3] and int(test.images.max()) == 7


def test_empty_cifar_batch_is_refused_naming_it(tmp_path):
    bad = _cifar(tmp_path, pickle.dumps({"data": np.zeros((0, 3072), dtype=np.uint8), "labels": []}))
    with pytest.raises(ValueError, match="holds no images") as info:
        load_cifar10(tmp_path)
    assert str(bad) in str(info.value)


def _idx_header(*dims: int) -> bytes:
    return bytes([0, 0, 0x08, len(dims)]) + np.array(dims, dtype=">u4").tobytes()


def _mnist(tmp_path, images: bytes, labels: bytes | None = None, *, gz: bool = True):
    folder = tmp_path / "mnist"
    folder.mkdir(exist_ok=True)
    labels = _idx_header(2) + bytes(2) if labels is None else labels
    suffix = ".gz" if gz else ""
    for prefix in ("train", "t10k"):
        for kind, raw in (("images-idx3-ubyte", images), ("labels-idx1-ubyte", labels)):
            (folder / f"{prefix}-{kind}{suffix}").write_bytes(gzip.compress(raw, 1) if gz else raw)
    return folder / f"train-images-idx3-ubyte{suffix}"


@pytest.mark.parametrize("case,head,match", [
    pytest.param("zeros", b"", "not an unsigned-byte IDX file", id="zeros"),
    pytest.param("padded", _idx_header(2, 28, 28), "holds more than 1568 bytes", id="padded"),
])
def test_gzip_bombs_stop_at_the_header_or_the_declared_size(tmp_path, case, head, match):
    bad = _mnist(tmp_path, head + bytes(32 * MB))  # 32 MB of zeros gzip to ~32 KB
    assert bad.stat().st_size < 200_000
    peak, raised = _peak_of(lambda: load_mnist(tmp_path))
    assert raised is not None and str(bad) in str(raised) and match in str(raised), str(raised)
    assert peak < 2 * MB, f"{case}: decompressed {peak / MB:.1f} MB before refusing"


def test_declared_size_is_capped_before_reading(tmp_path, monkeypatch):
    bad = _mnist(tmp_path, _idx_header(2, 28, 28) + bytes(2 * 28 * 28), gz=False)
    monkeypatch.setattr(readers, "MAX_IDX_BYTES", 1000)
    with pytest.raises(ValueError, match=r"\(1,568 bytes\), over MAX_IDX_BYTES=1,000") as info:
        load_mnist(tmp_path)
    assert str(bad) in str(info.value)


@pytest.mark.parametrize("images,labels,bad", [
    pytest.param(_idx_header(4, 0, 0), None, "train-images-idx3-ubyte", id="4x0x0 images"),
    pytest.param(_idx_header(0, 28, 28), _idx_header(0), "train-images-idx3-ubyte", id="no images"),
    pytest.param(_idx_header(2, 28, 28) + bytes(2 * 784), _idx_header(0), "train-labels-idx1-ubyte", id="no labels"),
])
def test_empty_idx_files_are_refused_naming_them(tmp_path, images, labels, bad):
    _mnist(tmp_path, images, labels, gz=False)
    with pytest.raises(ValueError, match=r"declares shape \(.*0.*\)") as info:
        load_mnist(tmp_path)
    assert str(tmp_path / "mnist" / bad) in str(info.value)
