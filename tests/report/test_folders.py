"""The output folder: a build that dies between its two renames loses nothing, the runner replaces only
what it made (marker files) and refuses the rest, and its lock never follows a link."""

import json
import os
import shutil

import pytest
from runner_cases import run_cli

from workbench import report
from workbench.report import UsageError, build_reports, write_index
from workbench.report.folders import MARKER, foreign_entries, locked


def _build(notebooks, out, **kwargs):
    return build_reports(["good"], profile="smoke", out_dir=out, notebooks=notebooks, progress=False, **kwargs)


def _tree(folder):
    """Every file under `folder` (the build lock aside) and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


# ---------------------------------------------------------------------------------------------
# A crash between the two renames


def test_a_build_that_died_between_its_renames_gets_its_last_good_report_back(notebooks, tmp_path, fake,
                                                                              monkeypatch):
    out = tmp_path / "reports"
    _build(notebooks, out)
    good = out / "smoke" / "good"
    before = _tree(good)
    real_replace = os.replace

    def crash_after_the_first_rename(src, dst):
        real_replace(src, dst)
        if os.path.basename(dst).startswith(".old-"):
            raise KeyboardInterrupt  # the process dies here: the report is under .old-*, nothing in its place

    monkeypatch.setattr(report.folders.os, "replace", crash_after_the_first_rename)
    with pytest.raises(KeyboardInterrupt):
        _build(notebooks, out)
    monkeypatch.setattr(report.folders.os, "replace", real_replace)
    assert not good.exists()
    (hidden,) = [p for p in (out / "smoke").iterdir() if p.name.startswith(".old-good-")]
    assert _tree(hidden) == before
    monkeypatch.setattr(report.folders, "_alive", lambda pid: False)  # the build that crashed is gone

    # the next build fails: there is no replacement, so the last good report is restored, never deleted
    results = _build(notebooks, out, overrides={"value": "-1"})
    assert results.status.tolist() == ["failed"] and results.kept_previous.tolist() == [True]
    assert {k: v for k, v in _tree(good).items() if not k.startswith("failed-run")} == before
    assert json.loads((good / "failed-run" / "run.json").read_text())["status"] == "failed"
    assert [p.name for p in (out / "smoke").iterdir() if p.name.startswith(".")] == []
    assert "rebuild failed; last good report shown" in (out / "smoke" / "index.html").read_text()


def test_leftovers_whose_report_is_in_place_are_removed_and_a_failed_run_comes_back(notebooks, tmp_path, fake,
                                                                                    monkeypatch):
    out = tmp_path / "reports"
    _build(notebooks, out)
    _build(notebooks, out, overrides={"value": "-1"})  # a failed run beside the good report
    good = out / "smoke" / "good"
    failed_before = _tree(good / "failed-run")
    os.replace(good / "failed-run", good / ".old-failed-run-999999999-0badc0de")  # died mid-swap
    (out / "smoke" / ".old-good-999999999-deadbeef").mkdir()  # the swap finished, its cleanup did not
    (out / "smoke" / ".staging-good-999999999-cafef00d").mkdir()
    (out / "smoke" / ".old-notes-999999999-deadbeef").write_text("a file an older runner moved aside")
    report.folders.recover(out / "smoke")
    assert _tree(good / "failed-run") == failed_before
    assert sorted(p.name for p in (out / "smoke").iterdir()) == ["good", "index.html", "notes"]
    assert (out / "smoke" / "notes").read_text() == "a file an older runner moved aside"


# ---------------------------------------------------------------------------------------------
# Only what the runner made


def test_a_rebuild_replaces_what_the_runner_made(notebooks, tmp_path, fake):
    out = tmp_path / "reports"
    _build(notebooks, out)
    good = out / "smoke" / "good"
    made = json.loads((good / MARKER).read_text())
    assert made["files"] == sorted(p.name for p in good.iterdir() if p.name != MARKER)
    assert foreign_entries(good) == []
    assert _build(notebooks, out).status.tolist() == ["ok"]


CASES = {  # what is in the way -> what the message says
    "notes in a report": ("smoke/good/notes.txt", "smoke/good holds notes.txt, which workbench report did not make"),
    "notes in a failed run": ("smoke/good/failed-run/notes.txt", "smoke/good holds failed-run/notes.txt"),
    "a file named like a notebook": ("smoke/good", "smoke/good is a file that workbench report did not make"),
    "a folder of yours": ("smoke/good/draft.md", "smoke/good is a folder that workbench report did not make"),
    "a link": ("smoke/good", "smoke/good is a symbolic link that workbench report did not make"),
    "your index page": ("index.html", "index.html was not written by workbench report"),
    "your profile page": ("smoke/index.html", "smoke/index.html was not written by workbench report"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_files_the_runner_did_not_make_are_refused_and_kept(notebooks, tmp_path, fake, capsys, case):
    out = tmp_path / "reports"
    if case in ("notes in a report", "notes in a failed run", "your profile page"):
        assert run_cli(notebooks, out, "good", "--profile", "smoke") == 0
    if case == "notes in a failed run":
        assert run_cli(notebooks, out, "good", "--profile", "smoke", "-p", "value=-1") == 1
    capsys.readouterr()
    where, message = CASES[case]
    target = out / where
    target.parent.mkdir(parents=True, exist_ok=True)
    if case == "a link":
        (tmp_path / "elsewhere").mkdir()
        target.symlink_to(tmp_path / "elsewhere")
    else:
        target.write_text("mine")
    before, calls = _tree(out), len(fake.calls)
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 2
    err = capsys.readouterr().err
    assert "refusing to replace what workbench report did not make" in err and f"{out}/{message}" in err
    assert _tree(out) == before and len(fake.calls) == calls  # nothing ran, nothing moved
    assert not [p for p in out.rglob(".old-*")]


def test_a_file_of_yours_that_appears_during_the_build_is_kept(notebooks, tmp_path, fake):
    out = tmp_path / "reports"
    _build(notebooks, out)
    notes = out / "smoke" / "good" / "notes.txt"
    real_call = fake.__class__.__call__

    def write_notes_meanwhile(self, *args, **kwargs):
        notes.write_text("mine")
        real_call(self, *args, **kwargs)

    fake.__class__.__call__ = write_notes_meanwhile
    try:
        results = _build(notebooks, out)
    finally:
        fake.__class__.__call__ = real_call
    assert results.status.tolist() == ["failed"] and "notes.txt" in results.error[0]
    assert notes.read_text() == "mine"
    assert not [p for p in (out / "smoke").iterdir() if p.name.startswith(".")]


def test_reports_from_before_the_marker_and_empty_folders_are_replaced(notebooks, tmp_path, fake):
    out = tmp_path / "reports"
    _build(notebooks, out)
    good = out / "smoke" / "good"
    (good / MARKER).unlink()  # an older runner wrote no marker; its run.json names the notebook
    assert foreign_entries(good) == []
    (good / "notes.txt").write_text("mine")
    assert foreign_entries(good) == ["notes.txt"]
    (good / "notes.txt").unlink()
    assert _build(notebooks, out).status.tolist() == ["ok"]
    empty = tmp_path / "other"
    (empty / "smoke" / "good").mkdir(parents=True)
    assert _build(notebooks, empty).status.tolist() == ["ok"]


def test_write_index_never_overwrites_a_page_it_did_not_write(tmp_path):
    (tmp_path / "index.html").write_text("<html>my own page</html>")
    with pytest.raises(UsageError, match="not written by workbench report"):
        write_index(tmp_path)
    assert (tmp_path / "index.html").read_text() == "<html>my own page</html>"
    (tmp_path / "index.html").unlink()
    write_index(tmp_path)
    write_index(tmp_path)  # its own page, rewritten


# ---------------------------------------------------------------------------------------------
# The lock


def test_the_lock_never_follows_a_link(notebooks, tmp_path, fake, capsys):
    out = tmp_path / "reports"
    out.mkdir()
    elsewhere = tmp_path / "elsewhere" / "lock"
    (out / ".lock").symlink_to(elsewhere)  # dangling: opening it for writing would create the target
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 2
    assert "is a symbolic link" in capsys.readouterr().err
    with pytest.raises(UsageError, match="is a symbolic link"):
        with locked(out):
            pass
    elsewhere.parent.mkdir()
    with pytest.raises(UsageError, match="is a symbolic link"):
        with locked(out):
            pass
    assert not elsewhere.exists() and not fake.calls


def test_the_lock_is_a_plain_file_created_once(tmp_path):
    with locked(tmp_path):
        assert (tmp_path / ".lock").is_file()
    with locked(tmp_path):  # an existing lock file is reused
        pass
    os.remove(tmp_path / ".lock")
    (tmp_path / ".lock").mkdir()
    with pytest.raises(UsageError, match="not a plain file"):
        with locked(tmp_path):
            pass


def test_a_second_rename_that_fails_puts_the_last_good_report_back(notebooks, tmp_path, fake, monkeypatch):
    out = tmp_path / "reports"
    _build(notebooks, out)
    before = _tree(out / "smoke" / "good")
    real_replace = os.replace

    def full_disk(src, dst):
        if os.path.basename(src).startswith(".staging-"):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(report.folders.os, "replace", full_disk)
    results = _build(notebooks, out)
    assert results.status.tolist() == ["failed"] and "No space left on device" in results.error[0]
    assert _tree(out / "smoke" / "good") == before
    assert not [p for p in (out / "smoke").iterdir() if p.name.startswith(".")]


def test_recovery_keeps_every_report_it_cannot_prove_replaced(notebooks, tmp_path, fake):
    """`settle`: a good report hidden behind a failed run comes back in front of it; a hidden report whose
    run.json is damaged beats a failed run and stays hidden beside a report of unknown state, until a good
    report is in place."""
    out, elsewhere = tmp_path / "reports", tmp_path / "failed"
    _build(notebooks, out)
    _build(notebooks, elsewhere, overrides={"value": "-1"})  # a failed run with nothing before it
    smoke, good, hidden = out / "smoke", out / "smoke" / "good", out / "smoke" / ".old-good-999999999-0000abcd"
    before = _tree(good)
    os.replace(good, hidden)  # the state an older runner left: a failed run in place of a hidden good report
    shutil.copytree(elsewhere / "smoke" / "good", good)
    with locked(out):
        report.folders.recover(smoke)
    assert {k: v for k, v in _tree(good).items() if not k.startswith("failed-run/")} == before
    assert json.loads((good / "failed-run" / "run.json").read_text())["status"] == "failed"
    assert not hidden.exists()

    (good / "run.json").write_text("{damaged")
    damaged = _tree(good)
    os.replace(good, hidden)
    shutil.copytree(elsewhere / "smoke" / "good", good)
    (good / "run.json").write_text("{also damaged")  # neither proves the other replaced
    with locked(out):
        report.folders.recover(smoke)
    assert _tree(hidden) == damaged and (good / "run.json").read_text() == "{also damaged"
    shutil.rmtree(good)
    os.replace(hidden, good)
    assert _build(notebooks, out, overrides={"value": "-1"}).kept_previous.tolist() == [True]  # may be good
    os.replace(good, hidden)
    _build(notebooks, out)  # the hidden one comes back, then a good report replaces it
    assert not hidden.exists() and json.loads((good / "run.json").read_text())["status"] == "ok"
