"""Shared nets for the workbench.checkpoint tests: a small conv net and a tiny ResNet (seeded)."""

import pytest
import torch
from torch import nn

from workbench.checkpoint import profile_layers


def _small_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
        nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(inplace=True),
        nn.Conv2d(4, 8, 3, padding=1), nn.Dropout2d(0.2), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    )


def _tiny_resnet() -> nn.Module:
    from workbench.models import resnet18

    torch.manual_seed(0)
    return resnet18(num_classes=4, width=4)


@pytest.fixture
def small_net():
    """Makes the small net: BatchNorm, dropout and an in-place ReLU among 13 layers."""
    return _small_net


@pytest.fixture
def tiny_resnet():
    """Makes a width-4 ResNet-18 (its blocks open into units)."""
    return _tiny_resnet


@pytest.fixture(scope="module")
def profile():
    """The small net's per-unit profile on a 4x3x8x8 batch."""
    return profile_layers(_small_net(), torch.randn(4, 3, 8, 8))
