"""Running notebooks headlessly: papermill under the `workbench` kernel at a named profile.

Parameters (typed by each notebook's defaults, within their declared ranges), profile files, the kernel
spec and output folders are checked before any kernel starts (`UsageError`); a failing notebook is
marked failed and the others still run; a failed rebuild never replaces the last good report, and the
runner replaces only what it made (`folders`). Notebooks run one after another in this process, or in
parallel as tasks on a Dask cluster (`cluster`), each task running the same `_run_one`. While they run, the
progress bar names each running notebook, its section (the latest markdown heading above the cell executing,
told by nbclient's cell hooks; from a Dask worker as events to this process) and how long it has run
(`progress`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..devices import cpu_features, repo_root
from .folders import locked, mark, prepare_out, recover, report_state, swap_into_place, temp_name
from .index import write_index
from .parameters import (
    available_notebooks, check_inputs, coerce, load_profile, notebook_parameters, notebooks_dir,
)
from .progress import PROGRESS_TOPIC, CellHooks, Progress, tell_driver
from .results import (
    FAILED_RUN, KERNEL_NAME, KERNEL_QUIET, NAME_PATTERN, PROFILES, RESERVED, UsageError, _jsonable, _write_atomic,
)

__all__ = ["build_reports", "available_notebooks", "load_profile", "notebooks_dir", "check_kernel",
           "check_kernel_spec"]


@dataclass(frozen=True)
class _Job:
    name: str
    parameters: dict  # profile values and overrides, checked and typed
    overrides: dict  # the -p values alone (shown in the index)


def _plan(names, profile, overrides, folder: Path) -> list[_Job]:
    """Validate everything before running anything; the typed parameters per notebook."""
    if profile not in PROFILES:
        raise UsageError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    if not folder.is_dir():
        raise UsageError(f"notebook folder {folder} does not exist (or is not a folder)")
    known = available_notebooks(folder)
    if not known:
        raise UsageError(f"notebook folder {folder} holds no notebooks (<name>.ipynb, names of letters, digits, "
                         f"'_' and '-'); choose the folder with --notebooks")
    names = list(names) or known
    bad = [n for n in names if not isinstance(n, str) or not NAME_PATTERN.fullmatch(n) or n not in known]
    if bad:
        shown = ", ".join(n if isinstance(n, str) and NAME_PATTERN.fullmatch(n) else repr(n) for n in bad)
        raise UsageError(f"unknown notebook(s) {shown}; choose from {', '.join(known)}")
    reserved = sorted(set(overrides) & set(RESERVED))
    if reserved:
        raise UsageError(f"-p {', '.join(reserved)}: set by the report runner itself (interactive=False, "
                         f"output_dir=the report folder); choose the folder with --out")
    jobs = []
    for name in dict.fromkeys(names):
        declared = notebook_parameters(folder / f"{name}.ipynb")
        missing = [p for p in RESERVED if p not in declared]
        if missing:
            raise UsageError(f"notebook {name!r} declares no {', '.join(missing)} in its parameters cell")
        from_profile = load_profile(name, profile, folder)
        params = {**from_profile, **overrides}
        undeclared = sorted(set(params) - set(declared))
        if undeclared:
            raise UsageError(
                f"notebook {name!r} declares no parameter {', '.join(undeclared)}; "
                f"its parameters are {', '.join(sorted(declared))}"
            )
        profile_file = folder / "profiles" / f"{name}.yaml"
        typed = {
            key: coerce(key, value, declared[key],
                        f"-p for notebook {name!r}" if key in overrides else f"{profile_file} ({profile})")
            for key, value in params.items()
        }
        from_p, from_file = f"-p for notebook {name!r}", f"{profile_file} ({profile})"
        check_inputs(typed, declared, lambda keys, p=from_p, f=from_file: p if set(keys) & set(overrides) else f)
        jobs.append(_Job(name, typed, {k: typed[k] for k in overrides}))
    return jobs


def check_kernel() -> Path:
    """The kernel spec papermill will start (`kernels/workbench/kernel.json`), checked before any kernel
    starts; UsageError naming the file when it is missing or not a valid spec."""
    from jupyter_client.kernelspec import KernelSpecManager

    folder = KernelSpecManager().find_kernel_specs().get(KERNEL_NAME)
    if folder is None:
        raise UsageError(f"no Jupyter kernel named {KERNEL_NAME!r}: {repo_root() / 'kernels' / KERNEL_NAME} "
                         f"is missing; restore it from the repository")
    return check_kernel_spec(Path(folder) / "kernel.json")


def check_kernel_spec(path: Path) -> Path:
    """`path` when it is a kernel spec Jupyter can start; UsageError naming the file and the problem."""
    expected = ('expected JSON like {"argv": ["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"], '
                '"display_name": "...", "language": "python"}')
    try:
        spec = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read the kernel spec ({exc})") from None
    except ValueError as exc:
        raise UsageError(f"{path}: not a valid kernel spec ({exc}); {expected}") from None
    except RecursionError:  # json's decoder recurses once a level: a spec nested thousands deep
        raise UsageError(f"{path}: not a valid kernel spec (lists or objects nested too deep to read); "
                         f"{expected}") from None
    argv = spec.get("argv") if isinstance(spec, dict) else None
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)
            and isinstance(spec.get("display_name"), str)):
        raise UsageError(f"{path}: not a valid kernel spec (argv must be a list of strings and display_name a "
                         f"string); {expected}")
    return path


def _export_html(notebook: Path) -> None:
    from .pages import export_page  # here: `python -m workbench.report.pages` runs the module as __main__

    export_page(notebook)  # offline (no CDN scripts), missing values read "—"


def _record(job: _Job, profile: str) -> dict:
    """run.json's start, with the machine it runs on (`devices.cpu_features`: CPU model, ISA flags, torch's and
    oneDNN's kernel choice), so that two builds are compared like with like."""
    return {"name": job.name, "profile": profile, "parameters": job.parameters, "overrides": job.overrides,
            "status": "ok", "error": None, "kept_previous": False, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": cpu_features()}


def _run_one(job: _Job, profile: str, folder: Path, out: Path, root: Path, tell=None) -> dict:
    """Run one notebook into its report folder; `tell(name, section, cell)`, when given, hears of each code cell
    as it starts (`progress.CellHooks`)."""
    import papermill

    name = job.name
    staging = out / temp_name("staging", name)
    record = _record(job, profile)
    start = time.perf_counter()
    try:
        try:
            staging.mkdir(parents=True)
            executed = staging / f"{name}.ipynb"
            papermill.execute_notebook(
                str(folder / f"{name}.ipynb"), str(executed),
                parameters={**job.parameters, "interactive": False, "output_dir": str(staging.resolve())},
                kernel_name=KERNEL_NAME, cwd=str(folder), progress_bar=False,
                extra_arguments=[*KERNEL_QUIET, f"--IPKernelApp.exec_lines={_warm_start(name)}"],
                **(CellHooks(name, tell).engine_kwargs() if tell is not None else {}),
            )
        except Exception as exc:  # a failing notebook (or a full disk) is recorded and the build goes on
            record["status"] = "failed"
            record["error"] = _describe(exc)
        record["seconds"] = round(time.perf_counter() - start, 1)
        _store(record, staging, out, root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return record


def _warm_start(name: str) -> str:
    """The line the kernel runs before the notebook: `freeze_imports(name)`, binding no name of its own."""
    return f"__import__('workbench.report.runner', fromlist=['freeze_imports']).freeze_imports({name!r})"


def freeze_imports(name: str) -> None:
    """In a report's kernel, before its notebook: import the notebook's experiments package and torch's compiler
    front end, and put everything alive then beyond the cyclic garbage collector's reach (`gc.freeze`). A notebook
    without an experiments package (the user's own) gets nothing."""
    # NOTE: the measuring code calls `gc.collect()` before each meter, calibration run and allocator peak (so
    # that garbage of an earlier run is not freed inside the measured region), and a full collection walks
    # every object the imports made (about 0.3 M after torch, pandas and an experiments package: 0.2-0.6 s a
    # call): the advisor and calcgraph notebooks spent 36 s (62 calls) and 79 s (163 calls) of a smoke build in
    # it. Frozen objects are never collected, so only the kernel's and the imports' objects are frozen, before
    # the notebook makes anything: what it makes stays in the collector's reach, and its measures are unchanged.
    # torch._dynamo too (60 k objects): the first step of any torch.optim optimizer imports it (`_disable_dynamo`).
    # Unfrozen at exit, so that the last collection sees everything (else nanobind reports triton's objects leaked).
    import atexit
    import gc
    import importlib

    try:
        importlib.import_module(f"workbench.experiments.{name}")
    except ImportError:
        return
    import torch._dynamo  # noqa: F401

    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


def _store(record: dict, staging: Path, out: Path, root: Path) -> None:
    """Finish a run's staging folder (HTML, run.json, marker) and move it into place under the lock."""
    name = record["name"]
    try:
        if (staging / f"{name}.ipynb").exists():
            try:
                _export_html(staging / f"{name}.ipynb")
            except Exception as exc:
                record["error"] = (record["error"] or "") + f" (HTML export failed: {exc})"
        _write_atomic(staging / "run.json", json.dumps(_jsonable(record), indent=1))
        mark(staging)
        with locked(root):
            record["kept_previous"] = _place(staging, out / name, failed=record["status"] != "ok")
    except (OSError, UsageError) as exc:  # out of space, a vanished folder, a file of yours in the way
        record["status"] = "failed"
        record["kept_previous"] = (out / name / "run.json").exists()
        problem = exc if isinstance(exc, UsageError) else exc.strerror or exc
        record["error"] = (record["error"] + "; " if record["error"] else "") + (
            f"could not write the report: {problem}")


def _run_in_worker(job: _Job, *, profile: str, folder: Path, out: Path, root: Path, live: bool = False) -> dict:
    """One notebook as a Dask task: the serial build's `_run_one`, inside the worker process; `live`: its cells
    are told to the build's process as Dask events (`progress`)."""
    _add_kernel_path()
    if live:
        tell_driver(job.name)
    return _run_one(job, profile, folder, out, root, tell=tell_driver if live else None)


def _record_lost(job: _Job, error: str, started: str, seconds: float, pid: int | None = None, *, profile: str,
                 out: Path, root: Path) -> dict:
    """A notebook whose worker died: recorded failed like a notebook that raised, the last good report kept."""
    record = {**_record(job, profile), "status": "failed", "error": error, "started": started,
              "seconds": seconds, "machine": None}  # the worker's, not known here
    staging = out / temp_name("staging", job.name)
    try:
        staging.mkdir(parents=True)
        with locked(root):
            _restore_lost(out, job.name, pid)
        _store(record, staging, out, root)
    except (OSError, UsageError) as exc:
        problem = exc if isinstance(exc, UsageError) else exc.strerror or exc
        record["error"] += f"; could not write the report: {problem}"
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return record


def _restore_lost(out: Path, name: str, pid: int | None) -> None:
    """Under the lock, after the worker running `name` (process `pid`, if known) died: a swap it left between
    its two renames gives the report back from `.old-<name>-<pid>-<token>` (no one else is mid-swap under
    the lock), and its staging folder goes."""
    recover(out, name, worker_pid=pid)


def _describe(exc: Exception) -> str:
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _place(staging: Path, final: Path, *, failed: bool) -> bool:
    """Move a finished build into place; True when a failed rebuild kept the previous good report.

    # NOTE: a failed rebuild never replaces a report that may be good: it lands in `<name>/failed-run/` beside it
    # (the index shows both), and the next good build replaces the whole folder, failed run included.
    """
    # A report in place whose run.json is damaged may be a good one: only a proven failed run (or nothing)
    # makes way for a failed rebuild (`report_state`).
    if failed and report_state(final) in ("ok", "unknown"):
        swap_into_place(staging, final / FAILED_RUN)
        return True
    swap_into_place(staging, final)
    return False


class _Interrupts:
    """Ctrl-C during a build, never lost: the SIGINT handler raises KeyboardInterrupt as Python's own does and
    also records it; `check()` (after each notebook) and leaving the block raise it again if it was lost.

    # NOTE: Python raises KeyboardInterrupt wherever the main thread is when SIGINT arrives. Inside a
    # destructor (the kernel client's sockets are collected after each notebook) it is printed as
    # "Exception ignored in ..." and dropped, and a build so interrupted went on to its end (exit 0, 2 of
    # 13 tries in issue 35). A handler set by the caller (or SIG_IGN) is left as it is.
    """

    def __init__(self) -> None:
        self.seen, self.previous = False, None

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self.previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt

    def __exit__(self, kind, exc, tb) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        if kind is None:
            self.check()


def _check_path(what: str, path: Path) -> None:
    """UsageError when `path` cannot name a file here (a NUL byte, a name too long, a loop of links)."""
    if "\0" in str(path):
        raise UsageError(f"{what}={str(path)!r} holds a NUL byte, which no path can hold")
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        pass  # made later, or refused later naming what is in the way
    except OSError as exc:
        raise UsageError(f"{what}={str(path)!r}: {exc.strerror or exc}") from None


def _add_kernel_path() -> None:
    """Make kernels/workbench/kernel.json findable without installing anything (once per process)."""
    paths = [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    if str(repo_root()) not in paths:
        os.environ["JUPYTER_PATH"] = os.pathsep.join([str(repo_root()), *paths])


def build_reports(
    names: list[str] | tuple[str, ...] = (), *, profile: str = "cpu", out_dir: str | Path | None = None,
    overrides: dict | None = None, notebooks: str | Path | None = None, progress: bool = True,
    workers: int | None = None, scheduler: str | None = None,
) -> pd.DataFrame:
    """Execute notebooks into `out_dir/<profile>/<name>/` and rewrite the index pages.

    Bad names, profiles, parameters (typed by each notebook's declared default, within its declared
    range), profile files, the kernel spec or output folders (files the runner did not make in the way)
    raise `UsageError` before any kernel starts. A failing notebook is recorded (status "failed" with its
    error) and the others still run; a failed rebuild keeps the previous good report (`kept_previous`).
    `workers` runs the notebooks in parallel on a local Dask cluster of that many processes, `scheduler`
    on the Dask cluster at that address (`cluster`); a notebook whose worker dies is recorded failed.
    Returns one row per notebook: name, status, seconds, error, kept_previous.
    """
    from tqdm.auto import tqdm

    from .cluster import check_cluster_options

    check_cluster_options(workers, scheduler)
    for what, given in (("out_dir", out_dir), ("notebooks", notebooks)):
        if given is not None and not str(given).strip():
            raise UsageError(f"{what}={str(given)!r} is empty; give a folder (or None for the default)")
        if given is not None:
            _check_path(what, Path(given))
    folder = Path(notebooks) if notebooks is not None else notebooks_dir()
    root = Path(out_dir) if out_dir is not None else repo_root() / "reports"
    jobs = _plan(names, profile, dict(overrides or {}), folder)
    _add_kernel_path()
    check_kernel()
    if (root / profile).is_dir() and not (root / profile).is_symlink():
        with locked(root):  # a build that died between its two renames: its last good report comes back
            recover(root / profile)
    out = prepare_out(root, profile, [job.name for job in jobs])

    with _Interrupts() as interrupts:
        def indexed(record: dict) -> dict:
            with locked(root):
                write_index(root)
            interrupts.check()  # a Ctrl-C during that notebook stops the build here, its report in place
            return record

        if workers is None and scheduler is None:
            records = []
            with tqdm(total=len(jobs), desc=f"reports ({profile})", disable=not progress) as bar, \
                    Progress(bar) as live:
                for job in jobs:
                    live.tell(job.name)
                    record = _run_one(job, profile, folder, out, root, tell=live.tell if live.on else None)
                    live.done(job.name)
                    bar.update(1)
                    records.append(indexed(record))
        else:
            records = _build_on_cluster(jobs, profile, folder, out, root, workers=workers, scheduler=scheduler,
                                        done=indexed, bar=functools.partial(tqdm, total=len(jobs),
                                                                            desc=f"reports ({profile})",
                                                                            disable=not progress))
    return pd.DataFrame(records, columns=["name", "status", "seconds", "error", "kept_previous"])


def _build_on_cluster(jobs, profile, folder, out, root, *, workers, scheduler, done, bar) -> list[dict]:
    """The jobs as tasks on a Dask cluster (`cluster`); `bar()` makes the progress bar once it is reached."""
    from .cluster import connect, is_gpu_notebook, run_on_cluster

    # workers elsewhere (and local ones, whose current folder is their own) need absolute paths
    folder, out, root = folder.resolve(), out.resolve(), root.resolve()
    with connect(workers=workers, scheduler=scheduler) as (client, gpu_limit, cuda_here), bar() as progress, \
            Progress(progress) as live:
        if live.on:  # the workers tell their notebooks' cells as events (`tell_driver`)
            client.subscribe_topic(PROGRESS_TOPIC, live.event)
        try:
            return run_on_cluster(
                client, jobs, functools.partial(_run_in_worker, profile=profile, folder=folder, out=out, root=root,
                                                live=live.on),
                lost=functools.partial(_record_lost, profile=profile, out=out, root=root),
                done=lambda record: (live.done(record["name"]), done(record))[1],
                gpu=lambda job: is_gpu_notebook(job.parameters, profile, cuda_here=cuda_here), gpu_limit=gpu_limit,
                progress=progress,
            )
        finally:
            if live.on:
                client.unsubscribe_topic(PROGRESS_TOPIC)
