"""Models written for the workbench (there is no CPU torchvision here)."""

from .densenet import DenseNet, densenet_bc
from .inception import GoogLeNet, Inception, googlenet
from .mlp import MLP
from .mobilenet import MobileNetV1, mobilenet_v1
from .resnet import RESNETS, ResNet, resnet18, resnet34, resnet50
from .registry import NETWORKS, build
from .squeezenet import SqueezeNet, squeezenet1_0

__all__ = [
    "NETWORKS", "build",
    "RESNETS", "DenseNet", "MLP", "ResNet", "densenet_bc", "resnet18", "resnet34", "resnet50",
    "GoogLeNet", "Inception", "MobileNetV1", "SqueezeNet", "googlenet", "mobilenet_v1", "squeezenet1_0",
]
