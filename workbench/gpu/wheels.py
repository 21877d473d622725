"""The Jupyter stack a bare CUDA PyTorch image lacks, carried as wheels and installed there without a network.

Here (with a network): `wheel_requirements` walks the stack's requirements for the GPU image's Python (3.12,
Linux, x86-64), extras included (nbconvert needs `bleach[css]`, so `tinycss2` comes too), at the versions
installed here, and `download_wheels` fetches them. There: `install_wheels` installs into a folder that is put
first on the import path (`--target`, then PYTHONPATH) each carried wheel whose distribution the machine lacks,
or has at a version that does not meet what the stack requires, and nothing else, so the image's own builds
are kept wherever they serve; then Jupyter is told where the carried nbconvert keeps its HTML templates
(`<target>/share/jupyter`, which Jupyter does not search by itself).
"""

from __future__ import annotations

import email.parser
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from ..report.results import UsageError

__all__ = ["JUPYTER_STACK", "ON_IMAGE", "IMAGE_VERSIONS", "NEVER_CARRIED", "stack_requirements",
           "wheel_requirements", "download_wheels", "plan_install", "install_wheels"]

# What running a notebook headlessly needs beyond PyTorch (papermill, the kernel, the HTML export), and the
# optional peers that are pure Python (FlashOptim: Triton kernels, CUDA only); their dependencies are found from this
# environment's metadata.
JUPYTER_STACK = ("papermill", "nbclient", "nbformat", "nbconvert", "ipykernel", "jupyter_client", "torch-optimi",
                 "flashoptim")
# NOTE: the workplace's CUDA image's package list (its KINDS.md, "Python packages already there", read
# 2026-11-17). A requirement that only the image's Python has (a marker true on 3.12 but not here) must name
# one of these. The versions are the few that list gives; the others are unknown until the machine answers.
ON_IMAGE = frozenset(
    "absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi "
    "charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core "
    "cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock "
    "flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx "
    "huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt "
    "jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities "
    "linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes "
    "mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba "
    "numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime "
    "nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse "
    "nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx "
    "onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix "
    "orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client "
    "propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions "
    "pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning "
    "pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn "
    "sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy "
    "tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers "
    "toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton "
    "typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl "
    "zipp".split())
IMAGE_VERSIONS = {"numpy": "2.5.2", "torch": "2.11.0", "triton": "3.6.0", "huggingface-hub": "1.33.0",
                  "safetensors": "0.8.0", "accelerate": "1.15.0"}
# The image's CUDA builds: never carried, never replaced, and their own requirements are not walked.
NEVER_CARRIED = frozenset({"torch", "triton", "numpy", "torchvision", "torchaudio", "pip", "setuptools", "wheel"})
PYTHON_VERSION = "3.12"  # the GPU image's interpreter
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
TARGET_MARKERS = {"python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.3",
                  "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
                  "platform_machine": "x86_64", "implementation_name": "cpython",
                  "platform_python_implementation": "CPython"}
NEEDED_MODULES = ("papermill", "nbclient", "nbconvert", "ipykernel", "jupyter_client", "zmq")
STAMP = ".workbench-wheels.json"  # in the install folder: which wheels it holds

Metadata = Callable[[str], "tuple[str, list[str], set[str]] | None"]  # name -> (version, Requires-Dist, extras)


def _walk(roots: Iterable[str], metadata: Metadata, markers: dict, *, leaves=frozenset()
          ) -> tuple[dict[str, tuple[str, set[str]] | None], list[tuple[str, Requirement]]]:
    """Every distribution `roots` need (extras followed) with its version and the extras it provides (None:
    not found), and every requirement met on the way as (who requires it, requirement). `leaves` are found
    but not walked into."""
    versions: dict[str, tuple[str, set[str]] | None] = {}
    extras_seen: dict[str, set[str]] = {}
    found: list[tuple[str, Requirement]] = []
    todo = [(canonicalize_name(r), frozenset()) for r in roots]
    while todo:
        name, extras = todo.pop()
        seen = extras_seen.setdefault(name, set())
        if name in versions and extras <= seen:
            continue
        seen |= extras
        meta = metadata(name)
        versions[name] = (meta[0], meta[2]) if meta else None
        if meta is None or name in leaves:
            continue
        for text in meta[1]:
            try:
                requirement = Requirement(text)
            except InvalidRequirement:
                continue
            marker = requirement.marker
            if marker is None or any(marker.evaluate({**markers, "extra": e}) for e in ("", *sorted(seen))):
                found.append((name, requirement))
                todo.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return versions, found


def _extras(requires: list[str], provides: Iterable[str] | None) -> set[str]:
    """The extras a distribution offers: its Provides-Extra, and any `extra == "x"` its requirements name."""
    named = {canonicalize_name(e) for e in provides or []}
    for text in requires:
        named |= {canonicalize_name(e) for e in re.findall(r"""extra\s*==\s*['"]([^'"]+)['"]""", text)}
    return named


def _dist_metadata(dist) -> tuple[str, list[str], set[str]]:
    requires = list(dist.requires or [])
    return dist.version, requires, _extras(requires, dist.metadata.get_all("Provides-Extra"))


def _installed_here(name: str) -> tuple[str, list[str], set[str]] | None:
    try:
        return _dist_metadata(importlib.metadata.distribution(name))
    except importlib.metadata.PackageNotFoundError:
        return None


def stack_requirements(roots=JUPYTER_STACK) -> tuple[dict[str, str | None], list[tuple[str, Requirement]]]:
    """The stack's distributions at this environment's versions (None: needed on the image's Python only) and
    its requirements, as the GPU image's Python evaluates them (3.12, Linux), extras followed."""
    found, requirements = _walk(roots, _installed_here, TARGET_MARKERS, leaves=NEVER_CARRIED)
    return {n: (v[0] if v else None) for n, v in found.items()}, requirements


def wheel_requirements(roots=JUPYTER_STACK) -> list[str]:
    """`name==version` of every distribution the stack needs on the GPU image, at the versions installed here,
    less NEVER_CARRIED (the image's CUDA builds). A root not installed here, or a distribution needed only on
    the image's Python that the image lacks, is refused."""
    versions, _ = stack_requirements(roots)
    absent = [n for n in (canonicalize_name(r) for r in roots) if versions.get(n) is None]
    if absent:
        raise UsageError(f"{', '.join(absent)} not installed here: run `make install` (or pip install them) "
                         f"before `make wheels`")
    unmet = sorted(n for n, v in versions.items() if v is None and n not in ON_IMAGE)
    if unmet:
        raise UsageError(f"{', '.join(unmet)}: needed on Python {PYTHON_VERSION} but neither installed here nor on "
                         f"the GPU image; install them here (same versions) and rerun")
    return sorted(f"{n}=={v}" for n, v in versions.items() if v and n not in NEVER_CARRIED)


def download_wheels(dest: Path, requirements: list[str]) -> None:
    """`pip download` of `requirements` as binary wheels for the GPU image's Python and platform."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    subprocess.run([*command, *requirements], check=True)
    # NOTE: pip refuses an install given two versions of one distribution; wheels of an earlier download at
    # other versions are removed.
    wanted = {(canonicalize_name(r.split("==")[0]), r.split("==")[1]) for r in requirements}
    for wheel in dest.glob("*.whl"):
        name, version = wheel.name.split("-")[:2]
        if (canonicalize_name(name), version) not in wanted:
            wheel.unlink()


def wheel_metadata(path: Path) -> tuple[str, str, list[str], set[str]]:
    """(canonical name, version, Requires-Dist lines, extras) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as wheel:
        member = next((n for n in wheel.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
        if member is None:
            raise UsageError(f"{path}: not a wheel (no .dist-info/METADATA)")
        meta = email.parser.Parser().parsestr(wheel.read(member).decode("utf-8", "replace"), headersonly=True)
    requires = meta.get_all("Requires-Dist") or []
    return canonicalize_name(meta["Name"]), meta["Version"], requires, _extras(requires, meta.get_all("Provides-Extra"))


def _meets(found: tuple[str, set[str]] | None, requirement: Requirement) -> bool:
    """The distribution found (version, extras) is one `requirement` accepts, the extras it asks for offered."""
    if found is None or not {canonicalize_name(e) for e in requirement.extras} <= found[1]:
        return False
    try:
        return requirement.specifier.contains(Version(found[0]), prereleases=True)
    except InvalidVersion:
        return False


def plan_install(wheels: dict[str, tuple[str, list[str], set[str]]], installed: Metadata, roots=JUPYTER_STACK, *,
                 markers: dict | None = None) -> tuple[list[str], list[str]]:
    """Which carried wheels to install: those whose distribution is not installed, or is installed at a
    version (or without an extra) that a requirement of the stack, as it will stand once installed, does not
    accept; nothing else. Returns (names to install, requirements no distribution here or carried meets, as text)."""
    markers = {**default_environment(), **(markers or {})}
    replace: set[str] = set()
    while True:
        def active(name: str, replace=frozenset(replace)):
            mine = installed(name)
            if mine is not None and name not in replace:
                return mine
            return wheels.get(name) or mine

        versions, found = _walk(roots, active, markers, leaves=NEVER_CARRIED)
        wrong = {canonicalize_name(r.name) for _, r in found if not _meets(versions.get(canonicalize_name(r.name)), r)}
        fixable = {n for n in wrong - replace if n in wheels and n not in NEVER_CARRIED and installed(n) is not None}
        if not fixable:
            break
        replace |= fixable
    install = sorted(n for n in versions if n in wheels and n not in NEVER_CARRIED
                     and (n in replace or installed(n) is None))
    unmet = sorted({f"{r} (for {who}; found {(versions.get(canonicalize_name(r.name)) or ('none',))[0]})"
                    for who, r in found if not _meets(versions.get(canonicalize_name(r.name)), r)})
    return install, unmet


def _missing() -> list[str]:
    found = []
    for module in NEEDED_MODULES:
        try:
            importlib.import_module(module)
        except ImportError:
            found.append(module)
    return found


def prepend_path(variable: str, path: Path | str) -> None:
    parts = [p for p in os.environ.get(variable, "").split(os.pathsep) if p]
    if str(path) not in parts:
        os.environ[variable] = os.pathsep.join([str(path), *parts])


def _jupyter_data() -> None:
    """Tell Jupyter where nbconvert's templates are when they sit outside its search path (`--target`)."""
    try:
        share = Path(importlib.metadata.distribution("nbconvert").locate_file("")) / "share" / "jupyter"
    except importlib.metadata.PackageNotFoundError:
        return
    if (share / "nbconvert" / "templates").is_dir() and Path(sys.prefix) / "share" / "jupyter" != share:
        prepend_path("JUPYTER_PATH", share)


def _use_site(site: Path) -> None:
    """Put `site` first on the import path of this process and of the kernels it starts."""
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    prepend_path("PYTHONPATH", site)


def _installed_outside(site: Path) -> Metadata:
    """What this Python has installed, `site` left out (an earlier call's install folder)."""
    path = [p for p in sys.path if Path(p or ".").resolve() != site.resolve()]

    def metadata(name: str):
        dist = next(iter(importlib.metadata.distributions(name=name, path=path)), None)
        return _dist_metadata(dist) if dist is not None else None
    return metadata


def install_wheels(wheels: Path | None, site: Path, *, log: Callable[[str], None] = print,
                   roots: Iterable[str] = JUPYTER_STACK) -> Path | None:
    """Make papermill, the kernel and nbconvert work: install the carried wheels `plan_install` picks into
    `site` (no index, no dependency resolution), put it first on the import path and tell Jupyter where the
    templates are. A `site` an earlier call on this machine filled with the same wheels is reused. Returns
    `site` when it is in use, None when nothing was carried and nothing is missing."""
    files = sorted(wheels.glob("*.whl")) if wheels is not None and wheels.is_dir() else []
    if not files:
        if _missing():
            raise UsageError(f"{', '.join(_missing())} not importable and no wheels in {wheels}: run `make wheels` "
                             f"(or `python -m workbench.gpu pack`) where pip works and carry the wheels folder")
        _jupyter_data()
        return None
    carried = {}
    for path in files:
        name, *meta = wheel_metadata(path)
        carried[name] = (*meta, path)
    install, unmet = plan_install({n: meta[:3] for n, meta in carried.items()}, _installed_outside(site), roots)
    chosen = sorted(carried[n][3].name for n in install)
    stamp = site / STAMP
    previous = json.loads(stamp.read_text()) if stamp.is_file() else None
    if previous != chosen:
        if site.exists() and previous is None and any(site.iterdir()):
            raise UsageError(f"{site} exists and was not made by install_wheels; choose another --site")
        shutil.rmtree(site, ignore_errors=True)
        site.mkdir(parents=True)
        if chosen:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", str(site),
                            *(str(carried[n][3]) for n in install)], check=True)
        stamp.write_text(json.dumps(chosen))
    log(f"wheels: {len(chosen)} of {len(carried)} carried installed into {site} (the others' distributions are "
        f"here at versions the stack accepts)")
    for line in unmet:
        log(f"wheels: warning: requirement not met by this machine or the carried wheels: {line}")
    _use_site(site)
    _jupyter_data()
    still = _missing()
    if still:
        raise UsageError(f"{', '.join(still)} still not importable after installing {wheels}: the wheels do not "
                         f"match this Python ({sys.version.split()[0]}); rebuild them with `make wheels`")
    return site
