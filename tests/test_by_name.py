"""One place to build networks and load datasets by name: workbench.models.build, workbench.data.load."""

import pickle

import numpy as np
import pytest
import torch

from workbench.data import DATASETS, load
from workbench.models import NETWORKS, build, googlenet, resnet18


@pytest.mark.parametrize("name", NETWORKS)
def test_every_network_builds_and_runs_at_a_small_width(name, one_thread):
    stem = "imagenet" if name not in ("resnet18", "resnet34", "resnet50") else "cifar"
    model = build(name, width=0.125, num_classes=7, stem=stem).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 64, 64)).shape == (2, 7)


def test_width_is_one_multiplier_for_every_network():
    torch.manual_seed(0)
    a = build("resnet18", width=0.125, num_classes=10)
    torch.manual_seed(0)
    b = resnet18(10, stem="cifar", width=8)
    assert [p.shape for p in a.parameters()] == [p.shape for p in b.parameters()]
    assert [p.shape for p in build("googlenet", width=0.5).parameters()] == [
        p.shape for p in googlenet(10, width=0.5).parameters()]


@pytest.mark.parametrize("bad, match", [
    (dict(name="vgg16"), "network must be one of"), (dict(name="resnet18", width=0), "width"),
    (dict(name="resnet18", stem="tiny"), "stem"), (dict(name="googlenet", width=True), "width"),
])
def test_bad_names_and_widths_are_refused(bad, match):
    name = bad.pop("name")
    with pytest.raises(ValueError, match=match):
        build(name, **bad)


def test_missing_real_data_raises_unless_a_stand_in_is_asked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load("mnist", 10, 10)
    train, test = load("mnist", 100, 50, fallback=True)
    assert (train.name, len(train), len(test), train.shape) == ("digits", 100, 50, (1, 28, 28))
    train, test = load("cifar10", 2000, 50, fallback=True, seed=3)
    assert train.name.startswith("synthetic") and train.shape == (3, 32, 32) and len(test) == 50
    again, _ = load("cifar10", 2000, 50, fallback=True, seed=3)
    assert torch.equal(train.images, again.images)


def test_real_files_are_read_and_cut_to_size(tmp_path, monkeypatch):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), "labels": list(range(4))}
        (folder / name).write_bytes(pickle.dumps(batch))
    monkeypatch.setenv("WORKBENCH_DATA", str(tmp_path))
    train, test = load("cifar10", 7, 3)
    assert (train.name, len(train), len(test), train.shape) == ("cifar10", 7, 3, (3, 32, 32))
    small, _ = load("cifar10", 7, 3, shape=(1, 16, 16))
    assert small.shape == (1, 16, 16)


def test_bad_dataset_requests_are_refused():
    assert set(DATASETS) >= {"mnist", "cifar10", "digits", "synthetic"}
    with pytest.raises(ValueError, match="dataset must be one of"):
        load("imagenet", 1, 1)
    with pytest.raises(ValueError, match="n_train"):
        load("digits", 0, 1)
    with pytest.raises(ValueError, match="1797"):
        load("digits", 1790, 10)
