"""Reference reports: a notebook's report built on named hardware, kept so that it can be committed.

Issue 22: every paper at its own scale on a GPU (the `gpu` profile), through the same notebooks, kept as
`reports/reference/<device-slug>/<name>/` and shown on the index pages beside a build of your own. A
reference folder holds what a reader needs to check a result without running anything:

    results.json     parameters, environment, records and claims, as the notebook saved them
    run.json         status, seconds, profile and overrides, as the report runner wrote them, plus
                     `environment`: where it ran (device and GPU name, driver, torch, CUDA, Python, the
                     commit, when) and the seconds of each cell (papermill's record), to size the profile from
    <name>.html      the executed notebook
    *.png            its figures

The executed `.ipynb` stays out (the HTML shows the same outputs at a fraction of the size). A folder moves
between machines as one `.tar.gz` (`bundle`, `unpack`), checked member by member; a folder whose run.json has
no `environment` is not a reference folder and is never replaced.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

from .results import NAME_PATTERN, UsageError, _read_json, _write_atomic

__all__ = ["REFERENCE", "RUN_FILE", "device_slug", "gpu_driver", "write_reference", "bundle", "unpack",
           "read_references", "commit_relation", "checkout_commit", "cuda_memory_rows"]

REFERENCE = "reference"  # reports/reference/<device-slug>/<name>/
RUN_FILE = "run.json"  # the runner's run record, with the reference's `environment` added
SLUG_PATTERN = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
_FILE_PATTERN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.(json|html|png)")
_MAX_MEMBER_BYTES = 64 * 2**20
_STAGING = ".incoming-"


def device_slug(device_name: str) -> str:
    """A folder name for a device: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (at most 60 characters)."""
    text = re.sub(r"\((?:r|tm)\)", "", str(device_name).lower())
    slug = re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:60].strip("-")
    return slug or "unknown-device"


def gpu_driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi, else NVML), or None where there is neither."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # not installed, no driver: the reference says "unknown"
        return None


def _environment(results: dict, run: dict, *, commit: str | None, driver: str | None,
                 fallback: dict | None = None) -> dict:
    saved = results.get("environment") if isinstance(results.get("environment"), dict) else {}
    # a run that stopped before saving its results: where it ran comes from the machine (`fallback`)
    env = {**(fallback or {}), **{k: v for k, v in saved.items() if v is not None}}
    cuda = str(env.get("device", "")).startswith("cuda")
    return {
        "device": env.get("device"), "device_name": env.get("device_name"),
        "driver": (driver or gpu_driver()) if cuda else None, "torch": env.get("torch"), "cuda": env.get("cuda"),
        "python": env.get("python"), "platform": env.get("platform"), "cpu_model": env.get("cpu_model"),
        "commit": commit or env.get("git_commit"), "made": results.get("saved") or run.get("started")
        or time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _cell_seconds(notebook: Path) -> list[dict]:
    """Each executed code cell's seconds (papermill's record) and first line: where a profile's time goes."""
    cells = _read_json(notebook).get("cells")
    found = []
    for index, cell in enumerate(cells if isinstance(cells, list) else []):
        meta = cell.get("metadata", {}).get("papermill", {}) if isinstance(cell, dict) else {}
        seconds = meta.get("duration") if isinstance(meta, dict) else None
        if cell.get("cell_type") == "code" and isinstance(seconds, (int, float)):
            source = cell.get("source", "")
            source = "".join(source) if isinstance(source, list) else str(source)
            first = next((line for line in source.splitlines() if line.strip()), "")
            found.append({"cell": index, "seconds": round(float(seconds), 2), "first_line": first[:100]})
    return found


def _reference_run(path: Path) -> dict | None:
    """The run record of a reference folder (`run.json` with an `environment` mapping), else None."""
    run = _read_json(path) if path.is_file() and not path.is_symlink() else {}
    return run if isinstance(run, dict) and isinstance(run.get("environment"), dict) else None


def _is_reference(folder: Path) -> bool:
    return folder.is_dir() and not folder.is_symlink() and _reference_run(folder / RUN_FILE) is not None


def _swap(staging: Path, target: Path) -> None:
    """Put `staging` where `target` is; a `target` that is not a reference folder is refused, never replaced."""
    if os.path.lexists(target):
        if not _is_reference(target):
            shutil.rmtree(staging, ignore_errors=True)
            raise UsageError(f"{target} exists and is not a reference folder (no {RUN_FILE} with an environment); "
                             f"move it out of the way")
        old = target.with_name(f".old-{target.name}-{os.getpid()}")
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, target)


def write_reference(report: str | Path, root: str | Path, *, commit: str | None = None,
                    driver: str | None = None, environment: dict | None = None) -> Path:
    """Copy the report folder `report` (`reports/<profile>/<name>/`) to `<root>/<device-slug>/<name>/`, its
    run.json given the `environment` it ran in; returns that folder. `commit` names the checkout the notebook
    ran from (a copy without `.git`, such as a GPU machine's, records none of its own); `environment`
    (`workbench.devices.environment` of the device it ran on) fills what results.json does not say, e.g. for
    a run that failed before saving."""
    report, root = Path(report), Path(root)
    name = report.name
    results, run = _read_json(report / "results.json"), _read_json(report / "run.json")
    if not NAME_PATTERN.fullmatch(name) or not (results or run):
        raise UsageError(f"{report} is not a report folder (no results.json or run.json)")
    env = _environment(results, run, commit=commit, driver=driver, fallback=environment)
    env["cell_seconds"] = _cell_seconds(report / f"{name}.ipynb")
    slug = device_slug(env["device_name"] or "unknown device")
    staging = root / slug / f"{_STAGING}{name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    figures = results.get("figures") if isinstance(results.get("figures"), list) else []
    wanted = ["results.json", f"{name}.html", *[f for f in figures if isinstance(f, str)]]
    for file in dict.fromkeys(wanted):
        if _FILE_PATTERN.fullmatch(file) and (report / file).is_file() and not (report / file).is_symlink():
            shutil.copyfile(report / file, staging / file)
    _write_atomic(staging / RUN_FILE, json.dumps({**run, "name": name, "environment": env}, indent=1, default=str))
    target = root / slug / name
    _swap(staging, target)
    return target


def bundle(folder: str | Path, dest: str | Path) -> Path:
    """One `.tar.gz` of a reference folder, its members named `<device-slug>/<name>/<file>`."""
    folder, dest = Path(folder), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    slug, name = folder.parent.name, folder.name
    path = dest / f"reference-{slug}-{name}.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for file in sorted(folder.iterdir()):
            if file.is_file() and not file.is_symlink() and _FILE_PATTERN.fullmatch(file.name):
                tar.add(file, arcname=f"{slug}/{name}/{file.name}", recursive=False)
    return path


def unpack(archive: str | Path, root: str | Path) -> list[Path]:
    """Extract a `bundle` archive into `<root>/<device-slug>/<name>/`, replacing that reference folder.

    Every member must be a plain file named `<device-slug>/<name>/<file>.json|.html|.png` (no links, no other
    folders, at most 64 MiB) and each folder must hold a run.json with its `environment`; otherwise nothing is
    written (UsageError naming the member or the folder)."""
    archive, root = Path(archive), Path(root)
    try:
        tar = tarfile.open(archive, "r:*")
    except (OSError, tarfile.TarError) as exc:
        raise UsageError(f"{archive}: not a reference archive ({exc})") from None
    with tar:
        members, folders = [], {}
        for member in tar.getmembers():
            parts = member.name.split("/")
            if member.isdir() and len(parts) <= 2:
                continue
            ok = (member.isfile() and len(parts) == 3 and SLUG_PATTERN.fullmatch(parts[0]) is not None
                  and NAME_PATTERN.fullmatch(parts[1]) is not None and _FILE_PATTERN.fullmatch(parts[2]) is not None
                  and member.size <= _MAX_MEMBER_BYTES)
            if not ok:
                raise UsageError(f"{archive}: refusing member {member.name!r} (expected plain files "
                                 f"<device-slug>/<name>/<file>.json|.html|.png of at most 64 MiB)")
            members.append((member, parts))
            folders.setdefault((parts[0], parts[1]), set()).add(parts[2])
        missing = [f"{s}/{n}" for (s, n), files in folders.items() if RUN_FILE not in files]
        if not folders or missing:
            raise UsageError(f"{archive}: no reference folder with {RUN_FILE} "
                             f"({', '.join(missing) or 'empty archive'})")
        staged: dict[tuple[str, str], Path] = {}
        try:
            for member, (slug, name, file) in members:
                staging = staged.setdefault((slug, name), root / slug / f"{_STAGING}{name}-{os.getpid()}")
                if not staging.exists():
                    staging.mkdir(parents=True)
                source = tar.extractfile(member)
                with source, open(staging / file, "wb") as out:
                    shutil.copyfileobj(source, out)
        except (OSError, tarfile.TarError) as exc:
            for staging in staged.values():
                shutil.rmtree(staging, ignore_errors=True)
            raise UsageError(f"{archive}: cannot extract ({exc})") from None
    bad = [f"{slug}/{name}" for (slug, name), staging in staged.items() if _reference_run(staging / RUN_FILE) is None]
    if bad:
        for staging in staged.values():
            shutil.rmtree(staging, ignore_errors=True)
        raise UsageError(f"{archive}: {', '.join(bad)}: {RUN_FILE} holds no environment (not a reference folder)")
    targets = []
    for (slug, name), staging in staged.items():
        _swap(staging, root / slug / name)
        targets.append(root / slug / name)
    return targets


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
    """The short commit of the checkout (None outside a git checkout, e.g. a copy on a GPU machine)."""
    if repo is None:
        from ..devices import repo_root

        repo = repo_root()
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


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
