"""Reference folders written: a report kept as `reports/reference/<device-slug>/<name>/` (issue 22).

`write_reference` copies a report folder the runner built (results.json, the HTML, the figures) and gives its
run.json the `environment` it ran in (device and GPU name, driver, torch, CUDA, Python, the commit, when, and
each cell's seconds). The executed `.ipynb` stays out (the HTML shows the same outputs at a fraction of the
size). A folder is written file by file (`place_folder`): never through a symbolic link, never into a folder
without a record of ours (run.json or part.json with an `environment`), and the files a reference did not write
are kept. The format and its reading are `workbench.report.reference`'s; a folder moves between machines as one
`.tar.gz` (`archive`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
import subprocess
import time
from pathlib import Path

from ..report.reference import (
    FILE_PATTERN, PART_FILE, PART_FILE_PATTERN, PARTS, RUN_FILE, _reference_run,
)
from ..report.results import _NOFOLLOW, NAME_PATTERN, UsageError, _read_json

__all__ = ["device_slug", "gpu_driver", "marker_file", "own_files", "check_target", "place_folder",
           "write_reference"]


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


def marker_file(name: str) -> str:
    """The file that makes `<device-slug>/<name>/` ours: a part's `part.json`, a notebook's run.json."""
    return PART_FILE if name in PARTS else RUN_FILE


def own_files(folder: Path) -> set[str]:
    """The files of a reference folder that a reference writes (so may replace or remove): its record, and for
    a notebook results.json, the HTML and the figures results.json names; for a part, the files its record
    lists. Everything else in the folder is someone else's and is kept."""
    name = folder.name
    record = _reference_run(folder / marker_file(name)) or {}
    if name in PARTS:
        listed = record.get("files") if isinstance(record.get("files"), list) else []
        return {PART_FILE, *(f for f in listed if isinstance(f, str) and PART_FILE_PATTERN.fullmatch(f))}
    figures = _read_json(folder / "results.json").get("figures")
    figures = [f for f in figures if isinstance(f, str)] if isinstance(figures, list) else []
    return {RUN_FILE, "results.json", f"{name}.html", *(f for f in figures if FILE_PATTERN.fullmatch(f))}


def check_target(root: Path, slug: str, name: str) -> None:
    """Refuse (UsageError) to write `<root>/<slug>/<name>/` through a symbolic link, over something that is not
    a folder, or into a folder that is not a reference folder of ours."""
    if os.path.lexists(root.parent) and not root.parent.is_dir():
        raise UsageError(f"{root.parent} exists and is not a folder; move it out of the way")
    above = next((p for p in root.parent.parents if os.path.lexists(p)), None)
    if not os.path.lexists(root.parent) and above is not None and not above.is_dir():
        raise UsageError(f"{root.parent}: {above} is not a folder, so no folder can be made under it")
    for shown in (root, root / slug, root / slug / name):
        if shown.is_symlink():
            raise UsageError(f"{shown} is a symbolic link: reference reports are written only into real folders "
                             f"(remove the link)")
        if os.path.lexists(shown) and not shown.is_dir():
            raise UsageError(f"{shown} exists and is not a folder; move it out of the way")
    folder = root / slug / name
    if folder.is_dir() and _reference_run(folder / marker_file(name)) is None:
        raise UsageError(f"{folder} exists and is not a reference folder (no {marker_file(name)} with an "
                         f"environment); move it out of the way")


_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)


def _subfolder(parent: int, name: str, shown: Path) -> int:
    """A descriptor of folder `name` inside folder descriptor `parent`, made when missing, never a link."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, dir_fd=parent)
    try:
        return os.open(name, _DIR | _NOFOLLOW, dir_fd=parent)  # a link swapped in after check_target fails here
    except OSError as exc:
        raise UsageError(f"{shown}: not a real folder ({exc.strerror or exc}); reference reports are written only "
                         f"into real folders") from None


def place_folder(root: str | Path, slug: str, name: str, files: dict[str, bytes]) -> Path:
    """Write `files` into `<root>/<slug>/<name>/` and return that folder. Files of the reference already there
    (`own_files`) are replaced or, when `files` lacks them, removed; anything else in the folder stays. Nothing
    is written through a symbolic link: the folders are opened without following one, each file is written
    under a new name and renamed into place (a link of that name is replaced, not followed). The record goes
    first, so a folder an interruption left half-written is still ours to rewrite."""
    root = Path(root)
    check_target(root, slug, name)
    folder = root / slug / name
    stale = own_files(folder) - set(files) if folder.is_dir() else set()
    marker = marker_file(name)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{root.parent}: cannot make this folder ({exc.strerror or exc}); nothing was written") \
            from None
    fds: list[int] = []
    try:
        fds.append(os.open(root.parent, _DIR))
        for part, shown in ((root.name, root), (slug, root / slug), (name, folder)):
            fds.append(_subfolder(fds[-1], part, shown))
        for file in sorted(files, key=lambda f: f != marker):
            _write_in(fds[-1], file, files[file])
        for file in stale:
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.stat(file, dir_fd=fds[-1], follow_symlinks=False).st_mode):
                    os.unlink(file, dir_fd=fds[-1])
    except OSError as exc:
        raise UsageError(f"{folder}: cannot write the reference ({exc.strerror or exc})") from None
    finally:
        for fd in fds:
            os.close(fd)
    return folder


def _write_in(folder: int, file: str, data: bytes) -> None:
    """Write `file` inside folder descriptor `folder` under a new name, then rename it into place."""
    temporary = f".incoming-{file}-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(temporary, file, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=folder)
        raise


def write_reference(report: str | Path, root: str | Path, *, commit: str | None = None,
                    driver: str | None = None, environment: dict | None = None,
                    shown_paths: dict[str, str] | None = None) -> Path:
    """Copy the report folder `report` (`reports/<profile>/<name>/`) to `<root>/<device-slug>/<name>/`, its
    run.json given the `environment` it ran in; returns that folder. `commit` names the checkout the notebook
    ran from (a copy without `.git`, such as a GPU machine's, records none of its own); `environment`
    (`workbench.devices.environment` of the device it ran on) fills what results.json does not say, e.g. for
    a run that failed before saving. `shown_paths` (regular expression -> text) rewrites paths in the HTML: the
    build's temporary folder, which a reader has no use for, is shown as the report's folder in the build."""
    report, root = Path(report), Path(root)
    name = report.name
    results, run = _read_json(report / "results.json"), _read_json(report / "run.json")
    if not NAME_PATTERN.fullmatch(name) or not (results or run):
        raise UsageError(f"{report} is not a report folder (no results.json or run.json)")
    env = _environment(results, run, commit=commit, driver=driver, fallback=environment)
    env["cell_seconds"] = _cell_seconds(report / f"{name}.ipynb")
    figures = results.get("figures") if isinstance(results.get("figures"), list) else []
    files = {}
    for file in dict.fromkeys(["results.json", f"{name}.html", *[f for f in figures if isinstance(f, str)]]):
        if FILE_PATTERN.fullmatch(file) and (report / file).is_file() and not (report / file).is_symlink():
            files[file] = (report / file).read_bytes()
    page = f"{name}.html"
    for pattern, shown in (shown_paths or {}).items():
        if page in files:
            files[page] = re.sub(pattern.encode(), shown.encode(), files[page])
    files[RUN_FILE] = json.dumps({**run, "name": name, "environment": env}, indent=1, default=str).encode()
    return place_folder(root, device_slug(env["device_name"] or "unknown device"), name, files)
