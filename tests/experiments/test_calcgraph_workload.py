"""The CalcGraph notebook's workload: models by name through `workbench.models.build`, MNIST-shaped
data through `workbench.data.load` with the notebook's `data_source` choices."""

import pytest
import torch

from workbench.data import data_dir
from workbench.experiments import calcgraph as cgx


def test_data_sources_map_onto_workbench_data_load():
    data = cgx.load_data(40, 20, source="digits", seed=1)
    assert data["name"] == "digits"
    assert data["x_train"].shape == (40, 1, 28, 28) and data["x_test"].shape == (20, 1, 28, 28)
    assert data["x_train"].dtype == torch.float32 and -1 <= data["x_train"].min() < data["x_train"].max() <= 1
    assert cgx.load_data(40, 20, source="synthetic")["name"] != "digits"
    mnist_present = (data_dir() / "mnist").exists() or any(data_dir().glob("*idx*"))
    if not mnist_present:
        assert cgx.load_data(40, 20, source="auto")["name"] == "digits"  # small: the real digits stand in
        assert cgx.load_data(1800, 20, source="auto")["name"] != "digits"  # past 1797 images: synthetic
        with pytest.raises(FileNotFoundError):
            cgx.load_data(40, 20, source="mnist")
    with pytest.raises(ValueError, match="source"):
        cgx.load_data(40, 20, source="cifar")


def test_models_by_name():
    build, shape = cgx.model_factory("resnet18", resnet_width=0.125, image_size=16)
    net = build()
    assert shape == (3, 16, 16) and net(torch.randn(2, *shape)).shape == (2, 10)
    assert max(m.out_channels for m in net.modules() if isinstance(m, torch.nn.Conv2d)) == 64  # 8 x 8 at stage 4
    build, shape = cgx.model_factory("mlp")
    assert shape == (1, 28, 28) and [m.out_features for m in build() if isinstance(m, torch.nn.Linear)] == [64, 64, 10]
    assert cgx.model_factory("cnn")[0]()(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="model"):
        cgx.model_factory("vgg")
    with pytest.raises(ValueError, match="resnet_width"):
        cgx.model_factory("resnet18", resnet_width=64)
