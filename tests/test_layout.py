"""The house rule: one experiments module and one profile per notebook, techniques kept pure."""

import ast
import importlib.util

import pytest

from workbench.devices import repo_root
from workbench.report import available_notebooks

ROOT = repo_root()
TECHNIQUES = ("optim", "checkpoint", "data", "models", "calcgraph", "vbs")
FORBIDDEN = ("workbench.report", "matplotlib", "workbench.experiments")


@pytest.mark.parametrize("name", available_notebooks(ROOT / "notebooks"))
def test_every_notebook_has_its_experiments_module_and_profile(name):
    assert importlib.util.find_spec(f"workbench.experiments.{name}") is not None, (
        f"notebooks/{name}.ipynb needs workbench/experiments/{name}.py (or a package of that name)")
    assert (ROOT / "notebooks" / "profiles" / f"{name}.yaml").is_file(), f"notebooks/profiles/{name}.yaml missing"


def test_no_experiments_module_without_its_notebook():
    notebooks = set(available_notebooks(ROOT / "notebooks"))
    folder = ROOT / "workbench" / "experiments"
    names = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    assert names <= notebooks, f"experiments without a notebook: {sorted(names - notebooks)}"


def _imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def test_techniques_know_nothing_of_reports_plots_or_notebooks():
    offenders = []
    for package in TECHNIQUES:
        for path in sorted((ROOT / "workbench" / package).rglob("*.py")):
            offenders += [f"{path.relative_to(ROOT)} imports {m}" for m in _imports(path)
                          if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not offenders, "\n".join(offenders)
