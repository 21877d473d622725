"""Build reference reports on a bare CUDA machine: the `gpu` profile through the same notebooks (issue 22).

Here, once (needs the network): the Jupyter stack a bare PyTorch image lacks, as wheels for Python 3.12::

    make wheels                      # python -m workbench.report.gpu_run wheels --dest wheels

There, on a fresh GPU machine holding this checkout and `wheels/`, one notebook per call (each call is
limited in time; the gpu profile is sized for minutes per notebook)::

    python3 -m workbench.report.gpu_run run tour --wheels wheels --commit <sha> --deadline 540 --bundle "$OUT"

`run` installs the carried wheels the machine lacks into a folder (reused by later calls on the same machine)
when papermill or ipykernel is missing, gives the `workbench` kernel a `python` that is this interpreter,
builds the report with the ordinary runner (`build_reports`: same notebooks, same checks, same results.json),
keeps it as a reference folder (`reports/reference/<device-slug>/<name>/`, see `reference`) and writes it as
one archive to `--bundle`.
Back here::

    python -m workbench.report.gpu_run unpack reference-nvidia-h200-tour.tar.gz   # into reports/reference/

`--profile smoke --device cpu` is the dry run (a test does it): the same steps on a CPU at toy sizes.
`--deadline` stops a notebook past that many seconds and keeps what it finished as a failed report, so a
call on a time-limited machine always brings something back.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from ..devices import repo_root
from .reference import REFERENCE, bundle, checkout_commit, unpack, write_reference
from .results import PROFILES, UsageError

__all__ = ["JUPYTER_STACK", "ON_IMAGE", "wheel_requirements", "install_wheels", "main"]

# What running a notebook headlessly needs beyond PyTorch (papermill, the kernel, the HTML export), and the
# optional peer that is pure Python; their dependencies are found from this environment's metadata.
JUPYTER_STACK = ("papermill", "nbclient", "nbformat", "nbconvert", "ipykernel", "jupyter_client", "torch-optimi")
# NOTE: what the workplace's CUDA image holds already (KINDS.md, "Python packages already there", read
# 2026-11-17); `make wheels` does not carry these, and `install_wheels` never installs a carried wheel whose
# distribution the machine has, so the image's own builds are never shadowed. Others are carried.
ON_IMAGE = frozenset(
    "absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi "
    "charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cycler cython einops filelock "
    "fonttools frozenlist fsspec h11 h5py httpcore httpx huggingface-hub hypothesis idna iniconfig jinja2 joblib "
    "kiwisolver lightning lightning-utilities markdown markdown-it-py markupsafe matplotlib mdurl ml-dtypes mpmath "
    "msgpack multidict networkx ninja numpy packaging pandas pillow pip pluggy propcache protobuf psutil pyarrow "
    "pygments pyparsing pytest python-dateutil pytorch-lightning pyyaml regex requests rich safetensors "
    "scikit-learn scipy setuptools six sortedcontainers sympy tabulate threadpoolctl toolz torch torchvision tqdm "
    "triton typing-extensions urllib3 werkzeug wheel wrapt yarl zipp".split())
PYTHON_VERSION = "3.12"  # the GPU image's interpreter
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
_NEEDED = ("papermill", "nbclient", "nbconvert", "ipykernel", "jupyter_client", "zmq")
_TARGET_MARKERS = {"python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.0",
                   "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
                   "platform_machine": "x86_64", "implementation_name": "cpython",
                   "platform_python_implementation": "CPython", "extra": ""}


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def wheel_requirements(roots=JUPYTER_STACK, *, skip=ON_IMAGE) -> list[str]:
    """`name==version` for `roots` and everything they require (on Linux, Python 3.12, no extras), at the
    versions installed here, less what `skip` names. A root not installed here is refused."""
    from packaging.requirements import Requirement

    versions: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        key = _canonical(name)
        if key in versions:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            if name in roots:
                raise UsageError(f"{name} is not installed here: run `make install` (or pip install {name}) "
                                 f"before `make wheels`") from None
            versions[key] = ""  # an optional dependency absent here: the target must bring it
            continue
        versions[key] = dist.version
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate(_TARGET_MARKERS):
                todo.append(requirement.name)
    return sorted(f"{k}=={v}" for k, v in versions.items() if v and k not in skip)


def download_wheels(dest: Path, requirements: list[str]) -> None:
    """`pip download` of `requirements` as binary wheels for the GPU image's Python and platform."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run([*command, *requirements], check=True)
    # NOTE: pip refuses an install given two versions of one distribution; wheels of an earlier `make wheels`
    # at other versions are removed.
    wanted = {(_canonical(r.split("==")[0]), r.split("==")[1]) for r in requirements}
    for wheel in dest.glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        if (_canonical(name), version) not in wanted:
            wheel.unlink()


def _missing() -> list[str]:
    found = []
    for module in _NEEDED:
        try:
            importlib.import_module(module)
        except ImportError:
            found.append(module)
    return found


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _use_site(site: Path) -> None:
    """Put `site` first on the import path of this process and of the kernels it starts."""
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    _prepend("PYTHONPATH", site)
    _prepend("JUPYTER_PATH", site / "share" / "jupyter")  # nbconvert's HTML templates


def install_wheels(wheels: Path | None, site: Path) -> Path | None:
    """Make papermill, the kernel and nbconvert importable. A `site` left by an earlier call on the same
    machine is used first; when something is still missing, the wheels in `wheels` whose distributions this
    Python lacks are installed into `site` (no index, no dependency resolution), so nothing the image has
    is shadowed. Returns `site` when it is in use, None when nothing was missing."""
    if not _missing():
        return None
    if site.is_dir():
        _use_site(site)
        if not _missing():
            return site
    files = sorted(wheels.glob("*.whl")) if wheels is not None and wheels.is_dir() else []
    if not files:
        raise UsageError(f"{', '.join(_missing())} not importable and no wheels in {wheels}: run `make wheels` "
                         f"where pip works and carry the wheels folder")
    wanted = [f for f in files if not _installed(f.name.split("-")[0])]
    if wanted:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, wanted)], check=True)
    _use_site(site)
    still = _missing()
    if still:
        raise UsageError(f"{', '.join(still)} still not importable after installing {wheels}: the wheels do not "
                         f"match this Python ({sys.version.split()[0]}); rebuild them with `make wheels`")
    return site


def _prepend(variable: str, path: Path) -> None:
    parts = [p for p in os.environ.get(variable, "").split(os.pathsep) if p]
    if str(path) not in parts:
        os.environ[variable] = os.pathsep.join([str(path), *parts])


def _python_shim(folder: Path) -> None:
    """The kernel spec starts `python`: make it this interpreter (a bare image may only have `python3`)."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "python"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    shim.chmod(0o755)
    _prepend("PATH", folder)


@contextmanager
def _environment_restored():
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available here (torch {torch.__version__}); "
                         f"use --device cpu for a dry run")


def _where(device: str) -> dict:
    """The machine's description of `device` (the notebook's own `pick_device` rule when it is empty)."""
    from ..devices import environment, pick_device

    return environment(pick_device(device or None))


def _overrides(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"-p {pair!r}: expected name=value")
        out[key] = value
    return out


class DeadlineExceeded(Exception):
    """A notebook ran past `--deadline`: its run is recorded as failed, with the cells it finished."""


@contextmanager
def _deadline(seconds: float | None, name: str):
    """Raise DeadlineExceeded in this (main) thread after `seconds`, so a notebook that overruns a machine's
    time limit still leaves a report: papermill saves the cells it finished, the runner records the failure."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise DeadlineExceeded(f"{name} ran past --deadline {seconds:g} s; the cells it finished are in the report")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run(names: list[str], *, profile: str = "gpu", device: str | None = None, commit: str | None = None,
        out: Path | None = None, reference: Path | None = None, bundle_dir: Path | None = None,
        wheels: Path | None = None, site: Path | None = None, deadline: float | None = None,
        overrides: dict | None = None) -> list[dict]:
    """Build `names` one after another at `profile`, keep each as a reference folder (and an archive in
    `bundle_dir`). `device` overrides the profile's device (`cpu` for a dry run); `deadline` is each notebook's
    time limit in seconds. Returns one dict per notebook: name, status, seconds, error, reference, archive."""
    from .parameters import load_profile

    if deadline is not None and not 0 < deadline <= 86400:
        raise UsageError(f"--deadline {deadline}: expected seconds in 0..86400 (exclusive of 0)")
    overrides = dict(overrides or {})
    if device is not None:
        overrides["device"] = device
    devices = {name: str(overrides.get("device", load_profile(name, profile).get("device", ""))) for name in names}
    for chosen in devices.values():
        _check_device(chosen)
    scratch = Path(tempfile.mkdtemp(prefix="workbench-gpu-"))
    try:
        install_wheels(wheels, site or Path(tempfile.gettempdir()) / "workbench-gpu-site")
        _python_shim(scratch / "bin")
        _prepend("PYTHONPATH", repo_root())  # the kernel imports this checkout's workbench, installed or not
        from .runner import build_reports

        out = out or scratch / "reports"
        reference = reference or repo_root() / "reports" / REFERENCE
        commit = commit or os.environ.get("WORKBENCH_COMMIT") or checkout_commit()
        done = []
        for name in dict.fromkeys(names):
            try:
                with _deadline(deadline, name):
                    table = build_reports([name], profile=profile, out_dir=out, progress=False, overrides=overrides)
                rows = list(table.itertuples())
            except DeadlineExceeded as exc:  # past the deadline outside the notebook (saving, the index)
                rows = [SimpleNamespace(name=name, status="failed", seconds=deadline, error=str(exc))]
            for row in rows:
                folder, kept, archive = out / profile / row.name, None, None
                if (folder / "run.json").is_file():
                    kept = write_reference(folder, reference, commit=commit, environment=_where(devices[row.name]))
                    archive = bundle(kept, bundle_dir) if bundle_dir is not None else None
                done.append({"name": row.name, "status": row.status, "seconds": row.seconds, "error": row.error,
                             "reference": kept, "archive": archive})
        return done
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m workbench.report.gpu_run", description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  make wheels   (python -m workbench.report.gpu_run wheels --dest wheels)\n"
               "  python3 -m workbench.report.gpu_run run tour --wheels wheels --commit <sha> --deadline 540 "
               "--bundle \"$OUT\"\n"
               "  python -m workbench.report.gpu_run run tour --profile smoke --device cpu --bundle out/  (dry run)\n"
               "  python -m workbench.report.gpu_run unpack out/reference-<device>-tour.tar.gz")
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run", help="build notebooks at a profile and keep them as reference reports")
    go.add_argument("names", nargs="+", help="notebooks (one per call on a time-limited machine)")
    go.add_argument("--profile", default="gpu", choices=PROFILES)
    go.add_argument("--device", help="overrides the profile's device (the gpu profile's is cuda): cuda:N, or cpu "
                                     "for a dry run")
    go.add_argument("--commit", help="the commit this checkout holds (a copy without .git knows none)")
    go.add_argument("--out", type=Path, help="where the runner builds (default: a temporary folder)")
    go.add_argument("--reference", type=Path, help="reference root (default: reports/reference)")
    go.add_argument("--bundle", type=Path, default=os.environ.get("OUT") or None,
                    help="folder for one .tar.gz per notebook (default: $OUT when set)")
    go.add_argument("--wheels", type=Path, default=repo_root() / "wheels", help="wheels to install if needed")
    go.add_argument("--site", type=Path, help="where the wheels go (default: <tmp>/workbench-gpu-site, reused by "
                                             "later calls on the same machine)")
    go.add_argument("--deadline", type=float, help="seconds per notebook; past it the run stops and is recorded "
                                                   "as failed with the cells it finished (under a call's limit)")
    go.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE")
    back = sub.add_parser("unpack", help="put archives from `run` into reports/reference/ and rewrite the index")
    back.add_argument("archives", nargs="+", type=Path)
    back.add_argument("--reports", type=Path, default=repo_root() / "reports")
    get = sub.add_parser("wheels", help="download the wheels a bare PyTorch image lacks (needs the network)")
    get.add_argument("--dest", type=Path, default=repo_root() / "wheels")
    get.add_argument("--print", dest="only_print", action="store_true", help="list the requirements only")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "wheels":
            requirements = wheel_requirements()
            if args.only_print:
                print("\n".join(requirements))
                return 0
            download_wheels(args.dest, requirements)
            print(f"{len(list(args.dest.glob('*.whl')))} wheels in {args.dest} (carry this folder to the GPU machine)")
            return 0
        if args.command == "unpack":
            from .folders import locked
            from .index import write_index

            for archive in args.archives:
                for target in unpack(archive, args.reports / REFERENCE):
                    print(f"reference: {target}")
            with locked(args.reports):
                print(f"index: {write_index(args.reports)}")
            return 0
        with _environment_restored():
            done = run(args.names, profile=args.profile, device=args.device, commit=args.commit, out=args.out,
                       reference=args.reference, bundle_dir=args.bundle, wheels=args.wheels, site=args.site,
                       deadline=args.deadline, overrides=_overrides(args.param))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for row in done:
        print(f"{row['name']}: {row['status']} in {row['seconds']} s; reference {row['reference']}; "
              f"archive {row['archive']}" + (f"; error: {row['error']}" if row["error"] else ""))
    return 0 if all(row["status"] == "ok" for row in done) else 1


if __name__ == "__main__":
    sys.exit(main())
