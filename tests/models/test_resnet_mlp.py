"""ResNets (reference parameter counts, flat sequences) and the MLP, with their argument checks."""

import pytest
import torch

from workbench.models import MLP, resnet18, resnet34, resnet50


@pytest.mark.parametrize("factory,params", [
    (resnet18, 11_689_512), (resnet34, 21_797_672), (resnet50, 25_557_032),
])
def test_imagenet_resnets_have_the_reference_parameter_counts(factory, params):
    model = factory(1000, stem="imagenet")
    assert sum(p.numel() for p in model.parameters()) == params
    assert model.as_sequential() is model


def test_cifar_resnet18_is_a_flat_sequence():
    model = resnet18(10)
    names = [name for name, _ in model.named_children()]
    assert names[:3] == ["conv1", "bn1", "relu"] and names[-3:] == ["avgpool", "flatten", "fc"]
    assert len(names) == 3 + 8 + 3
    x = torch.randn(2, 3, 32, 32)
    out = x
    for layer in model:
        out = layer(out)
    torch.testing.assert_close(out, model(x))
    assert out.shape == (2, 10)


def test_bad_model_arguments():
    with pytest.raises(ValueError, match="stem must be one of"):
        resnet18(stem="tiny")
    with pytest.raises(ValueError, match="width must be >= 1"):
        resnet50(width=0)
    narrow = resnet34(width=16)
    assert narrow.fc.in_features == 16 * 8 and narrow(torch.randn(1, 3, 32, 32)).shape == (1, 10)
    with pytest.raises(ValueError, match="activation must be one of"):
        MLP(activation="swish")
    assert MLP()(torch.randn(5, 1, 28, 28)).shape == (5, 10)
