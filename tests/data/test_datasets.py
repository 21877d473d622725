import gzip
import pickle

import numpy as np
import pytest
import torch

from workbench.data import (
    ImageSet, load_cifar10, load_cifar100, load_digits, load_mnist, make_loader, normalize,
    synthetic_images,
)


def test_digits_are_real_uint8_images():
    digits = load_digits()
    assert len(digits) == 1797 and digits.images.dtype == torch.uint8 and digits.shape == (1, 8, 8)
    big = load_digits(32, 3)
    assert big.shape == (3, 32, 32)
    torch.testing.assert_close(big.images[:, 0], big.images[:, 2])


def test_synthetic_set_is_seeded_shaped_and_learnable():
    a, b = synthetic_images(200, (3, 16, 16), seed=1), synthetic_images(200, (3, 16, 16), seed=1)
    assert torch.equal(a.images, b.images) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.images, synthetic_images(200, (3, 16, 16), seed=2).images)
    # class means differ far more than the noise averages out: nearest-mean classifies well
    x = normalize(a.images).flatten(1)
    means = torch.stack([x[a.labels == c].mean(0) for c in range(10)])
    accuracy = (torch.cdist(x, means).argmin(1) == a.labels).float().mean()
    assert accuracy > 0.5


def test_split_loader_and_bad_input():
    train, test = load_digits().split(0.25, seed=0)
    assert len(train) + len(test) == 1797 and abs(len(test) - 449) <= 1
    x, y = next(iter(make_loader(test, 32, shuffle=False)))
    assert x.dtype == torch.float32 and x.min() >= -1 and x.max() <= 1 and y.shape == (32,)
    with pytest.raises(ValueError, match="test_fraction"):
        train.split(1.5)
    with pytest.raises(ValueError, match="uint8"):
        ImageSet(torch.zeros(2, 1, 4, 4), torch.zeros(2), 2, "bad")
    with pytest.raises(ValueError, match="size must be in"):
        load_digits(size=2)


def _write_cifar(folder, files, label_key, n, classes):
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    written = {}
    for name in files:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        labels = rng.integers(0, classes, n).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, label_key: labels}, f)
        written[name] = (data, labels)
    return written


def test_cifar10_reader_round_trips_pickle_batches(tmp_path):
    files = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    written = _write_cifar(tmp_path / "cifar-10-batches-py", files, "labels", 3, 10)
    train, test = load_cifar10(tmp_path)
    assert len(train) == 15 and len(test) == 3 and train.shape == (3, 32, 32)
    data, labels = written["test_batch"]
    assert torch.equal(test.images, torch.from_numpy(data.reshape(3, 3, 32, 32)))
    assert test.labels.tolist() == labels


def test_cifar100_reader_uses_fine_labels(tmp_path):
    written = _write_cifar(tmp_path / "cifar-100-python", ["train", "test"], "fine_labels", 4, 100)
    train, _ = load_cifar100(tmp_path)
    assert train.num_classes == 100 and train.labels.tolist() == written["train"][1]


def _write_idx(path, array, compress):
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, dtype=">u4").tobytes()
    opener = gzip.open if compress else open
    with opener(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_reader_round_trips_idx_files(tmp_path, compress):
    folder = tmp_path / "mnist"
    folder.mkdir()
    rng = np.random.default_rng(1)
    arrays = {}
    for prefix, n in (("train", 5), ("t10k", 2)):
        arrays[prefix] = (rng.integers(0, 256, (n, 28, 28)), rng.integers(0, 10, n))
        suffix = ".gz" if compress else ""
        _write_idx(folder / f"{prefix}-images-idx3-ubyte{suffix}", arrays[prefix][0], compress)
        _write_idx(folder / f"{prefix}-labels-idx1-ubyte{suffix}", arrays[prefix][1], compress)
    train, test = load_mnist(tmp_path)
    assert train.images.shape == (5, 1, 28, 28)
    assert torch.equal(test.images[:, 0], torch.from_numpy(arrays["t10k"][0].astype(np.uint8)))
    assert test.labels.tolist() == arrays["t10k"][1].tolist()


def test_missing_dataset_says_where_to_put_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        load_cifar10(tmp_path)
    with pytest.raises(FileNotFoundError, match="mnist"):
        load_mnist(tmp_path)
