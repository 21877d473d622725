"""The GPU run (workbench.gpu) on a bare CUDA image: the wheels it carries meet every requirement of the Jupyter
stack (extras too), a carried wheel replaces an installed distribution only when the stack needs another
version, Jupyter finds the carried templates, one commit is recorded everywhere, and bad input is refused before
any work; the command's earlier name still runs it."""

import json
import os
import sys
import zipfile

import pytest
import torch
from packaging.utils import canonicalize_name
from packaging.version import Version

from workbench.devices import environment
from workbench.gpu import cli
from workbench.gpu import run as gpu_run
from workbench.gpu import wheels as gpu_wheels
from workbench.report.results import UsageError


def test_every_requirement_of_the_stack_is_met_by_the_image_or_a_carried_wheel():
    """The wheel set for the image's package list (gpu_wheels.ON_IMAGE): each requirement of the stack, as
    Python 3.12 on Linux reads it, extras followed, names a carried wheel at a version it accepts (its extras
    offered) or a distribution the image has (at a version it accepts where the image's version is known)."""
    carried = dict(r.split("==") for r in gpu_wheels.wheel_requirements())
    versions, requirements = gpu_wheels.stack_requirements()
    assert {"papermill", "nbconvert", "ipykernel", "pyzmq", "bleach", "tinycss2"} <= set(carried)  # bleach[css]
    assert not set(carried) & gpu_wheels.NEVER_CARRIED
    for who, requirement in requirements:
        name = canonicalize_name(requirement.name)
        if name in carried:
            assert requirement.specifier.contains(Version(carried[name]), prereleases=True), (who, str(requirement))
            offered = gpu_wheels._installed_here(name)[2]
            assert {canonicalize_name(e) for e in requirement.extras} <= offered, (who, str(requirement))
        else:
            assert name in gpu_wheels.ON_IMAGE, f"{who} needs {requirement}: neither carried nor on the image"
            known = gpu_wheels.IMAGE_VERSIONS.get(name)
            assert known is None or requirement.specifier.contains(Version(known), prereleases=True), requirement


STACK = {  # name: (version, requires, extras offered): a small stand-in for the real stack's metadata
    "nbconvert": ("7.17.2", ["bleach[css]!=5.0.0", "jinja2>=3.0", "torch>=2.0"], set()),
    "bleach": ("6.4.0", ['tinycss2>=1.1.0; extra == "css"'], {"css"}),
    "tinycss2": ("1.5.1", [], set()),
    "jinja2": ("3.1.6", [], set()),
    "torch": ("2.13.0", [], set()),
}


CSS = ['tinycss2>=1.1.0; extra == "css"']


@pytest.mark.parametrize("image, expected", [
    ({}, ["bleach", "jinja2", "nbconvert", "tinycss2"]),  # a bare image: everything carried
    ({"bleach": ("6.0.0", CSS, {"css"}), "jinja2": ("3.1.2", [], set())}, ["nbconvert", "tinycss2"]),  # kept
    ({"bleach": ("6.0.0", CSS, {"css"}), "jinja2": ("2.11.3", [], set())}, ["jinja2", "nbconvert", "tinycss2"]),
    ({"bleach": ("4.1.0", [], set()), "jinja2": ("3.1.2", [], set())}, ["bleach", "nbconvert", "tinycss2"]),  # no css
    ({"bleach": ("5.0.0", CSS, {"css"})}, ["bleach", "jinja2", "nbconvert", "tinycss2"]),  # != 5.0.0
])
def test_a_carried_wheel_replaces_an_installed_one_only_when_the_stack_needs_another(image, expected):
    image = {**image, "torch": ("2.11.0", [], set())}
    wheels = {n: meta for n, meta in STACK.items() if n != "torch"}
    install, unmet = gpu_wheels.plan_install(wheels, image.get, roots=("nbconvert",))
    assert install == expected and unmet == []


def test_a_requirement_nothing_meets_is_reported():
    wheels = {"nbconvert": ("7.0", ["mistune>=2"], set())}
    install, unmet = gpu_wheels.plan_install(wheels, {"mistune": ("0.8", [], set())}.get, roots=("nbconvert",))
    assert install == ["nbconvert"] and unmet == ["mistune>=2 (for nbconvert; found 0.8)"]


def _wheel(folder, name, version, requires=(), extras=()):
    path = folder / f"{name}-{version}-py3-none-any.whl"
    lines = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires),
             *(f"Provides-Extra: {e}" for e in extras)]
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{name}-{version}.dist-info/METADATA", "Metadata-Version: 2.1\n" + "\n".join(lines) + "\n")
    return path


def test_install_wheels_installs_the_plan_once_and_shows_jupyter_the_templates(tmp_path, monkeypatch):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "nbconvert", "7.17.2", ["bleach[css]"])
    _wheel(wheels, "bleach", "6.4.0", ['tinycss2; extra == "css"'], ["css"])
    _wheel(wheels, "tinycss2", "1.5.1")
    installed = {"bleach": ("6.4.0", CSS, {"css"})}  # the image's bleach will do; tinycss2 and nbconvert will not
    monkeypatch.setattr(gpu_wheels, "_installed_outside", lambda site: installed.get)
    monkeypatch.setattr(gpu_wheels, "_missing", lambda: [])
    calls = []

    def pip(command, check):  # what `pip install --target` leaves: the dist-info and nbconvert's data files
        calls.append(command)
        (site / "nbconvert-7.17.2.dist-info").mkdir()
        (site / "nbconvert-7.17.2.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: nbconvert\n"
                                                                       "Version: 7.17.2\n")
        (site / "share" / "jupyter" / "nbconvert" / "templates" / "lab").mkdir(parents=True)

    monkeypatch.setattr(gpu_wheels.subprocess, "run", pip)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for variable in ("PYTHONPATH", "JUPYTER_PATH"):
        monkeypatch.setenv(variable, "")
    assert gpu_wheels.install_wheels(wheels, site, log=lambda text: None, roots=("nbconvert",)) == site
    (command,) = calls
    assert sorted(os.path.basename(c) for c in command if c.endswith(".whl")) == [
        "nbconvert-7.17.2-py3-none-any.whl", "tinycss2-1.5.1-py3-none-any.whl"]
    assert "--no-index" in command and "--no-deps" in command and command[command.index("--target") + 1] == str(site)
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(site)
    from jupyter_core.paths import jupyter_path

    assert str(site / "share" / "jupyter" / "nbconvert" / "templates") in jupyter_path("nbconvert", "templates")
    gpu_wheels.install_wheels(wheels, site, log=lambda text: None, roots=("nbconvert",))  # a later call there
    assert len(calls) == 1 and json.loads((site / gpu_wheels.STAMP).read_text())


def test_install_wheels_refuses_a_folder_it_did_not_make(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "tinycss2", "1.5.1")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "mine.txt").write_text("mine")
    monkeypatch.setattr(gpu_wheels, "_installed_outside", lambda site: {}.get)
    with pytest.raises(UsageError, match="was not made by install_wheels"):
        gpu_wheels.install_wheels(wheels, tmp_path / "site", log=lambda text: None)
    assert (tmp_path / "site" / "mine.txt").read_text() == "mine"


def test_the_commit_given_is_the_one_every_environment_records(monkeypatch):
    monkeypatch.setenv("WORKBENCH_COMMIT", "012f1da5c3862ec8e6ae36c52e551211181c1d3f")
    assert environment("cpu")["git_commit"] == "012f1da5c3862ec8e6ae36c52e551211181c1d3f"
    assert gpu_run.check_commit(None) == "012f1da5c3862ec8e6ae36c52e551211181c1d3f"
    assert gpu_run.check_commit("ABC1234") == "abc1234"
    with pytest.raises(UsageError, match="4 to 40 hexadecimal digits"):
        gpu_run.check_commit("main; rm -rf /")


def test_a_copy_inside_another_repository_knows_no_commit_of_its_own(tmp_path, monkeypatch):
    import subprocess

    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "pyproject.toml").write_text("")
    for command in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "t"]):
        subprocess.run(["git", *command], cwd=tmp_path, check=True, capture_output=True)
    assert gpu_run.checkout_commit(tmp_path / "copy") is None
    monkeypatch.delenv("WORKBENCH_COMMIT", raising=False)
    monkeypatch.setattr(gpu_run, "checkout_commit", lambda: None)
    with pytest.raises(UsageError, match="--commit: this copy is not a git checkout of its own"):
        gpu_run.check_commit(None)


@pytest.mark.parametrize("argv, message", [
    (["run", "tour", "-p", "device=tpu"], "'tpu': expected cpu, cuda or cuda:N"),
    (["run", "no_such_notebook", "--device", "cpu"], "unknown notebook(s) 'no_such_notebook'"),
    (["run", "tour", "--device", "cpu", "--deadline", "0"], "--deadline 0.0: expected seconds"),
    (["run", "tour", "--device", "cpu", "--commit", "xyz"], "--commit 'xyz'"),
])
def test_run_refuses_bad_input_before_any_work(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(gpu_run, "install_wheels", lambda *a, **k: pytest.fail("work started"))
    assert cli.main([*argv, "--out", str(tmp_path / "o"), "--reference", str(tmp_path / "r")]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "o").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_run_refuses_cuda_where_there_is_none(tmp_path, capsys):
    assert cli.main(["run", "tour", "--out", str(tmp_path / "o"), "--reference", str(tmp_path / "r")]) == 2
    assert "CUDA is not available here" in capsys.readouterr().err


def test_a_notebook_past_its_deadline_is_kept_as_a_failed_reference(tmp_path, capsys):
    """--deadline stops a notebook that would overrun a machine's time limit; what it finished comes back."""
    code = cli.main(["run", "tour", "--profile", "smoke", "--device", "cpu", "--deadline", "3",
                         "--out", str(tmp_path / "build"), "--reference", str(tmp_path / "ref"),
                         "--bundle", str(tmp_path / "bundle"), "--commit", "abc1234"])
    out = capsys.readouterr().out
    assert code == 1 and "ran past --deadline 3 s" in out, out
    (folder,) = (tmp_path / "ref").glob("*/tour")
    run = json.loads((folder / "run.json").read_text())
    assert run["status"] == "failed" and "DeadlineExceeded" in run["error"]
    assert run["environment"]["device"] == "cpu" and run["environment"]["torch"] == torch.__version__
    assert run["environment"]["commit"] == "abc1234" and os.environ.get("WORKBENCH_COMMIT") != "abc1234"
    assert folder.parent.name.startswith("cpu") and len(list((tmp_path / "bundle").glob("*.tar.gz"))) == 1


def test_a_deadline_swallowed_on_its_way_to_the_runner_is_still_the_recorded_error(tmp_path):
    """Raised inside a task of the notebook client's event loop, the deadline reached the runner once (in CI) as
    asyncio's "Event loop stopped before Future completed": the run and its report say it ran past the deadline."""
    import time

    import pandas as pd

    with gpu_run._deadline(0.2, "tour") as fired:
        try:
            time.sleep(5)
        except gpu_run.DeadlineExceeded:
            pass  # what asyncio's task machinery may do with it
    assert len(fired) == 1
    swallowed = "RuntimeError: Event loop stopped before Future completed."
    (tmp_path / "tour").mkdir()
    (tmp_path / "tour" / "run.json").write_text(json.dumps({"name": "tour", "status": "failed", "error": swallowed}))
    (row,) = pd.DataFrame([{"name": "tour", "status": "failed", "seconds": 0.2, "error": swallowed}]).itertuples()
    row = gpu_run._past_deadline(row, fired[0], tmp_path)
    assert row.status == "failed" and row.error.startswith("DeadlineExceeded: tour ran past --deadline 0.2 s")
    assert json.loads((tmp_path / "tour" / "run.json").read_text())["error"] == row.error
    with gpu_run._deadline(None, "tour") as fired:
        pass
    assert fired == []

@pytest.mark.parametrize("place", ["/lib/python3/asyncio/events.py", "<frozen importlib._bootstrap_external>",
                                   "/lib/python3/ast.py"])
def test_the_deadline_is_raised_once_the_main_thread_leaves_an_import_a_compile_or_an_event_loop_callback(place):
    """There an exception is lost (asyncio keeps it in the task) or breaks the interpreter (CPython 3.11's AST
    constructor); the deadline is raised a moment after the thread leaves."""
    import time

    namespace: dict = {}
    exec(compile("import time\ndef busy(seconds):\n    end = time.monotonic() + seconds\n"
                 "    while time.monotonic() < end:\n        pass\n", place, "exec"), namespace)
    left = None
    with gpu_run._deadline(0.1, "tour") as fired:
        try:
            namespace["busy"](0.4)  # past the deadline in there: it waits
            left = time.monotonic()
            time.sleep(5)
        except gpu_run.DeadlineExceeded:
            raised = time.monotonic()
    assert left is not None and len(fired) == 1 and 0 <= raised - left < 1

def test_the_earlier_command_name_runs_the_same_command():
    """../shared/GPU.md and packs made before issue 42 say `python -m workbench.report.gpu_run`."""
    import subprocess

    for module in ("workbench.gpu", "workbench.report.gpu_run"):
        done = subprocess.run([sys.executable, "-m", module, "unpack", "--help"], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0 and "usage: python -m workbench.gpu unpack" in done.stdout, done.stderr
