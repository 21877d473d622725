"""The index pages list notebooks run in JupyterLab (reports/interactive/<name>/) at once, with their
parameters and the time they were saved."""

import json
import re

import pandas as pd

from workbench.report import Ledger, at_least, save_results


def _clone(tmp_path, monkeypatch):
    repo = tmp_path / "my-clone"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    monkeypatch.chdir(repo / "notebooks")  # Jupyter starts the kernel in the notebook's folder
    return repo


def test_a_jupyterlab_run_is_listed_with_its_parameters_and_time(tmp_path, monkeypatch, capsys):
    repo = _clone(tmp_path, monkeypatch)
    ledger = Ledger(verdicts=False)
    ledger.add("x is large", paper=4, measured=5, unit="x", scale="tiny", device="cpu", rule=at_least(4))
    path = save_results("tour", output_dir="", parameters={"batch_size": 4, "stem": "cifar"},
                        records={"r": pd.DataFrame({"a": [1]})}, ledger=ledger)
    saved = json.loads(path.read_text())["saved"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", saved)
    reports = repo / "reports"
    assert f"listed in {reports / 'index.html'}" in capsys.readouterr().out
    top = (reports / "index.html").read_text()  # written by save_results itself, no build needed
    assert 'href="interactive/index.html#tour"' in top and saved in top and "2 parameters" in top
    page = (reports / "interactive" / "index.html").read_text()
    assert f"Run in JupyterLab, saved {saved}" in page
    assert "batch_size=4 stem=&quot;cifar&quot;" in page and "x is large" in page
    assert "each run replaces the notebook&#x27;s previous one" in page


def test_a_page_that_is_not_ours_is_left_alone_and_the_run_still_saved(tmp_path, monkeypatch, capsys):
    repo = _clone(tmp_path, monkeypatch)
    (repo / "reports").mkdir()
    (repo / "reports" / "index.html").write_text("<html>my notes</html>")
    path = save_results("tour", output_dir="", parameters={}, records={}, ledger=Ledger())
    assert path.is_file()
    assert "the index was not updated" in capsys.readouterr().err
    assert (repo / "reports" / "index.html").read_text() == "<html>my notes</html>"
