"""Models written for the workbench (there is no CPU torchvision here)."""

from .mlp import MLP
from .resnet import ResNet, resnet18, resnet34, resnet50

__all__ = ["MLP", "ResNet", "resnet18", "resnet34", "resnet50"]
