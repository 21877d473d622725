"""`load` of a real dataset (CIFAR files dropped into `data/`) with a `shape` to resize to (issue 43): a shape
that is not three whole positive sizes, a channel count the loader cannot make, or one whose resized set
would not fit in memory is refused naming `shape` before any image is resized (these were torch's own errors:
expand, interpolate, a 1.2 TB allocation), and only the images kept are resized."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from workbench.data import load, load_cifar10
from workbench.data.datasets import _resize

CIFAR10 = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


@pytest.fixture
def cifar(tmp_path, monkeypatch):
    """A small real-format CIFAR-10 folder (3 random images per batch file) that `load` reads as data/."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in CIFAR10:
        batch = {"data": rng.integers(0, 256, (3, 3072), dtype=np.uint8), "labels": rng.integers(0, 10, 3).tolist()}
        (folder / name).write_bytes(pickle.dumps(batch))
    monkeypatch.setenv("WORKBENCH_DATA", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("shape, needle", [
    ((2, 32, 32), r"shape=\(2, 32, 32\).*1 or 3 channels"),
    ((3, -5, -5), r"shape.*\(3, -5, -5\).*whole numbers >= 1"),
    ((3, 0, 0), r"shape.*\(3, 0, 0\).*whole numbers >= 1"),
    ("3x32x32", r"shape.*'3x32x32'.*\(C, H, W\)"),
    ((3, 32), r"shape.*\(3, 32\).*\(C, H, W\)"),
    ((3, 32.0, 32), r"shape.*32\.0.*whole numbers >= 1"),
    ((True, 32, 32), r"shape.*True.*whole numbers >= 1"),
    ((3, 32, 16), r"shape=\(3, 32, 16\).*H must equal W"),
])
def test_a_shape_cifar_cannot_be_resized_to_is_refused_naming_it(cifar, shape, needle):
    with pytest.raises(ValueError, match=needle):
        load("cifar10", 4, 2, shape=shape)


def test_a_resized_set_past_half_the_memory_is_refused_naming_the_bytes(cifar, monkeypatch):
    """(3, 100000, 100000) asked torch for 1.2 TB of floats (all 18 images): refused, with the bytes, before."""
    calls = []
    monkeypatch.setattr(F, "interpolate", lambda *a, **k: calls.append(a) or pytest.fail("resized anyway"))
    with pytest.raises(ValueError, match=r"shape=\(3, 100000, 100000\).*[\d,]{15,} bytes.*half"):
        load("cifar10", 4, 2, shape=(3, 100000, 100000))
    assert not calls


def test_a_set_that_fits_is_not_refused_by_the_bound(cifar):
    train, test = load("cifar10", 4, 2, shape=(3, 200, 200))
    assert train.shape == test.shape == (3, 200, 200) and (len(train), len(test)) == (4, 2)


@pytest.mark.parametrize("shape", [(3, 48, 48), (1, 16, 16), (1, 32, 32), (3, 32, 32)])
def test_only_the_images_kept_are_resized_with_the_same_result(cifar, monkeypatch, shape):
    full_train, full_test = load_cifar10(cifar)
    interpolate, sizes = F.interpolate, []

    def counting(images, *args, **kwargs):
        sizes.append(len(images))
        return interpolate(images, *args, **kwargs)

    monkeypatch.setattr(F, "interpolate", counting)
    train, test = load("cifar10", 4, 2, shape=shape)
    assert sum(sizes) <= 4 + 2, f"resized {sizes} images for 4 + 2 kept"
    monkeypatch.setattr(F, "interpolate", interpolate)
    for got, full, n in ((train, full_train, 4), (test, full_test, 2)):  # the old path: resize all, then cut
        pixels = full.images
        if shape[0] == 1:
            pixels = pixels.float().mean(1, keepdim=True).round().to(torch.uint8)
        want = _resize(pixels, shape[1], shape[0])[:n]
        assert torch.equal(got.images, want) and torch.equal(got.labels, full.labels[:n])
