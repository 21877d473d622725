"""Hostile inputs, round 5 (issue 43), command-line family: `workbench advise` options, `workbench report` options
(--workers, --scheduler, --out, names, --profile), and the paths given to `python -m workbench.gpu pack` and
`unpack`. Each is refused in one line naming the option (or path) and the value, exit status 2, before any work;
no file is lost and nothing is written outside the folder given (the listing of the test's folder is compared
before and after).

Found by this round and fixed here: `advise --sample` given a named pipe waited for ever (and /dev/zero would be
read without end); `pack` to a path holding a NUL byte or a name too long ended in a ValueError or OSError
traceback; `unpack` with a NUL byte in the archive's or the reports' path, or a reports name too long, ended in a
traceback; `unpack a.tar.gz b.tar.gz` with a damaged second archive unpacked the first, then failed before the
listing and the index were rewritten (now every archive is checked before any is written); `report --workers ٢`
(Arabic-Indic two, which int() reads as 2) started a cluster of 2 workers; `gpu run` checked its -p values and
its folders (--out, --reference, --bundle, --site, --wheels: a file, a pipe, a link loop, a NUL byte) only after
installing the wheels, in build_reports, although it promises that everything is checked before any work.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch

import workbench.advisor.command as command
from workbench.cli import main
from workbench.gpu import cli as gpu_cli
from workbench.gpu.pack import pack

MODELS = """
import sys
from torch import nn

def linear():
    return nn.Sequential(nn.Flatten(), nn.Linear(8, 4))

VALUE = 5
INSTANCE = nn.Linear(2, 2)
"""

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")


def _listing(folder) -> dict:
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(folder.rglob("*"))}


# ------------------------------------------------------------------ advise


@pytest.fixture
def advise_cli(tmp_path, monkeypatch, request):
    """`workbench advise MODEL ARGS` in-process in tmp_path (the advisor itself a stub that fails the test:
    every refusal comes before it runs); returns (status, the one line of stderr)."""
    module = f"probe_r5_models_{abs(hash(request.node.nodeid)) % 10**8}"
    (tmp_path / f"{module}.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))

    def traced(*args, **kwargs):
        raise AssertionError("the advisor ran before the input was refused")

    monkeypatch.setattr(command, "advise", traced)

    def run(model: str, *args: str, capsys) -> str:
        capsys.readouterr()
        before = _listing(tmp_path)
        model = model.replace("M:", f"{module}:")
        args = [a.replace("M:", f"{module}:") for a in args]
        try:
            status = main(["advise", model, *args])
        except SystemExit as exit_:
            status = exit_.code
        err = capsys.readouterr().err.strip()
        assert status == 2, err
        assert "Traceback" not in err and err.splitlines()[-1].startswith("workbench advise: error: "), err
        after = {k: v for k, v in _listing(tmp_path).items() if "__pycache__" not in k}
        assert after == {k: v for k, v in before.items() if "__pycache__" not in k}  # nothing written or lost
        return err.splitlines()[-1]

    return run


@pytest.mark.parametrize("budget, needles", [
    ("-1", ["--budget '-1'", "not a number of bytes"]), ("nan", ["--budget 'nan'"]), ("inf", ["--budget 'inf'"]),
    ("1e400", ["--budget '1e400'", "too large"]), ("8XB", ["--budget '8XB'", "gib"]), ("", ["--budget ''"]),
    ("１MB", ["--budget '１MB'"]), ("0", ["--budget '0'", "> 0 bytes"]), ("0e9", ["--budget '0e9'", "> 0"]),
    ("1 G B", ["--budget '1 G B'"]),
])
def test_a_budget_that_is_not_a_number_of_bytes_is_refused(advise_cli, capsys, budget, needles):
    err = advise_cli("M:linear", "--budget", budget, "--batch", "2x8", capsys=capsys)
    assert all(n in err for n in needles), err


@pytest.mark.parametrize("batch", ["0x8", "2x0", "2.5x8", "", "x", "2xx8", "2,8", "2 x 8", "nanx8", "2X8X", "infx8",
                                   "0x0", "+2x8", "2x-8"])
def test_a_batch_that_is_not_sizes_joined_by_x_is_refused(advise_cli, capsys, batch):
    err = advise_cli("M:linear", "--budget", "1MB", f"--batch={batch}", capsys=capsys)
    assert f"--batch {batch!r}" in err and "joined by 'x'" in err, err


@pytest.mark.parametrize("targets, needles", [("3", ["--targets '3'", "batch size of --batch '2x8'"]),
                                              ("0", ["--targets '0'", "joined by 'x'"]),
                                              ("abc", ["--targets 'abc'"]), ("2x", ["--targets '2x'"]),
                                              ("3x4", ["--targets '3x4'", "(2)"])])
def test_targets_that_cannot_follow_the_batch_are_refused(advise_cli, capsys, targets, needles):
    err = advise_cli("M:linear", "--budget", "1MB", "--batch", "2x8", "--targets", targets, capsys=capsys)
    assert all(n in err for n in needles), err


@pytest.mark.parametrize("args, needles", [
    (["--margin", "1"], ["--margin 1.0", "[0, 1)"]), (["--margin", "-0.1"], ["--margin -0.1"]),
    (["--margin", "inf"], ["--margin inf"]), (["--margin", "nan"], ["--margin nan"]),
    (["--margin", "abc"], ["--margin", "'abc'"]),
    (["--device", "meta"], ["--device 'meta'", "meta"]), (["--device", ""], ["--device ''"]),
    (["--device", "cuda:x"], ["--device 'cuda:x'"]), (["--device", "tpu:0"], ["--device 'tpu:0'"]),
    (["--optimizer", "adam"], ["--optimizer", "'adam'", "adamw"]),
    (["--input-dtype", "float128"], ["--input-dtype", "'float128'"]),
    (["--target-dtype", "str"], ["--target-dtype", "'str'"]),
])
def test_a_bad_option_value_is_refused_naming_the_option(advise_cli, capsys, args, needles):
    err = advise_cli("M:linear", "--budget", "1MB", "--batch", "2x8", *args, capsys=capsys)
    assert all(n in err for n in needles), err


@pytest.mark.parametrize("model, loss, needles", [
    ("M:VALUE", None, ["is not callable", "int"]), ("M:INSTANCE", None, ["Linear instance"]),
    ("M:nosuch", None, ["has no 'nosuch'"]), ("M:", None, ["must be MODULE:NAME"]),
    (":linear", None, ["':linear'", "MODULE:NAME"]), ("probe_r5_nosuch_module:f", None, ["cannot import"]),
    ("../up:linear", None, ["cannot import '../up'"]),
    ("M:linear", "M:VALUE", ["--loss", "is not callable"]), ("M:linear", "lossonly", ["--loss 'lossonly'"]),
    ("M:linear", "probe_r5_nosuch_module:f", ["cannot import"]), ("M:linear", "M:nosuch", ["has no 'nosuch'"]),
])
def test_a_model_or_loss_that_cannot_be_loaded_is_refused_naming_it(advise_cli, capsys, model, loss, needles):
    extra = ["--loss", loss] if loss else []
    err = advise_cli(model, "--budget", "1MB", "--batch", "2x8", *extra, capsys=capsys)
    assert all(n in err for n in needles), err


@pytest.mark.parametrize("kind", [pytest.param("fifo", marks=needs_fifo), "folder", "/dev/zero", "/dev/null",
                                  "link loop", "under a file", "python file", "empty file"])
def test_a_sample_that_is_not_a_saved_batch_is_refused_without_waiting(advise_cli, capsys, tmp_path, kind):
    """A named pipe waited for ever in torch.load (and /dev/zero fed it without end)."""
    path = {"fifo": "pipe.pt", "folder": "folder.pt", "/dev/zero": "/dev/zero", "/dev/null": "/dev/null",
            "link loop": "loop.pt", "under a file": "F/x.pt", "python file": "script.py", "empty file": "e.pt"}[kind]
    if kind == "fifo":
        os.mkfifo(tmp_path / path)
    elif kind == "folder":
        (tmp_path / path).mkdir()
    elif kind == "link loop":
        (tmp_path / path).symlink_to(tmp_path / path)
    elif kind == "under a file":
        (tmp_path / "F").write_text("mine")
    elif kind == "python file":
        (tmp_path / path).write_text("print('hi')\n")
    elif kind == "empty file":
        (tmp_path / path).write_bytes(b"")
    from probe_cases import within

    err = within(30, lambda: advise_cli("M:linear", "--budget", "1MB", "--sample", path, capsys=capsys))
    assert f"--sample {path!r}" in err, err


def test_a_sample_of_three_tensors_is_refused_naming_sample(advise_cli, capsys, tmp_path):
    torch.save((torch.zeros(2, 8), torch.zeros(2), torch.zeros(2)), tmp_path / "three.pt")
    err = advise_cli("M:linear", "--budget", "1MB", "--sample", "three.pt", capsys=capsys)
    assert "--sample 'three.pt'" in err and "(inputs, targets)" in err, err


# ------------------------------------------------------------------ gpu pack


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("r5repo") / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "a.py").write_text("A = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    return repo


def _gpu(argv, capsys) -> tuple[int, str]:
    capsys.readouterr()
    status = gpu_cli.main(argv)
    err = capsys.readouterr().err
    return status, err


def _one_line(err):
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


PACK_CASES = {
    "a regular file": (lambda w: (w / "F").write_text("mine"), "F", ["exists and is not a pack"]),
    "a link to a folder": (lambda w: ((w / "else").mkdir(), (w / "L").symlink_to(w / "else")), "L",
                           ["exists and is not a pack"]),
    "a link to a file": (lambda w: ((w / "F").write_text("m"), (w / "L").symlink_to(w / "F")), "L",
                         ["exists and is not a pack"]),
    "a dangling link": (lambda w: (w / "L").symlink_to(w / "nowhere"), "L", ["exists and is not a pack"]),
    "a link loop": (lambda w: (w / "L").symlink_to(w / "L"), "L", ["exists and is not a pack"]),
    "a named pipe": (lambda w: os.mkfifo(w / "Q"), "Q", ["exists and is not a pack"]),
    "a user's folder": (lambda w: ((w / "U").mkdir(), (w / "U" / "thesis.tex").write_text("x")), "U",
                        ["thesis.tex", "not a pack"]),
    "a NUL byte": (None, "a\0b", ["NUL byte"]),
    "a name too long": (None, "x" * 300, ["300 bytes", "255"]),
    "a name too long to stage beside": (None, "y" * 240, ["240 bytes"]),
    "under a link loop": (lambda w: (w / "L").symlink_to(w / "L"), "L/sub", ["Too many levels of symbolic links"]),
    "under a regular file": (lambda w: (w / "F").write_text("m"), "F/sub", ["is not a folder"]),
    "a pack's checkout": (lambda w: None, "G/checkout", ["not a pack", "pkg/a.py"]),
    "the folder given, holding a file": (lambda w: (w / "mine.txt").write_text("m"), ".", ["mine.txt", "not a pack"]),
}


@pytest.mark.parametrize("case", sorted(PACK_CASES))
def test_pack_to_a_path_that_cannot_be_a_new_pack_is_one_line_and_loses_nothing(tmp_path, repo, capsys,
                                                                                monkeypatch, case):
    setup, dest, needles = PACK_CASES[case]
    work = tmp_path / "w"
    work.mkdir()
    if case == "a pack's checkout":
        pack(work / "G", no_wheels=True, repo=repo)
    elif setup is not None:
        setup(work)
    monkeypatch.setattr("workbench.gpu.pack.repo_root", lambda: repo)
    monkeypatch.chdir(work)
    before = _listing(tmp_path)
    status, err = _gpu(["pack", str(work / dest) if dest != "." else ".", "--no-wheels"], capsys)
    assert status == 2, err
    _one_line(err)
    assert all(n in err for n in needles), err
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("case", ["missing", "a file", "empty", "a pipe named .whl", "a folder named .whl",
                                  "a link loop"])
def test_pack_wheels_from_that_holds_no_wheels_is_one_line(tmp_path, repo, capsys, monkeypatch, case):
    wheels = tmp_path / "W"
    if case == "a file":
        wheels.write_text("x")
    elif case == "a link loop":
        wheels.symlink_to(wheels)
    elif case != "missing":
        wheels.mkdir()
        if case == "a pipe named .whl":
            os.mkfifo(wheels / "x-1-py3-none-any.whl")
        elif case == "a folder named .whl":
            (wheels / "x-1-py3-none-any.whl").mkdir()
    monkeypatch.setattr("workbench.gpu.pack.repo_root", lambda: repo)
    before = _listing(tmp_path)
    status, err = _gpu(["pack", str(tmp_path / "Q"), "--wheels-from", str(wheels)], capsys)
    assert status == 2, err
    _one_line(err)
    assert "--wheels-from" in err or "make wheels" in err, err
    assert _listing(tmp_path) == before


def test_pack_to_a_unicode_name_packs(tmp_path, repo):
    info = pack(tmp_path / "пак😀", no_wheels=True, repo=repo)
    assert (tmp_path / "пак😀" / "checkout" / "pkg" / "a.py").read_text() == "A = 1\n" and info["commit"]


# ------------------------------------------------------------------ gpu unpack

SLUG, NAME = "nvidia-h100-80gb-hbm3", "tour"
RUN = json.dumps({"name": NAME, "profile": "gpu", "status": "ok", "seconds": 1.0,
                  "environment": {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "commit": "012f1da"}})
S = f"{SLUG}/{NAME}/"


def _archive(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                body = data.encode() if isinstance(data, str) else data
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
                continue
            info.type = {"sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE,
                         "chr": tarfile.CHRTYPE}[kind]
            if kind in ("sym", "hard"):
                info.linkname = data
            tar.addfile(info)
    return path


ARCHIVES = {
    "a member with ..": ([(S + "run.json", "file", RUN), (S + "../../../evil.txt", "file", "x")], ["refusing member"]),
    "an absolute member": ([(S + "run.json", "file", RUN), ("/tmp/r5evil.txt", "file", "x")], ["refusing member"]),
    "a symbolic link member": ([(S + "run.json", "file", RUN), (S + "l", "sym", "/etc/passwd")], ["refusing member"]),
    "a hard link member": ([(S + "run.json", "file", RUN), (S + "h", "hard", "/etc/passwd")], ["refusing member"]),
    "a named pipe member": ([(S + "run.json", "file", RUN), (S + "p", "fifo", None)], ["refusing member"]),
    "a device member": ([(S + "run.json", "file", RUN), (S + "c", "chr", None)], ["refusing member"]),
    "a top-level file": ([("run.json", "file", RUN)], ["refusing member 'run.json'"]),
    "no run.json": ([(S + "results.json", "file", "{}")], ["no run.json"]),
    "a run.json that is not JSON": ([(S + "run.json", "file", "not json")], ["no run.json"]),
    "a run.json that is a list": ([(S + "run.json", "file", "[]")], ["no run.json"]),
    "a name climbing out": ([("x/../../run.json", "file", RUN)], ["refusing member"]),
    "a slug climbing out": ([("../tour/run.json", "file", RUN)], ["refusing member"]),
    "no members": ([], ["empty archive"]),
    "a unicode file name": ([(S + "run.json", "file", RUN), (S + "résumé😀.json", "file", "{}")], ["refusing member"]),
    "a member under a member": ([(S + "run.json", "file", RUN), (S + "a", "file", "x"), (S + "a/b", "file", "y")],
                                ["refusing member"]),
}


@pytest.mark.parametrize("case", sorted(ARCHIVES))
def test_unpack_refuses_an_archive_it_cannot_place_and_writes_nothing(tmp_path, capsys, case):
    members, needles = ARCHIVES[case]
    archive = _archive(tmp_path / "a.tar.gz", members)
    before = _listing(tmp_path)
    status, err = _gpu(["unpack", str(archive), "--reports", str(tmp_path / "reports")], capsys)
    assert status == 2, err
    _one_line(err)
    assert str(archive) in err and all(n in err for n in needles), err
    assert _listing(tmp_path) == before and not os.path.lexists("/tmp/r5evil.txt")


PATHS = {
    "a missing archive": ("nosuch.tar.gz", "reports", None, ["cannot be read"]),
    "an empty archive file": ("a.tar.gz", "reports", lambda w: (w / "a.tar.gz").write_bytes(b""), ["empty file"]),
    "a damaged archive": ("a.tar.gz", "reports", lambda w: (w / "a.tar.gz").write_bytes(b"\x1f\x8bgarbage" * 9),
                          ["truncated or damaged"]),
    "a text file": ("a.tar.gz", "reports", lambda w: (w / "a.tar.gz").write_text("hello"), ["truncated or damaged"]),
    "an archive that is a link loop": ("L", "reports", lambda w: (w / "L").symlink_to(w / "L"),
                                       ["Too many levels of symbolic links"]),
    "an archive path with a NUL byte": ("a\0.tar.gz", "reports", None, ["NUL byte"]),
    "an archive name too long": ("a" * 300 + ".tar.gz", "reports", None, ["File name too long"]),
    "reports that is a named pipe": ("good.tar.gz", "reports", lambda w: os.mkfifo(w / "reports"),
                                     ["is not a folder"]),
    "reports under a regular file": ("good.tar.gz", "F/r", lambda w: (w / "F").write_text("m"),
                                     ["is not a folder"]),
    "reports with a NUL byte": ("good.tar.gz", "r\0s", None, ["NUL byte"]),
    "reports named too long": ("good.tar.gz", "r" * 300, None, ["File name too long"]),
}


@pytest.mark.parametrize("case", sorted(PATHS))
def test_unpack_paths_that_cannot_be_read_or_written_are_one_line(tmp_path, capsys, case):
    archive, reports, setup, needles = PATHS[case]
    work = tmp_path / "w"
    work.mkdir()
    _archive(work / "good.tar.gz", [(S + "run.json", "file", RUN)])
    if setup is not None:
        setup(work)
    before = _listing(tmp_path)
    status, err = _gpu(["unpack", str(work / archive), "--reports", str(work / reports)], capsys)
    assert status == 2, err
    _one_line(err)
    assert all(n in err for n in needles), err
    assert _listing(tmp_path) == before


def test_unpack_to_dev_null_is_one_line(tmp_path, capsys):
    archive = _archive(tmp_path / "a.tar.gz", [(S + "run.json", "file", RUN)])
    status, err = _gpu(["unpack", str(archive), "--reports", "/dev/null"], capsys)
    assert status == 2 and "/dev/null exists and is not a folder" in _one_line(err), err


def test_a_damaged_second_archive_leaves_the_first_unwritten(tmp_path, capsys):
    """The first archive was unpacked, then the second refused: reference/ held it without its listing and
    index, and the message said "nothing was written"."""
    first = _archive(tmp_path / "a.tar.gz", [(S + "run.json", "file", RUN)])
    (tmp_path / "b.tar.gz").write_text("bad")
    status, err = _gpu(["unpack", str(first), str(tmp_path / "b.tar.gz"), "--reports", str(tmp_path / "reports")],
                       capsys)
    assert status == 2 and "b.tar.gz" in _one_line(err) and "nothing was written" in err, err
    assert not (tmp_path / "reports").exists()
    assert _gpu(["unpack", str(first), "--reports", str(tmp_path / "reports")], capsys)[0] == 0  # alone, it unpacks
    assert json.loads((tmp_path / "reports" / "reference" / SLUG / NAME / "run.json").read_text())["name"] == NAME


# ------------------------------------------------------------------ report options


@pytest.fixture
def report_cli(tmp_path, monkeypatch, capsys):
    """`workbench report --notebooks NB --out OUT good --profile smoke ARGS` with papermill faked; returns the
    status and the last line of stderr, after checking that no notebook ran and nothing changed in tmp_path."""
    from probe_cases import make_notebooks, use_fake

    fake = use_fake(monkeypatch)
    notebooks = make_notebooks(tmp_path)

    def run(out: str, *args: str) -> str:
        capsys.readouterr()
        before = _listing(tmp_path)
        try:
            status = main(["report", "--notebooks", str(notebooks), "--out", out, *args])
        except SystemExit as exit_:
            status = exit_.code
        err = capsys.readouterr().err.strip()
        assert status == 2 and not fake.calls, err
        assert "Traceback" not in err and err.splitlines()[-1].startswith("workbench report: error: "), err
        assert _listing(tmp_path) == before
        return err.splitlines()[-1]

    return run


@pytest.mark.parametrize("workers", ["0", "-1", "abc", "1.5", "100000", "٢", "２", "", "1e2", "2_0"])
def test_a_worker_count_that_is_not_a_whole_number_in_range_is_refused(report_cli, tmp_path, workers):
    """'٢' (Arabic-Indic two) was read as 2 by int(), and a cluster of 2 workers started."""
    err = report_cli(str(tmp_path / "r"), "good", "--profile", "smoke", f"--workers={workers}")
    assert f"--workers: {workers!r}" in err and "1..256" in err, err


@pytest.mark.parametrize("address, needles", [("::::", ["'::::'", "brackets"]), ("127.0.0.1:99999", ["1..65535"]),
                                              ("", ["scheduler=''"]), ("tcp://", ["scheduler='tcp://'"])])
def test_a_scheduler_address_that_cannot_be_reached_is_refused_naming_it(report_cli, tmp_path, address, needles):
    err = report_cli(str(tmp_path / "r"), "good", "--profile", "smoke", f"--scheduler={address}")
    assert "--scheduler" in err and all(n in err for n in needles), err


OUT_CASES = {
    "a regular file": (lambda w: (w / "F").write_text("mine"), "F", ["is a file, not a folder"]),
    "under a regular file": (lambda w: (w / "F").write_text("mine"), "F/r", ["Not a directory"]),
    "a named pipe": (lambda w: os.mkfifo(w / "Q"), "Q", ["is a file, not a folder"]),
    "a link loop": (lambda w: (w / "L").symlink_to(w / "L"), "L", ["Too many levels of symbolic links"]),
}


@pytest.mark.parametrize("case", sorted(OUT_CASES))
def test_an_out_folder_that_cannot_be_one_is_refused_and_kept(report_cli, tmp_path, case):
    setup, out, needles = OUT_CASES[case]
    setup(tmp_path)
    err = report_cli(str(tmp_path / out), "good", "--profile", "smoke")
    assert all(n in err for n in needles), err


@pytest.mark.parametrize("args, needles", [
    (["good", "--profile", "nosuch"], ["--profile", "'nosuch'"]), (["gööd", "--profile", "smoke"], ["'gööd'"]),
    (["../good", "--profile", "smoke"], ["'../good'", "choose from good"]),
    (["good.ipynb", "--profile", "smoke"], ["'good.ipynb'"]),
])
def test_a_notebook_name_or_profile_not_offered_is_refused(report_cli, tmp_path, args, needles):
    err = report_cli(str(tmp_path / "r"), *args)
    assert all(n in err for n in needles), err


# ------------------------------------------------------------------ gpu run


RUN_CASES = {
    "--deadline -1": (None, ["--deadline", "-1"], ["--deadline -1.0", "0..86400"]),
    "--deadline nan": (None, ["--deadline", "nan"], ["--deadline nan"]),
    "--deadline inf": (None, ["--deadline", "inf"], ["--deadline inf"]),
    "--deadline 0": (None, ["--deadline", "0"], ["--deadline 0.0"]),
    "-p without a name": (None, ["-p", "=1"], ["-p '=1'", "name=value"]),
    "-p a value of the wrong type": (None, ["-p", "batch_size=abc"], ["batch_size='abc'", "not a whole number"]),
    "-p a value out of range": (None, ["-p", "batch_size=0"], ["batch_size=0", "out of range"]),
    "-p a parameter not declared": (None, ["-p", "nosuch=1"], ["declares no parameter nosuch"]),
    "-p a choice not declared": (None, ["-p", "model_name=vgg"], ["model_name='vgg'", "resnet18"]),
    "--out a regular file": (lambda w: (w / "F").write_text("mine"), ["--out", "F"], ["--out", "not a folder"]),
    "--reference a regular file": (lambda w: (w / "F").write_text("mine"), ["--reference", "F"],
                                   ["--reference", "not a folder"]),
    "--bundle under a regular file": (lambda w: (w / "F").write_text("mine"), ["--bundle", "F/b"],
                                      ["--bundle", "F is not a folder"]),
    "--site a named pipe": (lambda w: os.mkfifo(w / "Q"), ["--site", "Q"], ["--site", "not a folder"]),
    "--wheels a link loop": (lambda w: (w / "L").symlink_to(w / "L"), ["--wheels", "L"],
                             ["--wheels", "Too many levels of symbolic links"]),
    "--out with a NUL byte": (None, ["--out", "o\0x"], ["--out", "NUL byte"]),
    "--commit that is not one": (None, ["--commit", "HEAD; rm -rf"], ["--commit", "hexadecimal"]),
}


@pytest.mark.parametrize("case", sorted(RUN_CASES))
def test_gpu_run_refuses_a_bad_option_before_installing_anything(tmp_path, capsys, monkeypatch, case):
    """-p values and paths were checked only once the wheels were installed (minutes on a bare GPU machine), in
    build_reports; `run` promises that everything is checked before any work."""
    from workbench.gpu import run as gpu_run

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(gpu_run, "install_wheels", no_work)
    monkeypatch.setattr("workbench.report.runner.build_reports", no_work)
    setup, args, needles = RUN_CASES[case]
    work = tmp_path / "w"
    work.mkdir()
    if setup is not None:
        setup(work)
    monkeypatch.chdir(work)
    base = {"--out": "o", "--reference": "ref", "--bundle": "b", "--site": "site", "--wheels": "wheels"}
    for option, value in zip(args[::2], args[1::2], strict=True):
        if option in base:
            base[option] = value
    extra = [a for option, value in zip(args[::2], args[1::2], strict=True) if option not in base
             for a in (option, value)]
    argv = ["run", "tour", "--profile", "smoke", "--device", "cpu",
            *[a for option, value in base.items() for a in (option, str(work / value))], *extra]
    before = _listing(tmp_path)
    status, err = _gpu(argv, capsys)
    assert status == 2, err
    _one_line(err)
    assert all(n in err for n in needles), err
    assert _listing(tmp_path) == before
