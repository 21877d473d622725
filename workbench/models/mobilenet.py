"""MobileNet-v1 (Howard et al., "MobileNets: Efficient convolutional neural networks for mobile
vision applications", 2017) as a flat layer sequence.

Table 1 of that paper: a 3x3 stride-2 convolution, thirteen depthwise-separable blocks (a 3x3
depthwise convolution and a 1x1 pointwise convolution, each followed by BatchNorm and ReLU),
global average pooling and a fully connected classifier. `width` is the paper's width
multiplier alpha. The model is an `nn.Sequential` of named blocks, each an `nn.Sequential`, so a
per-layer profiler (VBS) sees a linear chain of convolution groups.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from .widths import channel_scaler

__all__ = ["MobileNetV1", "mobilenet_v1", "MOBILENET_V1_BLOCKS"]

# (output channels, stride) of the 13 depthwise-separable blocks
MOBILENET_V1_BLOCKS: tuple[tuple[int, int], ...] = (
    (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2),
    (512, 1), (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1),
)


def _conv_bn(cin: int, cout: int, kernel: int, stride: int, groups: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
    )


class MobileNetV1(nn.Sequential):
    """MobileNet-v1 whose children are the stem, 13 separable blocks, pooling and classifier."""

    def __init__(self, num_classes: int = 1000, *, in_channels: int = 3, width: float = 1.0) -> None:
        w = channel_scaler(num_classes, in_channels, width)

        layers: OrderedDict[str, nn.Module] = OrderedDict()
        layers["conv1"] = _conv_bn(in_channels, w(32), 3, 2)
        cin = w(32)
        for i, (cout, stride) in enumerate(MOBILENET_V1_BLOCKS, start=2):
            layers[f"conv{i}"] = nn.Sequential(OrderedDict(
                dw=_conv_bn(cin, cin, 3, stride, groups=cin), pw=_conv_bn(cin, w(cout), 1, 1)))
            cin = w(cout)
        layers["pool"] = nn.AdaptiveAvgPool2d(1)
        layers["flatten"] = nn.Flatten()
        layers["fc"] = nn.Linear(cin, num_classes)
        super().__init__(layers)


def mobilenet_v1(num_classes: int = 1000, *, in_channels: int = 3, width: float = 1.0) -> MobileNetV1:
    return MobileNetV1(num_classes, in_channels=in_channels, width=width)
