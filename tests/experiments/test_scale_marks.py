"""Figures made where a notebook gives no verdicts say so on themselves (issue 23).

The mark is driven by `verdicts`, the same notebook parameter that turns the ledger's verdicts off;
every plot function of every experiments package takes it and routes its figure through `marked`.
"""

import ast
import importlib
import inspect

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

MODULES = ["calcgraph", "efficient_densenet", "optorch", "tour", "variable_batch_size"]


def _plots(name):
    return importlib.import_module(f"workbench.experiments.{name}.plots")


def _marks(fig) -> list[str]:
    return [t.get_text() for t in fig.texts if "toy scale" in t.get_text()]


@pytest.mark.parametrize("name", MODULES)
def test_every_plot_function_takes_verdicts_and_returns_through_the_mark(name):
    module = _plots(name)
    functions = [n for n in module.__all__ if n.startswith("plot_")]
    assert functions
    tree = ast.parse(inspect.getsource(module))
    defs = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for fname in functions:
        parameter = inspect.signature(getattr(module, fname)).parameters["verdicts"]
        assert parameter.kind is parameter.KEYWORD_ONLY and parameter.default is True, fname
        returns = [n for n in ast.walk(defs[fname]) if isinstance(n, ast.Return)]
        assert returns and all(isinstance(r.value, ast.Call) and getattr(r.value.func, "id", "") == "marked"
                               and getattr(r.value.args[1], "id", "") == "verdicts" for r in returns), fname


@pytest.mark.parametrize("name", MODULES)
def test_the_mark_shows_exactly_when_verdicts_are_off(name):
    module = _plots(name)
    off, on = plt.subplots()[0], plt.subplots()[0]
    try:
        assert _marks(module.marked(off, False)) == [module.TOY_SCALE]
        assert _marks(module.marked(on, True)) == []
        with pytest.raises(TypeError, match="verdicts must be a bool .*got 'False'"):
            module.marked(on, "False")
    finally:
        plt.close("all")


def test_real_figures_carry_the_mark():
    from workbench.experiments import calcgraph, optorch, tour
    from workbench.experiments import variable_batch_size as vbs_exp

    fig1 = pd.DataFrame({"network": ["googlenet"] * 2, "batch": [1, 2], "time_per_image_s": [2e-3, 1e-3]})
    trace = pd.DataFrame({"variant": ["B"] * 3, "progress": [0, 0.5, 1], "bytes": [0, 2**20, 0],
                          "event": [0, 1, 2]})
    many = pd.DataFrame({"complexity": [1, 10], "run": [True, True], "plain_s": [1.0, 2.0], "switching_s": [0.5, 1.9]})
    try:
        for verdicts, marks in ((False, 1), (True, 0)):
            figs = [vbs_exp.plot_time_vs_batch(fig1, verdicts=verdicts),
                    optorch.plot_memory_over_iteration(trace, verdicts=verdicts),
                    calcgraph.plot_multi_model(many, verdicts=verdicts),
                    tour.plot_step_trace({"step": trace}, verdicts=verdicts)]
            assert [len(_marks(f)) for f in figs] == [marks] * len(figs)
        fig = vbs_exp.plot_time_vs_batch(fig1, verdicts=False)
        fig.canvas.draw()  # the mark lies inside what a tight bounding box saves
        box = fig.get_tightbbox(fig.canvas.get_renderer())
        mark = fig.texts[-1].get_window_extent(fig.canvas.get_renderer()).transformed(fig.dpi_scale_trans.inverted())
        assert box.y1 >= mark.y1 - 1e-6 and np.isfinite(mark.height)
    finally:
        plt.close("all")
