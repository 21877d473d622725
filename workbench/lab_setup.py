"""JupyterLab in a checkout: a saved notebook reads unchanged to `git status`, widgets behave as cells do.

The set-up `make` installs into the virtual environment beside the nbstripout git filter (README, "Notebooks
and git"), for the JupyterLab that runs from it:

1. **git's size shortcut.** git's index keeps each file's size from the last time git read it. When a file's
   size differs from that, `git status` and `git update-index --refresh` call it modified without reading it
   (git's read-cache.c: a changed size is trusted unless the cached size is 0), so the clean filter never
   runs. A notebook checked out stripped and saved by JupyterLab with outputs is larger while its filtered
   content is the committed blob: `git diff`, which compares content, is empty, yet `git status` lists the
   file until `git add`. A server extension (`workbench.lab_setup`, enabled in
   `etc/jupyter/jupyter_server_config.d/`) runs after every save: for a tracked file under a clean filter it
   re-enters the index entry with its own mode and blob (`git update-index --cacheinfo`), which stages
   nothing and clears the cached stat data, so git's next look reads the file through the filter and
   refreshes the entry (`git status` then writes the new size back).
2. **Widget state on save.** A widget's output in a saved notebook names a model that lived in the kernel;
   reopened, each one reads "Error displaying widget: model not found" unless the notebook also holds the
   models' state, which JupyterLab writes only with the widget manager's `saveState` setting. The setting
   is turned on in `share/jupyter/lab/settings/overrides.d/` (the filter strips that state from git).
3. **Widget callbacks on the kernel's main shell.** JupyterLab 4.4+ sends comm messages to a kernel subshell
   when the kernel has them (ipykernel 7, setting `commsOverSubshells`, default one subshell per comm
   target), so a widget's callback runs in a thread beside the cells. The kernel indicator then reads Idle
   while it runs (the output widget's echo of each printed line is answered busy-then-idle on the subshell),
   a cell run meanwhile competes with it, and a measurement in the callback shares the process with the
   cell (the allocator's events, the cores). Turned off in the same overrides: a callback runs as a cell
   does, the kernel reads Busy until it ends, a cell run meanwhile waits its turn.

    python -m workbench.lab_setup install --prefix .venv    # what `make hooks` runs
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["install", "refresh_git_index"]

SERVER_CONFIG = Path("etc/jupyter/jupyter_server_config.d/workbench.json")
LAB_OVERRIDES = Path("share/jupyter/lab/settings/overrides.d/workbench.json")
EXTENSION = "workbench.lab_setup"  # not __name__, which is __main__ under `python -m`
LAB_SETTINGS = {"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": True},
                "@jupyterlab/apputils-extension:kernels-settings": {"commsOverSubshells": "disabled"}}

log = logging.getLogger(__name__)


def _git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=True,
                          timeout=30).stdout


def refresh_git_index(os_path: str, **_: Any) -> bool:
    """Make git read `os_path` through its clean filter at its next look, if git tracks it under one.

    A jupyter_server post-save hook (called with `os_path`, `model`, `contents_manager`). Returns whether the
    index entry was re-entered. Never raises: a failed hook would fail the save (HTTP 500) of a file that is
    already written, so a git error is logged and left to git's own next look.
    """
    path = Path(os_path)
    try:
        # NOTE: only an entry git's own rule gets wrong is touched: a tracked file at stage 0 (not in a merge
        # conflict, tag H: neither assume-unchanged nor skip-worktree) under a clean filter.
        driver = _git(path.parent, "check-attr", "filter", "--", path.name).rsplit(": ", 1)[-1].strip()
        if driver in ("unspecified", "unset", ""):
            return False
        if not _git(path.parent, "config", "--default", "", f"filter.{driver}.clean").strip():
            return False
        entry = _git(path.parent, "ls-files", "--stage", "-t", "--full-name", "--", path.name).splitlines()
        if len(entry) != 1:
            return False
        fields, name = entry[0].split("\t", 1)
        tag, mode, blob, stage = fields.split(" ")
        if tag != "H" or stage != "0":
            return False
        top = Path(_git(path.parent, "rev-parse", "--show-toplevel").strip())
        _git(top, "update-index", "--cacheinfo", f"{mode},{blob},{name}")
        return True
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("workbench: could not refresh git's index entry of %s: %s", path, detail)
        return False


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": EXTENSION}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    server_app.contents_manager.register_post_save_hook(refresh_git_index)
    server_app.log.info("workbench: git reads each saved file through its clean filter")


def install(prefix: Path | str) -> list[Path]:
    """Write the server extension's switch and the widget setting under the environment `prefix` (the
    virtual environment JupyterLab runs from); returns the files written. Re-running rewrites them."""
    prefix = Path(prefix)
    if not prefix.is_dir():
        raise FileNotFoundError(f"prefix {str(prefix)!r} is not a folder (the virtual environment's root)")
    files = {SERVER_CONFIG: {"ServerApp": {"jpserver_extensions": {EXTENSION: True}}},
             LAB_OVERRIDES: LAB_SETTINGS}
    written = []
    for relative, content in files.items():
        path = prefix / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content, indent=2) + "\n")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workbench.lab_setup", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    inst = sub.add_parser("install", help="enable the save hook and the widget setting for a JupyterLab")
    inst.add_argument("--prefix", default=sys.prefix, help="the environment JupyterLab runs from (default: this one)")
    args = parser.parse_args(argv)
    try:
        for path in install(args.prefix):
            print(f"wrote {path}")
    except OSError as exc:
        print(f"python -m workbench.lab_setup install: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
