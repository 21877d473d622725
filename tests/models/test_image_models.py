"""GoogLeNet, MobileNet-v1 and SqueezeNet v1.0 (the networks of Choudhury et al., Section IV):
reference sizes and arguments. (The tests of their stages are in test_graph.py.)"""

import pytest

from workbench.models import googlenet, mobilenet_v1, squeezenet1_0


@pytest.mark.parametrize("factory,params", [
    (googlenet, 6_998_552),      # Caffe's bvlc_googlenet without auxiliary classifiers
    (mobilenet_v1, 4_231_976),   # alpha = 1.0, 224x224
    (squeezenet1_0, 1_248_424),
])
def test_reference_parameter_counts(factory, params):
    assert sum(p.numel() for p in factory(1000).parameters()) == params


def test_width_and_bad_arguments():
    narrow = sum(p.numel() for p in googlenet(width=0.5).parameters())
    assert narrow < sum(p.numel() for p in googlenet().parameters()) / 2
    for factory in (googlenet, mobilenet_v1, squeezenet1_0):
        with pytest.raises(ValueError, match="width"):
            factory(width=0)
        with pytest.raises(ValueError, match="num_classes"):
            factory(0)
