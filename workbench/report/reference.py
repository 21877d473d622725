"""Reference reports as the index reads them: `reports/reference/<device-slug>/<name>/`, a notebook's report
built on named hardware (issue 22), kept so that it can be committed and shown beside a build of your own.

A reference folder holds what a reader needs to check a result without running anything:

    results.json     parameters, environment, records and claims, as the notebook saved them
    run.json         status, seconds, profile and overrides, as the report runner wrote them, plus
                     `environment`: where it ran (device and GPU name, driver, torch, CUDA, Python, the
                     commit, when) and the seconds of each cell (papermill's record), to size the profile from
    <name>.html      the executed notebook
    *.png            its figures

Beside the notebooks, `<device-slug>/<part>/` holds what the GPU run's parts `tests`, `kernels` and `memory`
left (`part.json`, their logs and tables). This module is the format and its reading only: the folders are
written, moved between machines and unpacked by `workbench.gpu` (`gpu.place`, `gpu.archive`), which imports
the format from here; the index reads them through `read_references` and `read_parts`.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path

from .results import NAME_PATTERN, _read_json

__all__ = ["REFERENCE", "RUN_FILE", "PARTS", "PART_FILE", "read_references", "read_parts", "commit_mismatch",
           "commit_relation", "checkout_commit", "cuda_memory_rows"]

REFERENCE = "reference"  # reports/reference/<device-slug>/<name>/
RUN_FILE = "run.json"  # the runner's run record, with the reference's `environment` added
SLUG_PATTERN = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
FILE_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.(json|html|png)")  # a notebook reference's files
# What the GPU run's parts leave besides notebooks: reports/reference/<device-slug>/<part>/, with part.json
PARTS = ("tests", "kernels", "memory")
PART_FILE = "part.json"
PART_FILE_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.(json|csv|log|xml|txt)")


def _reference_run(path: Path) -> dict | None:
    """The record of a reference folder (`run.json`, or a part's `part.json`, with an `environment` mapping),
    else None."""
    run = _read_json(path)
    return run if isinstance(run.get("environment"), dict) else None


def read_references(root: str | Path) -> dict[str, list[dict]]:
    """Reference folders under `root` by notebook name: each a dict of slug, folder, environment (run.json's,
    with the run's profile, status and seconds), results and run. Other folders are skipped."""
    root = Path(root)
    found: dict[str, list[dict]] = {}
    if not root.is_dir() or root.is_symlink():
        return found
    for device in sorted(root.iterdir()):
        if not device.is_dir() or device.is_symlink() or not SLUG_PATTERN.fullmatch(device.name):
            continue
        for folder in sorted(device.iterdir()):
            run = _reference_run(folder / RUN_FILE) if NAME_PATTERN.fullmatch(folder.name) else None
            if run is None or folder.is_symlink():
                continue
            env = {**run["environment"], **{k: run.get(k) for k in ("profile", "status", "seconds", "overrides")}}
            found.setdefault(folder.name, []).append({
                "slug": device.name, "name": folder.name, "folder": folder, "environment": env,
                "results": _read_json(folder / "results.json"), "run": run})
    return found


def read_parts(root: str | Path) -> dict[str, list[dict]]:
    """What run.sh's parts left under `root`, by device slug: each a dict of part, folder and its record."""
    root, found = Path(root), {}
    if not root.is_dir() or root.is_symlink():
        return found
    for device in sorted(root.iterdir()):
        if device.is_dir() and not device.is_symlink() and SLUG_PATTERN.fullmatch(device.name):
            for part in PARTS:
                record = _reference_run(device / part / PART_FILE) if not (device / part).is_symlink() else None
                if record is not None:
                    found.setdefault(device.name, []).append({"part": part, "folder": device / part,
                                                              "record": record})
    return found


def commit_mismatch(ref: dict) -> str | None:
    """A note when the commit results.json recorded is not the reference's (run.json's, given to `gpu_run run
    --commit`); None when they agree or one is missing. Neither file is changed: both stay as written."""
    saved = ref["results"].get("environment") if isinstance(ref["results"].get("environment"), dict) else {}
    recorded, commit = saved.get("git_commit"), ref["environment"].get("commit")
    if not recorded or not commit:
        return None
    short, long = sorted((str(recorded).lower(), str(commit).lower()), key=len)
    if long.startswith(short):
        return None
    commit = str(commit)[:12]
    return (f"results.json records git_commit {recorded}, not the reference's commit {commit} (run.json's, given "
            f"to gpu_run with --commit): git read {recorded} from the repository the copy of the checkout sat in; "
            f"{commit} is the commit the notebook ran from. Both files are kept as written")


_COMMIT = re.compile(r"[0-9a-fA-F]{4,40}")


@functools.lru_cache(maxsize=256)
def _is_ancestor(older: str, newer: str, repo: str) -> bool | None:
    try:
        done = subprocess.run(["git", "merge-base", "--is-ancestor", older, newer], cwd=repo,
                              capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: True, 1: False}.get(done.returncode)


def commit_relation(reference: str | None, build: str | None, repo: str | Path | None = None) -> str:
    """How the reference's commit stands to the build's: "same", "older" (an ancestor of the build's),
    "newer", "different" (neither, or git cannot tell) or "unknown" (one of them not recorded)."""
    if not reference or not build or not _COMMIT.fullmatch(str(reference)) or not _COMMIT.fullmatch(str(build)):
        return "unknown"
    reference, build = str(reference).lower(), str(build).lower()
    if reference.startswith(build) or build.startswith(reference):
        return "same"
    if repo is None:
        from ..devices import repo_root

        repo = repo_root()
    if _is_ancestor(reference, build, str(repo)):
        return "older"
    if _is_ancestor(build, reference, str(repo)):
        return "newer"
    return "different"


def checkout_commit(repo: str | Path | None = None) -> str | None:
    """The short commit of the checkout: None outside a git checkout of its own, e.g. a copy on a GPU machine,
    also one that sits inside another repository's work tree (whose commit is not this copy's)."""
    if repo is None:
        from ..devices import repo_root

        repo = repo_root()
    try:
        done = subprocess.run(["git", "rev-parse", "--show-toplevel", "--short", "HEAD"], cwd=repo,
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    if done.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != Path(repo).resolve():
        return None
    return lines[1]


def _numbers(rows: list, column: str) -> list[float]:
    values = [row.get(column) for row in rows if isinstance(row, dict)]
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _partner(reserved: str, columns: list[str]) -> str | None:
    """The allocated-bytes column recorded beside a reserved-bytes one."""
    candidates = (reserved.replace("reserved", "allocated"), reserved.replace("reserved_", ""),
                  reserved.replace("_reserved", ""), "allocator_bytes", "allocator_peak_bytes", "measured_peak_bytes",
                  "peak_bytes")
    return next((c for c in candidates if c != reserved and c in columns), None)


def cuda_memory_rows(results: dict) -> list[dict]:
    """From a CUDA run's records, every pair of columns holding `max_memory_allocated`-style and
    `max_memory_reserved`-style bytes (a column named '...reserved...' and its allocated partner), with the
    largest value of each: what actually ran out beside what tensors held. [] for a run that was not on CUDA."""
    env = results.get("environment") if isinstance(results.get("environment"), dict) else {}
    if not str(env.get("device", "")).startswith("cuda"):
        return []
    rows = []
    records = results.get("records") if isinstance(results.get("records"), dict) else {}
    for record, frame in records.items():
        if not isinstance(frame, list) or not frame:
            continue
        columns = list(dict.fromkeys(c for row in frame if isinstance(row, dict) for c in row if isinstance(c, str)))
        for reserved in (c for c in columns if "reserved" in c):
            allocated = _partner(reserved, columns)
            got_allocated, got_reserved = _numbers(frame, allocated or ""), _numbers(frame, reserved)
            if allocated is None or not got_allocated or not got_reserved:
                continue
            rows.append({"record": str(record), "allocated_column": allocated, "reserved_column": reserved,
                         "max_allocated_bytes": max(got_allocated), "max_reserved_bytes": max(got_reserved)})
    return rows
