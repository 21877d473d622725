"""Reports: the claims ledger, `results.json`, the papermill runner and the index page.

A notebook measures, fills a `Ledger` (one row per paper claim, verdict computed by a stated
rule) and calls `save_results`. `build_reports` executes notebooks headlessly with papermill
under the `workbench` kernel at a named profile, one folder per notebook under `reports/`,
and writes `reports/index.html` from every folder's `run.json` and `results.json`.
"""

from __future__ import annotations

import html
import json
import math
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from .devices import environment, repo_root

__all__ = [
    "PROFILES", "KERNEL_NAME", "VERDICTS", "Rule", "at_least", "at_most", "within", "between", "Ledger", "tally",
    "save_results", "UsageError", "available_notebooks", "load_profile", "build_reports",
    "write_index",
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
                device: str = "") -> None:
        """A paper claim this notebook does not measure, with the reason."""
        self._append(claim, "paper", paper, None, None, unit, scale, device, "not run", reason)

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
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_results(
    name: str, *, output_dir: str | Path, parameters: dict, records: dict[str, pd.DataFrame],
    ledger: Ledger, figures: dict | None = None, device=None,
) -> Path:
    """Write `results.json` (parameters, environment, records, claims) and figures as PNG.

    `output_dir` "" means `reports/<name>` in the checkout. Returns the results.json path.
    """
    out = Path(output_dir) if output_dir else repo_root() / "reports" / name
    out.mkdir(parents=True, exist_ok=True)
    figure_files = []
    for fig_name, fig in (figures or {}).items():
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
    """Bad input to the report runner (unknown notebook, profile or parameter)."""


def notebooks_dir() -> Path:
    return repo_root() / "notebooks"


def available_notebooks(folder: Path | None = None) -> list[str]:
    folder = folder or notebooks_dir()
    return sorted(p.stem for p in folder.glob("*.ipynb"))


def load_profile(name: str, profile: str, folder: Path | None = None) -> dict:
    """Parameter overrides of notebook `name` at `profile` (notebooks/profiles/<name>.yaml)."""
    if profile not in PROFILES:
        raise UsageError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    path = (folder or notebooks_dir()) / "profiles" / f"{name}.yaml"
    if not path.exists():
        return {}
    table = yaml.safe_load(path.read_text()) or {}
    unknown = set(table) - set(PROFILES)
    if unknown:
        raise UsageError(f"{path}: unknown profiles {sorted(unknown)}; allowed {list(PROFILES)}")
    return dict(table.get(profile) or {})


def _declared(path: Path) -> dict:
    import papermill

    return papermill.inspect_notebook(str(path))


def _plan(names, profile, overrides, folder) -> dict[str, dict]:
    """Validate everything before running anything; the parameters per notebook."""
    known = available_notebooks(folder)
    if profile not in PROFILES:
        raise UsageError(f"unknown profile {profile!r}; choose one of {', '.join(PROFILES)}")
    names = list(names) or known
    bad = [n for n in names if n not in known]
    if bad:
        raise UsageError(f"unknown notebook(s) {', '.join(bad)}; choose from {', '.join(known)}")
    plan = {}
    for name in names:
        declared = _declared(folder / f"{name}.ipynb")
        params = {**load_profile(name, profile, folder), **overrides}
        undeclared = sorted(set(params) - set(declared))
        if undeclared:
            raise UsageError(
                f"notebook {name!r} declares no parameter {', '.join(undeclared)}; "
                f"its parameters are {', '.join(sorted(declared))}"
            )
        plan[name] = params
    return plan


def _export_html(notebook: Path) -> None:
    import nbconvert
    import nbformat

    body, _ = nbconvert.HTMLExporter().from_notebook_node(nbformat.read(notebook, as_version=4))
    notebook.with_suffix(".html").write_text(body)


def _run_one(name: str, params: dict, profile: str, folder: Path, out: Path) -> dict:
    import papermill

    staging = out / f".staging-{name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    executed = staging / f"{name}.ipynb"
    record = {"name": name, "profile": profile, "parameters": params, "status": "ok", "error": None,
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    start = time.perf_counter()
    try:
        try:
            papermill.execute_notebook(
                str(folder / f"{name}.ipynb"), str(executed),
                parameters={**params, "interactive": False, "output_dir": str(staging.resolve())},
                kernel_name=KERNEL_NAME, cwd=str(folder), progress_bar=False,
            )
        except Exception as exc:  # a failing notebook is recorded and the build goes on
            record["status"] = "failed"
            record["error"] = _describe(exc)
        record["seconds"] = round(time.perf_counter() - start, 1)
        if executed.exists():
            try:
                _export_html(executed)
            except Exception as exc:
                record["error"] = (record["error"] or "") + f" (HTML export failed: {exc})"
        _write_atomic(staging / "run.json", json.dumps(_jsonable(record), indent=1))
        _swap_into_place(staging, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return record


def _describe(exc: Exception) -> str:
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _swap_into_place(staging: Path, final: Path) -> None:
    """Replace `final` by `staging` so a reader never sees a half-written report folder."""
    old = final.with_name(f".old-{final.name}-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def build_reports(
    names: list[str] | tuple[str, ...] = (), *, profile: str = "cpu", out_dir: str | Path | None = None,
    overrides: dict | None = None, notebooks: str | Path | None = None, progress: bool = True,
) -> pd.DataFrame:
    """Execute notebooks into `out_dir/<name>/` and rewrite `out_dir/index.html`.

    Bad names, profiles or parameters raise `UsageError` before anything runs. A failing
    notebook is recorded (status "failed" with its error) and the others still run.
    Returns one row per notebook: name, status, seconds, error.
    """
    from tqdm.auto import tqdm

    folder = Path(notebooks) if notebooks else notebooks_dir()
    out = Path(out_dir) if out_dir else repo_root() / "reports"
    plan = _plan(names, profile, dict(overrides or {}), folder)
    # The kernelspec kernels/workbench/kernel.json is found here without installing anything.
    paths = [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    if str(repo_root()) not in paths:
        os.environ["JUPYTER_PATH"] = os.pathsep.join([str(repo_root()), *paths])
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for name, params in tqdm(plan.items(), desc=f"reports ({profile})", disable=not progress):
        records.append(_run_one(name, params, profile, folder, out))
        write_index(out)
    return pd.DataFrame(records, columns=["name", "status", "seconds", "error"])


# ---------------------------------------------------------------------------------------------
# The index page

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:4px 8px;font-size:14px}
.ok{color:#176317}.failed{color:#b00020}.verdict-reproduced{background:#e3f6e3}
.verdict-better-than-claimed{background:#dcecff}.verdict-partly,.verdict-inconclusive{background:#fff6d6}
.verdict-not-reproduced,.verdict-refuted{background:#fde2e2}.note{color:#555;font-size:13px;margin:0}
img{max-width:360px;margin:4px;border:1px solid #ddd}pre{white-space:pre-wrap;color:#b00020}
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


def write_index(out_dir: str | Path) -> Path:
    """Rebuild `index.html` from every `<out_dir>/<name>/run.json` and `results.json`."""
    out = Path(out_dir)
    sections, summary = [], []
    for run_file in sorted(out.glob("*/run.json")):
        folder = run_file.parent
        run = json.loads(run_file.read_text())
        results_file = folder / "results.json"
        results = json.loads(results_file.read_text()) if results_file.exists() else {}
        name, status = folder.name, run.get("status", "?")
        counts = tally(results.get("claims", []))
        summary_tally = ", ".join(f"{n} {v}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "—"
        summary.append(
            f'<tr><td><a href="#{name}">{name}</a></td><td class="{status}">{status}</td>'
            f'<td>{run.get("profile")}</td><td>{run.get("seconds")}</td><td>{html.escape(summary_tally)}</td></tr>'
        )
        links = [f'<a href="{name}/{name}.html">notebook (HTML)</a>',
                 f'<a href="{name}/{name}.ipynb">notebook (.ipynb)</a>']
        if results:
            links.append(f'<a href="{name}/results.json">results.json</a>')
        env = results.get("environment", {})
        parts = [
            f'<h2 id="{name}">{name} <span class="{status}">({status})</span></h2>',
            f"<p>{' · '.join(links)}</p>",
            f"<p>Profile {html.escape(str(run.get('profile')))}, run {run.get('started')}, "
            f"{run.get('seconds')} s on {html.escape(str(env.get('device_name', 'unknown device')))}"
            f", torch {html.escape(str(env.get('torch', '?')))}.</p>",
        ]
        if run.get("error"):
            parts.append(f"<pre>{html.escape(run['error'])}</pre>")
        parts.append(_ledger_html(results.get("claims", [])))
        parts.extend(f'<a href="{name}/{f}"><img src="{name}/{f}" alt="{f}"></a>'
                     for f in results.get("figures", []))
        sections.append("\n".join(parts))
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>Workbench reports</title>"
        f"<style>{_CSS}</style></head><body><h1>Workbench reports</h1>"
        f"<table><tr><th>notebook</th><th>status</th><th>profile</th><th>seconds</th><th>paper claims</th></tr>"
        f"{''.join(summary)}</table>{''.join(sections)}</body></html>"
    )
    path = out / "index.html"
    _write_atomic(path, page)
    return path
