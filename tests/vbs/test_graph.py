"""workbench.vbs.graph: a network as the main path of stages the planner works on (Section III)."""

import pytest
import torch

from workbench import vbs
from workbench.models import build, googlenet, mobilenet_v1, resnet18, resnet50, squeezenet1_0

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("net", ["linear", "branched", "resnet18"])
def test_stages_reproduce_the_forward_pass(net, nets):
    model = nets[net]()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(vbs.run_stages(vbs.stages_of(model), x), model(x))


@pytest.mark.parametrize("factory", [googlenet, mobilenet_v1, squeezenet1_0])
def test_stages_of_the_papers_networks_equal_the_model(factory):
    model = factory(7, width=0.25).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        assert out.shape == (2, 7)
        torch.testing.assert_close(vbs.run_stages(vbs.stages_of(model), x), out)


def test_stage_structure(nets):
    stages = vbs.stages_of(nets["linear"]())
    assert [s.name for s in stages] == ["0", "3", "5", "6", "8", "10"]  # conv+bn+relu, conv+relu, ...
    res = vbs.stages_of(resnet18(4, width=4))
    blocks = [s for s in res if s.is_branch]
    assert len(blocks) == 8 and all(s.merge == "add" for s in blocks)
    assert len(blocks[0].branches[1]) == 0 and len(blocks[2].branches[1]) == 1  # identity / projection


def test_stage_structure_of_the_branched_models():
    g = vbs.stages_of(googlenet(width=0.25))
    inception = [s for s in g if s.is_branch]
    assert [s.name for s in inception][:2] == ["inception_3a", "inception_3b"] and len(inception) == 9
    assert [len(b) for b in inception[0].branches] == [1, 2, 2, 2]  # 1x1; 1x1-3x3; 1x1-5x5; pool-1x1
    assert [s.name for s in g][:7] == ["conv1", "pool1", "norm1", "conv2_reduce", "conv2", "norm2", "pool2"]
    s = vbs.stages_of(squeezenet1_0(width=0.25))
    assert [x.name for x in s if x.is_branch] == [f"fire{i}.expand" for i in range(2, 10)]
    assert "fire2.squeeze" in [x.name for x in s]
    m = vbs.stages_of(mobilenet_v1(width=0.25))
    assert not any(x.is_branch for x in m) and len(m) == 1 + 2 * 13 + 2
    r = vbs.stages_of(resnet50(10, stem="imagenet", width=8))
    assert sum(x.is_branch for x in r) == 16
    # the registry's ImageNet ResNet-50 at width x0.125 is the same network
    assert [x.name for x in vbs.stages_of(build("resnet50", width=0.125, stem="imagenet"))] == [x.name for x in r]


def test_bad_models():
    with pytest.raises(TypeError, match="nn.Module"):
        vbs.stages_of("resnet")
    with pytest.raises(ValueError, match="no layers"):
        vbs.stages_of(torch.nn.Sequential())
