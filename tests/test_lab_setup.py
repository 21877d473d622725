"""workbench.lab_setup's hooks on their own: what the save hooks touch and what they leave alone (the whole set-up
in a clone, through JupyterLab's contents manager, is tested in tests/test_notebooks.py; in a browser in
tests/test_browser.py)."""

import subprocess

import pytest

from workbench import lab_setup


def test_save_hook_leaves_files_git_gets_right_alone(tmp_path):
    """Untracked files, files without a clean filter and files outside a checkout are not touched; a
    failing git never fails the save."""
    (tmp_path / "outside.ipynb").write_text("{}")
    assert lab_setup.refresh_git_index(str(tmp_path / "outside.ipynb")) is False  # not a checkout: logged
    subprocess.run(["git", "init", "-q", str(tmp_path / "r")], check=True)
    (tmp_path / "r" / "a.txt").write_text("a")
    assert lab_setup.refresh_git_index(str(tmp_path / "r" / "a.txt")) is False
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        lab_setup.install(tmp_path / "missing")


def test_views_of_closed_widgets_are_dropped_on_save():
    """tqdm's notebook bar closes its container when it ends (leave=False), while the output that showed it stays,
    in a cell or in an output widget's state: reopened, it read "Error displaying widget: model not found". The
    pre-save hook drops exactly those views; without saved widget state nothing is known and nothing dropped."""
    def view(model_id):
        return {"output_type": "display_data", "metadata": {},
                "data": {"text/plain": "bar", lab_setup.WIDGET_VIEW: {"model_id": model_id, "version_major": 2}}}

    text = {"output_type": "stream", "name": "stdout", "text": "done"}
    state = {"out": {"model_name": "OutputModel", "state": {"outputs": [view("bar1"), text, view("slider")]}},
             "slider": {"model_name": "IntSliderModel", "state": {}}}
    content = {"metadata": {"widgets": {lab_setup.WIDGET_STATE: {"state": state}}},
               "cells": [{"cell_type": "code", "outputs": [view("out"), view("bar2"), text, view("")]},
                         {"cell_type": "markdown", "source": "x"}]}
    model = {"type": "notebook", "content": content}
    assert lab_setup.drop_closed_widget_views(model) == 2
    assert content["cells"][0]["outputs"] == [view("out"), text, view("")]
    assert state["out"]["state"]["outputs"] == [text, view("slider")]
    del content["metadata"]["widgets"]
    content["cells"][0]["outputs"].append(view("bar3"))
    assert lab_setup.drop_closed_widget_views(model) == 0 and len(content["cells"][0]["outputs"]) == 4
    assert lab_setup.drop_closed_widget_views({"type": "file", "content": "text"}) == 0


def test_the_environment_make_built_has_the_notebooks_kernel():
    """Issue 43: after `make report` or `make test` every notebook opened on "Select Kernel" (their kernelspec names
    'workbench'); the Makefile's set-up now installs it into the environment's own Jupyter data folder, where the
    JupyterLab of that environment finds it."""
    import json
    import sys
    from pathlib import Path

    from workbench.devices import repo_root
    from workbench.report import KERNEL_NAME

    if not (Path(sys.prefix) / ".installed").is_file():
        pytest.skip("not the environment `make` builds (its stamp .installed is missing)")
    # where that environment's JupyterLab looks (the tests' own JUPYTER_PATH names the repository's kernels/)
    installed = Path(sys.prefix) / "share" / "jupyter" / "kernels" / KERNEL_NAME / "kernel.json"
    assert installed.is_file(), f"{installed} is missing: the Makefile's set-up did not install the kernel"
    shipped = json.loads((repo_root() / "kernels" / KERNEL_NAME / "kernel.json").read_text())
    assert json.loads(installed.read_text()) == shipped
