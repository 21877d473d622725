"""Hostile inputs to `python -m workbench.gpu pack` and `unpack`'s destination (issue 43): a folder that only
looks like a pack, a user's file inside a pack, a destination under a regular file or in /proc, a file in
`--wheels-from` that is not a wheel. Each lost a file or ended in a traceback before; now a pack replaces only
what a pack wrote, and a bad path or value is one line naming it, exit code 2, before anything is written."""

import io
import json
import shutil
import subprocess
import tarfile

import pytest

from workbench.gpu import cli
from workbench.gpu.pack import pack
from workbench.report.results import UsageError


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path):
    """A tiny committed repository to pack (pack copies the committed HEAD only)."""
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    (repo / "README.md").write_text("tiny\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    return repo


def _commit(repo, files: dict, removed=()):
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    for name in removed:
        (repo / name).unlink()
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "next")


def _tree(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _one_line_error(capsys, *names):
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for name in names:
        assert str(name) in err, err
    return err


# -- finding 1: a folder with a pack.json is not therefore a pack ------------------------------------------------

def test_a_folder_with_a_bare_pack_json_is_refused_naming_the_files_it_would_lose(tmp_path, repo):
    """Was: exit 0 and thesis.tex gone (any folder holding a pack.json was removed whole)."""
    folder = tmp_path / "P"
    folder.mkdir()
    (folder / "pack.json").write_text("{}")
    (folder / "thesis.tex").write_text("work")
    before = _tree(folder)
    with pytest.raises(UsageError, match="exists and is not a pack") as error:
        pack(folder, no_wheels=True, repo=repo)
    assert str(folder) in str(error.value) and "thesis.tex" in str(error.value)
    assert _tree(folder) == before
    assert [p.name for p in tmp_path.iterdir()] and not list(tmp_path.glob(".P.incoming-*"))


@pytest.mark.parametrize("record", ['{"commit": "abc", "made": "x", "bytes": 1, "wheels": []}',
                                    '{"files": ["../outside.txt"]}', '{"files": "thesis.tex"}', "[]", "not json"])
def test_a_pack_json_that_does_not_list_what_a_pack_wrote_is_not_a_pack(tmp_path, repo, record):
    folder = tmp_path / "P"
    folder.mkdir()
    (folder / "pack.json").write_text(record)
    (folder / "thesis.tex").write_text("work")
    (tmp_path / "outside.txt").write_text("mine")
    with pytest.raises(UsageError, match="exists and is not a pack"):
        pack(folder, no_wheels=True, repo=repo)
    assert (folder / "thesis.tex").read_text() == "work" and (tmp_path / "outside.txt").read_text() == "mine"


def test_the_command_refuses_it_with_exit_code_2(tmp_path, capsys):
    folder = tmp_path / "P"
    folder.mkdir()
    (folder / "pack.json").write_text("{}")
    (folder / "thesis.tex").write_text("work")
    assert cli.main(["pack", str(folder), "--no-wheels"]) == 2
    _one_line_error(capsys, folder, "thesis.tex")
    assert (folder / "thesis.tex").read_text() == "work"


# -- finding 2: a re-pack replaces what the pack wrote, nothing else --------------------------------------------

def test_a_repack_keeps_a_file_the_pack_did_not_write_and_says_so(tmp_path, repo):
    """Was: `pack G; echo n > G/notes.md; pack G` deleted notes.md without a word."""
    folder = tmp_path / "G"
    pack(folder, no_wheels=True, repo=repo)
    (folder / "notes.md").write_text("n")
    (folder / "checkout" / "mine.txt").write_text("mine")
    (folder / "run.sh").write_text("edited")  # a file the pack wrote: replaced
    _commit(repo, {"pkg/b.py": "B = 2\n"}, removed=["README.md"])
    info = pack(folder, no_wheels=True, repo=repo)
    assert (folder / "notes.md").read_text() == "n" and (folder / "checkout" / "mine.txt").read_text() == "mine"
    assert sorted(info["kept"]) == ["checkout/mine.txt", "notes.md"]
    assert (folder / "checkout" / "pkg" / "b.py").is_file() and not (folder / "checkout" / "README.md").exists()
    assert info["commit"] in (folder / "run.sh").read_text()
    assert "notes.md" not in json.loads((folder / "pack.json").read_text())["files"]


def test_the_command_names_the_files_it_kept(tmp_path, repo, capsys, monkeypatch):
    folder = tmp_path / "G"
    pack(folder, no_wheels=True, repo=repo)
    (folder / "notes.md").write_text("n")
    monkeypatch.setattr("workbench.gpu.pack.repo_root", lambda: repo)
    assert cli.main(["pack", str(folder), "--no-wheels"]) == 0
    assert "notes.md" in capsys.readouterr().out and (folder / "notes.md").read_text() == "n"


def test_a_repack_refuses_when_a_user_s_file_stands_where_the_new_pack_writes(tmp_path, repo):
    folder = tmp_path / "G"
    pack(folder, no_wheels=True, repo=repo)
    (folder / "checkout" / "pkg" / "b.py").write_text("my own b")
    _commit(repo, {"pkg/b.py": "B = 2\n"})
    before = _tree(folder)
    with pytest.raises(UsageError, match="not written by pack") as error:
        pack(folder, no_wheels=True, repo=repo)
    assert "checkout/pkg/b.py" in str(error.value)
    assert _tree(folder) == before


def test_a_repack_never_deletes_through_a_link_the_user_put_in_place_of_a_folder(tmp_path, repo):
    folder, elsewhere = tmp_path / "G", tmp_path / "elsewhere"
    pack(folder, no_wheels=True, repo=repo)
    (elsewhere / "pkg").mkdir(parents=True)
    (elsewhere / "pkg" / "a.py").write_text("mine")
    (elsewhere / "README.md").write_text("mine")
    _tree_before = _tree(elsewhere)
    shutil.rmtree(folder / "checkout")
    (folder / "checkout").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UsageError):
        pack(folder, no_wheels=True, repo=repo)
    assert _tree(elsewhere) == _tree_before


# -- finding 3: bad paths and values are one line, exit code 2, before anything is written -----------------------

@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_pack_to_a_path_that_cannot_be_a_folder_is_one_line(tmp_path, capsys, where):
    (tmp_path / "F").write_text("mine")
    dest = {"under-a-file": tmp_path / "F" / "sub", "proc": "/proc/workbench-probe-pack"}[where]
    assert cli.main(["pack", str(dest), "--no-wheels"]) == 2
    _one_line_error(capsys, dest)
    assert (tmp_path / "F").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["F"]


def test_wheels_from_with_a_file_that_is_not_a_wheel_is_one_line(tmp_path, capsys):
    wheels = tmp_path / "W"
    wheels.mkdir()
    (wheels / "bad-1.0-py3-none-any.whl").write_text("junk")
    dest = tmp_path / "Q"
    assert cli.main(["pack", str(dest), "--wheels-from", str(wheels)]) == 2
    _one_line_error(capsys, "--wheels-from", "bad-1.0-py3-none-any.whl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["W"]


def _archive(path):
    run = {"name": "tour", "profile": "gpu", "status": "ok", "seconds": 1.0,
           "environment": {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "commit": "012f1da"}}
    with tarfile.open(path, "w:gz") as tar:
        data = json.dumps(run).encode()
        info = tarfile.TarInfo("nvidia-h100-80gb-hbm3/tour/run.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("where", ["under-a-file", "proc"])
def test_unpack_to_reports_that_cannot_be_a_folder_is_one_line(tmp_path, capsys, where):
    (tmp_path / "F").write_text("mine")
    archive = _archive(tmp_path / "a.tar.gz")
    reports = {"under-a-file": tmp_path / "F" / "sub", "proc": "/proc/workbench-probe-reports"}[where]
    assert cli.main(["unpack", str(archive), "--reports", str(reports)]) == 2
    _one_line_error(capsys, reports)
    assert (tmp_path / "F").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["F", "a.tar.gz"]
