"""Models written for the workbench (there is no CPU torchvision here)."""

from .densenet import DenseNet, densenet_bc
from .mlp import MLP
from .resnet import ResNet, resnet18, resnet34, resnet50

__all__ = ["DenseNet", "MLP", "ResNet", "densenet_bc", "resnet18", "resnet34", "resnet50"]
