"""Command-line arguments from issue 35: refused by the parser (exit status 2) naming the value and what is
expected, before any notebook is planned or run."""

from __future__ import annotations

import pytest
from probe_cases import make_notebooks, run_cli, use_fake

from workbench.cli import main
from workbench.report import UsageError, build_reports


@pytest.fixture
def notebooks(tmp_path):
    return make_notebooks(tmp_path)


@pytest.fixture
def fake(monkeypatch):
    return use_fake(monkeypatch)


def test_a_scheduler_scheme_whose_backend_cannot_run_is_refused_before_any_work(notebooks, tmp_path, fake, capsys):
    """distributed lists `ucx` without the package that implements it: the build planned, then crashed in
    Client() with TypeError (and spent 20 s more closing that client)."""
    with pytest.raises(SystemExit) as info:
        run_cli(notebooks, tmp_path / "r", "good", "--profile", "smoke", "--scheduler", "ucx://127.0.0.1:8786")
    err = capsys.readouterr().err
    assert info.value.code == 2 and not fake.calls and not (tmp_path / "r").exists()
    assert "scheduler='ucx://127.0.0.1:8786': the 'ucx' scheme cannot be used here" in err
    assert "give the scheduler's address as [tcp://]HOST:PORT" in err


# ------------------------------------------------------------------ found by tests/probes/explore.py


@pytest.mark.parametrize("name, shown", [("", "''"), ("   ", "'   '"), (".", "'.'")])
def test_an_invisible_notebook_name_is_shown_quoted(notebooks, tmp_path, fake, capsys, name, shown):
    """`unknown notebook(s) ; choose from good` named nothing a reader could see."""
    assert run_cli(notebooks, tmp_path / "r", name, "--profile", "smoke") == 2
    assert f"unknown notebook(s) {shown}; choose from good" in capsys.readouterr().err
    assert not fake.calls


@pytest.mark.parametrize("option", ["--out", "--notebooks"])
def test_a_folder_with_a_nul_byte_is_refused_not_a_traceback(notebooks, tmp_path, fake, capsys, option):
    args = {"--out": str(tmp_path / "r"), "--notebooks": str(notebooks), option: str(tmp_path / "a\0b")}
    with pytest.raises(SystemExit) as info:
        main(["report", "--out", args["--out"], "--notebooks", args["--notebooks"], "good", "--profile", "smoke"])
    assert info.value.code == 2 and "holds a NUL byte, which no path can hold" in capsys.readouterr().err
    with pytest.raises(UsageError, match="holds a NUL byte"):
        build_reports(["good"], profile="smoke", out_dir=tmp_path / "a\0b", notebooks=notebooks, progress=False)
    assert not fake.calls


def test_an_out_folder_whose_name_is_too_long_is_refused_with_status_2(notebooks, tmp_path, fake, capsys):
    """It ended in exit status 1 ("File name too long"), as if a notebook had failed."""
    out = tmp_path / ("x" * 300)
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 2
    assert f"out_dir={str(out)!r}: File name too long" in capsys.readouterr().err
    assert not fake.calls
