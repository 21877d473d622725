"""`python -m workbench.gpu pack DEST`: all a bare GPU machine needs, in one folder to carry there.

DEST holds:

    checkout/   the committed HEAD (`git archive`: no uncommitted change, no ignored file), without
                reports/reference/ (the machine makes references; it needs none)
    wheels/     the Jupyter stack for the image's Python (`wheels`), or none with `--no-wheels`
    run.sh      `run.sh PART OUTDIR [options]`: the image's python3 (with torch) is all it needs
    pack.json   the commit, when it was made, the wheels and the size

and stays under MAX_PACK_BYTES, so that it travels beside the repository within the 64 MiB a device call
carries. Made inside the repository as `gpu-pack/` (which git ignores), it is carried by naming `gpu-pack` and
run as `bash gpu-pack/run.sh tests "$OUT"` (README, "Profiles"). The commit recorded everywhere on the
machine is the one packed (`--commit` and WORKBENCH_COMMIT in run.sh; git is kept from reading an enclosing
repository's).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile
import time
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


def _wheels(dest: Path, wheels_from: Path | None, no_wheels: bool) -> list[str]:
    dest.mkdir()
    if no_wheels:
        return []
    wanted = wheel_requirements()
    if wheels_from is None:
        download_wheels(dest, wanted)
    else:
        if not wheels_from.is_dir():
            raise UsageError(f"--wheels-from {wheels_from}: not a folder of wheels")
        for wheel in sorted(wheels_from.glob("*.whl")):
            shutil.copyfile(wheel, dest / wheel.name)
    have = {f"{n}=={v}" for n, v, *_ in map(wheel_metadata, sorted(dest.glob("*.whl")))}
    missing = sorted(set(wanted) - have)
    if missing:
        raise UsageError(f"wheels missing for {', '.join(missing)}: run `make wheels` (or pack without --wheels-from, "
                         f"which downloads them)")
    return sorted(have)


def pack(dest: str | Path, *, wheels_from: Path | None = None, no_wheels: bool = False,
         repo: Path | None = None) -> dict:
    """Write the pack (see the module's docstring) to `dest`, replacing an earlier pack there; anything else
    at `dest` is refused. Returns pack.json's content."""
    repo, dest = Path(repo or repo_root()), Path(dest).absolute()
    commit = _head(repo)
    if dest.is_symlink() or (dest.exists() and not (dest / PACK_FILE).is_file() and (
            not dest.is_dir() or any(dest.iterdir()))):
        raise UsageError(f"{dest} exists and is not a pack; choose another folder (or remove it)")
    staging = dest.with_name(f".{dest.name}.incoming-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _checkout(repo, staging / "checkout")
        wheels = _wheels(staging / "wheels", wheels_from, no_wheels)
        made = time.strftime("%Y-%m-%d %H:%M:%S")
        (staging / "run.sh").write_text(RUN_SH.format(commit=commit, made=made))
        (staging / "run.sh").chmod(0o755)
        size = _size(staging)
        if size > MAX_PACK_BYTES:
            raise UsageError(f"the pack would be {size / 2**20:.1f} MiB, over {MAX_PACK_BYTES >> 20} MiB (a device "
                             f"call carries 64 MiB with the repository); look for large committed files")
        info = {"commit": commit, "made": made, "bytes": size, "wheels": wheels}
        (staging / PACK_FILE).write_text(json.dumps(info, indent=1))
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(staging, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return info


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
        print(_usage(args.dest, repo_root()))
        return 0

    parser.set_defaults(handler=handler)
