"""Report runner faults from issue 35: what a build may delete, and how it stops.

Each test is one finding of the issue's probe battery; each failed on 012f1da. A rebuild deletes a report only
when what replaces it proves it replaced (`folders.report_state`), recovers a hidden report whatever process
now has the id of the build that hid it, counts as its own only the figures a pre-marker report listed, and
an interrupt is never lost, even one raised where Python swallows exceptions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from probe_cases import make_notebooks, run_cli, use_fake

from workbench.report import build_reports
from workbench.report.folders import MARKER


@pytest.fixture
def notebooks(tmp_path):
    return make_notebooks(tmp_path)


@pytest.fixture
def fake(monkeypatch):
    return use_fake(monkeypatch)


def _build(notebooks, out, **kwargs):
    return build_reports(["good"], profile="smoke", out_dir=out, notebooks=notebooks, progress=False, **kwargs)


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_damaged_run_json_does_not_let_a_failed_rebuild_delete_the_report(notebooks, tmp_path, fake):
    out = tmp_path / "reports"
    _build(notebooks, out)
    good = out / "smoke" / "good"
    (good / "run.json").write_text('{"status": "ok", "na')  # damaged: the report may still be a good one
    before = _tree(good)
    results = _build(notebooks, out, overrides={"value": "-1"})
    assert results.status.tolist() == ["failed"] and results.kept_previous.tolist() == [True]
    assert {k: v for k, v in _tree(good).items() if not k.startswith("failed-run/")} == before
    assert json.loads((good / "failed-run" / "run.json").read_text())["status"] == "failed"


def test_a_hidden_report_whose_process_id_is_reused_is_restored_not_deleted(notebooks, tmp_path, fake):
    out = tmp_path / "reports"
    _build(notebooks, out)
    good = out / "smoke" / "good"
    before = _tree(good)
    other = subprocess.Popen(["sleep", "60"])  # a live process that now has the dead build's id
    try:
        os.replace(good, out / "smoke" / f".old-good-{other.pid}-0badc0de")  # the build died between renames
        failed = _build(notebooks, out, overrides={"value": "-1"})
        assert failed.kept_previous.tolist() == [True]
    finally:
        other.kill()
        other.wait()
    _build(notebooks, out, overrides={"value": "-1"})  # the process is gone: the next build
    assert {k: v for k, v in _tree(good).items() if not k.startswith("failed-run/")} == before
    assert not [p for p in (out / "smoke").iterdir() if p.name.startswith(".")]


def test_a_picture_of_yours_in_a_report_from_before_the_marker_is_refused_not_deleted(notebooks, tmp_path, fake,
                                                                                      capsys):
    out = tmp_path / "reports"
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 0
    good = out / "smoke" / "good"
    (good / MARKER).unlink()  # a report an older runner wrote
    (good / "holiday.png").write_bytes(b"\x89PNG mine")
    capsys.readouterr()
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 2
    assert "holiday.png, which workbench report did not make" in capsys.readouterr().err
    assert (good / "holiday.png").read_bytes() == b"\x89PNG mine"
    (good / "holiday.png").unlink()
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 0  # its own figures are still its own


class _SwallowsInterrupt:
    """Sends SIGINT from a destructor: Python runs the handler there and prints "Exception ignored in"
    instead of raising, the window where a Ctrl-C while the kernel's client was torn down went unseen."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # bytecode after the kill, so the handler runs inside this destructor
            pass


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler while the test runs, as in a terminal: Python keeps SIGINT ignored where the
    process that started it ignored it (a shell's background job: `.ci/run ... &` failed here)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the swallowed interrupt
def test_an_interrupt_swallowed_by_a_destructor_still_stops_the_build(notebooks, tmp_path, fake, capsys,
                                                                     python_sigint):
    real_call = fake.__class__.__call__

    def interrupted(self, *args, **kwargs):
        real_call(self, *args, **kwargs)
        _SwallowsInterrupt()  # collected at once: the interrupt is raised, and lost, in its __del__

    fake.__class__.__call__ = interrupted
    try:
        code = run_cli(notebooks, tmp_path / "reports", "good", "--profile", "smoke")
    finally:
        fake.__class__.__call__ = real_call
    assert code == 130, "the build went on after Ctrl-C"
    assert "interrupted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ------------------------------------------------------------------ found by tests/probes/explore.py


@pytest.mark.parametrize("marker", ["{", '{"files": "run.json"}', ""])
def test_a_damaged_marker_leaves_the_report_the_runners(notebooks, tmp_path, fake, capsys, marker):
    """A damaged marker was refused as a file "workbench report did not make" (its own marker); the report
    is judged as one from before the marker: its run.json and the figures its results.json lists."""
    out = tmp_path / "reports"
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 0
    (out / "smoke" / "good" / MARKER).write_text(marker)
    capsys.readouterr()
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 0, capsys.readouterr().err
    assert json.loads((out / "smoke" / "good" / MARKER).read_text())["files"]
