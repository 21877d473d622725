"""ResNet-18/34/50 (He et al., 2016) as flat layer sequences.

Each ResNet is an `nn.Sequential` whose children are the stem layers, one child per residual
block, then pooling and the classifier. Sequential checkpointing (OpTorch) and per-layer
profiling (VBS) walk this list directly; nothing else about the architecture is special.
The `cifar` stem is a 3x3 stride-1 convolution without max-pooling (for 32x32 inputs); the
`imagenet` stem is the 7x7 stride-2 convolution plus 3x3 max-pooling (for 224x224 inputs).
`width` (64 in the paper) scales every stage; narrower copies keep CPU runs short.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

__all__ = ["RESNETS", "BasicBlock", "Bottleneck", "ResNet", "resnet18", "resnet34", "resnet50"]

_STEMS = ("cifar", "imagenet")


def _conv_bn(cin: int, cout: int, kernel: int, stride: int) -> list[nn.Module]:
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=False)
    return [conv, nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            *_conv_bn(cin, width, 3, stride), nn.ReLU(inplace=True), *_conv_bn(width, cout, 3, 1)
        )
        self.shortcut = (
            nn.Sequential(*_conv_bn(cin, cout, 1, stride))
            if stride != 1 or cin != cout else nn.Identity()
        )
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class Bottleneck(BasicBlock):
    """1x1 reduce, 3x3, 1x1 expand (x4), with an identity (or projection) shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__(cin, width, stride)
        self.body = nn.Sequential(
            *_conv_bn(cin, width, 1, 1), nn.ReLU(inplace=True),
            *_conv_bn(width, width, 3, stride), nn.ReLU(inplace=True),
            *_conv_bn(width, width * self.expansion, 1, 1),
        )


class ResNet(nn.Sequential):
    """A ResNet whose children form its flat layer sequence."""

    def __init__(
        self, block: type[BasicBlock], depths: tuple[int, ...], num_classes: int = 10, *,
        stem: str = "cifar", in_channels: int = 3, width: int = 64,
    ) -> None:
        if stem not in _STEMS:
            raise ValueError(f"stem must be one of {_STEMS}, got {stem!r}")
        if min(num_classes, in_channels, width) < 1:
            raise ValueError(
                f"num_classes, in_channels and width must be >= 1, got {num_classes}, {in_channels}, {width}"
            )
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        if stem == "cifar":
            layers["conv1"] = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        else:
            layers["conv1"] = nn.Conv2d(in_channels, width, 7, stride=2, padding=3, bias=False)
        layers["bn1"] = nn.BatchNorm2d(width)
        layers["relu"] = nn.ReLU(inplace=True)
        if stem == "imagenet":
            layers["maxpool"] = nn.MaxPool2d(3, stride=2, padding=1)
        cin = width
        for stage, depth in enumerate(depths):
            for i in range(depth):
                stride = 2 if stage > 0 and i == 0 else 1
                layers[f"layer{stage + 1}_{i}"] = block(cin, width * 2**stage, stride)
                cin = width * 2**stage * block.expansion
        layers["avgpool"] = nn.AdaptiveAvgPool2d(1)
        layers["flatten"] = nn.Flatten()
        layers["fc"] = nn.Linear(cin, num_classes)
        super().__init__(layers)

    def as_sequential(self) -> nn.Sequential:
        """The flat layer sequence: the model itself."""
        return self


def resnet18(num_classes: int = 10, *, stem: str = "cifar", in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes, stem=stem, in_channels=in_channels, width=width)


def resnet34(num_classes: int = 10, *, stem: str = "cifar", in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(BasicBlock, (3, 4, 6, 3), num_classes, stem=stem, in_channels=in_channels, width=width)


def resnet50(num_classes: int = 10, *, stem: str = "cifar", in_channels: int = 3, width: int = 64) -> ResNet:
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes, stem=stem, in_channels=in_channels, width=width)


# By name, for notebooks and experiment functions that take the model as a parameter.
RESNETS = {"resnet18": resnet18, "resnet34": resnet34, "resnet50": resnet50}
