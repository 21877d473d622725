"""Shared cases for the workbench.vbs tests: the paper's worked example, random tables, small nets."""

import numpy as np
import pytest
import torch
from torch import nn

from workbench import vbs
from workbench.models import resnet18


def _worked_example() -> vbs.LayerProfile:
    """Section III, "Illustration with an example": 3 layers, in = out = b, ws = b, 4b, b."""
    return vbs.LayerProfile(time=[[4, 3]] * 3, inp=[[1, 2]] * 3, out=[[1, 2]] * 3, ws=[[1, 2], [4, 8], [1, 2]])


def _random_linear(rng, n: int, B: int) -> tuple[vbs.LayerProfile, np.ndarray]:
    """A linear chain whose activations are linear in b (sizes a[l] per sample at boundary l)."""
    a = rng.integers(1, 4, n + 1)
    b = np.arange(1, B + 1)
    time = rng.uniform(1.0, 2.0, (n, B)) * (1.0 - 0.5 * rng.uniform(0, 1, (n, 1)) * (b - 1) / B)
    ws = rng.integers(0, 6, (n, B))
    return vbs.LayerProfile(time, a[:-1, None] * b, a[1:, None] * b, ws), a


def _random_branched(rng, B: int) -> vbs.LayerProfile:
    """Five main-path layers; layer 2 is a special layer with branches of 2, 1 and 0 layers."""
    b = np.arange(1, B + 1)

    def chain(n: int, branch: bool = False) -> vbs.LayerProfile:
        sizes = rng.integers(1, 4, n + 1)
        inp = sizes[:-1, None] * b
        if branch and n:
            inp[0] = 0
        t = rng.uniform(1.0, 2.0, (n, B)) / (1 + 0.3 * rng.uniform(0, 1, (n, 1)) * (b - 1))
        return vbs.LayerProfile(t, inp, sizes[1:, None] * b, rng.integers(0, 4, (n, B)))

    main = chain(5)
    main.ws[2] = 0
    main.branches = {2: [chain(2, True), chain(1, True), chain(0, True)]}
    main.merge = {2: "cat"}
    main.__post_init__()
    return main


class Inceptionish(nn.Module):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.merge = "cat"
        self.branches = nn.ModuleList([
            nn.Sequential(nn.Conv2d(cin, 4, 1), nn.ReLU(inplace=True)),
            nn.Sequential(nn.Conv2d(cin, 3, 1), nn.ReLU(inplace=True), nn.Conv2d(3, 5, 3, padding=1)),
            nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(cin, 2, 1)),
        ])

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], 1)


def _linear_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(32, 4, 1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5),
    ).eval()


def _branched_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(inplace=True), Inceptionish(6),
                         nn.MaxPool2d(2), Inceptionish(11), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(11, 3)).eval()


NETS = {"linear": _linear_net, "branched": _branched_net, "resnet18": lambda: resnet18(4, width=4).eval()}


@pytest.fixture
def worked_example() -> vbs.LayerProfile:
    return _worked_example()


@pytest.fixture
def random_linear():
    """`random_linear(rng, n, B) -> (tables, per-sample sizes at each layer boundary)`."""
    return _random_linear


@pytest.fixture
def random_branched():
    """`random_branched(rng, B) -> tables` with one special layer (index 2, three branches)."""
    return _random_branched


@pytest.fixture
def nets():
    """Small eval-mode models by name: "linear", "branched" (two inception-like groups), "resnet18"."""
    return NETS
