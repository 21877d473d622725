"""workbench.vbs.graph: a network as the main path of stages the planner works on (Section III)."""

import warnings

import pytest
import torch
from torch import nn
from vbs_custom_nets import CUSTOM, DataDependent, UserNet, look_alike_net

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


# --- the stages follow the real forward (torch.fx), not attribute names -----------------------


@pytest.mark.parametrize("net", list(CUSTOM))
def test_custom_forwards_are_decomposed_by_what_they_do(net):
    model = CUSTOM[net]()
    x = torch.randn(3, 3, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # all of these trace: no fallback
        stages = vbs.stages_of(model)
    with torch.no_grad():
        torch.testing.assert_close(vbs.run_stages(stages, x), model(x))
    assert len({s.name for s in stages}) == len(stages)


def test_a_look_alike_block_is_no_residual_block():
    stages = vbs.stages_of(look_alike_net())
    # relu(body) - 0.5 * shortcut is no sum of branches: one stage that runs that part of the graph
    assert [s.name for s in stages] == ["0", "1", "2", "4"] and not any(s.is_branch for s in stages)
    summed = vbs.stages_of(CUSTOM["look_alike_sum"]())
    block = summed[1]
    assert block.name == "1" and block.is_branch and block.merge == "add" and block.post is None
    assert [[n for n, _ in br] for br in block.branches] == [["1.body", "1.body.3"], ["1.shortcut"]]
    assert isinstance(block.branches[0][1][1][-1], nn.ReLU)  # bundled with the conv before it, inside the branch


def test_a_user_model_decomposes():
    stages = vbs.stages_of(UserNet())
    assert [s.name for s in stages] == ["conv1", "add", "adaptive_avg_pool2d", "fc"]
    block = stages[1]
    assert block.is_branch and block.merge == "add" and block.post is not None  # the ReLU after the sum
    assert [[n for n, _ in br] for br in block.branches] == [["conv2"], ["proj"]]
    b = vbs.stages_of(CUSTOM["branchy"]())
    assert sum(s.is_branch for s in b) == 0 and len(b) >= 4  # gate, 3-sum, nested: run as they are


def test_an_untraceable_module_warns_and_stays_whole():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), DataDependent(), nn.Conv2d(4, 2, 1)).eval()
    with pytest.warns(UserWarning, match=r"module '1' \(DataDependent\).*TraceError.*one opaque stage"):
        stages = vbs.stages_of(model)
    assert [s.name for s in stages] == ["0", "1", "2"] and isinstance(stages[1].module, DataDependent)
    x = torch.randn(2, 3, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(vbs.run_stages(stages, x), model(x))
    with pytest.warns(UserWarning, match=r"forward of DataDependent could not be traced.*whole model"):
        whole = vbs.decompose(DataDependent())
    assert len(whole.stages) == 1 and whole.traced is None and "DataDependent" in whole.opaque
