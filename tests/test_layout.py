"""The house rule: one experiments module and one profile per notebook, techniques kept pure."""

import ast
import importlib
import importlib.util

import nbformat
import pytest

from workbench.devices import repo_root
from workbench.report import PROFILES, available_notebooks

ROOT = repo_root()
TECHNIQUES = ("optim", "checkpoint", "data", "models", "calcgraph", "vbs", "advisor")
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


# ---------------------------------------------------------------------------------------------
# One shape for every experiment (DESIGN.md, "Library shape" and "Notebooks")

NOTEBOOK_NAMES = available_notebooks(ROOT / "notebooks")
MAX_MODULE_LINES = 450
MAX_CELL_LINES = 30
MAX_NOTEBOOK_CODE_LINES = 150  # outside the parameters cell


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_every_experiments_package_has_the_one_shape(name):
    from workbench.report import Claim

    folder = ROOT / "workbench" / "experiments" / name
    assert (folder / "__init__.py").is_file(), f"workbench/experiments/{name}/ must be a package"
    assert (folder / "claims.py").is_file(), f"workbench/experiments/{name}/claims.py holds the notebook's claims"
    claims = importlib.import_module(f"workbench.experiments.{name}.claims")
    assert claims.CLAIMS and all(isinstance(c, Claim) for c in claims.CLAIMS)
    assert len({c.text for c in claims.CLAIMS}) == len(claims.CLAIMS), "two claims with one text"
    assert callable(claims.ledger)
    assert (ROOT / "tests" / "experiments" / f"test_{name}_claims.py").is_file(), "claims need their unit tests"


def test_no_module_over_the_size_limit():
    big = {str(p.relative_to(ROOT)): n for p in (ROOT / "workbench").rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not big, f"modules over {MAX_MODULE_LINES} lines (split them, one idea each): {big}"


def _code_cells(name):
    nb = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    return [c for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_notebook_parameters_are_literals_and_captured_once(name):
    parameters, *rest = _code_cells(name)
    tree = ast.parse(parameters.source)
    for node in tree.body:
        assert isinstance(node, ast.Assign) and len(node.targets) == 1, f"{name}: parameters are plain assignments"
        value = ast.literal_eval(node.value)  # raises for anything that is not a literal
        assert not (isinstance(value, str) and "," in value), (
            f"{name}: {node.targets[0].id} = {value!r} is a comma string; write a list")
    assert "PARAMS = capture_parameters(globals())" in rest[0].source, (
        f"{name}: the cell after the parameters captures them once as PARAMS")
    source = "\n".join(c.source for c in rest)
    assert "parameters=PARAMS" in source, f"{name}: save_results records PARAMS"


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_every_numeric_parameter_declares_its_range(name):
    """A number (or list of numbers) in the parameters cell says which values it allows, beside its default:
    `batch_size = 4  # range: 1..4096`. The runner refuses a `-p` or profile value outside it."""
    from workbench.report import load_profile, notebook_parameters
    from workbench.report.parameters import coerce, numeric

    declared = notebook_parameters(ROOT / "notebooks" / f"{name}.ipynb")
    missing = [p for p, d in declared.items() if numeric(d.default) and d.bounds is None]
    assert not missing, f"{name}: numeric parameters without '# range: LO..HI' on their line: {missing}"
    for parameter, d in declared.items():
        if d.bounds is not None:
            coerce(parameter, d.default, d, f"{name}: the default of")  # the default lies in its own range
    for profile in PROFILES:  # smoke, cpu, gpu, paper: the runner refuses a profile value outside its range
        for parameter, value in load_profile(name, profile, ROOT / "notebooks").items():
            assert parameter in declared, f"notebooks/profiles/{name}.yaml ({profile}) sets undeclared {parameter}"
            coerce(parameter, value, declared[parameter], f"notebooks/profiles/{name}.yaml ({profile})")


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_every_notebook_has_a_gpu_profile_that_judges_on_cuda(name):
    """Issue 22: each notebook runs at its paper's scale on one GPU (`gpu`), verdicts on, device CUDA."""
    from workbench.report import load_profile

    gpu = load_profile(name, "gpu", ROOT / "notebooks")
    assert gpu.get("device") == "cuda", f"notebooks/profiles/{name}.yaml: the gpu profile sets device: cuda"
    assert gpu.get("verdicts") is True, f"notebooks/profiles/{name}.yaml: the gpu profile sets verdicts: true"
    paper = load_profile(name, "paper", ROOT / "notebooks")
    assert not set(paper) - set(gpu) - {"threads", "device"}, (
        f"notebooks/profiles/{name}.yaml: the gpu profile leaves {sorted(set(paper) - set(gpu))} at the notebook's "
        "toy defaults where the paper profile sets them; give each a gpu value")


@pytest.mark.parametrize("name", NOTEBOOK_NAMES)
def test_notebook_cells_stay_thin(name):
    _, *rest = _code_cells(name)
    lengths = [len(c.source.splitlines()) for c in rest]
    assert max(lengths) <= MAX_CELL_LINES, f"{name}: a code cell of {max(lengths)} lines (at most {MAX_CELL_LINES})"
    assert sum(lengths) <= MAX_NOTEBOOK_CODE_LINES, (
        f"{name}: {sum(lengths)} code lines outside the parameters cell (at most {MAX_NOTEBOOK_CODE_LINES})")
    ledger_cells = [c.source for c in rest if "claims.ledger(" in c.source]
    assert len(ledger_cells) == 1 and "Ledger(" not in "\n".join(c.source for c in rest), (
        f"{name}: the ledger comes from one claims.ledger(...) call, never built in a cell")


PACKAGES = ("workbench", "workbench.models", "workbench.data", "workbench.optim", "workbench.checkpoint",
            "workbench.calcgraph", "workbench.vbs", "workbench.measure", "workbench.report")


# Names a torch function also has, kept on purpose: the issue that fixed the API named them.
TORCH_NAMES_KEPT = {
    "load",  # workbench.data.load(name, n_train, n_test): datasets by name (torch.load reads a file)
    "split",  # workbench.optim.split(x, dtype=..., extra_bits=...): fp32 values into 16-bit values + extra bits
}


@pytest.mark.parametrize("package", PACKAGES)
def test_public_names_shadow_no_builtin_or_torch_name(package):
    import builtins

    import torch

    module = importlib.import_module(package)
    public = set(getattr(module, "__all__", ()))
    clashes = sorted(n for n in public if hasattr(builtins, n) or (hasattr(torch, n) and n not in TORCH_NAMES_KEPT))
    assert not clashes, f"{package} exports names that shadow builtins or torch: {clashes}"


def test_profile_means_a_parameter_set_only():
    import workbench.vbs as vbs

    assert not hasattr(vbs, "profile") and callable(vbs.measure_layers)
    import workbench.calcgraph as calcgraph

    assert not hasattr(calcgraph, "compile") and callable(calcgraph.plan_training)
