"""Every notebook runs through the report runner at the smoke profile, is committed stripped, and stays
clean under the nbstripout git filter that `make` installs."""

import asyncio
import importlib
import json
import logging
import re
import shutil
import subprocess
from types import SimpleNamespace

import nbformat
import pandas as pd
import pytest

from tests.report.page_checks import dead_links, raw_numbers
from workbench import lab_setup
from workbench.devices import repo_root
from workbench.report import RESERVED, available_notebooks, build_reports, load_profile

ROOT = repo_root()
NOTEBOOKS = ROOT / "notebooks"


@pytest.mark.parametrize("name", available_notebooks(NOTEBOOKS))
def test_notebook_is_stripped_and_declares_parameters(name):
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", []), "first code cell must be tagged"
    assert "interactive = True" in code[0].source and "output_dir" in code[0].source
    assert all(not c.outputs and c.execution_count is None for c in code), "outputs not stripped"
    assert nb.metadata["kernelspec"]["name"] == "workbench"
    for profile in ("smoke", "cpu", "paper"):
        assert not set(load_profile(name, profile, NOTEBOOKS)) & set(RESERVED)


def _hooks_recipe() -> str:
    """The shell commands of `make hooks` (printed by make, not run in this checkout)."""
    done = subprocess.run(["make", "-s", "-n", "-o", ".venv/.installed", "hooks"], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return done.stdout


def _clean_command() -> str:
    """The git clean filter `make hooks` configures, as a shell command (reads stdin, writes stdout)."""
    return re.search(r"git config filter\.nbstripout\.clean '([^']+)'", _hooks_recipe()).group(1)


def _as_jupyterlab_saves_it(nb):
    """What JupyterLab adds on save: outputs and counts, the kernel's language_info, widget state, the
    view state of cells (hidden input/outputs, scrolled, collapsed), execution timing and trust."""
    nb.metadata["language_info"] = {
        "codemirror_mode": {"name": "ipython", "version": 3}, "file_extension": ".py", "mimetype": "text/x-python",
        "name": "python", "nbconvert_exporter": "python", "pygments_lexer": "ipython3", "version": "3.11.9"}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {
        "state": {"a1": {"model_name": "IntSliderModel", "state": {"value": 4}}}, "version_major": 2,
        "version_minor": 0}}
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = i + 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"output {i}\n")]
        cell.metadata.update({"scrolled": True, "collapsed": False, "trusted": True,
                              "jupyter": {"source_hidden": i == 2, "outputs_hidden": False},
                              "execution": {"iopub.status.busy": "2025-01-01T00:00:00.000Z"}})
    return nb


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make to read the configured filter")
def test_notebooks_saved_by_jupyterlab_come_out_of_the_filter_as_committed(tmp_path):
    """The clean filter `make` configures rewrites nothing in a committed notebook, and turns each notebook as
    JupyterLab saves it back into the committed file: `git diff` stays empty, `git add` stages nothing.
    (One run of the command over copies of every notebook; git pipes one file through it the same way.)"""
    names = available_notebooks(NOTEBOOKS)
    for name in names:
        shutil.copy(NOTEBOOKS / f"{name}.ipynb", tmp_path / f"{name}.ipynb")
        saved = _as_jupyterlab_saves_it(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4))
        nbformat.write(saved, tmp_path / f"{name}.saved.ipynb")
    assert "language_info" in (tmp_path / f"{names[0]}.saved.ipynb").read_text()
    subprocess.run(["bash", "-c", _clean_command() + ' "$@"', "clean", *map(str, sorted(tmp_path.iterdir()))],
                   capture_output=True, check=True)
    for name in names:
        committed = (NOTEBOOKS / f"{name}.ipynb").read_bytes()
        assert (tmp_path / f"{name}.ipynb").read_bytes() == committed, (
            f"the filter would rewrite {name}.ipynb: write it with nbformat.write, without language_info")
        assert (tmp_path / f"{name}.saved.ipynb").read_bytes() == committed, f"{name}: JupyterLab's save shows in git"


def _jupyterlab_contents(root, prefix):
    """The contents manager JupyterLab saves through, with the server extensions `make hooks` enabled under the
    environment `prefix` loaded as jupyter_server loads them."""
    from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

    manager = AsyncLargeFileManager(root_dir=str(root))
    config = json.loads((prefix / lab_setup.SERVER_CONFIG).read_text())
    app = SimpleNamespace(contents_manager=manager, log=logging.getLogger("jupyter_server"))
    for module, enabled in config["ServerApp"]["jpserver_extensions"].items():
        if enabled:
            for point in importlib.import_module(module)._jupyter_server_extension_points():
                importlib.import_module(point["module"])._load_jupyter_server_extension(app)
    return manager


@pytest.mark.skipif(shutil.which("git") is None or shutil.which("make") is None, reason="needs git and make")
def test_notebook_saved_by_jupyterlab_keeps_git_status_clean(tmp_path):
    """git trusts a changed size without running the clean filter, so a notebook saved with outputs (larger
    than the stripped one checked out) is listed by `git status` though its filtered content is unchanged;
    the save hook `make hooks` installs for JupyterLab has git read it through the filter. A real change
    still shows, and nothing is ever staged."""
    repo, prefix = tmp_path / "clone", tmp_path / "venv"
    (repo / "notebooks").mkdir(parents=True)
    prefix.mkdir()
    for name in (".gitattributes", ".gitignore"):
        shutil.copy(ROOT / name, repo / name)
    shutil.copy(NOTEBOOKS / "tour.ipynb", repo / "notebooks" / "tour.ipynb")

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo,
                              capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "stripped")
    recipe = _hooks_recipe()
    venv = f'--prefix "{ROOT / ".venv"}"'
    assert "-m workbench.lab_setup install " + venv in recipe
    subprocess.run(["bash", "-c", recipe.replace(venv, f'--prefix "{prefix}"')], cwd=repo, check=True)
    assert "nbstripout --keep-id" in git("config", "filter.nbstripout.clean")
    saved = _as_jupyterlab_saves_it(nbformat.read(repo / "notebooks" / "tour.ipynb", as_version=4))
    # Written without the hook: git lists the notebook on its size alone (git's rule; the filter does not run).
    nbformat.write(saved, repo / "notebooks" / "tour.ipynb")
    assert git("status", "--porcelain") == " M notebooks/tour.ipynb\n"
    # Saved through JupyterLab's contents manager, as Ctrl+S does: clean.
    contents = _jupyterlab_contents(repo, prefix)
    model = {"type": "notebook", "format": "json", "content": json.loads(nbformat.writes(saved))}
    asyncio.run(contents.save(model, "notebooks/tour.ipynb"))
    assert "output 0" in (repo / "notebooks" / "tour.ipynb").read_text()  # outputs stay on disk
    assert git("status", "--porcelain") == "" and git("diff", "--cached") == ""
    # A change to a cell's source is a change: still listed.
    saved.cells[-1].source += "\n# edited"
    model["content"] = json.loads(nbformat.writes(saved))
    asyncio.run(contents.save(model, "notebooks/tour.ipynb"))
    assert git("status", "--porcelain") == " M notebooks/tour.ipynb\n"
    committed = git("show", "HEAD:notebooks/tour.ipynb")
    assert "output 0" not in committed and "language_info" not in committed and "widget-state" not in committed
    overrides = json.loads((prefix / lab_setup.LAB_OVERRIDES).read_text())
    assert overrides == {"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": True},
                         "@jupyterlab/apputils-extension:kernels-settings": {"commsOverSubshells": "disabled"}}


def test_every_notebook_builds_at_smoke(tmp_path, monkeypatch):
    # One intra-op thread in the kernels (they inherit the variable), as in the test process (conftest): every
    # cell still runs; at smoke sizes OpenMP's spinning threads cost more than they share (efficient_densenet's
    # smoke build 107 s at torch's default of 2 threads, 25 s at 1, on 2 cores at load 5).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "reports"
    results = build_reports(profile="smoke", out_dir=out, progress=False)
    failures = results[results.status != "ok"]
    assert failures.empty, failures.to_string()
    for name in results.name:
        data = json.loads((out / "smoke" / name / "results.json").read_text())
        assert data["claims"], f"{name} recorded no claims"
        assert all(c["verdict"] for c in data["claims"])
        # Toy scales give no verdicts: at smoke every paper claim reads "not run (at this scale)".
        judged = [c["claim"] for c in data["claims"]
                  if c.get("source") == "paper" and c["verdict"] not in ("not run at this scale", "not run")]
        assert not judged, f"{name} judges paper claims at smoke: {judged}"
        _rejudge(name, data)
    assert (out / "index.html").exists() and (out / "smoke" / "index.html").exists()
    # What a reader meets on the pages: every local link leads somewhere, no table cell shows NaN or inf raw
    # (a notebook shows its tables through workbench.report.table, which shows them as —).
    pages = [out / "index.html", out / "smoke" / "index.html", *(out / "smoke" / n / f"{n}.html" for n in results.name)]
    dead = {str(p.relative_to(out)): dead_links(p) for p in pages if dead_links(p)}
    assert not dead, dead
    raw = {p.stem: raw_numbers(p)[:3] for p in pages if raw_numbers(p)}
    assert not raw, raw


def _rejudge(name, data):
    """results.json alone re-judges the notebook: its claims read only saved records and parameters, and
    the rows (with verdicts on, as at the cpu profile) come out for every claim without error."""
    claims = importlib.import_module(f"workbench.experiments.{name}.claims")
    records = {k: pd.DataFrame(v) for k, v in data["records"].items()}
    env = data["environment"]
    again = claims.ledger(records, data["parameters"], device=env["device_name"], device_class="cpu", verdicts=False)
    assert [r["claim"] for r in again.rows] == [c["claim"] for c in data["claims"]]
    assert [r["verdict"] for r in again.rows] == [c["verdict"] for c in data["claims"]]
    judged = claims.ledger(records, data["parameters"], device=env["device_name"], device_class="cpu", verdicts=True)
    assert len(judged.rows) == len(claims.CLAIMS)
