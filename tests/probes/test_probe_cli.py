"""Command-line arguments from issue 35: refused by the parser (exit status 2) naming the value and what is
expected, before any notebook is planned or run."""

from __future__ import annotations

import pytest
from probe_cases import make_notebooks, run_cli, use_fake


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
