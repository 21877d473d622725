"""`python -m workbench.gpu pack DEST`: all a bare GPU machine needs, in one folder to carry there.

DEST holds:

    checkout/   the committed HEAD (`git archive`: no uncommitted change, no ignored file), without
                reports/reference/ (the machine makes references; it needs none)
    wheels/     the Jupyter stack for the image's Python (`wheels`), or none with `--no-wheels`
    run.sh      `run.sh PART OUTDIR [options]`: the image's python3 (with torch) is all it needs
    pack.json   the commit, when it was made, the wheels, the size and `files`: every path the pack wrote

and stays under MAX_PACK_BYTES, so that it travels beside the repository within the 64 MiB a device call
carries. Made inside the repository as `gpu-pack/` (which git ignores), it is carried by naming `gpu-pack` and
run as `bash gpu-pack/run.sh tests "$OUT"` (README, "Profiles"). Packing again into DEST replaces only the
paths its pack.json lists: a file someone else put there is kept (and named), and a folder holding files but
no pack.json that lists them is refused, never emptied. The commit recorded everywhere on the machine is the
one packed (`--commit` and WORKBENCH_COMMIT in run.sh; git is kept from reading an enclosing repository's).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path

from ..devices import repo_root
from ..report.reference import REFERENCE
from ..report.results import UsageError
from .wheels import download_wheels, wheel_metadata, wheel_requirements

__all__ = ["MAX_PACK_BYTES", "PACK_FILE", "pack", "add_pack_parser"]

MAX_PACK_BYTES = 40 * 2**20
PACK_FILE = "pack.json"
_LEFT_OUT = f"reports/{REFERENCE}/"

RUN_SH = """#!/bin/sh
# Written by `python -m workbench.gpu pack` from commit {commit} on {made}.
# usage: run.sh PART OUTDIR [--profile gpu|smoke] [--device cuda|cuda:N|cpu] [--deadline SECONDS] [--only PATH]
#   PART: tests | kernels | memory | a notebook name, or several joined by commas
# Needs only the machine's python3 with torch; the checkout and the wheels are in this folder.
set -u
if [ $# -lt 2 ]; then
  sed -n '3,4p' "$0" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
part=$1
case $2 in /*) out=$2 ;; *) out=$(pwd)/$2 ;; esac
shift 2
export WORKBENCH_COMMIT={commit} PYTHONPATH="$here/checkout" PYTHONUNBUFFERED=1 GIT_CEILING_DIRECTORIES="$here"
cd "$here/checkout" || exit 2
exec "${{PYTHON:-python3}}" -m workbench.gpu part "$part" "$out" --commit {commit} \\
  --wheels "$here/wheels" "$@"
"""


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, timeout=120)


def _head(repo: Path) -> str:
    done = _git(repo, "rev-parse", "--show-toplevel", "HEAD")
    lines = done.stdout.decode().split()
    if done.returncode != 0 or len(lines) != 2 or Path(lines[0]).resolve() != repo.resolve():
        raise UsageError(f"{repo} is not a git checkout of its own: pack copies its committed HEAD")
    return lines[1]


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _checkout(repo: Path, dest: Path) -> None:
    """The committed HEAD, less reports/reference/, extracted into `dest`."""
    done = _git(repo, "archive", "--format=tar", "HEAD")
    if done.returncode != 0:
        raise UsageError(f"git archive HEAD failed in {repo}: {done.stderr.decode()[-500:]}")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        members = [m for m in tar.getmembers() if not f"{m.name}/".startswith(_LEFT_OUT)]
        tar.extractall(dest, members=members, filter="data")


def _source_wheels(wheels_from: Path) -> list[Path]:
    """The wheels in `--wheels-from`, each checked to be a regular file holding a wheel's METADATA (UsageError
    naming the file otherwise), before anything is written."""
    if not wheels_from.is_dir():
        raise UsageError(f"--wheels-from {wheels_from}: not a folder of wheels")
    wheels = sorted(wheels_from.glob("*.whl"))
    for wheel in wheels:
        try:
            regular = stat.S_ISREG(wheel.stat().st_mode)
            if regular:
                wheel_metadata(wheel)
        except UsageError:
            raise UsageError(f"--wheels-from {wheels_from}: {wheel.name} is not a wheel (no .dist-info/METADATA)") \
                from None
        except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile, KeyError, ValueError, TypeError, EOFError) as exc:
            raise UsageError(f"--wheels-from {wheels_from}: {wheel.name} is not a wheel ({exc})") from None
        if not regular:
            raise UsageError(f"--wheels-from {wheels_from}: {wheel.name} is not a regular file (expected wheels)")
    return wheels


def _wheels(dest: Path, wheels_from: list[Path] | None, no_wheels: bool) -> list[str]:
    dest.mkdir()
    if no_wheels:
        return []
    wanted = wheel_requirements()
    if wheels_from is None:
        download_wheels(dest, wanted)
    else:
        for wheel in wheels_from:
            shutil.copyfile(wheel, dest / wheel.name)
    have = {f"{n}=={v}" for n, v, *_ in map(wheel_metadata, sorted(dest.glob("*.whl")))}
    missing = sorted(set(wanted) - have)
    if missing:
        raise UsageError(f"wheels missing for {', '.join(missing)}: run `make wheels` (or pack without --wheels-from, "
                         f"which downloads them)")
    return sorted(have)


def _entries(folder: Path) -> list[str]:
    """Everything under `folder`, as paths relative to it: folders with a trailing '/', anything else (files,
    links, a link to a folder too) without; links are listed, never followed."""
    out = []
    for top, dirs, files in os.walk(folder):
        here = Path(top).relative_to(folder)
        for name in list(dirs):
            path = (here / name).as_posix()
            if os.path.islink(os.path.join(top, name)):
                dirs.remove(name)
                out.append(path)
            else:
                out.append(f"{path}/")
        out.extend((here / name).as_posix() for name in files)
    return sorted(out)


def _listed(dest: Path) -> set[str] | None:
    """The paths pack.json at `dest` says a pack wrote, or None when it lists none (no pack of ours)."""
    try:
        files = json.loads((dest / PACK_FILE).read_text()).get("files")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(files, list) or PACK_FILE not in files or not all(
            isinstance(f, str) and f and not f.startswith("/") and ".." not in f.split("/") for f in files):
        return None
    return set(files)


def _shown(paths, limit: int = 8) -> str:
    paths = sorted(paths)
    return ", ".join(paths[:limit]) + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def _foreign(dest: Path, ours: set[str]) -> list[str]:
    """What is at `dest` that a pack did not write: files and links not listed, and folders not listed (named
    once, not their content)."""
    out = []
    for entry in _entries(dest):
        if entry not in ours and not any(entry.startswith(f) for f in out if f.endswith("/")):
            out.append(entry)
    return out


def _check_dest(dest: Path) -> None:
    """Refuse (UsageError) a destination that cannot become a folder: a link, something other than a folder,
    a path under a regular file, a name no path can hold."""
    if "\0" in str(dest):
        raise UsageError(f"{str(dest)!r} holds a NUL byte, which no path can hold; choose another folder")
    if len(dest.name.encode()) > 255 - len(".incoming-4194304."):  # the pack is staged beside it, under a longer name
        raise UsageError(f"{dest.name[:40]}...: a folder name of {len(dest.name.encode())} bytes; a file system allows "
                         f"255, and pack stages it beside under a name {len('.incoming-4194304.')} bytes longer")
    try:
        os.lstat(dest)
    except (FileNotFoundError, NotADirectoryError):
        pass  # made later, or refused below naming what is in the way
    except OSError as exc:
        raise UsageError(f"{dest}: {exc.strerror or exc}; choose another folder") from None
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise UsageError(f"{dest} exists and is not a pack; choose another folder (or remove it)")
    for above in dest.parents:
        if os.path.lexists(above):
            if not above.is_dir():
                raise UsageError(f"{dest}: {above} is not a folder; choose another place for the pack")
            break


def _replace(dest: Path, staging: Path, old: set[str], kept: list[str]) -> None:
    """Put the pack built in `staging` at `dest` in place of the earlier one (`old`, what it wrote), keeping
    `kept`. pack.json first lists both packs' files, so that a run stopped half-way leaves a folder whose
    files are all still known as ours; then the old files go, the new ones come, and pack.json last."""
    new = _entries(staging)
    names, files = {e.rstrip("/") for e in new}, {e for e in new if not e.endswith("/")}
    clash = [k for k in kept if k.rstrip("/") in names or any(p.as_posix() in files for p in Path(k).parents)]
    if clash:
        raise UsageError(f"{dest}: {_shown(clash)} not written by pack, where the new pack writes; move them out "
                         f"of the way (nothing was changed)")
    here = set(_entries(dest))
    (dest / f".{PACK_FILE}.incoming").write_text(json.dumps({"files": sorted(old | set(new))}))
    os.replace(dest / f".{PACK_FILE}.incoming", dest / PACK_FILE)
    for entry in sorted(old & here, reverse=True):  # the deepest first; a folder only once it is empty
        if entry.endswith("/"):
            with contextlib.suppress(OSError):
                os.rmdir(dest / entry)
        elif entry != PACK_FILE:
            os.unlink(dest / entry)
    for entry in new:
        if entry.endswith("/"):
            (dest / entry).mkdir(exist_ok=True)
        elif entry != PACK_FILE:
            os.replace(staging / entry, dest / entry)
    os.replace(staging / PACK_FILE, dest / PACK_FILE)


def pack(dest: str | Path, *, wheels_from: Path | None = None, no_wheels: bool = False,
         repo: Path | None = None) -> dict:
    """Write the pack (see the module's docstring) to `dest`: a new or empty folder, or an earlier pack, whose
    files (those its pack.json lists) are replaced; anything else there is kept, and `dest` holding files but
    no pack.json that lists them is refused. Returns pack.json's content with `kept`, the paths at `dest` the
    pack did not write."""
    repo, dest = Path(repo or repo_root()), Path(dest).absolute()
    commit = _head(repo)
    _check_dest(dest)
    old: set[str] = set()
    kept: list[str] = []
    if dest.is_dir() and any(dest.iterdir()):
        listed = _listed(dest)
        if listed is None:
            raise UsageError(f"{dest} exists and is not a pack (no {PACK_FILE} listing the files a pack wrote); "
                             f"packing there would lose {_shown(_entries(dest))}: choose another folder (or, for a "
                             f"pack made before pack.json listed its files, remove it yourself)")
        old, kept = listed, _foreign(dest, listed)
    sources = None if wheels_from is None or no_wheels else _source_wheels(wheels_from)
    staging = dest.with_name(f".{dest.name}.incoming-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
    except OSError as exc:
        raise UsageError(f"{dest}: cannot make a folder there ({exc.strerror or exc})") from None
    try:
        _checkout(repo, staging / "checkout")
        wheels = _wheels(staging / "wheels", sources, no_wheels)
        made = time.strftime("%Y-%m-%d %H:%M:%S")
        (staging / "run.sh").write_text(RUN_SH.format(commit=commit, made=made))
        (staging / "run.sh").chmod(0o755)
        size = _size(staging)
        if size > MAX_PACK_BYTES:
            raise UsageError(f"the pack would be {size / 2**20:.1f} MiB, over {MAX_PACK_BYTES >> 20} MiB (a device "
                             f"call carries 64 MiB with the repository); look for large committed files")
        info = {"commit": commit, "made": made, "bytes": size, "wheels": wheels}
        files = sorted({*_entries(staging), PACK_FILE})
        (staging / PACK_FILE).write_text(json.dumps({**info, "files": files}, indent=1))
        if old:
            _replace(dest, staging, old, kept)
        else:
            if dest.exists():
                os.rmdir(dest)  # empty
            os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {**info, "files": files, "kept": kept}


def _usage(dest: Path, repo: Path) -> str:
    """How to run the pack with the device tool: what to carry and each part's command line."""
    try:
        inside = dest.resolve().relative_to(repo.resolve()).as_posix()
    except ValueError:
        return f"{dest} is outside the repository: make it inside (e.g. gpu-pack) so that it can be carried"
    ignored = _git(repo, "check-ignore", "-q", inside).returncode == 0
    lines = [f"carry [\"{inside}\"]; command, one part per call (timeout_s 600):",
             *(f"  bash {inside}/run.sh {part} \"$OUT\"" for part in ("tests", "kernels", "memory", "tour")),
             "then here: python -m workbench.gpu unpack <the .tar.gz files that came back>"]
    if not ignored:
        lines.append(f"note: git does not ignore {inside}; add it to .git/info/exclude or .gitignore")
    if _git(repo, "status", "--porcelain", "--untracked-files=no").stdout.strip():
        lines.append("note: the checkout has uncommitted changes; the pack holds the committed HEAD only")
    return "\n".join(lines)


def add_pack_parser(sub) -> None:
    parser = sub.add_parser("pack", help="write the folder a bare GPU machine needs: checkout, wheels, run.sh",
                            description=__doc__.split("\n\n")[0])
    parser.add_argument("dest", nargs="?", type=Path, default=repo_root() / "gpu-pack",
                        help="the folder to write (default: gpu-pack in the repository, which git ignores)")
    parser.add_argument("--wheels-from", type=Path, help="copy the wheels from this folder (`make wheels`) "
                                                         "instead of downloading them")
    parser.add_argument("--no-wheels", action="store_true", help="no wheels (a dry run where Jupyter is installed)")

    def handler(args) -> int:
        info = pack(args.dest, wheels_from=args.wheels_from, no_wheels=args.no_wheels)
        print(f"pack {args.dest}: commit {info['commit'][:12]}, {len(info['wheels'])} wheels, "
              f"{info['bytes'] / 2**20:.1f} MiB")
        if info["kept"]:
            print(f"kept (not written by pack, so left as they are): {_shown(info['kept'])}")
        print(_usage(args.dest, repo_root()))
        return 0

    parser.set_defaults(handler=handler)
