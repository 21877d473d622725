"""SqueezeNet v1.0 (Iandola et al., "SqueezeNet: AlexNet-level accuracy with 50x fewer parameters
and <0.5MB model size", 2016) as a flat layer sequence.

The paper's Table 1: a 7x7 stride-2 convolution (96 maps), eight Fire modules with max-pooling
after conv1, fire4 and fire8, dropout, a 1x1 convolution to the classes, ReLU and global average
pooling. A Fire module is a 1x1 *squeeze* convolution followed by an *expand* layer whose 1x1 and
3x3 convolutions run in parallel and are concatenated. `Fire` is an `nn.Sequential` of the
squeeze layer and a `FireExpand` module whose forward concatenates its `branches`, which
`workbench.vbs` reads off the traced forward as a branch group. `width` scales every channel count.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from .widths import channel_scaler

__all__ = ["Fire", "FireExpand", "SqueezeNet", "squeezenet1_0", "FIRE_CONFIG"]

# name: (squeeze, expand 1x1, expand 3x3)
FIRE_CONFIG: dict[str, tuple[int, int, int]] = {
    "fire2": (16, 64, 64), "fire3": (16, 64, 64), "fire4": (32, 128, 128), "fire5": (32, 128, 128),
    "fire6": (48, 192, 192), "fire7": (48, 192, 192), "fire8": (64, 256, 256), "fire9": (64, 256, 256),
}


class FireExpand(nn.Module):
    """The expand layer: 1x1 and 3x3 convolutions (each with ReLU) concatenated."""

    merge = "cat"

    def __init__(self, cin: int, e1: int, e3: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList([
            nn.Sequential(nn.Conv2d(cin, e1, 1), nn.ReLU(inplace=True)),
            nn.Sequential(nn.Conv2d(cin, e3, 3, padding=1), nn.ReLU(inplace=True)),
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches], dim=1)


class Fire(nn.Sequential):
    """Squeeze (1x1 convolution + ReLU), then expand."""

    def __init__(self, cin: int, squeeze: int, e1: int, e3: int) -> None:
        super().__init__(OrderedDict(
            squeeze=nn.Sequential(nn.Conv2d(cin, squeeze, 1), nn.ReLU(inplace=True)),
            expand=FireExpand(squeeze, e1, e3)))
        self.out_channels = e1 + e3


class SqueezeNet(nn.Sequential):
    """SqueezeNet v1.0 whose children form its flat layer sequence."""

    def __init__(self, num_classes: int = 1000, *, in_channels: int = 3, width: float = 1.0,
                 dropout: float = 0.5) -> None:
        w = channel_scaler(num_classes, in_channels, width)

        layers: OrderedDict[str, nn.Module] = OrderedDict()
        layers["conv1"] = nn.Sequential(nn.Conv2d(in_channels, w(96), 7, stride=2), nn.ReLU(inplace=True))
        layers["pool1"] = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        cin = w(96)
        for name, (s, e1, e3) in FIRE_CONFIG.items():
            layers[name] = Fire(cin, w(s), w(e1), w(e3))
            cin = layers[name].out_channels
            if name in ("fire4", "fire8"):
                layers[f"pool{name[-1]}"] = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        layers["dropout"] = nn.Dropout(dropout)
        layers["conv10"] = nn.Sequential(nn.Conv2d(cin, num_classes, 1), nn.ReLU(inplace=True))
        layers["pool10"] = nn.AdaptiveAvgPool2d(1)
        layers["flatten"] = nn.Flatten()
        super().__init__(layers)


def squeezenet1_0(num_classes: int = 1000, *, in_channels: int = 3, width: float = 1.0) -> SqueezeNet:
    return SqueezeNet(num_classes, in_channels=in_channels, width=width)
