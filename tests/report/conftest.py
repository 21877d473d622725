import matplotlib
import pytest
from runner_cases import FakeExecutor, write_notebook

from workbench import report

matplotlib.use("Agg")


@pytest.fixture
def notebooks(tmp_path):
    """A notebook folder with one notebook, `good` (parameters value, rate, flag, label), and its profiles."""
    folder = tmp_path / "notebooks"
    (folder / "profiles").mkdir(parents=True)
    write_notebook(folder, "good")
    (folder / "profiles" / "good.yaml").write_text("smoke:\n  value: 2\ncpu:\n  value: 3\n")
    return folder


@pytest.fixture
def fake(monkeypatch):
    """papermill's executor replaced by a FakeExecutor (its calls listed), HTML export by a stub."""
    import papermill

    executor = FakeExecutor()
    monkeypatch.setattr(papermill, "execute_notebook", executor)
    monkeypatch.setattr(report.runner, "_export_html", lambda nb: nb.with_suffix(".html").write_text("<html></html>"))
    return executor
