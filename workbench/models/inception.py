"""GoogLeNet (Szegedy et al., "Going deeper with convolutions", 2015) as a flat layer sequence.

The network of the paper's Table 1 (Inception v1) without the auxiliary classifiers: every
convolution has a bias and a ReLU, local response normalisation after the first two
convolutional stages, and nine inception modules whose four branches (1x1; 1x1 -> 3x3;
1x1 -> 5x5; 3x3 max-pool -> 1x1) are concatenated along channels. The model is an
`nn.Sequential` whose children are the stem layers, one child per inception module, then
pooling and the classifier; an `Inception` module's forward concatenates its `branches`, which
`workbench.vbs` reads off the traced forward as a branch group. `width` scales every channel count (1.0 is the
paper's network; narrower copies keep CPU runs short). Global average pooling replaces the
fixed 7x7 pool so that small inputs also work (identical at 224x224).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from .widths import channel_scaler

__all__ = ["GoogLeNet", "Inception", "googlenet", "INCEPTION_CONFIG"]

# name: (1x1, 3x3 reduce, 3x3, 5x5 reduce, 5x5, pool proj), the paper's Table 1
INCEPTION_CONFIG: dict[str, tuple[int, int, int, int, int, int]] = {
    "inception_3a": (64, 96, 128, 16, 32, 32),
    "inception_3b": (128, 128, 192, 32, 96, 64),
    "inception_4a": (192, 96, 208, 16, 48, 64),
    "inception_4b": (160, 112, 224, 24, 64, 64),
    "inception_4c": (128, 128, 256, 24, 64, 64),
    "inception_4d": (112, 144, 288, 32, 64, 64),
    "inception_4e": (256, 160, 320, 32, 128, 128),
    "inception_5a": (256, 160, 320, 32, 128, 128),
    "inception_5b": (384, 192, 384, 48, 128, 128),
}


def _conv(cin: int, cout: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2), nn.ReLU(inplace=True))


class Inception(nn.Module):
    """Four parallel branches concatenated along channels."""

    merge = "cat"

    def __init__(self, cin: int, c1: int, r3: int, c3: int, r5: int, c5: int, pool: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList([
            _conv(cin, c1, 1),
            nn.Sequential(_conv(cin, r3, 1), _conv(r3, c3, 3)),
            nn.Sequential(_conv(cin, r5, 1), _conv(r5, c5, 5)),
            nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), _conv(cin, pool, 1)),
        ])
        self.out_channels = c1 + c3 + c5 + pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches], dim=1)


class GoogLeNet(nn.Sequential):
    """GoogLeNet whose children form its flat layer sequence (inception modules as children)."""

    def __init__(self, num_classes: int = 1000, *, in_channels: int = 3, width: float = 1.0,
                 dropout: float = 0.4) -> None:
        w = channel_scaler(num_classes, in_channels, width)

        layers: OrderedDict[str, nn.Module] = OrderedDict()
        layers["conv1"] = _conv(in_channels, w(64), 7, stride=2)
        layers["pool1"] = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        layers["norm1"] = nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75)
        layers["conv2_reduce"] = _conv(w(64), w(64), 1)
        layers["conv2"] = _conv(w(64), w(192), 3)
        layers["norm2"] = nn.LocalResponseNorm(5, alpha=1e-4, beta=0.75)
        layers["pool2"] = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        cin = w(192)
        for name, cfg in INCEPTION_CONFIG.items():
            block = Inception(cin, *(w(c) for c in cfg))
            layers[name] = block
            cin = block.out_channels
            if name in ("inception_3b", "inception_4e"):
                layers[f"pool{3 if name == 'inception_3b' else 4}"] = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        layers["pool5"] = nn.AdaptiveAvgPool2d(1)
        layers["flatten"] = nn.Flatten()
        layers["dropout"] = nn.Dropout(dropout)
        layers["classifier"] = nn.Linear(cin, num_classes)
        super().__init__(layers)


def googlenet(num_classes: int = 1000, *, in_channels: int = 3, width: float = 1.0) -> GoogLeNet:
    return GoogLeNet(num_classes, in_channels=in_channels, width=width)
