"""Build notebooks as reference reports on a device: the `gpu` profile through the same notebooks (issue 22).

`run` is what run.sh calls for notebooks (`parts`), also usable alone on a machine holding a checkout and
`wheels/`::

    python3 -m workbench.gpu run tour --wheels wheels --commit <sha> --deadline 540 --bundle "$OUT"

It installs the carried wheels the machine needs (`wheels`), gives the `workbench` kernel a `python` that
is this interpreter, builds the report with the ordinary runner (`build_reports`: same notebooks, same checks,
same results.json), keeps it as a reference folder (`reports/reference/<device-slug>/<name>/`, see
`place`) and writes it as one archive to `--bundle`. The commit given with `--commit` is the one recorded
everywhere (run.json, and results.json through WORKBENCH_COMMIT): git would read none in a copy, or the commit
of a repository the copy sits in. `--deadline` stops a notebook past that many seconds and keeps what it
finished as a failed report, so a call on a time-limited machine always brings something back.
`--profile smoke --device cpu` is the dry run (tests do it): the same steps on a CPU at toy sizes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from ..devices import repo_root
from ..report.reference import REFERENCE, checkout_commit
from ..report.results import PROFILES, UsageError, _read_json, _write_atomic
from .place import write_reference
from .wheels import install_wheels, prepend_path

__all__ = ["check_device", "check_commit", "environment_restored", "DeadlineExceeded", "run"]

DEVICE_PATTERN = re.compile(r"cpu|cuda(?::[0-9]+)?")
COMMIT_PATTERN = re.compile(r"[0-9a-fA-F]{4,40}")


def check_device(device: str) -> str:
    """`device` if it names a device this project runs on (cpu, cuda, cuda:N) that is here, else UsageError."""
    import torch

    if not isinstance(device, str) or not DEVICE_PATTERN.fullmatch(device):
        raise UsageError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available here (torch {torch.__version__}); "
                         f"use --device cpu for a dry run")
    return device


def check_commit(commit: str | None) -> str:
    """The commit to record: `commit`, else WORKBENCH_COMMIT, else this checkout's own (UsageError if none)."""
    commit = commit or os.environ.get("WORKBENCH_COMMIT") or checkout_commit()
    if not commit:
        raise UsageError("--commit: this copy is not a git checkout of its own, so it knows no commit; pass the "
                         "commit it holds (run.sh passes the one `pack` copied)")
    if not COMMIT_PATTERN.fullmatch(commit):
        raise UsageError(f"--commit {commit!r}: expected a git commit, 4 to 40 hexadecimal digits")
    return commit.lower()


def _python_shim(folder: Path) -> None:
    """The kernel spec starts `python`: make it this interpreter (a bare image may only have `python3`)."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "python"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    prepend_path("PATH", folder)


@contextmanager
def environment_restored():
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _where(device: str) -> dict:
    """The machine's description of `device` (the notebook's own `pick_device` rule when it is empty)."""
    from ..devices import environment, pick_device

    return environment(pick_device(device or None))


class DeadlineExceeded(Exception):
    """A notebook ran past `--deadline`: its run is recorded as failed, with the cells it finished."""


# NOTE: where the deadline is not raised (it waits for the main thread to leave, at most `_GRACE` seconds): an import or
# a compile (CPython 3.11's AST constructor, interrupted by an exception from a finalizer it set off, leaves "AST
# constructor recursion depth mismatch" for the next parse), and an asyncio callback or task step (the task keeps the
# exception, the loop stops: "Event loop stopped before Future completed", once in CI). Waiting for the kernel's
# messages (the selector), where the client spends its time, it leaves the event loop as it should
_UNSAFE_PREFIX, _UNSAFE_FILES, _GRACE = "<frozen importlib._bootstrap", ("/ast.py", "/asyncio/events.py"), 60.0


def _unsafe(frame) -> bool:
    """Whether `frame` runs inside one of the places named above."""
    while frame is not None:
        file = frame.f_code.co_filename
        if file.startswith(_UNSAFE_PREFIX) or file.endswith(_UNSAFE_FILES):
            return True
        frame = frame.f_back
    return False


@contextmanager
def _deadline(seconds: float | None, name: str):
    """Raise DeadlineExceeded in this (main) thread after `seconds`, so a notebook that overruns a machine's
    time limit still leaves a report: papermill saves the cells it finished, the runner records the failure.
    Yields a list that holds the exception once raised (see `_past_deadline`)."""
    fired: list[DeadlineExceeded] = []
    if not seconds:
        yield fired
        return

    last = time.monotonic() + seconds + _GRACE

    def expire(signum, frame):
        if _unsafe(frame) and time.monotonic() < last:
            signal.setitimer(signal.ITIMER_REAL, 0.02)  # raised a moment later, where it cannot be lost
            return
        fired.append(DeadlineExceeded(f"{name} ran past --deadline {seconds:g} s; the cells it finished are in the "
                                      f"report"))
        raise fired[-1]

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _past_deadline(row, exc: DeadlineExceeded, reports: Path):
    """`row` of `build_reports` (and its report's run.json) failed by the deadline `exc`. Raised while the notebook
    client's event loop runs a task, the exception can reach the runner as asyncio's own ("RuntimeError: Event loop
    stopped before Future completed", once in CI), which would say nothing of the deadline."""
    error = f"{type(exc).__name__}: {exc}"
    run = reports / row.name / "run.json"
    record = _read_json(run)
    if record.get("status") == "failed" and "DeadlineExceeded" not in str(record.get("error")):
        _write_atomic(run, json.dumps({**record, "error": error}, indent=1))  # as the runner writes it
    return row if "DeadlineExceeded" in str(row.error) else row._replace(status="failed", error=error)


def _shown_paths(out: Path, scratch: Path, profile: str, name: str) -> dict[str, str]:
    """The build's temporary folders as the HTML shows them: the report's folder in the build."""
    built = re.escape(str(out.resolve()))
    return {rf"{built}/{re.escape(profile)}/\.staging-{re.escape(name)}-[0-9]+-[0-9a-f]+": f"reports/{profile}/{name}",
            built: "reports", re.escape(str(scratch.resolve())): "build"}


def _check_folder(option: str, path: Path) -> None:
    """UsageError naming `option` when `path` cannot be a folder: a NUL byte, a name too long, a loop of links,
    something there that is not a folder, or a regular file above it (checked before any work)."""
    if "\0" in str(path):
        raise UsageError(f"{option} {str(path)!r} holds a NUL byte, which no path can hold")
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        pass
    except OSError as exc:
        raise UsageError(f"{option} {path}: {exc.strerror or exc}") from None
    if os.path.lexists(path) and not path.is_dir():
        raise UsageError(f"{option} {path} exists and is not a folder; choose another path (or move it away)")
    above = next((p for p in path.absolute().parents if os.path.lexists(p)), None)
    if above is not None and not above.is_dir():
        raise UsageError(f"{option} {path}: {above} is not a folder, so no folder can be made under it")


def run(names: list[str], *, profile: str = "gpu", device: str | None = None, commit: str | None = None,
        out: Path | None = None, reference: Path | None = None, bundle_dir: Path | None = None,
        wheels: Path | None = None, site: Path | None = None, deadline: float | None = None,
        overrides: dict | None = None) -> list[dict]:
    """Build `names` one after another at `profile`, keep each as a reference folder (and an archive in
    `bundle_dir`). `device` overrides the profile's device (`cpu` for a dry run); `deadline` is each notebook's
    time limit in seconds. Everything is checked before any work. Returns one dict per notebook: name, status,
    seconds, error, reference, archive. Sets WORKBENCH_COMMIT (the caller restores the environment)."""
    from ..report.parameters import load_profile
    from ..report.runner import available_notebooks
    from .archive import bundle

    if deadline is not None and not 0 < deadline <= 86400:
        raise UsageError(f"--deadline {deadline}: expected seconds in 0..86400 (exclusive of 0)")
    overrides = dict(overrides or {})
    if device is not None:
        overrides["device"] = check_device(device)
    if profile not in PROFILES:
        raise UsageError(f"--profile {profile!r}: expected one of {', '.join(PROFILES)}")
    known = available_notebooks(repo_root() / "notebooks")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(f"unknown notebook(s) {', '.join(map(repr, unknown))}; expected some of {', '.join(known)}")
    devices = {name: str(overrides.get("device", load_profile(name, profile).get("device", ""))) for name in names}
    for chosen in devices.values():
        if chosen:
            check_device(chosen)
    from ..report.runner import _plan

    _plan(list(dict.fromkeys(names)), profile, overrides, repo_root() / "notebooks")  # each -p, before any work
    for option, path in (("--out", out), ("--reference", reference), ("--bundle", bundle_dir), ("--wheels", wheels),
                         ("--site", site)):
        if path is not None:
            _check_folder(option, Path(path))
    os.environ["WORKBENCH_COMMIT"] = commit = check_commit(commit)  # devices.environment records it
    scratch = Path(tempfile.mkdtemp(prefix="workbench-gpu-"))
    try:
        install_wheels(wheels, site or Path(tempfile.gettempdir()) / "workbench-gpu-site")
        _python_shim(scratch / "bin")
        prepend_path("PYTHONPATH", repo_root())  # the kernel imports this checkout's workbench, installed or not
        from ..report.runner import build_reports

        out = out or scratch / "reports"
        reference = reference or repo_root() / "reports" / REFERENCE
        done = []
        for name in dict.fromkeys(names):
            try:
                with _deadline(deadline, name) as fired:
                    table = build_reports([name], profile=profile, out_dir=out, progress=False, overrides=overrides)
                rows = [_past_deadline(row, fired[0], out / profile) if fired else row for row in table.itertuples()]
            except DeadlineExceeded as exc:  # past the deadline outside the notebook (saving, the index)
                rows = [SimpleNamespace(name=name, status="failed", seconds=deadline, error=str(exc))]
            for row in rows:
                folder, kept, archive = out / profile / row.name, None, None
                if (folder / "run.json").is_file():
                    kept = write_reference(folder, reference, commit=commit, environment=_where(devices[row.name]),
                                           shown_paths=_shown_paths(out, scratch, profile, row.name))
                    archive = bundle(kept, bundle_dir) if bundle_dir is not None else None
                done.append({"name": row.name, "status": row.status, "seconds": row.seconds, "error": row.error,
                             "reference": kept, "archive": archive})
        return done
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
