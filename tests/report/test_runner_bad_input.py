"""Hardening: no code runs from data files, bad input refused before work starts, a failed rebuild
loses nothing, and every value on the index page is escaped.

Runner tests replace papermill's executor by an in-process fake (the runner's logic is what is under
test; tests/report/test_runner.py runs real kernels).
"""

import errno
import gzip
import json
import os
import pickle
import threading

import matplotlib
import numpy as np
import pandas as pd
import pytest
import torch

from runner_cases import FakeExecutor, run_cli, write_notebook

from workbench import report
from workbench.cli import main
from workbench.data import load_cifar10, load_cifar100, load_mnist
from workbench.measure import MemoryMeter
from workbench.report import Ledger, UsageError, build_reports, save_results, write_index

matplotlib.use("Agg")


# ---------------------------------------------------------------------------------------------
# Security: data files, names, escaping


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _cifar_batches(folder, files, label_key="labels", n=2, classes=10, *, protocol=pickle.DEFAULT_PROTOCOL,
                   bytes_keys=False):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in files:
        batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 label_key: rng.integers(0, classes, n).tolist(), "batch_label": "training batch"}
        if bytes_keys:
            batch = {k.encode(): v for k, v in batch.items()}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f, protocol=protocol)


CIFAR10 = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def test_cifar_pickle_payload_runs_nothing_and_is_refused_naming_the_file(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    _cifar_batches(folder, CIFAR10)
    marker = tmp_path / "pwned"
    (folder / "data_batch_1").write_bytes(pickle.dumps({"data": _Payload(marker), "labels": [0]}))
    with pytest.raises(ValueError, match=r"data_batch_1: refused to load (posix|os|nt)\.system"):
        load_cifar10(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize("protocol,bytes_keys", [(2, True), (2, False), (4, False), (5, False)])
def test_restricted_unpickler_reads_what_real_batches_hold(tmp_path, protocol, bytes_keys):
    _cifar_batches(tmp_path / "cifar-100-python", ["train", "test"], "fine_labels", 3, 100,
                   protocol=protocol, bytes_keys=bytes_keys)
    train, test = load_cifar100(tmp_path)
    assert len(train) == len(test) == 3 and train.images.dtype == torch.uint8 and train.num_classes == 100


def _rewrite(folder, name, batch):
    with open(folder / name, "wb") as f:
        pickle.dump(batch, f)


@pytest.mark.parametrize("case,match", [
    ("garbage", "not a CIFAR python batch"),
    ("truncated", "not a CIFAR python batch .*truncated"),
    ("list", "expected a CIFAR batch"),
    ("no labels", "lacks"),
    ("shape", r"must be \[N, 3072\]"),
    ("pixels", r"pixel values must be in 0..255, found 0..300"),
    ("floats", "must be integers"),
    ("labels", r"labels must be in 0..9, found 0..10"),
    ("label count", "expected 2 labels"),
])
def test_cifar_reader_refuses_bad_files_naming_them(tmp_path, case, match):
    folder = tmp_path / "cifar-10-batches-py"
    _cifar_batches(folder, CIFAR10)
    target = folder / "data_batch_3"
    good = np.zeros((2, 3072), dtype=np.uint8)
    if case == "garbage":
        # NOTE: fixed bytes, not random ones: random garbage that happens to start with an opcode the scan
        # refuses (OBJ) is refused as well, by another message (a CI run met it)
        target.write_bytes(bytes(range(0xC8, 0x100)) + b"not a pickle")  # 0xC8 is no pickle opcode
    elif case == "truncated":
        target.write_bytes(target.read_bytes()[:1000])
    elif case == "list":
        _rewrite(folder, "data_batch_3", [1, 2, 3])
    elif case == "no labels":
        _rewrite(folder, "data_batch_3", {"data": good})
    elif case == "shape":
        _rewrite(folder, "data_batch_3", {"data": np.zeros((2, 100), dtype=np.uint8), "labels": [0, 1]})
    elif case == "pixels":
        data = good.astype(np.int64)
        data[1, 5] = 300
        _rewrite(folder, "data_batch_3", {"data": data, "labels": [0, 1]})
    elif case == "floats":
        _rewrite(folder, "data_batch_3", {"data": good.astype(np.float32), "labels": [0, 1]})
    elif case == "labels":
        _rewrite(folder, "data_batch_3", {"data": good, "labels": [0, 10]})
    else:
        _rewrite(folder, "data_batch_3", {"data": good, "labels": [0, 1, 2]})
    with pytest.raises(ValueError, match=match) as info:
        load_cifar10(tmp_path)
    assert str(target) in str(info.value)


def _idx(array):
    return bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, dtype=">u4").tobytes() + array.tobytes()


def _mnist(folder, *, images=None, labels=None, gz=False):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix in ("train", "t10k"):
        parts = {
            "images-idx3-ubyte": _idx(rng.integers(0, 256, (3, 28, 28), dtype=np.uint8)) if images is None else images,
            "labels-idx1-ubyte": _idx(rng.integers(0, 10, 3).astype(np.uint8)) if labels is None else labels,
        }
        for kind, raw in parts.items():
            path = folder / f"{prefix}-{kind}"
            if gz:
                raw = gzip.compress(raw)
                path = path.with_name(path.name + ".gz")
            path.write_bytes(raw)


@pytest.mark.parametrize("case,match", [
    ("garbage images", "not an unsigned-byte IDX file"),
    ("truncated images", "truncated or padded"),
    ("truncated header", "truncated header"),
    ("flat images", "expected a 3-dimensional IDX array"),
    ("labels out of range", r"labels must be in 0..9, found \d+..12"),
    ("label count", "expected 3 labels"),
    ("corrupt gzip", "corrupt or truncated"),
])
def test_mnist_reader_refuses_bad_files_naming_them(tmp_path, case, match):
    folder = tmp_path / "mnist"
    good_images = _idx(np.zeros((3, 28, 28), dtype=np.uint8))
    images = labels = None
    bad = "train-images-idx3-ubyte"
    if case == "garbage images":
        images = b"\x13\x37garbage" * 10
    elif case == "truncated images":
        images = good_images[:-100]
    elif case == "truncated header":
        images = good_images[:9]
    elif case == "flat images":
        images = _idx(np.zeros(3 * 28 * 28, dtype=np.uint8))
    elif case == "labels out of range":
        labels, bad = _idx(np.array([0, 12, 1], dtype=np.uint8)), "train-labels-idx1-ubyte"
    elif case == "label count":
        labels, bad = _idx(np.array([0, 1], dtype=np.uint8)), "train-labels-idx1-ubyte"
    _mnist(folder, images=images, labels=labels, gz=case == "corrupt gzip")
    if case == "corrupt gzip":
        bad = "train-images-idx3-ubyte.gz"
        (folder / bad).write_bytes((folder / bad).read_bytes()[:40])
    with pytest.raises(ValueError, match=match) as info:
        load_mnist(tmp_path)
    assert str(folder / bad) in str(info.value)


EVIL = 'x"><img src=q onerror=alert(1)>'


def test_index_escapes_every_value_and_skips_odd_folder_names(tmp_path):
    out = tmp_path / "reports"
    (out / "cpu" / EVIL).mkdir(parents=True)
    (out / "cpu" / EVIL / "run.json").write_text(json.dumps({"status": "ok"}))
    (out / "cpu" / ".staging-good-1-ab").mkdir()
    (out / "cpu" / ".staging-good-1-ab" / "run.json").write_text(json.dumps({"status": "ok"}))
    folder = out / "cpu" / "good"
    folder.mkdir()
    (folder / "x.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (folder / "run.json").write_text(json.dumps({
        "status": EVIL, "profile": EVIL, "started": EVIL, "seconds": EVIL, "error": EVIL,
        "overrides": {"value": EVIL}}))
    (folder / "results.json").write_text(json.dumps({
        "environment": {"device_name": EVIL, "torch": EVIL}, "figures": [EVIL, "../../etc/passwd", "x.png"],
        "claims": [{"claim": EVIL, "source": "paper", "verdict": EVIL, "unit": EVIL, "scale": EVIL}]}))
    write_index(out)
    for page in (out / "index.html", out / "cpu" / "index.html"):
        text = page.read_text()
        assert "<img src=q" not in text and 'x">' not in text and "passwd" not in text
        assert ".staging" not in text
    text = (out / "cpu" / "index.html").read_text()
    assert "&lt;img src=q onerror=alert(1)&gt;" in text and 'src="good/x.png"' in text


def test_notebook_names_are_letters_digits_underscore_dash(notebooks, tmp_path, fake):
    (notebooks / "...ipynb").write_text("{}")
    (notebooks / "a b.ipynb").write_text("{}")
    assert report.available_notebooks(notebooks) == ["good"]
    with pytest.raises(UsageError, match="unknown notebook"):
        build_reports([".."], out_dir=tmp_path / "r", notebooks=notebooks)
    with pytest.raises(UsageError, match="not allowed"):
        save_results("..", output_dir=tmp_path / "r", parameters={}, records={}, ledger=Ledger())
    assert not fake.calls and not (tmp_path / "r").exists()


# ---------------------------------------------------------------------------------------------
# Nothing lost


def test_failed_rebuild_keeps_the_last_good_report(notebooks, tmp_path, fake, capsys):
    out = tmp_path / "reports"
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 0
    good = out / "smoke" / "good"
    before = (good / "results.json").read_text()
    assert run_cli(notebooks, out, "good", "--profile", "smoke", "-p", "value=-1") == 1
    printed = capsys.readouterr().out
    assert "RuntimeError: boom -1" in printed and "last good report is kept" in printed
    assert (good / "results.json").read_text() == before
    assert json.loads((good / "failed-run" / "run.json").read_text())["status"] == "failed"
    page = (out / "smoke" / "index.html").read_text()
    assert "rebuild failed" in page and 'href="good/failed-run/good.html"' in page and "boom -1" in page
    assert "1 reproduced" in page  # the last good report's ledger is still shown
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 0
    assert not (good / "failed-run").exists()
    assert "rebuild failed" not in (out / "smoke" / "index.html").read_text()


@pytest.mark.parametrize("arg,typed", [
    ("rate=1e-3", {"rate": 0.001}), ("rate=2", {"rate": 2.0}), ("value=012", {"value": 12}),
    ("flag=true", {"flag": True}), ("flag=False", {"flag": False}), ("label=012", {"label": "012"}),
    ("label=no", {"label": "no"}),
])
def test_parameters_take_the_type_of_the_declared_default(notebooks, tmp_path, fake, arg, typed):
    assert run_cli(notebooks, tmp_path / "r", "good", "--profile", "smoke", "-p", arg) == 0
    name, value = next(iter(typed.items()))
    passed = fake.calls[0][0][name]
    assert passed == value and type(passed) is type(value)
    run = json.loads((tmp_path / "r" / "smoke" / "good" / "run.json").read_text())
    assert run["overrides"] == typed


@pytest.mark.parametrize("arg,message", [
    ("value=abc", "value='abc' is not a whole number"),
    ("value=1.5", "is not a whole number"),
    ("rate=abc", "is not a number"),
    ("rate=nan", "is not a finite number"),
    ("flag=no", "flag='no' is not true or false"),
    ("flag=off", "is not true or false"),
    ("interactive=False", "set by the report runner"),
    ("output_dir=/tmp/x", "set by the report runner"),
])
def test_bad_parameter_values_are_refused_before_any_kernel_starts(notebooks, tmp_path, fake, capsys, arg,
                                                                  message):
    assert run_cli(notebooks, tmp_path / "r", "good", "--profile", "smoke", "-p", arg) == 2
    assert message in capsys.readouterr().err
    assert not fake.calls and not (tmp_path / "r").exists()


PROFILE_FILES = {
    "list": ("- smoke\n", "expected a mapping of profile names"),
    "scalar section": ("smoke: fast\n", "profile 'smoke' must be a mapping of parameter names to values"),
    "scalar": ("hello\n", "expected a mapping of profile names"),
    "python tag": ("smoke: !!python/object/apply:os.system ['true']\n", "not a valid profile file"),
    "custom tag": ("smoke: !fast {value: 1}\n", "not a valid profile file"),
    "malformed": ("smoke: [value: 1\n", "not a valid profile file"),
    "unknown profile": ("huge:\n  value: 1\n", "unknown profiles ['huge']; allowed"),
    "reserved": ("smoke:\n  output_dir: /tmp\n", "which the report runner sets itself"),
    "wrong type": ("smoke:\n  value: abc\n", "value='abc' is not a whole number"),
}


@pytest.mark.parametrize("case", list(PROFILE_FILES))
def test_bad_profile_files_exit_2_naming_the_file(notebooks, tmp_path, fake, capsys, case):
    path = notebooks / "profiles" / "good.yaml"
    text, message = PROFILE_FILES[case]
    path.write_text(text)
    assert run_cli(notebooks, tmp_path / "r", "good", "--profile", "smoke") == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err
    assert not fake.calls


def test_unusable_output_folders_and_notebook_folders_exit_2(notebooks, tmp_path, fake, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert run_cli(notebooks, a_file, "good") == 2
    assert "is a file" in capsys.readouterr().err
    if os.path.isdir("/proc/self"):  # /proc refuses new folders, even to root
        assert run_cli(notebooks, "/proc/workbench-reports", "good") == 2
        assert "cannot write reports to" in capsys.readouterr().err
    assert run_cli(tmp_path / "missing", tmp_path / "r", "good") == 2
    assert "notebook folder" in capsys.readouterr().err
    assert not fake.calls and not (tmp_path / "r").exists()


def test_out_of_space_is_recorded_cleanly_and_the_previous_report_stays(notebooks, tmp_path, fake, monkeypatch,
                                                                        capsys):
    out = tmp_path / "reports"
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 0
    before = {p.name: p.read_bytes() for p in (out / "smoke" / "good").iterdir()}
    index_before = (out / "index.html").read_text()
    real_write = report.results._write_atomic

    def full_disk(path, text):
        if path.name == "run.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, text)

    monkeypatch.setattr(report.runner, "_write_atomic", full_disk)
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 1
    assert "could not write the report: No space left on device" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in (out / "smoke" / "good").iterdir()} == before
    assert not [p for p in (out / "smoke").iterdir() if p.name.startswith(".staging")]

    def full_disk_everywhere(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    for module in (report.runner, report.index, report.results):
        monkeypatch.setattr(module, "_write_atomic", full_disk_everywhere)
    assert run_cli(notebooks, out, "good", "--profile", "smoke") == 1
    assert "No space left on device" in capsys.readouterr().err
    assert (out / "index.html").read_text() == index_before
    assert {p.name: p.read_bytes() for p in (out / "smoke" / "good").iterdir()} == before


def test_two_builds_into_one_folder_and_stale_temporaries(notebooks, tmp_path, fake):
    out = tmp_path / "reports"
    (out / "smoke" / ".staging-good-999999999-deadbeef").mkdir(parents=True)  # no such process
    (out / "smoke" / ".old-good-999999999-deadbeef").mkdir()
    barrier = threading.Barrier(2)
    real_call = FakeExecutor.__call__

    def together(self, *args, **kwargs):
        barrier.wait(timeout=30)
        real_call(self, *args, **kwargs)

    errors = []

    def build(names):
        try:
            build_reports(names, profile="smoke", out_dir=out, notebooks=notebooks, progress=False)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    FakeExecutor.__call__ = together
    try:
        threads = [threading.Thread(target=build, args=(["good"],)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        FakeExecutor.__call__ = real_call
    assert not errors and len(fake.calls) == 2
    assert sorted(p.name for p in (out / "smoke").iterdir()) == ["good", "index.html"]
    assert json.loads((out / "smoke" / "good" / "run.json").read_text())["status"] == "ok"
    assert sorted(p.name for p in (out / "smoke" / "good").iterdir()) == [
        ".workbench-report", "good.html", "good.ipynb", "narrow.png", "results.json", "run.json", "two_panels.png"]
    assert 'id="good"' in (out / "smoke" / "index.html").read_text()


# ---------------------------------------------------------------------------------------------
# The index: papers, profiles, overrides, figures; JupyterLab runs


def test_index_names_papers_links_profiles_and_shows_overrides(notebooks, tmp_path, fake):
    write_notebook(notebooks, "efficient_densenet")
    out = tmp_path / "reports"
    build_reports(profile="smoke", out_dir=out, notebooks=notebooks, progress=False)
    build_reports(["good"], profile="cpu", out_dir=out, notebooks=notebooks, overrides={"rate": "0.25"},
                  progress=False)
    assert json.loads((out / "smoke" / "good" / "run.json").read_text())["parameters"] == {"value": 2}
    assert json.loads((out / "cpu" / "good" / "run.json").read_text())["parameters"] == {"value": 3, "rate": 0.25}
    top = (out / "index.html").read_text()
    assert 'href="smoke/index.html"' in top and 'href="cpu/index.html"' in top
    assert "Memory-Efficient Implementation of DenseNets (Pleiss et al., 2017)" in top
    cpu = (out / "cpu" / "index.html").read_text()
    assert "-p rate=0.25" in cpu and "efficient_densenet" not in cpu
    assert '<img src="good/two_panels.png" alt="two_panels.png" class="wide">' in cpu
    assert '<img src="good/narrow.png" alt="narrow.png">' in cpu
    assert report.paper_citation("good") == "good"


def test_paper_registry_names_every_notebook():
    assert set(report.PAPERS) == {"tour", "packed_bit_optimizers", "optorch", "efficient_densenet", "calcgraph",
                                  "variable_batch_size", "advisor"}
    assert report.paper_citation("optorch") == (
        "OpTorch: optimized deep learning architectures for resource limited environments (Ahmed & Naveed, 2021)")


def test_notebook_results_from_jupyterlab_go_to_the_notebooks_repository(tmp_path, monkeypatch):
    repo = tmp_path / "my-clone"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    monkeypatch.chdir(repo / "notebooks")  # Jupyter starts the kernel in the notebook's folder
    path = save_results("tour", output_dir="", parameters={}, records={"r": pd.DataFrame({"a": [1]})},
                        ledger=Ledger())
    assert path == repo / "reports" / "interactive" / "tour" / "results.json"
    write_index(repo / "reports")
    assert 'href="interactive/index.html#tour"' in (repo / "reports" / "index.html").read_text()


# ---------------------------------------------------------------------------------------------
# The library: MemoryMeter


def test_memory_meter_refuses_cuda_without_cuda_and_reentry():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            MemoryMeter("cuda")
    meter = MemoryMeter()
    with meter:
        with pytest.raises(RuntimeError, match="already measuring"):
            meter.__enter__()
        kept = torch.zeros(10)
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None  # nothing left active after the block
    assert meter.peak_bytes == 40
    with meter:  # one region after another is fine
        torch.zeros(5)
    assert meter.peak_bytes == 20
    del kept


# ---------------------------------------------------------------------------------------------
# Messages that name what is wrong


def test_an_empty_out_or_notebooks_folder_name_is_refused(notebooks, tmp_path, fake, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for option in ("--out", "--notebooks"):
        with pytest.raises(SystemExit) as exit_info:
            main(["report", "good", option, ""])
        assert exit_info.value.code == 2
        assert f"argument {option}: '' is an empty folder name" in capsys.readouterr().err
    with pytest.raises(UsageError, match="out_dir='' is empty"):
        build_reports(["good"], out_dir="", notebooks=notebooks)
    assert not fake.calls and list(tmp_path.iterdir()) == [notebooks]


def test_a_notebook_folder_without_notebooks_is_an_error(tmp_path, fake, capsys):
    (tmp_path / "empty").mkdir()
    assert run_cli(tmp_path / "empty", tmp_path / "r") == 2
    assert f"notebook folder {tmp_path / 'empty'} holds no notebooks" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("text,message", [
    ("{not json", "not a valid kernel spec (Expecting property name"),
    ('{"display_name": "x"}', "not a valid kernel spec (argv must be a list of strings"),
])
def test_an_invalid_kernel_spec_is_named_before_any_kernel_starts(notebooks, tmp_path, fake, capsys, monkeypatch,
                                                                  text, message):
    root = tmp_path / "checkout"
    (root / "kernels" / "workbench").mkdir(parents=True)
    spec = root / "kernels" / "workbench" / "kernel.json"
    spec.write_text(text)
    monkeypatch.setattr(report.runner, "repo_root", lambda: root)
    monkeypatch.setenv("JUPYTER_PATH", "")
    assert run_cli(notebooks, tmp_path / "r", "good", "--profile", "smoke") == 2
    err = capsys.readouterr().err
    assert f"{spec}: {message}" in err
    assert not fake.calls and not (tmp_path / "r").exists()
    monkeypatch.setattr("workbench.devices.repo_root", lambda: root)
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "jupyter"))
    assert main(["kernel", "install", "--user"]) == 2
    assert f"{spec}: {message}" in capsys.readouterr().err and not (tmp_path / "jupyter").exists()
