"""`python -m workbench.gpu pack` and the run.sh it writes, dry-run on this CPU at smoke sizes: the same commands a
GPU machine runs (`run.sh tests`, `run.sh <notebook>`), then `unpack` of what they leave.

The pack here has no wheels (`--no-wheels`): this Python has the Jupyter stack already, and downloading 22 MB
of wheels would make the test slow and need the network; the wheels themselves are checked in
tests/gpu/test_run.py. The two dry runs take about 20 s each on a quiet 2-core machine (a Python and pytest start,
then a notebook kernel): they are the only end-to-end check of what the GPU machine runs."""

import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time

import pytest

from workbench.devices import repo_root
from workbench.gpu import parts as gpu_parts
from workbench.gpu.archive import unpack
from workbench.gpu.pack import MAX_PACK_BYTES, pack
from workbench.report.reference import PARTS
from workbench.report.results import UsageError


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """This working tree committed into a scratch repository (pack copies committed HEAD only), packed."""
    repo = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo_root(),
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (repo_root() / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_bytes((repo_root() / name).read_bytes())
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "scratch")
    info = pack(repo / "gpu-pack", no_wheels=True, repo=repo)
    return repo / "gpu-pack", info


def _run_sh(pack_dir, *args, timeout=300):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": ""}  # the pack's own checkout, not this one
    env.pop("WORKBENCH_COMMIT", None)
    return subprocess.run(["sh", str(pack_dir / "run.sh"), *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def test_the_pack_holds_the_committed_checkout_run_sh_and_its_commit(packed):
    folder, info = packed
    head = _git(folder.parent, "rev-parse", "HEAD").strip()
    assert info["commit"] == head and json.loads((folder / "pack.json").read_text())["commit"] == head
    assert (folder / "checkout" / "workbench" / "gpu" / "pack.py").is_file()
    assert not (folder / "checkout" / "reports" / "reference").exists() and not (folder / "checkout" / ".git").exists()
    assert os.access(folder / "run.sh", os.X_OK) and head in (folder / "run.sh").read_text()
    assert info["bytes"] < MAX_PACK_BYTES and info["wheels"] == []
    done = _run_sh(folder)
    assert done.returncode == 2 and "usage: run.sh PART OUTDIR" in done.stderr


def test_pack_replaces_an_earlier_pack_but_nothing_else(packed, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(UsageError, match="exists and is not a pack"):
        pack(mine, no_wheels=True, repo=packed[0].parent)
    assert (mine / "notes.txt").read_text() == "keep"


def test_run_sh_tests_on_cpu_then_unpack(packed, tmp_path):
    folder, info = packed
    out = tmp_path / "out"
    done = _run_sh(folder, "tests", str(out), "--profile", "smoke", "--device", "cpu",
                   "--only", "tests/test_measure.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and "tests.log" in files and "tests.xml" in files
    assert "test_cuda_meter_agrees_with_allocator SKIPPED" in (out / "tests.log").read_text()  # `-m cuda` chose it
    (archive,) = out.glob("tests-cpu*.tar.gz")
    (target,) = unpack(archive, tmp_path / "reports" / "reference")
    record = json.loads((target / "part.json").read_text())
    assert record["status"] == "ok" and record["commit"] == info["commit"] and record["files"] == ["tests.log",
                                                                                                   "tests.xml"]
    assert record["environment"]["git_commit"] == info["commit"]


def test_run_sh_notebook_on_cpu_then_unpack(packed, tmp_path):
    folder, info = packed
    out, reports = tmp_path / "out", tmp_path / "reports"
    done = _run_sh(folder, "tour", str(out), "--profile", "smoke", "--device", "cpu")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["notebooks.log", f"reference-{_slug(out)}-tour.tar.gz"]
    from workbench.gpu import cli

    assert cli.main(["unpack", *map(str, out.glob("*.tar.gz")), "--reports", str(reports)]) == 0
    (reference,) = (reports / "reference").glob("*/tour")
    run, results = (json.loads((reference / f).read_text()) for f in ("run.json", "results.json"))
    assert run["status"] == "ok" and run["environment"]["commit"] == info["commit"]
    assert results["environment"]["git_commit"] == info["commit"]  # one commit, wherever it is recorded
    page = (reference / "tour.html").read_text()
    assert "workbench-gpu-" not in page and ".staging-" not in page and str(tmp_path) not in page
    assert 'output_dir</span> <span class="o">=</span> <span class="s2">&quot;reports/smoke/tour&quot;' in page or \
        "reports/smoke/tour" in page
    assert "| tour | ok | smoke |" in (reports / "reference" / "README.md").read_text()
    assert info["commit"][:7] in (reports / "index.html").read_text()


def _slug(out):
    with tarfile.open(next(out.glob("*.tar.gz"))) as tar:
        return tar.getnames()[0].split("/")[0]


def test_a_part_stopped_at_its_deadline_keeps_its_log_and_archive(tmp_path, monkeypatch):
    script = "import time\nprint('first result', flush=True)\ntime.sleep(120)\n"
    monkeypatch.setattr(gpu_parts, "_command", lambda part, out, device, profile, paths: (
        [sys.executable, "-c", script], [out / "kernels.csv"]))
    started = time.monotonic()
    code = gpu_parts.run_part("kernels", tmp_path, profile="smoke", device="cpu", deadline=2, commit="abc1234")
    assert code == 1 and time.monotonic() - started < 60
    log = (tmp_path / "kernels.log").read_text()
    assert "first result" in log and "stopped at the deadline" in log
    (archive,) = tmp_path.glob("kernels-*.tar.gz")
    with tarfile.open(archive) as tar:
        record = json.load(tar.extractfile(next(m for m in tar.getmembers() if m.name.endswith("part.json"))))
    assert record["status"] == "stopped" and record["files"] == ["kernels.log"]


@pytest.mark.parametrize("part, options, message", [
    ("lint", {}, "expected one of tests, kernels, memory"),
    ("tour,optorch,calcgraph,advisor,efficient_densenet,variable_batch_size,packed_bit_optimizers", {},
     "up to 6 of"),
    ("kernels", {"paths": ["tests"]}, "test paths are for the tests part only"),
    ("tests", {"device": "tpu"}, "'tpu': expected cpu, cuda or cuda:N"),
    ("tests", {"profile": "paper"}, "expected gpu (or smoke"),
    ("tests", {"deadline": 0}, "expected seconds in 1..86400"),
])
def test_a_part_refuses_bad_input_before_any_work(tmp_path, part, options, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        gpu_parts.run_part(part, tmp_path / "out", commit="abc1234", **options)
    assert not (tmp_path / "out").exists()


def test_the_kernels_command_is_the_benchmark_s_own(capsys):
    """`kernels_command` names the benchmark's options: a change to its command line fails here, not there."""
    module = gpu_parts.kernels_command("cuda", repo_root() / "k.csv")[1]
    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    shown = capsys.readouterr().out
    for smoke in (False, True):
        command = gpu_parts.kernels_command("cuda", repo_root() / "k.csv", smoke=smoke)
        assert command[1] == module and all(f in shown for f in command if f.startswith("--"))
    full = gpu_parts.kernels_command("cuda", repo_root() / "k.csv")
    assert full[full.index("--sizes") + 1] == "100000000" and "--compiled-too" in full
    # 64 tensors and 512, where a step that launches once per parameter shows (issue 46)
    assert full[full.index("--tensors") + 1:full.index("--csv")] == ["64", "512"]
    configs = full[full.index("--configs") + 1:full.index("--peers")]
    speed = importlib.import_module(module)
    assert len(configs) >= 8 and all(speed._config(c)[0].packed for c in configs)


def test_the_readme_s_gpu_commands_fit_a_device_call():
    """Each `run.sh` line the README shows names a real part and fits the 2000 characters of a device command."""
    blocks = re.findall(r"```sh\n(.*?)```", (repo_root() / "README.md").read_text(), flags=re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if "run.sh " in line]
    assert lines, "the README shows no run.sh command"
    for line in lines:
        words = shlex.split(line)
        part = words[words.index(next(w for w in words if w.endswith("run.sh"))) + 1]
        assert part in PARTS or part in ("tour", "optorch", "calcgraph", "advisor", "efficient_densenet",
                                         "variable_batch_size", "packed_bit_optimizers") or "," in part, line
        assert len(line) < 2000
