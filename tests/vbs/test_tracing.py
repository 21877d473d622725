"""workbench.vbs.tracing: reading a model's real forward with torch.fx."""

import pytest
import torch
from torch import nn
from vbs_custom_nets import DataDependent

from workbench import vbs
from workbench.models import resnet18
from workbench.vbs.tracing import depends_on_input, node_values, subgraph, trace_forward

pytestmark = pytest.mark.usefixtures("one_thread")


class TwoInputs(nn.Module):
    def forward(self, x, y):
        return x + y


class Pair(nn.Module):
    def forward(self, x):
        return x, x


class WithFlag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x, double: bool = False):
        y = self.conv(x)
        return y * 2 if double else y


def test_identity_leaves_no_node_and_the_trace_equals_the_model():
    model = resnet18(4, width=4).eval()
    t, why = trace_forward(model)
    assert why == "" and not t.opaque
    assert not any(n.op == "call_module" and "shortcut" == str(n.target).split(".")[-1] for n in t.graph.nodes)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(t.module(x), model(x))


def test_an_untraceable_submodule_is_kept_whole():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), DataDependent(), nn.ReLU()).eval()
    t, _ = trace_forward(model)
    assert list(t.opaque) == ["1"] and "TraceError" in t.opaque["1"]
    assert [str(n.target) for n in t.graph.nodes if n.op == "call_module"] == ["0", "1", "2"]
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(t.module(x), model(x))


def test_what_cannot_be_traced_says_why():
    assert trace_forward(TwoInputs())[0] is None and "takes 2 inputs" in trace_forward(TwoInputs())[1]
    assert "one tensor" in trace_forward(Pair())[1]
    assert "TraceError" in trace_forward(DataDependent())[1]
    model = WithFlag().eval()
    t, _ = trace_forward(model)  # an argument with a default is fixed at it
    x = torch.randn(1, 3, 2, 2)
    with torch.no_grad():
        torch.testing.assert_close(t.module(x), model(x))
        torch.testing.assert_close(vbs.run_stages(vbs.stages_of(model), x), model(x))


def test_subgraphs_and_node_values():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.ReLU(inplace=True), nn.Conv2d(4, 2, 1)).eval()
    t, _ = trace_forward(model)
    live = depends_on_input(t.graph)
    nodes = [n for n in t.graph.nodes if n in live and n.op != "placeholder"]
    assert [n.op for n in nodes] == ["call_module"] * 3
    part = subgraph(model, nodes[1:], nodes[0], nodes[-1], "tail")
    x = torch.randn(2, 3, 4, 4)
    with torch.no_grad():
        h = model[0](x)
        torch.testing.assert_close(part(h.clone()), model[2](model[1](h.clone())))
        out, values = node_values(t, x, [nodes[0].name])
        torch.testing.assert_close(out, model(x))
    torch.testing.assert_close(values[nodes[0].name], h)  # before the in-place ReLU changed it
    assert set(values) == {nodes[0].name}
