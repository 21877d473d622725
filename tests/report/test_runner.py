import json
import math

import nbformat
import pandas as pd
import pytest

from workbench import report
from workbench.cli import main
from workbench.report import Ledger, UsageError, at_least, at_most, build_reports, save_results, within


def test_rules_compute_verdicts_from_numbers():
    rule = at_least(3.5, partly=2.0, refuted=1.0)
    assert [rule.verdict(v) for v in (3.5, 2.0, 1.5, 0.5)] == [
        "reproduced", "partly", "not reproduced", "refuted"]
    assert rule.verdict(None) == rule.verdict(math.nan) == "not run at this scale"
    assert at_most(0.35, partly=0.5).verdict(0.4) == "partly"
    assert at_most(0.35).verdict(0.36) == "not reproduced"
    assert within(0.15, rel=0.5, partly_rel=1.0).verdict(0.29) == "partly"
    assert "refuted if < 1" in rule.describe()
    with pytest.raises(ValueError, match="partly"):
        at_least(1.0, partly=2.0)


def test_ledger_and_save_results(tmp_path):
    import matplotlib.pyplot as plt

    ledger = Ledger()
    ledger.add("x is large", paper=4, measured=5, unit="x", scale="tiny", device="cpu", rule=at_least(4))
    with pytest.raises(TypeError, match="rule"):
        ledger.add("bad", paper=1, measured=1, unit="", scale="", device="", rule="reproduced")
    fig, ax = plt.subplots()
    ax.plot([1, 2])
    path = save_results("demo", output_dir=tmp_path, parameters={"n": 1},
                        records={"r": pd.DataFrame({"a": [1.0, float("nan")]})}, ledger=ledger,
                        figures={"f": fig})
    data = json.loads(path.read_text())
    assert data["claims"][0]["verdict"] == "reproduced"
    assert data["records"]["r"] == [{"a": 1.0}, {"a": None}]
    assert data["figures"] == ["f.png"] and (tmp_path / "f.png").exists()
    assert data["environment"]["torch"]


def _notebook(folder, name, body):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("value = 1\ninteractive = True\noutput_dir = ''",
                                  metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(body),
    ]
    nb.metadata["kernelspec"] = {"name": "workbench", "display_name": "Workbench", "language": "python"}
    nbformat.write(nb, folder / f"{name}.ipynb")


GOOD = """
import gc
from workbench.report import Ledger, at_least, save_results
assert gc.get_freeze_count() == 0, "a notebook of the user's own runs in a kernel as JupyterLab starts it"
assert not get_ipython().history_manager.enabled, 'the workbench kernel must not keep IPython history'
ledger = Ledger()
ledger.add('value is at least 1', paper=1, measured=value, unit='', scale='', device='cpu', rule=at_least(1))
save_results('good', output_dir=output_dir, parameters={'value': value}, records={}, ledger=ledger)
"""


@pytest.fixture
def notebooks(tmp_path):
    folder = tmp_path / "notebooks"
    (folder / "profiles").mkdir(parents=True)
    _notebook(folder, "good", GOOD)
    _notebook(folder, "bad", "raise RuntimeError('boom ' + str(value))")
    (folder / "profiles" / "good.yaml").write_text("smoke:\n  value: 2\n")
    return folder


def test_build_keeps_going_after_a_failure_and_indexes_both(notebooks, tmp_path, capfd):
    out = tmp_path / "reports"
    results = build_reports(profile="smoke", out_dir=out, notebooks=notebooks, progress=False)
    assert dict(zip(results.name, results.status, strict=True)) == {"bad": "failed", "good": "ok"}
    assert "RuntimeError: boom 1" in results.set_index("name").error["bad"]
    good = json.loads((out / "smoke" / "good" / "results.json").read_text())
    assert good["parameters"] == {"value": 2} and good["claims"][0]["verdict"] == "reproduced"
    assert (out / "smoke" / "good" / "good.html").exists() and (out / "smoke" / "bad" / "bad.ipynb").exists()
    index = (out / "smoke" / "index.html").read_text()
    assert "boom 1" in index and "value is at least 1" in index and "1 reproduced" in index
    assert 'href="smoke/index.html#good"' in (out / "index.html").read_text()
    assert not list((out / "smoke").glob(".staging-*"))
    # the kernel's own log lines read like failures in a build log: none reach the terminal
    printed = "".join(capfd.readouterr())
    assert "without encryption" not in printed and "KeyboardInterrupt" not in printed


def test_a_report_kernel_starts_with_its_experiments_imported_and_frozen(tmp_path):
    """`runner.freeze_imports` runs in the kernel before a notebook named after an experiments package: the
    collector no longer walks the imports' objects (each `gc.collect()` of the measuring code walked them all),
    and the notebook's namespace gets no name of it."""
    folder = tmp_path / "notebooks"
    folder.mkdir()
    _notebook(folder, "tour", "import gc, sys\n"
                              "assert gc.get_freeze_count() > 100_000, gc.get_freeze_count()\n"
                              "assert 'workbench.experiments.tour' in sys.modules and 'torch._dynamo' in sys.modules\n"
                              "assert not {'freeze_imports', 'importlib', 'atexit'} & set(globals())")
    results = build_reports(profile="smoke", out_dir=tmp_path / "reports", notebooks=folder, progress=False)
    assert results.status.tolist() == ["ok"], results.error.tolist()


def test_interrupted_build_leaves_the_previous_report_whole(notebooks, tmp_path, monkeypatch):
    import papermill

    out = tmp_path / "reports"
    build_reports(["good"], profile="smoke", out_dir=out, notebooks=notebooks, progress=False)
    before = (out / "smoke" / "good" / "results.json").read_text()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(papermill, "execute_notebook", interrupted)
    with pytest.raises(KeyboardInterrupt):
        build_reports(["good"], profile="smoke", out_dir=out, notebooks=notebooks, progress=False)
    assert (out / "smoke" / "good" / "results.json").read_text() == before
    assert not list((out / "smoke").glob(".staging-*"))


def test_bad_input_is_refused_before_running(notebooks, tmp_path, capsys):
    out = str(tmp_path / "reports")
    with pytest.raises(UsageError, match="choose from bad, good"):
        build_reports(["nope"], out_dir=out, notebooks=notebooks)
    assert main(["report", "nope", "--notebooks", str(notebooks), "--out", out]) == 2
    assert "unknown notebook(s) nope; choose from bad, good" in capsys.readouterr().err
    assert main(["report", "good", "-p", "epochs=3", "--notebooks", str(notebooks), "--out", out]) == 2
    assert "declares no parameter epochs; its parameters are interactive, output_dir, value" in (
        capsys.readouterr().err)
    assert main(["report", "good", "-p", "value=2", "-p", "value=3", "--notebooks", str(notebooks), "--out", out]) == 2
    assert "-p value given more than once" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--profile", "huge"])
    assert exit_info.value.code == 2
    assert "choose from 'smoke', 'cpu', 'gpu', 'paper'" in capsys.readouterr().err
    with pytest.raises(UsageError, match="unknown profile"):
        report.load_profile("good", "huge", notebooks)
    assert not (tmp_path / "reports" / "smoke").exists()


def test_cli_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in ("report", "kernel", "list"))


def test_kernel_install_and_module_entry_point(tmp_path, monkeypatch, capsys):
    import json as _json
    import subprocess
    import sys

    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path))
    assert main(["kernel", "install", "--user"]) == 0
    spec = _json.loads((tmp_path / "kernels" / "workbench" / "kernel.json").read_text())
    assert spec["argv"][:3] == ["python", "-m", "ipykernel_launcher"]
    assert "--HistoryManager.enabled=False" in spec["argv"]  # injected parameters stay out of the history
    done = subprocess.run([sys.executable, "-m", "workbench", "--help"], capture_output=True, text=True,
                          check=True)
    assert "report" in done.stdout


def test_kernelspec_path_is_added_once(notebooks, tmp_path, monkeypatch):
    import os

    import papermill

    from workbench.devices import repo_root

    def fake_execute(source, executed, parameters, **kwargs):
        nbformat.write(nbformat.read(source, as_version=4), executed)

    monkeypatch.setattr(papermill, "execute_notebook", fake_execute)
    monkeypatch.setenv("JUPYTER_PATH", "/elsewhere")
    for _ in range(2):
        build_reports(["good"], profile="smoke", out_dir=tmp_path / "r", notebooks=notebooks, progress=False)
    assert os.environ["JUPYTER_PATH"].split(os.pathsep) == [str(repo_root()), "/elsewhere"]


def test_capture_parameters_keeps_the_literals_a_parameters_cell_defines():
    from workbench.report import capture_parameters

    namespace = {"batch": 8, "lr": 1e-3, "formats": ["fp32", "bf16+8"], "amp": True, "device": "", "none": None,
                 "_private": 1, "In": ["x"], "Out": {}, "get_ipython": print, "torch": pytest, "exit": 0,
                 "output_dir": "/tmp/staging"}
    assert capture_parameters(namespace) == {"batch": 8, "lr": 1e-3, "formats": ["fp32", "bf16+8"], "amp": True,
                                             "device": "", "none": None}
