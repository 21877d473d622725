"""The workload of the CalcGraph notebook: the paper's MLP, a small CNN and ResNet-18 by name, and
MNIST-shaped data.

"CalcGraph: taming the high costs of deep learning using models" (2022), Section 4.1: every
experiment trains an MLP 784-64-64-10 (sigmoid, softmax cross-entropy, Adam) on 10,000 MNIST images.
The CNN and ResNet-18 go beyond the paper (it could not model convolutions yet, Section 5) and serve
the memory prediction only. Networks come from `workbench.models.build`, data from
`workbench.data.load`: nothing here builds a network or a dataset of its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from workbench.calcgraph import CompiledGraph, plan_training
from workbench.data import load, normalize
from workbench.models import MLP, build

__all__ = [
    "DATA_SOURCES", "MODELS", "PAPER_MLP", "load_data", "model_factory", "paper_mlp", "paper_mlp_plan", "small_cnn",
]

PAPER_MLP = (784, 64, 64, 10)  # Section 4.1: three dense layers with biases, sigmoid, softmax
MNIST_SHAPE = (1, 28, 28)
# source -> (dataset name for workbench.data.load, fallback): "auto" is real MNIST from data/ when present,
# else the bundled digits (when enough) or a seeded synthetic MNIST-shaped set
DATA_SOURCES: dict[str, tuple[str, bool]] = {
    "auto": ("mnist", True), "mnist": ("mnist", False), "digits": ("digits", False), "synthetic": ("synthetic", False),
}


def paper_mlp() -> nn.Module:
    """The paper's MLP 784-64-64-10 with sigmoid activations (logits; softmax is in the loss)."""
    return MLP(PAPER_MLP, "sigmoid")


def small_cnn() -> nn.Sequential:
    """A CNN with pooling for 1x28x28 inputs: two conv-ReLU-maxpool stages and a classifier."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
    )


# name -> (factory, per-example input shape); ResNet-18 takes its width and image size from the caller
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp": (paper_mlp, MNIST_SHAPE),
    "cnn": (small_cnn, MNIST_SHAPE),
}


def model_factory(
    name: str, *, resnet_width: float = 1.0, image_size: int = 32,
) -> tuple[Callable[[], nn.Module], tuple[int, ...]]:
    """(zero-argument factory, per-example input shape) of `name`: "mlp", "cnn" or "resnet18".

    `resnet_width` is ResNet-18's channel multiplier (`workbench.models.build`: stage width
    round(64 x width); 1.0 is the standard network), `image_size` its input size (CIFAR stem).
    """
    if name == "resnet18":
        if image_size < 8:
            raise ValueError(f"image_size must be >= 8 for ResNet-18, got {image_size}")
        if isinstance(resnet_width, bool) or not isinstance(resnet_width, (int, float)) or not 0 < resnet_width <= 16:
            raise ValueError(f"resnet_width must be a channel multiplier in (0, 16], got {resnet_width!r}")
        return (lambda: build("resnet18", width=resnet_width, num_classes=10)), (3, image_size, image_size)
    if name not in MODELS:
        raise ValueError(f"model must be one of {[*MODELS, 'resnet18']}, got {name!r}")
    return MODELS[name]


def paper_mlp_plan(*, lr: float = 1e-2, device: torch.device | str | None = None,
                   persistent_grads: bool = False) -> CompiledGraph:
    """The memory plan of the paper's MLP trained with Adam (`persistent_grads`: gradients kept for the
    whole run, as a `Heap` keeps them)."""
    return plan_training(paper_mlp, MNIST_SHAPE, lr=lr, device=device, persistent_grads=persistent_grads,
                         calibrate=False)


def load_data(n_train: int, n_test: int, *, source: str = "auto", seed: int = 0, device=None) -> dict:
    """MNIST-shaped (1x28x28) float data in [-1, 1] as a dict (x_train, y_train, x_test, y_test, name).

    `source`: "auto" (real MNIST from `data/` when present, else the real 8x8 digits upscaled when
    n_train + n_test fits their 1797 images, else a seeded synthetic set), "mnist" (real files or an
    error naming where to put them), "digits" or "synthetic". The set's `name` says which was used.
    """
    if source not in DATA_SOURCES:
        raise ValueError(f"source must be one of {list(DATA_SOURCES)}, got {source!r}")
    name, fallback = DATA_SOURCES[source]
    train, test = load(name, n_train, n_test, seed=seed, shape=MNIST_SHAPE, fallback=fallback)
    dev = torch.device(device or "cpu")
    return {"x_train": normalize(train.images).to(dev), "y_train": train.labels.to(dev),
            "x_test": normalize(test.images).to(dev), "y_test": test.labels.to(dev), "name": train.name}
