"""variable_batch_size.tables: the paper's four networks, Fig 1 (time against batch) and Fig 2 (memory
per layer at batch 1) from measured tables."""

import pytest
import torch

import workbench.experiments.variable_batch_size as exp
from workbench import vbs
from workbench.models import googlenet, mobilenet_v1, resnet50, squeezenet1_0

pytestmark = pytest.mark.usefixtures("one_thread")

# What the notebook built before `workbench.models.build` was the one place to build networks by name.
OLD = {"googlenet": lambda w: googlenet(1000, width=w), "mobilenet_v1": lambda w: mobilenet_v1(1000, width=w),
       "squeezenet1_0": lambda w: squeezenet1_0(1000, width=w),
       "resnet50": lambda w: resnet50(1000, stem="imagenet", width=max(1, round(64 * w)))}


@pytest.mark.parametrize("name", exp.NETWORKS)
@pytest.mark.parametrize("width", [0.125, 1.0])
def test_build_network_is_the_network_the_notebook_always_built(name, width):
    model, old = exp.build_network(name, width=width), OLD[name](width)
    assert not model.training
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in old.state_dict().items()}
    assert [s.name for s in vbs.stages_of(model)] == [s.name for s in vbs.stages_of(old)]
    if width < 1:
        torch.manual_seed(0)
        a = exp.build_network(name, width=width)
        torch.manual_seed(0)
        b = OLD[name](width).eval()
        x = torch.randn(1, 3, 32, 32)
        with torch.no_grad():
            torch.testing.assert_close(a(x), b(x))
    with pytest.raises(ValueError, match="network must be one of"):
        exp.build_network("vgg16")


@pytest.fixture(scope="module")
def measured():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return exp.measure_networks(["resnet50", "mobilenet_v1"], image_size=32, width=0.125, max_batch=2, repeats=1)
    finally:
        torch.set_num_threads(threads)


def test_time_vs_batch(measured):
    _, layers = measured
    fig1 = exp.time_vs_batch(layers)
    assert list(fig1.columns) == ["network", "batch", "time_per_image_s", "relative_to_batch_1"]
    assert set(fig1.network) == {"resnet50", "mobilenet_v1"} and sorted(set(fig1.batch)) == [1, 2]
    assert (fig1[fig1.batch == 1].relative_to_batch_1 == 1.0).all() and (fig1.time_per_image_s > 0).all()
    frame = exp.tables_frame(layers)
    assert set(frame.network) == set(layers) and len(frame) == sum(t.n_layers * 2 for t in layers.values())


def test_layer_memory_has_every_layer_group_with_its_real_input(measured):
    _, layers = measured
    t = layers["resnet50"]
    fig2 = exp.layer_memory(t, network="resnet50")
    n_branch = sum(p.n_layers for parts in t.branches.values() for p in parts)
    assert len(fig2) == t.n_layers - len(t.branches) + n_branch  # 2 + 16 blocks of 3 or 4 convs + 2
    assert (fig2.total_bytes == fig2.in_bytes + fig2.out_bytes + fig2.ws_bytes).all()
    first = fig2[fig2.group == "layer1_0"].iloc[0]
    assert first.in_bytes == t.inp[t.names.index("layer1_0"), 0] > 0  # the group's input, not the tables' 0
    conv1 = fig2[fig2.name == "conv1"].iloc[0]
    assert conv1.in_bytes == 3 * 32 * 32 * 4 and conv1.network == "resnet50"
    assert "kind" not in fig2  # only where the model's kinds are given


def test_layer_kinds_name_what_each_layer_group_is(measured):
    models, layers = measured
    kinds = exp.layer_kinds(models["resnet50"])
    fig2 = exp.layer_memory(layers["resnet50"], network="resnet50", kinds=kinds)
    by_name = fig2.set_index("name").kind
    assert by_name["conv1"] == "Conv2d" and by_name["maxpool"] == "MaxPool2d" and by_name["fc"] == "Linear"
    assert by_name["layer1_0.body"] == "Conv2d"  # the paper's res2a_branch2a: a 1x1 convolution
    assert models["resnet50"].get_submodule("layer1_0.body.0").kernel_size == (1, 1)
    assert kinds["layer1_0"] == "" and (fig2.kind != "").all()  # groups are not rows of Fig 2
    assert (by_name[by_name.index.str.contains("shortcut")] == "Conv2d").all()


def test_layer_memory_of_a_network_without_branches(measured):
    _, layers = measured
    t = layers["resnet50"]
    plain = exp.layer_memory(layers["mobilenet_v1"], batch=2)
    assert len(plain) == layers["mobilenet_v1"].n_layers and (plain.group == "").all()
    with pytest.raises(ValueError, match="batch"):
        exp.layer_memory(t, batch=3)
    with pytest.raises(ValueError, match="image_size"):
        exp.measure_networks(["resnet50"], image_size=8, width=0.125, max_batch=2)
