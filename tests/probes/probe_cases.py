"""Shared by the probe tests (issue 35): a notebook folder and papermill's fake executor from
tests/report/runner_cases.py, a bounded wait, and a child Python process with a short timeout.

Not collected by pytest (no `test_` prefix); each probe file imports what it needs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "report"))

from runner_cases import FakeExecutor, run_cli, write_notebook  # noqa: E402

__all__ = ["FakeExecutor", "run_cli", "write_notebook", "make_notebooks", "use_fake", "within", "python",
           "refused"]


def make_notebooks(tmp_path: Path) -> Path:
    """A notebook folder holding `good` (parameters value, rate, flag, label) and its profiles."""
    folder = tmp_path / "notebooks"
    (folder / "profiles").mkdir(parents=True)
    write_notebook(folder, "good")
    (folder / "profiles" / "good.yaml").write_text("smoke:\n  value: 2\ncpu:\n  value: 3\n")
    return folder


def use_fake(monkeypatch) -> FakeExecutor:
    """papermill's executor replaced by a FakeExecutor, HTML export by a stub (as tests/report/conftest.py)."""
    import matplotlib
    import papermill

    from workbench.report import runner

    matplotlib.use("Agg")
    executor = FakeExecutor()
    monkeypatch.setattr(papermill, "execute_notebook", executor)
    monkeypatch.setattr(runner, "_export_html", lambda nb: nb.with_suffix(".html").write_text("<html></html>"))
    return executor


def within(seconds: float, fn):
    """fn()'s result (or the exception it raised, re-raised), failing the test instead of hanging it."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds} s (a hang)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def python(code: str, *, timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`code` run by a child Python importing the workbench this test imports (a crash stays in the child)."""
    import workbench

    tested = str(Path(workbench.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tested, os.environ.get("PYTHONPATH", "")])}
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the child process still ran after {timeout} s (a hang)")


def refused(call, needles, types=(ValueError, TypeError)) -> str:
    """The error `call()` raises (one of `types`): its message names every one of `needles`, and is no traceback."""
    with pytest.raises(types) as info:
        call()
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert "\n" not in message.strip() or "Traceback" not in message, message
    return message
