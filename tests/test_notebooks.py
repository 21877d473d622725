"""Every notebook runs through the report runner at the smoke profile, and is committed stripped."""

import json

import nbformat
import pytest

from workbench.devices import repo_root
from workbench.report import available_notebooks, build_reports

NOTEBOOKS = repo_root() / "notebooks"


@pytest.mark.parametrize("name", available_notebooks(NOTEBOOKS))
def test_notebook_is_stripped_and_declares_parameters(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", []), "first code cell must be tagged"
    assert "interactive = True" in code[0].source and "output_dir" in code[0].source
    assert all(not c.outputs and c.execution_count is None for c in code), "outputs not stripped"
    assert nb.metadata["kernelspec"]["name"] == "workbench"


def test_every_notebook_builds_at_smoke(tmp_path):
    out = tmp_path / "reports"
    results = build_reports(profile="smoke", out_dir=out, progress=False)
    failures = results[results.status != "ok"]
    assert failures.empty, failures.to_string()
    for name in results.name:
        data = json.loads((out / name / "results.json").read_text())
        assert data["claims"], f"{name} recorded no claims"
        assert all(c["verdict"] for c in data["claims"])
    assert (out / "index.html").exists()
