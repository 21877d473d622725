"""Report builds on a Dask cluster (`workbench report --workers N` / `--scheduler ADDRESS`): the serial build's
results, index, failure and locking semantics, and a worker that dies fails its own notebook only.

Most tests run a fake executor inside the two workers of one small cluster, as a scheduler elsewhere would
have them (given to workers as a preload script, so a restarted worker has it too; one worker declares a
`GPU` resource); one test runs real papermill in the runner's own local cluster.
"""

import json
import logging
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import dask
import pytest
from distributed import Nanny, Scheduler, SpecCluster
from runner_cases import run_cli, write_notebook

from workbench.report import UsageError, build_reports
from workbench.report import cluster
from workbench.report.cluster import _cores, check_cluster_options, is_gpu_notebook, run_on_cluster
from workbench.report.folders import locked

# Runs in each worker of the test cluster: papermill replaced by the fake executor of runner_cases (a module of
# that name, so the real one, seconds to import, never loads there), which here also ends the worker process
# (os._exit) when a notebook's value is -99.
FAKE_WORKER = f"""
import os, sys, types
sys.path.insert(0, {str(Path(__file__).parent)!r})
import matplotlib
matplotlib.use("Agg")
from runner_cases import FakeExecutor
from workbench.report import runner


class DyingExecutor(FakeExecutor):
    def __call__(self, source, executed, parameters, **kwargs):
        if parameters.get("value") == -99:
            os._exit(3)
        return super().__call__(source, executed, parameters, **kwargs)


def dask_setup(worker):
    sys.modules["papermill"] = types.SimpleNamespace(execute_notebook=DyingExecutor())
    runner._export_html = lambda nb: nb.with_suffix(".html").write_text("<html></html>")
"""
TIMEOUT = 60  # seconds any one wait in these tests may take


@pytest.fixture(scope="module")
def cluster_address():
    worker = {"nthreads": 1, "host": "127.0.0.1", "memory_limit": 0, "preload": [FAKE_WORKER],
              "silence_logs": logging.CRITICAL}
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        spec = SpecCluster(
            scheduler={"cls": Scheduler, "options": {"host": "127.0.0.1", "dashboard_address": None}},
            workers={"cpu": {"cls": Nanny, "options": worker},
                     "gpu": {"cls": Nanny, "options": {**worker, "resources": {"GPU": 1}}}},
            silence_logs=logging.CRITICAL,
        )
    with spec:
        yield spec.scheduler_address


def _add(notebooks, name, profile_text):
    write_notebook(notebooks, name)
    (notebooks / "profiles" / f"{name}.yaml").write_text(profile_text)


def _normalized(page: str) -> str:
    """An index page without its times: when each run started and how many seconds it took."""
    page = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "TIME", page)
    page = re.sub(r"<td>\d+(?:\.\d+)?</td>", "<td>N</td>", page)
    return re.sub(r"\d+(?:\.\d+)? s on", "N s on", page)


def _report(folder: Path) -> dict:
    """What a report folder says, times and the staging path aside."""
    run = json.loads((folder / "run.json").read_text())
    results = json.loads((folder / "results.json").read_text()) if (folder / "results.json").exists() else {}
    results.get("parameters", {}).pop("output_dir", None)
    return {"run": {k: v for k, v in run.items() if k not in ("started", "seconds")},
            "results": {k: results.get(k) for k in ("parameters", "records", "claims", "figures")},
            "files": sorted(p.name for p in folder.iterdir())}


def test_a_two_worker_build_equals_the_serial_one(notebooks, fake, cluster_address, tmp_path):
    _add(notebooks, "bad", "smoke:\n  value: -1\n")  # the fake executor fails it like a failing cell
    _add(notebooks, "other", "smoke:\n  value: 5\n")
    serial = build_reports(profile="smoke", out_dir=tmp_path / "serial", notebooks=notebooks, progress=False,
                           overrides={"label": "b"})
    parallel = build_reports(profile="smoke", out_dir=tmp_path / "dask", notebooks=notebooks, progress=False,
                             overrides={"label": "b"}, scheduler=cluster_address)
    columns = ["name", "status", "error", "kept_previous"]
    assert parallel[columns].equals(serial[columns])
    assert dict(zip(parallel.name, parallel.status, strict=True)) == {"bad": "failed", "good": "ok", "other": "ok"}
    for name in ("bad", "good", "other"):
        assert _report(tmp_path / "dask" / "smoke" / name) == _report(tmp_path / "serial" / "smoke" / name)
    for page in ("index.html", "smoke/index.html"):
        assert _normalized((tmp_path / "dask" / page).read_text()) == _normalized(
            (tmp_path / "serial" / page).read_text())


def test_reports_move_into_place_under_the_same_build_lock(notebooks, cluster_address, tmp_path):
    out = tmp_path / "reports"
    out.mkdir()
    outcome = {}

    def build():
        outcome["results"] = build_reports(["good"], profile="smoke", out_dir=out, notebooks=notebooks,
                                           progress=False, scheduler=cluster_address)

    with locked(out):  # another build is moving its reports into place
        thread = threading.Thread(target=build, daemon=True)
        thread.start()
        deadline = time.monotonic() + TIMEOUT
        while not list((out / "smoke").glob(".staging-good-*/run.json")):  # run, waiting for the lock
            assert time.monotonic() < deadline and thread.is_alive(), "the notebook never finished its run"
            time.sleep(0.1)
        time.sleep(0.5)
        assert not (out / "smoke" / "good").exists() and thread.is_alive()
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    assert outcome["results"].status.tolist() == ["ok"]
    assert (out / "smoke" / "good" / "results.json").is_file() and (out / "smoke" / "index.html").is_file()


def test_workers_run_papermill_in_a_local_cluster(notebooks, tmp_path, capsys):
    """The runner's own cluster, real kernels in its workers: one notebook kills its worker (the kernel's
    parent process) and is recorded failed; the other runs, its kernel given its worker's share of threads."""
    import nbformat

    body = "import os, signal\nprint('threads', os.environ.get('OMP_NUM_THREADS'))\nif value < 0:\n    "
    write_notebook(notebooks, "killer")
    for name, last in (("killer", "os.kill(os.getppid(), signal.SIGKILL)"), ("good", "pass")):
        nb = nbformat.read(notebooks / f"{name}.ipynb", as_version=4)
        nb.cells[1].source = body + last
        nbformat.write(nb, notebooks / f"{name}.ipynb")
    out = tmp_path / "reports"
    assert run_cli(notebooks, out, "--profile", "smoke", "--workers", "2", "-p", "value=-1") == 1
    printed = capsys.readouterr().out
    assert "failed  killer" in printed and "the Dask worker running this notebook died" in printed
    assert "    ok  good" in printed and "\n        nan" not in printed
    assert json.loads((out / "smoke" / "killer" / "run.json").read_text())["status"] == "failed"
    executed = nbformat.read(out / "smoke" / "good" / "good.ipynb", as_version=4)
    shared = max(1, _cores() // 2)  # two workers share the cores: the kernels they start run as many threads
    assert f"threads {shared}" in str(executed.cells[-1].outputs)


def test_cluster_options_are_checked_before_anything_runs(notebooks, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cluster, "CONNECT_TIMEOUT", 1)
    for workers, scheduler, message in (
        (0, None, "1..256"), (257, None, "1..256"), (True, None, "whole number"), (2, "tcp://127.0.0.1:1", "give one"),
        (None, " ", "HOST:PORT"), (None, "nonsense", "missing port number"), (None, "tcp://h:port", "HOST:PORT"),
        (None, "tcp://h:70000", "1..65535"), (None, "http://h:8786", "unknown scheme 'http'; choose one of"),
    ):
        with pytest.raises(UsageError, match=message) as caught:
            check_cluster_options(workers, scheduler)
        assert repr(scheduler if workers is None else workers) in str(caught.value)  # the bad value, named
    with pytest.raises(UsageError, match="cannot reach the Dask scheduler at 'tcp://127.0.0.1:9'"):
        build_reports(profile="smoke", out_dir=tmp_path / "r", notebooks=notebooks, progress=False,
                      scheduler="tcp://127.0.0.1:9")
    assert not list((tmp_path / "r").glob("smoke/*"))
    for args, message in ((("--workers", "two"), "'two': give a whole number of worker processes in 1..256"),
                          (("--workers", "2", "--scheduler", "tcp://h:1"), "not allowed with argument"),
                          (("--scheduler", "h:1:2"), "HOST:PORT")):
        with pytest.raises(SystemExit) as stopped:
            run_cli(notebooks, tmp_path / "r", *args)
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_gpu_notebooks_are_those_that_ask_for_cuda(monkeypatch):
    monkeypatch.delenv("WORKBENCH_DEVICE", raising=False)
    assert is_gpu_notebook({"device": "cuda"}, "smoke") and is_gpu_notebook({"device": "cuda:1"}, "cpu")
    assert not is_gpu_notebook({"device": "cpu"}, "paper") and not is_gpu_notebook({"device": "cpu"}, "cpu",
                                                                                    cuda_here=True)
    # a device left to the notebook, on a cluster elsewhere: the profiles sized for a GPU
    assert is_gpu_notebook({}, "paper") and is_gpu_notebook({"device": "auto"}, "gpu")
    assert not is_gpu_notebook({"device": ""}, "cpu")
    # ... on a local cluster: the device the notebook will pick here (devices.pick_device)
    assert is_gpu_notebook({"device": ""}, "cpu", cuda_here=True) and not is_gpu_notebook({}, "gpu", cuda_here=False)
    monkeypatch.setenv("WORKBENCH_DEVICE", "cpu")
    assert not is_gpu_notebook({"device": "auto"}, "paper", cuda_here=True)


def _stamped(job):  # runs in a worker, which imports this module (the preload put its folder on sys.path)
    from distributed import get_worker

    start = time.time()
    time.sleep(0.5)
    return {"name": job.name, "span": (start, time.time()), "worker": get_worker().name}


def test_gpu_notebooks_run_one_per_gpu_beside_the_others(cluster_address):
    """On a cluster whose workers declare GPUs, GPU notebooks ask for one: they run on the GPU worker, one
    at a time, while the other worker runs the CPU notebook."""
    from distributed import Client

    def lost(job, error, *when):
        raise AssertionError(f"{job.name}: {error}")

    jobs = [SimpleNamespace(name=n) for n in ("gpu_a", "gpu_b", "cpu")]
    with Client(cluster_address, set_as_default=False, timeout=TIMEOUT) as client:
        client.wait_for_workers(2, timeout=TIMEOUT)  # a worker an earlier test killed is back
        records = run_on_cluster(client, jobs, _stamped, lost=lost, done=lambda record: None,
                                 gpu=lambda job: job.name.startswith("gpu"))
    span = {r["name"]: r["span"] for r in records}
    assert [r["name"] for r in records] == ["gpu_a", "gpu_b", "cpu"]
    assert [r["worker"] for r in records] == ["gpu", "gpu", "cpu"]
    assert span["gpu_a"][1] <= span["gpu_b"][0]  # one GPU: one after the other
    assert span["cpu"][0] < span["gpu_b"][1]  # not queued behind them: the other worker runs it meanwhile


# Last of the tests on the module's cluster: its nanny restarts the worker this kills, but a restart that
# overlapped another cluster's shutdown under load was seen closed again by the nanny (distributed 2026.8),
# which would leave the tests after it one worker.
def test_a_worker_that_dies_fails_its_notebook_and_keeps_the_last_good_report(notebooks, cluster_address,
                                                                              tmp_path):
    _add(notebooks, "dies", "smoke:\n  value: -99\n")  # its worker process exits in the middle of its run
    out = tmp_path / "reports"
    first = build_reports(profile="smoke", out_dir=out, notebooks=notebooks, progress=False,
                          overrides={"value": 4}, scheduler=cluster_address)
    assert set(first.status) == {"ok"}
    good_report = (out / "smoke" / "dies" / "results.json").read_text()
    rebuilt = build_reports(profile="smoke", out_dir=out, notebooks=notebooks, progress=False,
                            scheduler=cluster_address).set_index("name")
    assert rebuilt.status.to_dict() == {"dies": "failed", "good": "ok"}  # the other notebook is not blamed
    assert "the Dask worker running this notebook died" in rebuilt.error["dies"]
    assert rebuilt.kept_previous["dies"]
    assert (out / "smoke" / "dies" / "results.json").read_text() == good_report
    failed = json.loads((out / "smoke" / "dies" / "failed-run" / "run.json").read_text())
    assert failed["status"] == "failed" and failed["parameters"] == {"value": -99}
    assert "rebuild failed; last good report shown" in (out / "smoke" / "index.html").read_text()
    assert not list((out / "smoke").glob(".*-dies-*"))  # the dead worker's staging folder is gone
