"""Models by name: one place that builds every image network of `workbench.models` from a name.

Experiments and notebooks pick networks by name (a profile holds strings); this is the one mapping
from those names to the factories, with one meaning of `width` for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from numbers import Integral

from torch import nn

from .inception import googlenet
from .mobilenet import mobilenet_v1
from .resnet import RESNETS
from .squeezenet import squeezenet1_0

__all__ = ["NETWORKS", "build"]

_FIXED_STEM: dict[str, Callable[..., nn.Module]] = {
    "googlenet": googlenet, "mobilenet_v1": mobilenet_v1, "squeezenet1_0": squeezenet1_0,
}
NETWORKS = (*sorted(RESNETS), *_FIXED_STEM)
STEMS = ("cifar", "imagenet")


def build(
    name: str, *, width: float = 1.0, num_classes: int = 10, stem: str = "cifar", in_channels: int = 3,
) -> nn.Module:
    """The network `name` (one of `NETWORKS`) in train mode.

    `width` scales every layer's channels (1.0 is the published network; ResNets get a stage width of
    round(64 x width), so 0.125 is width 8). `stem` is the ResNets' input stem: "cifar" (3x3 conv, for
    32 px) or "imagenet" (7x7 conv and max pool, for 224 px); GoogLeNet, MobileNet and SqueezeNet have
    only the ImageNet stem.
    """
    if not isinstance(width, (int, float)) or isinstance(width, bool) or not 0 < width <= 16:
        raise ValueError(f"width must be a channel multiplier in (0, 16], got {width!r}")
    if stem not in STEMS:
        raise ValueError(f"stem must be one of {STEMS}, got {stem!r}")
    for what, value in (("num_classes", num_classes), ("in_channels", in_channels)):
        if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
            raise ValueError(f"{what} must be a whole number >= 1, got {value!r}")
    if name in RESNETS:
        return RESNETS[name](num_classes, stem=stem, in_channels=in_channels, width=max(1, round(64 * width)))
    if name in _FIXED_STEM:
        return _FIXED_STEM[name](num_classes, in_channels=in_channels, width=float(width))
    raise ValueError(f"network must be one of {list(NETWORKS)}, got {name!r}")
