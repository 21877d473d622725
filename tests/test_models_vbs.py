"""GoogLeNet, MobileNet-v1 and SqueezeNet v1.0: reference sizes, shapes and their VBS stages."""

import pytest
import torch

from workbench import vbs
from workbench.models import googlenet, mobilenet_v1, resnet50, squeezenet1_0


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("factory,params", [
    (googlenet, 6_998_552),      # Caffe's bvlc_googlenet without auxiliary classifiers
    (mobilenet_v1, 4_231_976),   # alpha = 1.0, 224x224
    (squeezenet1_0, 1_248_424),
])
def test_reference_parameter_counts(factory, params):
    assert sum(p.numel() for p in factory(1000).parameters()) == params


@pytest.mark.parametrize("factory", [googlenet, mobilenet_v1, squeezenet1_0])
def test_forward_shapes_and_stages_equal_the_model(factory):
    model = factory(7, width=0.25).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = model(x)
        assert out.shape == (2, 7)
        torch.testing.assert_close(vbs.run_stages(vbs.stages_of(model), x), out)


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


def test_width_and_bad_arguments():
    narrow = sum(p.numel() for p in googlenet(width=0.5).parameters())
    assert narrow < sum(p.numel() for p in googlenet().parameters()) / 2
    for factory in (googlenet, mobilenet_v1, squeezenet1_0):
        with pytest.raises(ValueError, match="width"):
            factory(width=0)
        with pytest.raises(ValueError, match="num_classes"):
            factory(0)


@pytest.mark.parametrize("factory", [googlenet, squeezenet1_0])
def test_vbs_plan_executes_on_the_branched_models(factory):
    model = factory(5, width=0.125).eval()
    prof = vbs.profile(model, torch.randn(3, 32, 32), [1, 4], repeats=1, warmup=0).coarsen(1024)
    p = vbs.plan(prof, memory=vbs.fbs_peak(prof, batch=4, size=2), batch=4)
    x = torch.randn(4, 3, 32, 32)
    result = vbs.run(model, p, x, measure_memory=False)
    with torch.no_grad():
        torch.testing.assert_close(result.outputs, model(x))
    assert p.time_per_sample <= vbs.fbs(prof, memory=p.memory, batch=4).time_per_sample
