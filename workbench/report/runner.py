"""Running notebooks headlessly: papermill under the `workbench` kernel at a named profile.

Parameters, profile files and output folders are checked before any kernel starts (`UsageError`);
a failing notebook is marked failed and the others still run; a failed rebuild never replaces the
last good report.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import secrets
import shutil
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from ..devices import repo_root
from .index import write_index
from .results import (
    FAILED_RUN, KERNEL_NAME, KERNEL_QUIET, NAME_PATTERN, PROFILES, RESERVED, UsageError, _check_name, _jsonable,
    _read_json, _write_atomic,
)


def notebooks_dir() -> Path:
    return repo_root() / "notebooks"


def available_notebooks(folder: Path | None = None) -> list[str]:
    """Notebook names in `folder`; files whose names are not letters, digits, '_' and '-' are skipped."""
    folder = folder or notebooks_dir()
    return sorted(p.stem for p in folder.glob("*.ipynb") if NAME_PATTERN.fullmatch(p.stem) and p.is_file())


_PROFILE_SHAPE = "a mapping of profile names (smoke, cpu, paper) to mappings of parameter names to values"


def _read_profiles(path: Path) -> dict[str, dict]:
    """Every profile in `path`, its shape checked; UsageError naming the file and what was expected."""
    try:
        table = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        problem = " ".join(str(exc).split())
        raise UsageError(f"{path}: not a valid profile file ({problem}); expected {_PROFILE_SHAPE}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot read the profile file ({exc})") from None
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise UsageError(f"{path}: expected {_PROFILE_SHAPE}, got {type(table).__name__} {table!r}")
    unknown = sorted(map(str, set(table) - set(PROFILES)))
    if unknown:
        raise UsageError(f"{path}: unknown profiles {unknown}; allowed {list(PROFILES)}")
    for profile, section in table.items():
        if section is None:
            continue
        if not isinstance(section, dict):
            raise UsageError(f"{path}: profile {profile!r} must be a mapping of parameter names to values "
                             f"(e.g. 'batch_size: 8' indented under '{profile}:'), got {section!r}")
        for key in section:
            if not isinstance(key, str) or not key.isidentifier():
                raise UsageError(f"{path}: profile {profile!r} has a bad parameter name {key!r}")
            if key in RESERVED:
                raise UsageError(f"{path}: profile {profile!r} sets {key!r}, which the report runner sets itself")
    return {p: dict(s or {}) for p, s in table.items()}


def load_profile(name: str, profile: str, folder: Path | None = None) -> dict:
    """Parameter overrides of notebook `name` at `profile` (notebooks/profiles/<name>.yaml)."""
    if profile not in PROFILES:
        raise UsageError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    path = (folder or notebooks_dir()) / "profiles" / f"{_check_name(name)}.yaml"
    if not path.exists():
        return {}
    return _read_profiles(path).get(profile, {})


def _declared(path: Path) -> dict:
    import papermill

    try:
        return papermill.inspect_notebook(str(path))
    except Exception as exc:  # not JSON, not a notebook, or no readable parameters cell
        raise UsageError(f"{path}: cannot read the notebook's parameters ({type(exc).__name__}: {exc})") from None


_MISSING = object()


def _default_value(text: str | None):
    try:
        return ast.literal_eval(text) if text is not None else _MISSING
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _MISSING  # a default written as an expression: its type is unknown


def _coerce(name: str, value, default_text: str | None, where: str):
    """`value` converted to the type of the notebook's declared default; UsageError when it cannot be.

    # NOTE: strings from the command line are parsed by the declared type, not guessed with YAML
    # (where `1e-3` stays a string, `012` is octal 10 and `no`/`off` are False): an int parameter
    # takes decimal digits only, a float any finite number, a bool only true/false.
    """
    default = _default_value(default_text)
    kind = type(default)

    def refuse(expected: str):
        return UsageError(f"{where}: {name}={value!r} is not {expected} (the notebook's default is {default_text})")

    if default is _MISSING or default is None:
        if isinstance(value, str):
            parsed = _default_value(value)
            return value if parsed is _MISSING else parsed
        return value
    if isinstance(value, str) and kind is not str:
        text = value.strip()
        if kind is bool:
            if text.lower() not in ("true", "false"):
                raise refuse("true or false")
            return text.lower() == "true"
        if kind is int:
            if not re.fullmatch(r"[+-]?\d+", text):
                raise refuse("a whole number")
            return int(text)
        if kind is float:
            try:
                number = float(text)
            except ValueError:
                raise refuse("a number") from None
            if not math.isfinite(number):
                raise refuse("a finite number")
            return number
        value = _default_value(text)
        if value is _MISSING:
            raise refuse(f"a Python {kind.__name__} literal")
    if kind is bool:
        if not isinstance(value, bool):
            raise refuse("true or false")
    elif kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise refuse("a whole number")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise refuse("a number")
        if not math.isfinite(value):
            raise refuse("a finite number")
        value = float(value)
    elif kind in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise refuse("a list")
    elif not isinstance(value, kind):
        raise refuse(f"a {kind.__name__}")
    return value


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
    names = list(names) or known
    bad = [n for n in names if not isinstance(n, str) or not NAME_PATTERN.fullmatch(n) or n not in known]
    if bad:
        raise UsageError(f"unknown notebook(s) {', '.join(map(str, bad))}; choose from {', '.join(known) or '(none)'}")
    reserved = sorted(set(overrides) & set(RESERVED))
    if reserved:
        raise UsageError(f"-p {', '.join(reserved)}: set by the report runner itself (interactive=False, "
                         f"output_dir=the report folder); choose the folder with --out")
    jobs = []
    for name in dict.fromkeys(names):
        declared = _declared(folder / f"{name}.ipynb")
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
            key: _coerce(key, value, declared[key].get("default"),
                         f"-p for notebook {name!r}" if key in overrides else f"{profile_file} ({profile})")
            for key, value in params.items()
        }
        jobs.append(_Job(name, typed, {k: typed[k] for k in overrides}))
    return jobs


def _prepare_out(out: Path, profile: str) -> Path:
    """The profile's output folder, created and proven writable before any kernel starts."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file, not a folder")
    target = out / profile
    probe = target / f".write-test-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"cannot write reports to {target}: {exc.strerror or exc}") from None
    return target


@contextmanager
def _locked(out: Path):
    """An exclusive lock on `out` for the swap into place and the index write (two builds, one folder)."""
    try:
        import fcntl
    except ImportError:  # Windows: per-build temporary names still keep builds apart
        fcntl = None
    with open(out / ".lock", "a") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _temp_name(kind: str, name: str) -> str:
    """A per-build temporary folder name: `.staging-<name>-<pid>-<token>` (also unique across threads)."""
    return f".{kind}-{name}-{os.getpid()}-{secrets.token_hex(4)}"


def _clean_stale(folder: Path) -> None:
    """Remove `.staging-*`/`.old-*` folders left by builds that died (their process is gone)."""
    for path in (*folder.glob(".staging-*"), *folder.glob(".old-*")):
        match = re.search(r"-(\d+)-[0-9a-f]+$", path.name)
        if match is None or not _alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def _export_html(notebook: Path) -> None:
    import nbconvert
    import nbformat

    body, _ = nbconvert.HTMLExporter().from_notebook_node(nbformat.read(notebook, as_version=4))
    notebook.with_suffix(".html").write_text(body)


def _run_one(job: _Job, profile: str, folder: Path, out: Path, root: Path) -> dict:
    import papermill

    name = job.name
    staging = out / _temp_name("staging", name)
    record = {"name": name, "profile": profile, "parameters": job.parameters, "overrides": job.overrides,
              "status": "ok", "error": None, "kept_previous": False,
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    start = time.perf_counter()
    try:
        try:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            executed = staging / f"{name}.ipynb"
            papermill.execute_notebook(
                str(folder / f"{name}.ipynb"), str(executed),
                parameters={**job.parameters, "interactive": False, "output_dir": str(staging.resolve())},
                kernel_name=KERNEL_NAME, cwd=str(folder), progress_bar=False, extra_arguments=KERNEL_QUIET,
            )
        except Exception as exc:  # a failing notebook (or a full disk) is recorded and the build goes on
            record["status"] = "failed"
            record["error"] = _describe(exc)
        record["seconds"] = round(time.perf_counter() - start, 1)
        try:
            if (staging / f"{name}.ipynb").exists():
                try:
                    _export_html(staging / f"{name}.ipynb")
                except Exception as exc:
                    record["error"] = (record["error"] or "") + f" (HTML export failed: {exc})"
            _write_atomic(staging / "run.json", json.dumps(_jsonable(record), indent=1))
            with _locked(root):
                record["kept_previous"] = _place(staging, out / name, failed=record["status"] != "ok")
        except OSError as exc:  # out of space or a vanished folder: the previous report stays as it was
            record["status"] = "failed"
            record["kept_previous"] = (out / name / "run.json").exists()
            record["error"] = (record["error"] + "; " if record["error"] else "") + (
                f"could not write the report: {exc.strerror or exc}")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return record


def _describe(exc: Exception) -> str:
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _place(staging: Path, final: Path, *, failed: bool) -> bool:
    """Move a finished build into place; True when a failed rebuild kept the previous good report.

    # NOTE: a failed rebuild never replaces a good report: it lands in `<name>/failed-run/` beside it
    # (the index shows both), and the next good build replaces the whole folder, failed run included.
    """
    if failed and _read_json(final / "run.json").get("status") == "ok":
        _swap_into_place(staging, final / FAILED_RUN)
        return True
    _swap_into_place(staging, final)
    return False


def _swap_into_place(staging: Path, final: Path) -> None:
    """Replace `final` by `staging` so a reader never sees a half-written report folder."""
    old = final.parent / _temp_name("old", final.name)
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def build_reports(
    names: list[str] | tuple[str, ...] = (), *, profile: str = "cpu", out_dir: str | Path | None = None,
    overrides: dict | None = None, notebooks: str | Path | None = None, progress: bool = True,
) -> pd.DataFrame:
    """Execute notebooks into `out_dir/<profile>/<name>/` and rewrite the index pages.

    Bad names, profiles, parameters (checked against the type of each notebook's declared default),
    profile files or output folders raise `UsageError` before any kernel starts. A failing notebook is
    recorded (status "failed" with its error) and the others still run; a failed rebuild keeps the
    previous good report (`kept_previous`). Returns one row per notebook: name, status, seconds, error,
    kept_previous.
    """
    from tqdm.auto import tqdm

    folder = Path(notebooks) if notebooks else notebooks_dir()
    root = Path(out_dir) if out_dir else repo_root() / "reports"
    jobs = _plan(names, profile, dict(overrides or {}), folder)
    out = _prepare_out(root, profile)
    # The kernelspec kernels/workbench/kernel.json is found here without installing anything.
    paths = [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    if str(repo_root()) not in paths:
        os.environ["JUPYTER_PATH"] = os.pathsep.join([str(repo_root()), *paths])
    with _locked(root):
        _clean_stale(out)
    records = []
    for job in tqdm(jobs, desc=f"reports ({profile})", disable=not progress):
        records.append(_run_one(job, profile, folder, out, root))
        with _locked(root):
            write_index(root)
    return pd.DataFrame(records, columns=["name", "status", "seconds", "error", "kept_previous"])


