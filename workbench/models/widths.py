"""The width multiplier shared by the ImageNet-shaped inference models (GoogLeNet, MobileNet, SqueezeNet)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["channel_scaler"]


def channel_scaler(num_classes: int, in_channels: int, width: float) -> Callable[[int], int]:
    """Validate a model's size arguments and return ``c -> max(1, round(c * width))``."""
    if num_classes < 1 or in_channels < 1 or not 0 < width <= 4:
        raise ValueError(f"need num_classes >= 1, in_channels >= 1, 0 < width <= 4; got {num_classes}, "
                         f"{in_channels}, {width}")

    def scaled(channels: int) -> int:
        return max(1, round(channels * width))

    return scaled
