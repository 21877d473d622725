"""Hostile inputs to `gpu unpack` and `gpu run` (probes of the report-runner family): each case lost
data, wrote outside the reports folder, hung or crashed before, and must now be refused with a clear error
that names the bad value and what was expected, or handled without harm."""

import io
import json
import os
import subprocess
import sys
import tarfile

import pytest

from workbench.devices import repo_root
from workbench.gpu import cli
from workbench.gpu import run as gpu_run
from workbench.gpu.archive import unpack
from workbench.report.results import UsageError

SLUG, NAME = "nvidia-h100-80gb-hbm3", "tour"
RUN = {"name": NAME, "profile": "gpu", "status": "ok", "seconds": 1.0,
       "environment": {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3", "commit": "012f1da"}}


def _archive(path, files: dict, *, slug=SLUG, name=NAME):
    """A reference archive holding `files` (file name -> bytes, or an int: that many zero bytes) and run.json."""
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for file, data in {"run.json": json.dumps(RUN).encode(), **files}.items():
            info = tarfile.TarInfo(f"{slug}/{name}/{file}")
            info.size = data if isinstance(data, int) else len(data)
            tar.addfile(info, _Zeros(data) if isinstance(data, int) else io.BytesIO(data))
    return path


class _Zeros(io.RawIOBase):
    """`size` zero bytes, read in pieces (a big member without holding it in memory)."""

    def __init__(self, size):
        self.left = size

    def readable(self):
        return True

    def readinto(self, buffer):
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


def _bytes_under(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def test_unpack_keeps_the_user_s_own_files_in_a_reference_folder(tmp_path):
    reports = tmp_path / "reports"
    first = _archive(tmp_path / "first.tar.gz", {"results.json": b'{"a": 1}', "old_figure.png": b"png"})
    unpack(first, reports / "reference")
    folder = reports / "reference" / SLUG / NAME
    (folder / "my-notes.md").write_text("mine")
    (folder / "my-plot.png").write_bytes(b"mine too")
    second = _archive(tmp_path / "second.tar.gz", {"results.json": b'{"a": 2}'})
    unpack(second, reports / "reference")
    assert (folder / "my-notes.md").read_text() == "mine" and (folder / "my-plot.png").read_bytes() == b"mine too"
    assert json.loads((folder / "results.json").read_text()) == {"a": 2}  # the reference's own files replaced


@pytest.mark.parametrize("link", ["reference", f"reference/{SLUG}", f"reference/{SLUG}/{NAME}"])
def test_unpack_never_writes_through_a_symbolic_link(tmp_path, link):
    reports, outside = tmp_path / "reports", tmp_path / "outside"
    outside.mkdir()
    (reports / link).parent.mkdir(parents=True, exist_ok=True)
    (reports / link).symlink_to(outside, target_is_directory=True)
    archive = _archive(tmp_path / "a.tar.gz", {"results.json": b"{}"})
    with pytest.raises(UsageError, match="symbolic link") as error:
        unpack(archive, reports / "reference")
    assert link.split("/")[-1] in str(error.value)
    assert list(outside.rglob("*")) == []


def test_unpack_never_writes_through_a_link_inside_the_reference_folder(tmp_path):
    reports, outside = tmp_path / "reports", tmp_path / "outside.json"
    outside.write_text("not yours")
    unpack(_archive(tmp_path / "a.tar.gz", {"results.json": b"{}"}), reports / "reference")
    target = reports / "reference" / SLUG / NAME / "results.json"
    target.unlink()
    target.symlink_to(outside)
    unpack(_archive(tmp_path / "b.tar.gz", {"results.json": b'{"new": 1}'}), reports / "reference")
    assert outside.read_text() == "not yours" and not target.is_symlink()


def test_unpack_limits_the_total_bytes_written(tmp_path):
    """Each member under the per-file limit, together past the archive's: refused before the limit is written."""
    archive = _archive(tmp_path / "bomb.tar.gz", {f"f{i}.json": 30 * 2**20 for i in range(4)})
    assert archive.stat().st_size < 2**20  # a small archive that would write 120 MiB
    with pytest.raises(UsageError, match=r"more than \d+ MiB") as error:
        unpack(archive, tmp_path / "reports" / "reference")
    assert "bomb.tar.gz" in str(error.value)
    assert _bytes_under(tmp_path / "reports") == 0


def test_unpack_limits_the_number_of_files(tmp_path):
    archive = _archive(tmp_path / "many.tar.gz", {f"f{i}.json": b"" for i in range(20_000)})
    with pytest.raises(UsageError, match=r"more than \d+ members"):
        unpack(archive, tmp_path / "reports" / "reference")
    assert not list((tmp_path / "reports").rglob("*.json"))


def test_a_truncated_archive_is_a_clear_error(tmp_path, capsys):
    whole = _archive(tmp_path / "whole.tar.gz", {"results.json": os.urandom(200_000)})
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert cli.main(["unpack", str(cut), "--reports", str(tmp_path / "reports")]) == 2
    err = capsys.readouterr().err
    assert "cut.tar.gz" in err and "truncated or damaged" in err and "Traceback" not in err
    assert not list((tmp_path / "reports").rglob("*.json"))


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "directory"])
def test_unpack_refuses_what_is_not_a_regular_file_without_hanging(tmp_path, kind):
    path = {"fifo": tmp_path / "pipe.tar.gz", "/dev/zero": "/dev/zero", "directory": tmp_path}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    done = subprocess.run([sys.executable, "-m", "workbench.report.gpu_run", "unpack", str(path), "--reports",
                           str(tmp_path / "reports")], cwd=repo_root(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "not a regular file" in done.stderr and str(path) in done.stderr, done.stderr


def test_run_refuses_an_unknown_device_before_any_work(tmp_path, monkeypatch, capsys):
    def no_work(*args, **kwargs):
        raise AssertionError("work started before the device was checked")

    monkeypatch.setattr(gpu_run, "install_wheels", no_work)
    monkeypatch.setattr("workbench.report.runner.build_reports", no_work)
    assert cli.main(["run", "tour", "--device", "tpu", "--out", str(tmp_path / "o"),
                         "--reference", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "'tpu'" in err and "cpu" in err and "cuda:N" in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()


@pytest.mark.parametrize("mode", ["w:xz", "w:bz2", "w"])
def test_an_archive_repacked_with_another_compression_unpacks_as_gzip_does(tmp_path, mode):
    path = tmp_path / "repacked.tar"
    with tarfile.open(path, mode) as tar:
        data = json.dumps(RUN).encode()
        info = tarfile.TarInfo(f"{SLUG}/{NAME}/run.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    unpack(path, tmp_path / "reports" / "reference")  # was "truncated or damaged archive" for xz and bz2
    assert json.loads((tmp_path / "reports" / "reference" / SLUG / NAME / "run.json").read_text()) == RUN


def test_a_file_name_too_long_for_the_file_system_is_refused_naming_archive_and_member(tmp_path):
    path = _archive(tmp_path / "long.tar.gz", {"x" * 5000 + ".json": b"{}"})
    with pytest.raises(UsageError, match=rf"long\.tar\.gz: refusing member {SLUG}/{NAME}/x{{40}}\.\.\. "
                                         r"\(a file name of 5005 bytes; a file system allows 255\)"):
        unpack(path, tmp_path / "reports" / "reference")
    assert not (tmp_path / "reports").exists()


def test_a_reports_path_that_is_a_file_is_refused_and_kept(tmp_path):
    (tmp_path / "reports").write_text("mine")
    with pytest.raises(UsageError, match="reports exists and is not a folder; move it out of the way"):
        unpack(_archive(tmp_path / "a.tar.gz", {}), tmp_path / "reports" / "reference")
    assert (tmp_path / "reports").read_text() == "mine"
