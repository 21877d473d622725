"""Bad data and arguments the issue 23 probe battery found unhandled in `workbench.data`: refused with the
argument (or file) and the value named, before a hang, a silent truncation or a runaway allocation."""

from __future__ import annotations

import os
import struct
import threading

import numpy as np
import pytest
import torch

from workbench.data import ImageSet, load, load_mnist, make_loader, synthetic_images
from workbench.data.datasets import MAX_SYNTHETIC_BYTES, load_digits
from workbench.data.prefetch import PrefetchLoader
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
