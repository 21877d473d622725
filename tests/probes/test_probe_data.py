"""Bad data and arguments the issue 23 and issue 35 probe batteries found unhandled in `workbench.data`: refused
with the argument (or file) and the value named, before a crash, a hang, a silent truncation or a runaway
allocation; and a loader dropped mid-epoch leaves no thread behind."""

from __future__ import annotations

import gc
import gzip
import os
import pickle
import struct
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch
from probe_cases import python

from workbench.data import ImageSet, load, load_mnist, make_loader, synthetic_images
from workbench.data.datasets import MAX_SYNTHETIC_BYTES, load_digits
from workbench.data.prefetch import PrefetchLoader, ShuffledBatchSampler
from workbench.data.sampling import ClassAugmenter, MixUp, SelectiveBatchSampler


def _idx(dims, body=None):
    head = bytes([0, 0, 8, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims)
    return head + (bytes(int(np.prod(dims))) if body is None else body)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_mnist_named_pipe_is_refused_not_waited_on(tmp_path):
    """Opening a FIFO blocks until a writer comes: the reader refused to open anything but a regular file."""
    folder = tmp_path / "mnist"
    folder.mkdir()
    for name, data in {"train-labels-idx1-ubyte": _idx((2,), bytes([1, 2])),
                       "t10k-images-idx3-ubyte": _idx((2, 28, 28)),
                       "t10k-labels-idx1-ubyte": _idx((2,), bytes([3, 4]))}.items():
        (folder / name).write_bytes(data)
    os.mkfifo(folder / "train-images-idx3-ubyte")
    box = {}

    def target():
        try:
            load_mnist(tmp_path)
        except ValueError as exc:
            box["error"] = str(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # release the reader before failing
        with open(folder / "train-images-idx3-ubyte", "wb"):
            pass
        pytest.fail("load_mnist waits forever on a named pipe")
    assert "train-images-idx3-ubyte: not an IDX file" in box["error"]


@pytest.mark.parametrize("kw, needle", [
    ({"n_train": 2.5}, "n_train must be a whole number >= 1, got 2.5"),
    ({"n_train": "10"}, "n_train must be a whole number >= 1, got '10'"),
    ({"n_test": True}, "n_test must be a whole number >= 1, got True"),
])
def test_load_refuses_counts_that_are_not_whole_numbers(kw, needle):
    with pytest.raises(ValueError, match=needle):
        load("digits", **{"n_train": 10, "n_test": 5, **kw})


def test_load_refuses_a_huge_synthetic_set_before_allocating():
    with pytest.raises(ValueError, match="MAX_SYNTHETIC_BYTES"):
        load("synthetic", 10**12, 1)


@pytest.mark.parametrize("args, kw, needle", [
    ((2, (3, 100000, 100000)), {}, "100000"), ((4, (1, 8, 8), 2.5), {}, "num_classes"),
    (("4", (1, 8, 8)), {}, "'4'"), ((4, (1, 8, 8)), {"noise": float("nan")}, "noise"),
    ((4, (1, 8.5, 8)), {}, "8.5"),
])
def test_synthetic_images_refuses_naming_the_value(args, kw, needle):
    with pytest.raises(ValueError, match=needle):
        synthetic_images(*args, **kw)
    assert MAX_SYNTHETIC_BYTES >= 50_000 * 3 * 32 * 32  # a CIFAR-sized stand-in still fits


@pytest.mark.parametrize("labels, num_classes, needle", [
    (torch.tensor([0, 12]), 10, r"0\.\.9, found 0\.\.12"), (torch.tensor([0.5, 1.0]), 10, "float32"),
    (torch.tensor([-1, 0]), 10, "found -1"), (torch.tensor([0, 1]), 2.5, "num_classes"),
])
def test_imageset_refuses_labels_outside_its_classes(labels, num_classes, needle):
    with pytest.raises(ValueError, match=needle):
        ImageSet(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), labels, num_classes, "x")


def test_imageset_refuses_an_empty_set_and_loaders_fractional_batches():
    with pytest.raises(ValueError, match="at least one image"):
        ImageSet(torch.zeros(0, 1, 4, 4, dtype=torch.uint8), torch.zeros(0), 10, "x")
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1, got 2.5"):
        make_loader(synthetic_images(4, (1, 8, 8)), 2.5)
    with pytest.raises(ValueError, match=r"size must be in 4..512 \(whole pixels\), got '8'"):
        load_digits("8")


@pytest.mark.parametrize("labels, weights, kw, needle", [
    ([0, 1, -1, 2], [1, 1, 1], {}, "found -1..2"), ([0.5, 1.5], [1, 1], {}, "float32"),
    ([0, 10**9], {0: 1.0}, {}, "found 0..1000000000"), ([0, 1], ["a", 1], {}, r"class_weights must be numbers"),
    ([0, 1], [1, 1], {"num_batches": 2.5}, "num_batches must be an int >= 1, got 2.5"),
])
def test_selective_sampler_refuses_labels_and_weights_naming_them(labels, weights, kw, needle):
    """A label 10**9 sized a table of 10**9 classes (a hang); float labels were truncated silently."""
    with pytest.raises(ValueError, match=needle):
        SelectiveBatchSampler(labels, weights, 1, **kw)


def test_class_augmenter_names_labels_beyond_its_classes():
    with pytest.raises(ValueError, match=r"labels must be in 0..3 \(num_classes=4\), found 0..7"):
        ClassAugmenter({0: MixUp()}, 4)(torch.zeros(2, 1, 4, 4), torch.tensor([0, 7]))


def test_prefetch_loader_refuses_bad_data_and_fractional_prefetch():
    with pytest.raises(TypeError, match="data must be an ImageSet"):
        PrefetchLoader("imgs", 4)
    with pytest.raises(ValueError, match="max_prefetch must be an int >= 1 .* got 2.5"):
        PrefetchLoader(synthetic_images(8, (1, 8, 8)), 4, max_prefetch=2.5)


# ------------------------------------------------------------------ issue 35


def test_a_cifar_key_nested_200000_tuples_deep_is_refused_not_a_segfault(tmp_path):
    """Hashing the key recursed once per tuple in C: a 200 KB file of opcodes the scan allows killed the process.
    Read in a child process (about 5 s, most of it importing torch there): a segfault would end pytest itself."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    for name in [f"data_batch_{i}" for i in range(2, 6)] + ["test_batch"]:
        (folder / name).write_bytes(pickle.dumps({"data": np.zeros((1, 3072), np.uint8), "labels": [0]}))
    # {((...(),)...,): 1} with EMPTY_DICT, MARK, EMPTY_TUPLE, 200000 TUPLE1, BININT1, SETITEMS
    (folder / "data_batch_1").write_bytes(b"\x80\x02}(" + b")" + b"\x85" * 200_000 + b"K\x01u.")
    done = python(f"from workbench.data import load_cifar10\ntry:\n    load_cifar10({str(tmp_path)!r})\n"
                  f"except ValueError as exc:\n    print(exc)\n", timeout=60)
    assert done.returncode == 0, f"the reader's process died (status {done.returncode})"
    assert f"{folder / 'data_batch_1'}: objects nested more than MAX_NESTING=100 levels deep" in done.stdout


def _mnist_with(tmp_path, images: bytes, *, gz: bool):
    folder = tmp_path / "mnist"
    folder.mkdir(exist_ok=True)
    files = {"train-images-idx3-ubyte": images, "train-labels-idx1-ubyte": _idx((2,), bytes([1, 2])),
             "t10k-images-idx3-ubyte": _idx((2, 28, 28)), "t10k-labels-idx1-ubyte": _idx((2,), bytes([3, 4]))}
    for name, data in files.items():
        if gz and name == "train-images-idx3-ubyte":
            (folder / f"{name}.gz").write_bytes(gzip.compress(data, compresslevel=9))
        else:
            (folder / name).write_bytes(data)
    return folder / ("train-images-idx3-ubyte" + (".gz" if gz else ""))


@pytest.mark.parametrize("dims, gz", [((2, 3, 5), False), ((1, 2048, 2048), True), ((2, 28, 27), False)])
def test_mnist_images_of_another_shape_are_refused_naming_the_file(tmp_path, dims, gz):
    path = _mnist_with(tmp_path, _idx(dims), gz=gz)
    with pytest.raises(ValueError, match=r"expected N x 28 x 28 \(28 x 28-pixel images\)") as info:
        load_mnist(tmp_path)
    assert f"{path}: header declares shape {dims}" in str(info.value)


def test_a_gzip_declaring_far_more_than_it_could_hold_is_refused_before_decompressing(tmp_path):
    """32 MB of zero images gzip to 33 KB; the header is checked against the file's size first."""
    count = 32 * 2**20 // 784
    path = _mnist_with(tmp_path, _idx((count, 28, 28)), gz=True)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="more than MAX_GZIP_RATIO=64 times its size") as info:
            load_mnist(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(path) in str(info.value) and peak < 4 * 2**20


def test_mnist_reads_each_file_once_into_its_array(tmp_path):
    """The body is read in chunks into the array: a real-sized file costs its size, not twice (nor a copy)."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (3000, 28, 28), dtype=np.uint8)
    _mnist_with(tmp_path, _idx((3000, 28, 28), pixels.tobytes()), gz=True)
    labels = rng.integers(0, 10, 3000, dtype=np.uint8)
    (tmp_path / "mnist" / "train-labels-idx1-ubyte").write_bytes(_idx((3000,), labels.tobytes()))
    tracemalloc.start()
    try:
        train, _ = load_mnist(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(train.images[:, 0], torch.from_numpy(pixels)) and torch.equal(train.labels, torch.from_numpy(
        labels.astype(np.int64)))
    assert peak < pixels.nbytes * 1.5 + 2**20


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "workbench-prefetch" and t.is_alive()]


def test_an_abandoned_prefetch_loader_stops_its_thread():
    before = len(_prefetch_threads())
    data = synthetic_images(32, (1, 8, 8))
    for _ in range(3):
        loader = PrefetchLoader(data, 4)
        for _batch in loader:
            break  # abandoned mid-epoch, never closed
    del loader, _batch
    gc.collect()
    deadline = time.monotonic() + 10
    while len(_prefetch_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_prefetch_threads()) == before, "a dropped loader's producer thread is still running"


@pytest.mark.parametrize("seed, shown", [("a", "'a'"), (2**64, "18446744073709551616"), (1.5, "1.5"),
                                         (True, "True")])
def test_a_seed_torch_cannot_take_is_refused_naming_it(seed, shown):
    """load(seed='a') ended in torch's RuntimeError, seed=2**64 in "Overflow when unpacking long long"."""
    for call in (lambda: load("synthetic", 4, 2, seed=seed), lambda: synthetic_images(4, (1, 8, 8), seed=seed),
                 lambda: make_loader(synthetic_images(4, (1, 8, 8)), 2, seed=seed),
                 lambda: PrefetchLoader(synthetic_images(4, (1, 8, 8)), 2, seed=seed)):
        with pytest.raises(ValueError, match=r"seed must be a whole number in -2\*\*63..2\*\*64-1, got " + shown):
            call()


@pytest.mark.parametrize("n, batch, shown", [(2.5, 2, "n must be a whole number >= 1, got 2.5"),
                                             (4, "2", "batch_size must be a whole number >= 1, got '2'"),
                                             (True, 1, "n must be a whole number >= 1, got True")])
def test_the_shuffled_sampler_names_counts_that_are_not_whole_numbers(n, batch, shown):
    """torch's randperm() complained about its own arguments instead (or '<' between str and int)."""
    with pytest.raises(ValueError, match=shown):
        ShuffledBatchSampler(n, batch)
    sampler = ShuffledBatchSampler(10, 3, seed=2**64 - 1)  # any seed torch takes, at any epoch
    sampler.set_epoch(10**6)
    assert sorted(i for b in sampler for i in b) == list(range(10))


def test_a_data_file_that_is_a_link_loop_is_named_as_one_not_missing(tmp_path):
    """The reader said the file was not found and asked to download it; it is there, a link to itself."""
    folder = tmp_path / "mnist"
    folder.mkdir()
    (folder / "train-images-idx3-ubyte").symlink_to(folder / "train-images-idx3-ubyte")
    with pytest.raises(ValueError, match="train-images-idx3-ubyte: a symbolic link that leads nowhere"):
        load_mnist(tmp_path)
