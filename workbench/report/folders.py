"""The output folder: what the runner made, the build lock, and moving a report into place.

The runner replaces only what it made. Every report folder it writes holds a marker file,
`.workbench-report`, listing the files the build put there; every index page it writes names its
generator. A folder without the marker, a file the marker does not list (your `notes.txt`), an index
page written by someone else or a file where a report folder belongs is refused before any kernel
starts, with its path.

A finished report moves into place in two renames (`<name>` -> `.old-<name>-<pid>-<token>`, then the
staging folder -> `<name>`), always under the build lock. A build that dies between them leaves the last
good report under its hidden name; the next build, holding the lock, knows that no build is mid-swap and
restores it, whatever process now has that id. A hidden report is deleted only when what is in its place
proves it replaced: a report whose run.json says "ok", or the hidden one being a failed run itself
(`report_state`). A report whose run.json is damaged is never judged failed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
from contextlib import contextmanager
from pathlib import Path

from .results import FAILED_RUN, INTERACTIVE, NAME_PATTERN, PROFILES, UsageError, _read_json, _write_atomic

__all__ = ["MARKER", "GENERATOR", "mark", "foreign_entries", "page_is_ours", "prepare_out", "locked", "recover",
           "report_state", "settle", "swap_into_place", "temp_name"]

MARKER = ".workbench-report"  # in every report folder the runner made: the files it wrote there
GENERATOR = '<meta name="generator" content="workbench report">'  # in every index page it wrote
LOCK = ".lock"
_TEMP = re.compile(r"\.(staging|old)-(.+)-(\d+)-([0-9a-f]+)")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # not on Windows
try:
    import fcntl as _fcntl
except ImportError:  # Windows: per-build temporary names still keep builds apart
    _fcntl = None


def temp_name(kind: str, name: str) -> str:
    """A per-build temporary name: `.<kind>-<name>-<pid>-<token>` (also unique across threads)."""
    return f".{kind}-{name}-{os.getpid()}-{secrets.token_hex(4)}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


# ---------------------------------------------------------------------------------------------
# What the runner made


def mark(folder: Path) -> None:
    """Record every entry now in `folder` as made by the runner (call when the folder is complete)."""
    names = sorted(p.name for p in folder.iterdir() if p.name != MARKER)
    _write_atomic(folder / MARKER, json.dumps({"made_by": "workbench report", "files": names}, indent=1))


def _made(folder: Path) -> set[str] | None:
    """The entries the runner made in `folder`, or None when it did not make the folder."""
    marker = _read_json(folder / MARKER)
    if isinstance(marker.get("files"), list):
        return {str(f) for f in marker["files"]} | {MARKER, FAILED_RUN}
    # a report from before the marker (or whose marker is damaged): the files that runner wrote
    run = _read_json(folder / "run.json")
    if run.get("status") in ("ok", "failed") and isinstance(run.get("name"), str):
        name = run["name"]
        # NOTE: its figures are those its results.json lists, not every *.png: a picture of yours saved
        # into the folder is yours (and with results.json damaged, every picture counts as yours)
        figures = _read_json(folder / "results.json").get("figures")
        listed = {f for f in figures if isinstance(f, str) and f.endswith(".png")
                  and NAME_PATTERN.fullmatch(f[:-4])} if isinstance(figures, list) else set()
        return {"run.json", "results.json", f"{name}.ipynb", f"{name}.html", FAILED_RUN, MARKER} | listed
    return None


def foreign_entries(folder: Path) -> list[str] | None:
    """Entries of report folder `folder` the runner did not make ([] when it made all of them), or None
    when it did not make the folder (no marker, a plain file, a symbolic link)."""
    if folder.is_symlink() or not folder.is_dir():
        return None
    made = _made(folder)
    if made is None:
        return None if any(folder.iterdir()) else []  # an empty folder holds nothing to lose
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.name == FAILED_RUN:
            inner = foreign_entries(entry)
            found += [FAILED_RUN] if inner is None else [f"{FAILED_RUN}/{e}" for e in inner]
        elif entry.name not in made and not _TEMP.fullmatch(entry.name):
            found.append(entry.name)
    return found


def _ownership_problem(target: Path) -> str | None:
    """Why the runner may not replace `target` (a report folder), or None when it may."""
    if not os.path.lexists(target):
        return None
    found = foreign_entries(target)
    if found is None:
        what = "a symbolic link" if target.is_symlink() else "a folder" if target.is_dir() else "a file"
        return f"{target} is {what} that workbench report did not make (it has no {MARKER})"
    if found:
        return f"{target} holds {', '.join(found)}, which workbench report did not make"
    return None


def page_is_ours(path: Path) -> bool:
    """True when `path` is absent or an index page the runner wrote (now or before the generator tag)."""
    if not os.path.lexists(path):
        return True
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            head = handle.read(4096)
    except OSError:
        return False
    return GENERATOR in head or "<title>Workbench reports" in head


def _problems(root: Path, profile: str, names) -> list[str]:
    if os.path.lexists(root / LOCK) and (root / LOCK).is_symlink():
        return [f"{root / LOCK} is a symbolic link; the build lock must be a plain file: remove the link"]
    if os.path.lexists(root / LOCK) and not stat.S_ISREG(os.lstat(root / LOCK).st_mode):
        # NOTE: found only when the first notebook finished and its report was moved into place under the lock
        return [f"{root / LOCK} is not a plain file; the build lock must be one: remove it"]
    found = [f"{page} was not written by workbench report" for page in
             (root / "index.html", *(root / g / "index.html" for g in (*PROFILES, INTERACTIVE)))
             if not page_is_ours(page)]
    out = root / profile
    if os.path.lexists(out) and (out.is_symlink() or not out.is_dir()):
        return [*found, f"{out} is not a folder"]
    return found + [p for name in names if (p := _ownership_problem(out / name))]


def prepare_out(root: Path, profile: str, names=()) -> Path:
    """The profile's output folder, checked (nothing the runner did not make is in the way of `names`),
    created and proven writable before any kernel starts."""
    if root.exists() and not root.is_dir():
        raise UsageError(f"--out {root} is a file, not a folder")
    problems = _problems(root, profile, names)
    if problems:
        raise UsageError("refusing to replace what workbench report did not make:\n  "
                         + "\n  ".join(problems) + "\nmove it out of the way or choose another --out")
    target = root / profile
    probe = target / temp_name("write-test", "probe")
    try:
        target.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise UsageError(f"cannot write reports to {target}: {exc.strerror or exc}") from None
    return target


# ---------------------------------------------------------------------------------------------
# The build lock


def _open_lock(path: Path) -> int:
    """A descriptor of the lock file `path`: created exclusively, never through a symbolic link."""
    for _ in range(3):
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        except FileExistsError:
            pass
        try:
            fd = os.open(path, os.O_RDWR | _NOFOLLOW)
        except FileNotFoundError:  # removed in between: create it again
            continue
        except OSError as exc:
            if path.is_symlink():
                raise UsageError(f"{path} is a symbolic link; the build lock must be a plain file: "
                                 f"remove the link") from None
            if os.path.lexists(path) and not path.is_file():
                raise UsageError(f"{path} is not a plain file; the build lock must be one: remove it") from None
            raise UsageError(f"cannot open the build lock {path}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UsageError(f"{path} is not a plain file; the build lock must be one: remove it")
        return fd
    raise UsageError(f"cannot create the build lock {path}: it keeps disappearing")


@contextmanager
def locked(root: Path):
    """An exclusive lock on `root` for moving reports into place and writing the index (two builds, one
    folder). `<root>/.lock` is created with O_CREAT | O_EXCL | O_NOFOLLOW: a link there is refused."""
    fd = _open_lock(root / LOCK)
    try:
        if _fcntl is not None:
            _fcntl.flock(fd, _fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


# ---------------------------------------------------------------------------------------------
# Moving into place, and recovering from a build that died


def report_state(folder: Path) -> str:
    """What a report folder the runner made is: "absent" (nothing there, or an empty folder), "ok" or "failed"
    (its run.json says so), or "unknown" (run.json missing or damaged: it may be a good report)."""
    if not os.path.lexists(folder) or (folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir())):
        return "absent"
    status = _read_json(folder / "run.json").get("status") if folder.is_dir() and not folder.is_symlink() else None
    return status if status in ("ok", "failed") else "unknown"


_RANK = {"ok": 0, "unknown": 1, "failed": 2, "absent": 3}  # which copy of a report is worth the most


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():  # only folders a build made; a file stays as it is
        shutil.rmtree(path, ignore_errors=True)


def settle(final: Path, hidden: list[Path]) -> None:
    """Under the lock: put the best of `final` and the reports hidden by builds that died (`hidden`,
    `.old-<name>-*`) in place, and delete a hidden one only when the report in place proves it replaced.

    The best is a proven good report, then one of unknown state, the newest first. A failed run in place
    of a better hidden report moves into that report's `failed-run/` (as a failed rebuild would have put it).
    """
    if not NAME_PATTERN.fullmatch(final.name):
        return
    folders = [p for p in hidden if p.is_dir() and not p.is_symlink()]
    if not folders:
        if hidden and not os.path.lexists(final):  # a file an older runner moved aside goes back
            os.replace(max(hidden, key=lambda p: p.lstat().st_mtime), final)
        return
    best = min(folders, key=lambda p: (_RANK[report_state(p)], -p.lstat().st_mtime))
    here = report_state(final) if os.path.lexists(final) else "absent"
    if _RANK[report_state(best)] < _RANK[here] and here in ("failed", "absent"):
        beaten = final.parent / temp_name("old", final.name) if os.path.lexists(final) else None
        if beaten is not None:
            os.replace(final, beaten)
        os.replace(best, final)
        folders.remove(best)
        if beaten is not None and here == "failed" and report_state(final / FAILED_RUN) in ("failed", "absent"):
            _remove(final / FAILED_RUN)
            os.replace(beaten, final / FAILED_RUN)
        elif beaten is not None:
            _remove(beaten)  # an empty folder
        here = report_state(final)
    for path in folders:
        if here == "ok" or report_state(path) in ("failed", "absent"):
            _remove(path)
        # else: kept under its hidden name; a later good report in place replaces it


def _leftovers(parent: Path, name: str | None = None, worker_pid: int | None = None) -> dict[tuple, list[Path]]:
    """Temporary entries of builds that died, by (kind, name): every `.old-*` (the caller holds the lock, so
    no build is between its renames), and `.staging-*` of processes gone (or of `worker_pid`, known dead)."""
    found: dict[tuple[str, str], list[Path]] = {}
    for path in parent.iterdir():
        match = _TEMP.fullmatch(path.name)
        if match is None or (name is not None and match.group(2) != name):
            continue
        kind, pid = match.group(1), int(match.group(3))
        # NOTE: a process id says nothing once the process is gone (the id is reused); only staging folders,
        # made outside the lock, need it. Without flock (Windows) the lock is no proof, so ids decide.
        mid_swap = kind == "old" and _fcntl is None
        if (kind == "staging" or mid_swap) and pid != worker_pid and _alive(pid):
            continue
        found.setdefault((kind, match.group(2)), []).append(path)
    return found


def _recover_in(parent: Path, name: str | None = None, worker_pid: int | None = None) -> None:
    for (kind, entry), paths in sorted(_leftovers(parent, name, worker_pid).items()):
        if kind == "old":
            settle(parent / entry, paths)
        else:
            for path in paths:
                _remove(path)


def recover(folder: Path, name: str | None = None, worker_pid: int | None = None) -> None:
    """Under `locked(root)`: restore reports that builds which died left under `.old-*` names in the profile
    folder `folder` (and failed runs inside its report folders); remove their staging folders. `name`: only
    that report's; `worker_pid`: a process known dead (a Dask worker) whose id may already be reused."""
    if not folder.is_dir():
        return
    _recover_in(folder, name, worker_pid)
    for sub in folder.iterdir():
        if NAME_PATTERN.fullmatch(sub.name) and (name is None or sub.name == name) and sub.is_dir() \
                and not sub.is_symlink():
            _recover_in(sub)


def swap_into_place(staging: Path, final: Path) -> None:
    """Replace `final` by `staging` (two renames) so a reader never sees a half-written report folder.

    UsageError when `final` holds something the runner did not make; nothing is moved then.
    """
    problem = _ownership_problem(final)
    if problem:
        raise UsageError(problem)
    old = final.parent / temp_name("old", final.name)
    if os.path.lexists(final):
        os.replace(final, old)
    try:
        os.replace(staging, final)
    except BaseException:
        if os.path.lexists(old) and not os.path.lexists(final):
            os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)
