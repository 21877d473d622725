"""Reports: the claims ledger, `results.json`, the papermill runner and the index pages.

A notebook measures, fills a `Ledger` (one row per paper claim, verdict computed by a stated
rule) and calls `save_results`. `build_reports` executes notebooks headlessly with papermill
under the `workbench` kernel at a named profile, one folder per notebook under
`reports/<profile>/`, and writes `reports/<profile>/index.html` from every folder's `run.json` and
`results.json`, plus `reports/index.html` linking the profiles. Nothing a report folder holds is
trusted: parameters are checked before a kernel starts, every value on a page is escaped, and a
failed rebuild never replaces the last good report.
"""

from __future__ import annotations

import ast
import html
import json
import math
import os
import re
import secrets
import shutil
import time
import traceback
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from .devices import environment, repo_root

__all__ = [
    "PROFILES", "KERNEL_NAME", "VERDICTS", "Rule", "at_least", "at_most", "within", "between", "Ledger", "tally",
    "save_results", "UsageError", "available_notebooks", "load_profile", "build_reports",
    "write_index", "Paper", "PAPERS", "paper_citation", "notebook_repository",
]

PROFILES = ("smoke", "cpu", "paper")
KERNEL_NAME = "workbench"
# Verdicts of paper claims and targets, best first; "inconclusive" when the spread straddles a threshold.
VERDICTS = (
    "better than claimed", "reproduced", "partly", "not reproduced", "refuted", "inconclusive",
    "not run at this scale", "not run",
)
CHECK = "exact by construction"  # a row that cannot fail: shown, never tallied
SOURCES = ("paper", "target", "check")

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]+")  # notebook, figure and report folder names
RESERVED = ("interactive", "output_dir")  # parameters the report runner sets itself
INTERACTIVE = "interactive"  # reports/interactive/<name>: results saved from JupyterLab
FAILED_RUN = "failed-run"  # reports/<profile>/<name>/failed-run: a failed rebuild beside the last good report
# The kernel's own log lines (TCP transport warning, "KeyboardInterrupt caught in kernel" at shutdown) are not
# the notebook's output and read like failures in a build log; cell errors still arrive as cell errors.
KERNEL_QUIET = ["--IPKernelApp.log_level=CRITICAL"]


@dataclass(frozen=True)
class Paper:
    """The paper a notebook reproduces, as the index page names it."""

    title: str
    authors: str = ""
    year: int | None = None


# NOTE: the index names papers, not file names; a notebook missing here is listed by its name alone.
PAPERS = {
    "tour": Paper("No paper: the workbench's conventions"),
    "packed_bit_optimizers": Paper("Memory Efficient Mixed Precision Optimizers", "Lewandowski & Kosson"),
    "optorch": Paper("OpTorch: optimized deep learning architectures for resource limited environments",
                     "Ahmed & Naveed", 2021),
    "efficient_densenet": Paper("Memory-Efficient Implementation of DenseNets", "Pleiss et al.", 2017),
    "calcgraph": Paper("CalcGraph: taming the high costs of deep learning using models", "", 2022),
    "variable_batch_size": Paper("Variable batch size across layers for efficient prediction on CNNs",
                                 "Choudhury et al."),
}


# ---------------------------------------------------------------------------------------------
# The claims ledger


@dataclass(frozen=True)
class Rule:
    """How a measured value becomes a verdict; `describe()` is printed beside every row.

    One-sided (`at_least`, `at_most`) for claims the paper states as bounds; two-sided (`within` a
    stated value, `between` a stated range) where the paper gives a number, so a result better than
    claimed is its own verdict instead of passing silently.
    """

    kind: str  # "at_least", "at_most", "within" or "between"
    target: float  # the bound, the stated value, or the low end of a range
    upper: float | None = None  # the high end of a range (between)
    partly: float | None = None  # one-sided: the weaker bound that still reads "partly"
    refuted: float | None = None  # any kind: beyond this on the worse side reads "refuted"
    rel: float | None = None  # within: relative tolerance for "reproduced"
    partly_rel: float | None = None  # two-sided: relative distance on the worse side for "partly"
    better: str | None = None  # two-sided: "higher" or "lower" is the better direction

    def _worse_than(self, measured: float, bound: float) -> bool:
        """True if `measured` lies beyond `bound` on the worse side."""
        higher_is_better = self.kind == "at_least" or self.better == "higher"
        return measured < bound if higher_is_better else measured > bound

    def _two_sided(self, measured: float) -> str:
        lo, hi = (self.target, self.upper) if self.kind == "between" else (self.target, self.target)
        if self.kind == "within":
            slack = self.rel * abs(self.target)
            lo, hi = lo - slack, hi + slack
        if lo <= measured <= hi:
            return "reproduced"
        above = measured > hi
        if self.better is not None and above == (self.better == "higher"):
            return "better than claimed"
        edge = hi if above else lo
        if self.partly_rel is not None and abs(measured - edge) <= self.partly_rel * abs(edge):
            return "partly"
        if self.refuted is not None and self.better is not None and self._worse_than(measured, self.refuted):
            return "refuted"
        return "not reproduced"

    def _one_sided(self, measured: float) -> str:
        if not self._worse_than(measured, self.target):
            return "reproduced"
        if self.partly is not None and not self._worse_than(measured, self.partly):
            return "partly"
        if self.refuted is not None and self._worse_than(measured, self.refuted):
            return "refuted"
        return "not reproduced"

    def verdict(self, measured: float | None, spread: tuple[float, float] | None = None) -> str:
        """The verdict for `measured`; with a `spread` (lo, hi) that changes it, "inconclusive"."""
        if measured is None or math.isnan(measured):
            return "not run at this scale"
        judge = self._one_sided if self.kind in ("at_least", "at_most") else self._two_sided
        verdict = judge(measured)
        if spread is not None and any(judge(float(v)) != verdict for v in spread):
            return "inconclusive"
        return verdict

    def describe(self) -> str:
        if self.kind in ("at_least", "at_most"):
            op, worse = (">=", "<") if self.kind == "at_least" else ("<=", ">")
            text = f"reproduced if measured {op} {self.target:g}"
            if self.partly is not None:
                text += f"; partly if {op} {self.partly:g}"
        else:
            text = (f"reproduced if within {self.rel:.0%} of {self.target:g}" if self.kind == "within"
                    else f"reproduced if in [{self.target:g}, {self.upper:g}]")
            if self.better is not None:
                text += f"; better than claimed if {self.better}"
            if self.partly_rel is not None:
                text += f"; partly if worse by at most {self.partly_rel:.0%}"
            worse = "<" if self.better == "higher" else ">"
        if self.refuted is not None:
            text += f"; refuted if {worse} {self.refuted:g}"
        return text


def at_least(target: float, *, partly: float | None = None, refuted: float | None = None) -> Rule:
    """A claim stated as a lower bound: reproduced at or above `target`, partly at or above `partly`,
    refuted below `refuted`, otherwise not reproduced."""
    if partly is not None and partly > target:
        raise ValueError(f"partly ({partly}) must be <= target ({target}) for at_least")
    return Rule("at_least", float(target), partly=partly, refuted=refuted)


def at_most(target: float, *, partly: float | None = None, refuted: float | None = None) -> Rule:
    """A claim stated as an upper bound: reproduced at or below `target`, partly at or below `partly`,
    refuted above `refuted`, otherwise not reproduced."""
    if partly is not None and partly < target:
        raise ValueError(f"partly ({partly}) must be >= target ({target}) for at_most")
    return Rule("at_most", float(target), partly=partly, refuted=refuted)


def _check_better(better: str | None) -> None:
    if better not in (None, "higher", "lower"):
        raise ValueError(f"better must be 'higher', 'lower' or None, got {better!r}")


def within(
    target: float, *, rel: float, partly_rel: float | None = None, better: str | None = None,
    refuted: float | None = None,
) -> Rule:
    """A value the paper states: reproduced within `rel` (relative) of `target`; outside it on the
    `better` side "better than claimed"; on the worse side partly within a further `partly_rel` of
    the band's edge, refuted beyond `refuted`."""
    if rel <= 0 or (partly_rel is not None and partly_rel <= 0):
        raise ValueError(f"need rel > 0 and partly_rel > 0, got rel={rel}, partly_rel={partly_rel}")
    _check_better(better)
    return Rule("within", float(target), rel=rel, partly_rel=partly_rel, better=better, refuted=refuted)


def between(
    low: float, high: float, *, better: str | None = None, partly_rel: float | None = None,
    refuted: float | None = None,
) -> Rule:
    """A range the paper states: reproduced inside [low, high]; outside it on the `better` side
    "better than claimed"; on the worse side partly within `partly_rel` of the nearer end."""
    if not low <= high:
        raise ValueError(f"need low <= high, got low={low}, high={high}")
    _check_better(better)
    return Rule("between", float(low), upper=float(high), better=better, partly_rel=partly_rel, refuted=refuted)


class Ledger:
    """Rows of claims checked by measurement: paper claims, our own targets, and checks.

    `verdicts=False` (toy scales: the smoke profile, small interactive defaults) records every row
    with the verdict "not run at this scale", so a toy run never reads as evidence.
    """

    COLUMNS = ["claim", "source", "paper", "measured", "spread", "unit", "scale", "device", "verdict", "rule"]

    def __init__(self, *, verdicts: bool = True) -> None:
        self.verdicts = bool(verdicts)
        self.rows: list[dict] = []

    def add(
        self, claim: str, *, paper: float | str, measured: float | None, unit: str, scale: str,
        device: str, rule: Rule, source: str = "paper", spread: tuple[float, float] | None = None,
    ) -> None:
        """A paper claim (`source="paper"`) or a goal of ours (`source="target"`), judged by `rule`."""
        if not isinstance(rule, Rule):
            raise TypeError(f"rule must come from at_least/at_most/within/between, got {rule!r}")
        if source not in ("paper", "target"):
            raise ValueError(f"source must be 'paper' or 'target', got {source!r}")
        measured = None if measured is None else float(measured)
        if spread is not None:
            spread = (float(min(spread)), float(max(spread)))
        verdict = rule.verdict(measured, spread) if self.verdicts else "not run at this scale"
        text = rule.describe() + ("; inconclusive if the spread crosses a threshold" if spread else "")
        self._append(claim, source, paper, measured, spread, unit, scale, device, verdict, text)

    def check(self, claim: str, *, measured: float | str, unit: str, scale: str, device: str, why: str) -> None:
        """A row that cannot fail (equal by construction): shown for completeness, never tallied."""
        self._append(claim, "check", "—", measured, None, unit, scale, device, CHECK, why)

    def not_run(self, claim: str, *, paper: float | str, reason: str, unit: str = "", scale: str = "",
                device: str = "", source: str = "paper") -> None:
        """A paper claim (or a target of ours) this notebook does not measure, with the reason."""
        if source not in ("paper", "target"):
            raise ValueError(f"source must be 'paper' or 'target', got {source!r}")
        self._append(claim, source, paper, None, None, unit, scale, device, "not run", reason)

    def _append(self, claim, source, paper, measured, spread, unit, scale, device, verdict, rule) -> None:
        self.rows.append({
            "claim": claim, "source": source, "paper": paper, "measured": measured, "spread": spread,
            "unit": unit, "scale": scale, "device": str(device), "verdict": verdict, "rule": rule,
        })

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=self.COLUMNS)

    def tally(self) -> dict[str, int]:
        """Verdict counts over paper claims only."""
        return tally(self.rows)

    def _repr_html_(self) -> str:
        return self.to_frame().to_html(index=False)


def tally(claims: list[dict]) -> dict[str, int]:
    """Verdict counts of the paper rows in `claims` (targets and checks are shown apart)."""
    counts: dict[str, int] = {}
    for c in claims:
        if c.get("source", "paper") == "paper":
            counts[c.get("verdict")] = counts.get(c.get("verdict"), 0) + 1
    return counts

# ---------------------------------------------------------------------------------------------
# results.json


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _jsonable(value.item())
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename: a reader sees the old or the new file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # out of space or interrupted: leave no half-written file behind
        raise


def _check_name(name: str, what: str = "notebook name") -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise UsageError(f"{what} {name!r} is not allowed; names use only letters, digits, '_' and '-'")
    return name


def notebook_repository(start: str | Path | None = None) -> Path:
    """The repository a notebook runs in: the nearest folder above `start` (default: the current folder,
    which Jupyter sets to the notebook's folder) holding `.git` or `pyproject.toml`; else this checkout."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / ".git").exists() or (folder / "pyproject.toml").is_file():
            return folder
    return repo_root()


def save_results(
    name: str, *, output_dir: str | Path, parameters: dict, records: dict[str, pd.DataFrame],
    ledger: Ledger, figures: dict | None = None, device=None,
) -> Path:
    """Write `results.json` (parameters, environment, records, claims) and figures as PNG.

    `output_dir` "" (a notebook run in JupyterLab) means `reports/interactive/<name>` in the repository
    the notebook is in. Returns the results.json path.
    """
    _check_name(name)
    # NOTE: the kernel's current folder is the notebook's folder, so a run in JupyterLab saves beside
    # the notebook's own repository, not beside the checkout the package happens to be installed from.
    out = Path(output_dir) if output_dir else notebook_repository() / "reports" / INTERACTIVE / name
    out.mkdir(parents=True, exist_ok=True)
    figure_files = []
    for fig_name, fig in (figures or {}).items():
        _check_name(fig_name, "figure name")
        fig.savefig(out / f"{fig_name}.png", dpi=110, bbox_inches="tight")
        figure_files.append(f"{fig_name}.png")
    payload = {
        "name": name,
        "parameters": _jsonable(parameters),
        "environment": environment(device),
        "records": {k: _jsonable(df.to_dict(orient="records")) for k, df in records.items()},
        "claims": _jsonable(ledger.rows),
        "figures": figure_files,
    }
    path = out / "results.json"
    _write_atomic(path, json.dumps(payload, indent=1))
    return path


# ---------------------------------------------------------------------------------------------
# Running notebooks


class UsageError(ValueError):
    """Bad input to the report runner (unknown notebook, profile or parameter, unusable output folder)."""


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


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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


# ---------------------------------------------------------------------------------------------
# The index page

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:4px 8px;font-size:14px}
.ok{color:#176317}.failed{color:#b00020}.verdict-reproduced{background:#e3f6e3}
.verdict-better-than-claimed{background:#dcecff}.verdict-partly,.verdict-inconclusive{background:#fff6d6}
.verdict-not-reproduced,.verdict-refuted{background:#fde2e2}.note{color:#555;font-size:13px;margin:0}
.paper{color:#333;font-style:italic}.rebuild{border:1px solid #b00020;padding:.3em .8em;background:#fff4f4}
figure{display:inline-block;margin:6px;vertical-align:top}figcaption{font-size:12px;color:#555}
img{width:480px;max-width:100%;border:1px solid #ddd}img.wide{width:960px}pre{white-space:pre-wrap;color:#b00020}
"""


_LEDGER_PARTS = (
    ("paper", "Paper claims", "the tally counts these"),
    ("target", "Our targets", "goals of ours, not claims of the paper"),
    ("check", "Checks", "rows that cannot fail by construction, shown for completeness"),
)


def _ledger_html(claims: list[dict]) -> str:
    """One table each for paper claims, our targets and checks."""
    if not claims:
        return "<p>No claims recorded.</p>"
    columns = [c for c in Ledger.COLUMNS if c != "source"]
    parts = []
    for source, title, note in _LEDGER_PARTS:
        chosen = [c for c in claims if c.get("source", "paper") == source]
        if not chosen:
            continue
        rows = []
        for c in chosen:
            cls = "verdict-" + str(c.get("verdict", "")).replace(" ", "-")
            cells = "".join(f"<td>{html.escape(_fmt(c.get(k)))}</td>" for k in columns)
            rows.append(f'<tr class="{html.escape(cls)}">{cells}</tr>')
        head = "".join(f"<th>{k}</th>" for k in columns)
        parts.append(f"<h3>{title}</h3><p class='note'>{note}</p><table><tr>{head}</tr>{''.join(rows)}</table>")
    return "".join(parts)


def _fmt(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _e(value) -> str:
    """Any value as text safe inside HTML elements and quoted attributes."""
    return html.escape(str(value), quote=True)


def _href(*parts: str) -> str:
    return _e("/".join(urllib.parse.quote(p) for p in parts))


def paper_citation(name: str) -> str:
    """'Title (Authors, Year)' of the paper a notebook reproduces; the name alone for an unknown notebook."""
    paper = PAPERS.get(name)
    if paper is None:
        return name
    extra = ", ".join(str(x) for x in (paper.authors, paper.year) if x)
    return f"{paper.title} ({extra})" if extra else paper.title


def _png_size(path: Path) -> tuple[int, int] | None:
    try:
        with open(path, "rb") as f:
            head = f.read(24)
    except OSError:
        return None
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def _figures_html(folder: Path, prefix: str, figures) -> str:
    parts = []
    for f in figures if isinstance(figures, list) else []:
        # only plain PNG files inside the report folder: a results.json cannot point the page elsewhere
        if not isinstance(f, str) or "/" in f or "\\" in f or f.startswith(".") or not (folder / f).is_file():
            continue
        size = _png_size(folder / f)
        wide = size is not None and size[0] >= 1.6 * size[1]  # two-panel figures get twice the width
        css = ' class="wide"' if wide else ""
        parts.append(f'<figure><a href="{_href(prefix, f)}"><img src="{_href(prefix, f)}" alt="{_e(f)}"{css}>'
                     f"</a><figcaption>{_e(f)}</figcaption></figure>")
    return "".join(parts)


def _entries(folder: Path) -> list[dict]:
    """The report folders of one profile (or of JupyterLab runs), by name; hidden/odd names skipped."""
    entries = []
    for sub in sorted(folder.iterdir()) if folder.is_dir() else []:
        if not sub.is_dir() or not NAME_PATTERN.fullmatch(sub.name):
            continue
        run, results = _read_json(sub / "run.json"), _read_json(sub / "results.json")
        if not run and not results:
            continue
        if not run:  # saved from JupyterLab: results only
            run = {"status": "ok", "profile": folder.name}
        failed = _read_json(sub / FAILED_RUN / "run.json") if (sub / FAILED_RUN).is_dir() else {}
        entries.append({"name": sub.name, "run": run, "results": results, "failed_run": failed, "folder": sub})
    return entries


def _tally_text(results: dict) -> str:
    claims = results.get("claims") if isinstance(results.get("claims"), list) else []
    counts = tally([c for c in claims if isinstance(c, dict)])
    return ", ".join(f"{n} {v}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "—"


def _overrides_text(run: dict) -> str:
    overrides = run.get("overrides")
    if not isinstance(overrides, dict) or not overrides:
        return "none"
    return " ".join(f"-p {k}={json.dumps(v)}" for k, v in overrides.items())


def _status(entry: dict) -> tuple[str, str]:
    """(css class, text) of an entry's status."""
    status = str(entry["run"].get("status", "?"))
    if entry["failed_run"]:
        return "failed", "rebuild failed; last good report shown"
    return ("ok" if status == "ok" else "failed"), status


def _section(entry: dict) -> str:
    name, run, results = entry["name"], entry["run"], entry["results"]
    cls, status = _status(entry)
    env = results.get("environment") if isinstance(results.get("environment"), dict) else {}
    links = [f'<a href="{_href(name, name + ".html")}">notebook (HTML)</a>',
             f'<a href="{_href(name, name + ".ipynb")}">notebook (.ipynb)</a>']
    if results:
        links.append(f'<a href="{_href(name, "results.json")}">results.json</a>')
    parts = [
        f'<h2 id="{_e(name)}">{_e(name)} <span class="{cls}">({_e(status)})</span></h2>',
        f'<p class="paper">{_e(paper_citation(name))}</p>',
        f"<p>{' · '.join(links)}</p>",
        f"<p>Profile {_e(run.get('profile'))}, run {_e(run.get('started', '—'))}, {_e(run.get('seconds', '—'))} s "
        f"on {_e(env.get('device_name', 'unknown device'))}, torch {_e(env.get('torch', '?'))}. "
        f"Overrides: <code>{_e(_overrides_text(run))}</code>.</p>",
    ]
    failed = entry["failed_run"]
    if failed:
        parts.append(
            f'<div class="rebuild"><p>The rebuild of {_e(failed.get("started", "?"))} '
            f"(overrides <code>{_e(_overrides_text(failed))}</code>) failed; the report below is the last good one. "
            f'<a href="{_href(name, FAILED_RUN, name + ".html")}">failed run (HTML)</a> · '
            f'<a href="{_href(name, FAILED_RUN, name + ".ipynb")}">failed run (.ipynb)</a></p>'
            f"<pre>{_e(failed.get('error'))}</pre></div>")
    if run.get("error"):
        parts.append(f"<pre>{_e(run['error'])}</pre>")
    claims = results.get("claims") if isinstance(results.get("claims"), list) else []
    parts.append(_ledger_html([c for c in claims if isinstance(c, dict)]))
    parts.append(_figures_html(entry["folder"], name, results.get("figures")))
    return "\n".join(parts)


def _summary_rows(entries: list[dict], prefix: str) -> str:
    rows = []
    for entry in entries:
        name, run = entry["name"], entry["run"]
        cls, status = _status(entry)
        target = (f"{prefix}/" if prefix else "") + "index.html"
        rows.append(
            f'<tr><td><a href="{_e(target)}#{_e(name)}">{_e(name)}</a></td><td>{_e(paper_citation(name))}</td>'
            f'<td class="{cls}">{_e(status)}</td><td>{_e(run.get("seconds", "—"))}</td>'
            f"<td><code>{_e(_overrides_text(run))}</code></td><td>{_e(_tally_text(entry['results']))}</td></tr>")
    head = ("<tr><th>notebook</th><th>paper</th><th>status</th><th>seconds</th><th>overrides</th>"
            "<th>paper claims</th></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(title)}</title>"
            f"<style>{_CSS}</style></head><body><h1>{_e(title)}</h1>{body}</body></html>")


_GROUP_NOTES = {
    "smoke": "seconds-long runs that check the notebooks work; toy sizes, so no verdicts",
    "cpu": "the default report, sized for a laptop-class CPU",
    "paper": "the papers' own sizes (needs a GPU)",
    INTERACTIVE: "results saved by notebooks run in JupyterLab with their own parameters",
}


def write_index(out_dir: str | Path) -> Path:
    """Rebuild `<out_dir>/<profile>/index.html` for each profile present and the top `<out_dir>/index.html`
    that links them. Every value from a report folder is escaped; only folders named like notebooks count."""
    out = Path(out_dir)
    groups = []
    for group in (*PROFILES, INTERACTIVE):
        entries = _entries(out / group)
        if not entries:
            continue
        body = (f'<p><a href="../index.html">all profiles</a> · {_e(_GROUP_NOTES[group])}</p>'
                + _summary_rows(entries, "") + "".join(_section(e) for e in entries))
        _write_atomic(out / group / "index.html", _page(f"Workbench reports: {group}", body))
        groups.append(f'<h2 id="{_e(group)}"><a href="{_href(group, "index.html")}">{_e(group)}</a></h2>'
                      f'<p class="note">{_e(_GROUP_NOTES[group])}</p>{_summary_rows(entries, group)}')
    body = "".join(groups) or "<p>No reports yet: run <code>make report</code>.</p>"
    path = out / "index.html"
    _write_atomic(path, _page("Workbench reports", body))
    return path
