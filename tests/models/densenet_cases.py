"""Shared DenseNet test set-up (imported by the tests beside it; not a test module)."""

import torch

from workbench.models import DenseNet


def randomize_bn(model: DenseNet) -> DenseNet:
    """Non-trivial BN statistics and affine terms: at the defaults (mean 0, var 1, bias 0) an
    exactly-zero conv output stays exactly 0 through eval-mode BN and sits on the ReLU kink."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
    return model
