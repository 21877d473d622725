"""A notebook folder and a fake executor for the report runner's tests (the runner's logic is what is
under test; tests/report/test_runner.py runs real kernels)."""

import os

import nbformat

from workbench.cli import main
from workbench.report import Ledger, at_least, save_results

PARAMS = "value = 1\nrate = 0.5\nflag = False\nlabel = 'a'\n"


def write_notebook(folder, name, params=PARAMS):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(params + "interactive = True\noutput_dir = ''",
                                          metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("print(value)")]
    nb.metadata["kernelspec"] = {"name": "workbench", "display_name": "Workbench", "language": "python"}
    nbformat.write(nb, folder / f"{name}.ipynb")


class FakeExecutor:
    """Stands in for papermill.execute_notebook: writes the executed notebook and results.json, or raises
    for value < 0 like a failing cell."""

    def __init__(self):
        self.calls = []

    def __call__(self, source, executed, parameters, **kwargs):
        import matplotlib.pyplot as plt

        self.calls.append((parameters, kwargs))
        nbformat.write(nbformat.read(source, as_version=4), executed)
        if parameters.get("value", 1) < 0:
            raise RuntimeError(f"boom {parameters['value']}")
        ledger = Ledger()
        ledger.add("value is at least 1", paper=1, measured=parameters.get("value", 1), unit="", scale="",
                   device="cpu", rule=at_least(1))
        narrow, ax = plt.subplots(figsize=(4, 3))
        ax.plot([1, 2])
        wide, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        axes[0].plot([1, 2])
        name = os.path.basename(source).removesuffix(".ipynb")
        save_results(name, output_dir=parameters["output_dir"], parameters=parameters, records={},
                     ledger=ledger, figures={"narrow": narrow, "two_panels": wide})
        plt.close("all")


def run_cli(notebooks, out, *args):
    return main(["report", "--notebooks", str(notebooks), "--out", str(out), *args])
