"""Models written for the workbench (there is no CPU torchvision here)."""

from .densenet import DenseNet, densenet_bc
from .mlp import MLP
from .resnet import RESNETS, ResNet, resnet18, resnet34, resnet50

__all__ = ["RESNETS", "DenseNet", "MLP", "ResNet", "densenet_bc", "resnet18", "resnet34", "resnet50"]
