"""A notebook's results: `results.json` beside its figures, and the names and folders reports share.

`write_results` writes what a notebook measured (parameters, environment, records, claims ledger,
figures) and nothing else; the runner and the index page read these files back and trust nothing in them.
Notebooks call `save.save_results`, which writes through this module and then lists a JupyterLab run on
the index pages: data flows one way, results first, the index after, from what is on disk.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..devices import environment, repo_root
from .ledger import Ledger

PROFILES = ("smoke", "cpu", "gpu", "paper")  # gpu: each paper at its own scale, cut to minutes on one GPU
KERNEL_NAME = "workbench"

NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]+")  # notebook, figure and report folder names
RESERVED = ("interactive", "output_dir")  # parameters the report runner sets itself
INTERACTIVE = "interactive"  # reports/interactive/<name>: results saved from JupyterLab
# Figures are saved at 150 dpi and shown at 720 px (two-panel ones at up to 1300 px) on the index pages: at 110 dpi
# and 480 px a legend's 8-point text was about 5 px high (issue 43)
FIGURE_DPI = 150
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
    "advisor": Paper("No paper: the memory advisor across all five papers' techniques"),
    "packed_bit_optimizers": Paper("Memory Efficient Mixed Precision Optimizers", "Lewandowski & Kosson"),
    "optorch": Paper("OpTorch: optimized deep learning architectures for resource limited environments",
                     "Ahmed & Naveed", 2021),
    "efficient_densenet": Paper("Memory-Efficient Implementation of DenseNets", "Pleiss et al.", 2017),
    "calcgraph": Paper("CalcGraph: taming the high costs of deep learning using models", "", 2022),
    "variable_batch_size": Paper("Variable batch size across layers for efficient prediction on CNNs",
                                 "Choudhury et al."),
}


class UsageError(ValueError):
    """Bad input to the report runner (unknown notebook, profile or parameter, unusable output folder)."""



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


_LITERALS = (str, int, float, bool, list, tuple, dict, type(None))
# IPython's own globals, and the runner's staging folder (a temporary path, not a choice of the user's)
_NOT_PARAMETERS = frozenset({"In", "Out", "exit", "quit", "get_ipython", "display", "output_dir"})


def capture_parameters(namespace: dict) -> dict:
    """The notebook's parameters as a dict: every public literal (str, number, bool, list, dict, None)
    in `namespace`. Called once, in the cell right after the parameters cell (and papermill's
    injected one), where the parameters are the only such globals; what `save_results` records."""
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and k not in _NOT_PARAMETERS and isinstance(v, _LITERALS)}


def write_results(
    name: str, *, output_dir: str | Path, parameters: dict, records: dict[str, pd.DataFrame],
    ledger: Ledger, figures: dict | None = None, device=None,
) -> Path:
    """Write `results.json` (parameters, environment, records, claims) and figures as PNG; returns its path.

    `output_dir` "" (a notebook run in JupyterLab) means `reports/interactive/<name>` in the repository
    the notebook is in, replacing that notebook's previous run there. Nothing else is written: the index
    pages are built afterwards from what is on disk (`save.save_results` for a run in JupyterLab, the
    runner for a build).
    """
    _check_name(name)
    # NOTE: the kernel's current folder is the notebook's folder, so a run in JupyterLab saves beside
    # the notebook's own repository, not beside the checkout the package happens to be installed from.
    out = Path(output_dir) if output_dir else notebook_repository() / "reports" / INTERACTIVE / name
    if not output_dir:
        _refuse_links(out.parent.parent, out)
    out.mkdir(parents=True, exist_ok=True)
    figure_files = []
    for fig_name, fig in (figures or {}).items():
        _check_name(fig_name, "figure name")
        fig.savefig(out / f"{fig_name}.png", dpi=FIGURE_DPI, bbox_inches="tight")
        figure_files.append(f"{fig_name}.png")
    payload = {
        "name": name,
        "saved": time.strftime("%Y-%m-%d %H:%M:%S"),
        "parameters": _jsonable(parameters),
        "environment": environment(device),
        "records": {k: _jsonable(df.to_dict(orient="records")) for k, df in records.items()},
        "claims": _jsonable(ledger.rows),
        "figures": figure_files,
    }
    path = out / "results.json"
    _write_atomic(path, json.dumps(payload, indent=1))
    return path


def _refuse_links(reports: Path, out: Path) -> None:
    """UsageError when a folder between `reports` and `out` is a symbolic link (or not a folder): results
    saved from JupyterLab go only into real folders inside `reports/`, never through a link to elsewhere.
    `reports` itself may be a link (the output folder is wherever it points, as with `--out`)."""
    folder = reports
    for part in out.relative_to(reports).parts:
        folder = folder / part
        if folder.is_symlink():
            raise UsageError(f"{folder} is a symbolic link (to {os.readlink(folder)}); results are saved only into "
                             f"real folders inside {reports}: remove the link, or pass output_dir= explicitly")
        if os.path.lexists(folder) and not folder.is_dir():
            raise UsageError(f"{folder} is not a folder; results are saved into {out}: move it out of the way")


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # not on Windows
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
MAX_DEPTH = 64  # lists and mappings nested deeper than this in a results file make it damaged


def _depth_ok(data, limit: int = MAX_DEPTH) -> bool:
    """True when `data` nests lists and mappings at most `limit` deep (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (list, dict)):
            if depth > limit:
                return False
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return True


def read_json_file(path: Path) -> tuple[dict, str | None]:
    """(mapping, problem) of a JSON file a report folder holds: ({}, None) when there is no file there;
    ({}, why) when it cannot be used: not a plain file (a symbolic link, a named pipe, a folder), unreadable,
    not JSON, not a mapping, or nested deeper than MAX_DEPTH. Never blocks, never follows a link.

    # NOTE: Python's JSON decoder recurses once per nesting level, so a file of 100000 '[' raises
    # RecursionError; a named pipe opened without O_NONBLOCK waits for a writer forever.
    """
    path = Path(path)
    if not os.path.lexists(path):
        return {}, None
    if path.is_symlink():
        return {}, "a symbolic link, not a plain file"
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError as exc:
        return {}, f"cannot be read ({exc.strerror or exc})"
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a named pipe" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "a special file"
            return {}, f"{kind}, not a plain file"
        with os.fdopen(fd, "rb") as handle:
            fd = -1
            raw = handle.read()
    except OSError as exc:
        return {}, f"cannot be read ({exc.strerror or exc})"
    finally:
        if fd >= 0:
            os.close(fd)
    try:
        data = json.loads(raw)
    except RecursionError:
        return {}, f"nested too deep (more than {MAX_DEPTH} levels)"
    except ValueError as exc:  # also invalid UTF-8
        return {}, f"not valid JSON ({' '.join(str(exc).split())[:120]})"
    if not isinstance(data, dict):
        return {}, f"not a JSON mapping (a {type(data).__name__})"
    if not _depth_ok(data):
        return {}, f"nested too deep (more than {MAX_DEPTH} levels)"
    return data, None


def _read_json(path: Path) -> dict:
    """The mapping in JSON file `path`; {} when it is absent or damaged (see `read_json_file`)."""
    return read_json_file(path)[0]



def paper_citation(name: str) -> str:
    """'Title (Authors, Year)' of the paper a notebook reproduces; the name alone for an unknown notebook."""
    paper = PAPERS.get(name)
    if paper is None:
        return name
    extra = ", ".join(str(x) for x in (paper.authors, paper.year) if x)
    return f"{paper.title} ({extra})" if extra else paper.title


