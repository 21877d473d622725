"""Issue 44: every plot function of these notebooks takes `scale` (model, input size, batch, device) and shows it on
the figure, and each notebook passes it to every plot call."""

import ast
import importlib
import inspect
import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest


@pytest.mark.parametrize("name", ["calcgraph", "efficient_densenet", "variable_batch_size"])
def test_every_figure_carries_its_scale(name):
    plots = importlib.import_module(f"workbench.experiments.{name}.plots")
    for function in [n for n in plots.__all__ if n.startswith("plot_")]:
        parameter = inspect.signature(getattr(plots, function)).parameters["scale"]
        assert parameter.kind is parameter.KEYWORD_ONLY, function
    fig = plots.marked(plt.figure(), True, scale="ResNet-50 at 224px, batch 12; some CPU")
    try:
        assert [t.get_text() for t in fig.texts] == ["scale: ResNet-50 at 224px, batch 12; some CPU"]
    finally:
        plt.close(fig)
    notebook = json.loads((Path(__file__).parents[2] / "notebooks" / f"{name}.ipynb").read_text())
    calls = [node for cell in notebook["cells"] if cell["cell_type"] == "code"
             for node in ast.walk(ast.parse("".join(cell["source"])))
             if isinstance(node, ast.Call) and getattr(node.func, "attr", "").startswith("plot_")]
    assert calls and all(any(k.arg == "scale" for k in call.keywords) for call in calls), [
        ast.unparse(c)[:80] for c in calls if not any(k.arg == "scale" for k in c.keywords)]
