"""A configurable multi-layer perceptron, e.g. CalcGraph's 784-64-64-10 sigmoid MLP."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

from torch import nn

__all__ = ["MLP"]

_ACTIVATIONS = {"sigmoid": nn.Sigmoid, "relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


class MLP(nn.Sequential):
    """Flatten, then Linear + activation per hidden layer, then a final Linear (logits)."""

    def __init__(self, sizes: Sequence[int] = (784, 64, 64, 10), activation: str = "sigmoid") -> None:
        sizes = tuple(sizes)
        whole = all(isinstance(s, Integral) and not isinstance(s, bool) for s in sizes)
        if len(sizes) < 2 or not whole or any(s < 1 for s in sizes):
            raise ValueError(f"sizes needs at least two whole widths >= 1, got {sizes}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        layers: list[nn.Module] = [nn.Flatten()]
        for i, (cin, cout) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            layers.append(nn.Linear(cin, cout))
            if i < len(sizes) - 2:
                layers.append(_ACTIVATIONS[activation]())
        super().__init__(*layers)
        self.sizes = sizes

    def as_sequential(self) -> nn.Sequential:
        return self
