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


# ---------------------------------------------------------------------------------------------
# The import graph (issue 42; DESIGN.md, "The layout test"): every `import` and `from ... import` in
# workbench/, at module level, inside functions and under `if TYPE_CHECKING:` alike, resolved to the module
# of workbench/ it names (`from .x import y` names the submodule x.y where there is one, else x).

# Layers, lowest first: a module imports modules of its own layer and of the layers its entry lists, never
# one above (the no-upward rule). `report` and `gpu` sit below the notebooks' experiments: they run
# notebooks (papermill, subprocesses) but import none of their code. The command line sits on top.
LAYERS = {
    "spine": ("workbench", "workbench.devices", "workbench.measure", "workbench.measure_args", "workbench.allocator",
              "workbench.timing", "workbench.kineto", "workbench.part_output", "workbench.inplace",
              "workbench.dtype_probe"),
    "techniques": ("workbench.models", "workbench.data", "workbench.optim", "workbench.checkpoint",
                   "workbench.train", "workbench.calcgraph", "workbench.vbs", "workbench.advisor"),
    "report": ("workbench.report",),
    "gpu": ("workbench.gpu",),
    "experiments": ("workbench.experiments",),
    "command": ("workbench.cli", "workbench.__main__", "workbench.lab_setup"),
}
MAY_IMPORT = {
    "spine": {"spine"},
    "techniques": {"spine", "techniques"},
    "report": {"spine", "techniques", "report"},
    "gpu": {"spine", "techniques", "report", "gpu"},
    "experiments": {"spine", "techniques", "report", "experiments"},
    "command": set(LAYERS),
}


def _module_name(path):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph():
    """{module: {module it imports: the line of the first such import}} over workbench/, module -> path, and the
    relative imports that name no module."""
    paths = {_module_name(p): p for p in sorted((ROOT / "workbench").rglob("*.py"))}
    missing = []

    def ours(name):  # the longest prefix of `name` that is a module of workbench/, else None
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in paths.items():
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        edges = graph[module] = {}
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
                if node.level and base not in paths:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {base}, which is no module")
            else:
                continue
            for target in filter(None, map(ours, targets)):
                if target != module:
                    edges.setdefault(target, node.lineno)
    return graph, paths, missing


def _circles(graph):
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    order, low, stack, on_stack, found, counter = {}, {}, [], set(), [], 0
    for start in graph:
        if start in order:
            continue
        work = [(start, iter(graph[start]))]
        order[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in order:
                    order[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], order[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == order[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _layer(module):
    matches = [(len(prefix), layer) for layer, prefixes in LAYERS.items() for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1] if matches else None


def test_every_module_of_workbench_has_a_layer_and_every_relative_import_a_module():
    graph, paths, missing = _import_graph()
    assert not [m for m in graph if _layer(m) is None], "add these modules to LAYERS in tests/test_layout.py"
    assert not missing, "\n".join(missing)  # a module moved without its importers updated


def test_no_module_imports_one_that_imports_it_back():
    """The no-circle rule: following imports from any module of workbench/ never leads back to it."""
    graph, paths, _ = _import_graph()
    shown = []
    for component in _circles(graph):
        members = set(component)
        lines = [f"  {paths[a].relative_to(ROOT)}:{graph[a][b]} imports {paths[b].relative_to(ROOT)}"
                 for a in component for b in sorted(graph[a]) if b in members]
        shown.append("a circle of " + ", ".join(str(paths[m].relative_to(ROOT)) for m in component) + ":\n"
                     + "\n".join(lines))
    assert not shown, "modules that import each other (cut the edge that points back):\n" + "\n".join(shown)


def test_no_upward_import():
    """The no-upward rule: a module imports only its own layer and the layers MAY_IMPORT lists for it."""
    graph, paths, _ = _import_graph()
    upward = [f"{paths[a].relative_to(ROOT)}:{line} ({_layer(a)}) imports {paths[b].relative_to(ROOT)} ({_layer(b)})"
              for a in sorted(graph) for b, line in sorted(graph[a].items())
              if _layer(a) and _layer(b) and _layer(b) not in MAY_IMPORT[_layer(a)]]
    assert not upward, ("upward imports (move the code down, or run the upper module as a process):\n"
                        + "\n".join(upward))
