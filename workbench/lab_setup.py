"""JupyterLab in a checkout: a saved notebook reads unchanged to `git status`, widgets behave as cells do.

The set-up `make` installs into the virtual environment beside the nbstripout git filter (README, "Notebooks
and git"), for the JupyterLab that runs from it:

1. **git's size shortcut.** git's index keeps each file's size from the last time git read it. When a file's
   size differs from that, `git status` and `git update-index --refresh` call it modified without reading it
   (git's read-cache.c: a changed size is trusted unless the cached size is 0), so the clean filter never
   runs. A notebook checked out stripped and saved by JupyterLab with outputs is larger while its filtered
   content is the committed blob: `git diff`, which compares content, is empty, yet `git status` lists the
   file until `git add`. A server extension (`workbench.lab_setup`, enabled in
   `etc/jupyter/jupyter_server_config.d/`) runs at every save: for a tracked file under a clean filter it
   re-enters the index entry with its own mode and blob (`git update-index --cacheinfo`), which stages
   nothing and clears the cached stat data, so git's next look reads the file through the filter and
   refreshes the entry (`git status` then writes the new size back). Refreshes run one at a time in this
   server, and one that finds another git's `index.lock` (two notebooks saved at once: one was left listed,
   issue 43) tries again for up to `INDEX_LOCK_WAIT_S`.
   It runs before the file is written (`refresh_before_save`), since the entry it clears does not depend on
   the new content: JupyterLab saves in two requests (write, then read the file's hash back), and a save
   whose check reads the disk between those two finds a hash it has not seen yet and asks "File Changed ...
   Overwrite / Revert" (Ctrl+S while an autosave was in flight, issue 43). Run after the write, the refresh's
   five git commands (seconds on a loaded machine) held the first save's reply and so widened that window. The
   window itself is closed where the check asks for the hash: this server's own writes keep the hash the page read
   (`OwnWrites`); a write by anything else changes it as before.
2. **Widget state on save.** A widget's output in a saved notebook names a model that lived in the kernel;
   reopened, each one reads "Error displaying widget: model not found" unless the notebook also holds the
   models' state, which JupyterLab writes only with the widget manager's `saveState` setting. The setting
   is turned on in `share/jupyter/lab/settings/overrides.d/` (the filter strips that state from git). A
   widget closed before the save has no state to save: a tqdm notebook bar made with `leave=False` (the
   inner loops here; outer loops keep theirs) closes its container when it finishes, while the output that
   displayed it stays, in a cell or in an output widget's state. The extension's pre-save hook drops those
   views of closed widgets (the live page shows none of them either), so the reopened notebook reads as it
   did when saved.
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
import inspect
import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["OwnWrites", "drop_closed_widget_views", "install", "refresh_git_index", "refresh_before_save",
           "INDEX_LOCK_WAIT_S"]

SERVER_CONFIG = Path("etc/jupyter/jupyter_server_config.d/workbench.json")
LAB_OVERRIDES = Path("share/jupyter/lab/settings/overrides.d/workbench.json")
EXTENSION = "workbench.lab_setup"  # not __name__, which is __main__ under `python -m`
LAB_SETTINGS = {"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": True},
                "@jupyterlab/apputils-extension:kernels-settings": {"commsOverSubshells": "disabled"}}

WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

log = logging.getLogger(__name__)
WRITE_S = 60.0  # a save's write that has not ended by then has failed: its file's hash is its content's again


def _git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(folder), *args], capture_output=True, text=True, check=True,
                          timeout=30).stdout


INDEX_LOCK_WAIT_S = 10.0  # a refresh waits this long for another git's index.lock (git status holds it while it
# runs the clean filter over each changed notebook: seconds on a loaded machine), then gives up, logged


_index_writes = threading.Lock()  # one index write at a time from this process (hooks may run on threads)


def _git_writing_index(folder: Path, *args: str, wait_s: float = INDEX_LOCK_WAIT_S) -> str:
    """`_git` for a command that writes the index: while another git holds `index.lock` ("File exists"), tried
    again, 50 ms then doubling to 1 s apart, for up to `wait_s`."""
    deadline, pause = time.monotonic() + wait_s, 0.05
    while True:
        try:
            with _index_writes:
                return _git(folder, *args)
        except subprocess.CalledProcessError as exc:
            if "index.lock" not in (exc.stderr or "") or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 1.0)


def refresh_git_index(os_path: str, **_: Any) -> bool:
    """Make git read `os_path` through its clean filter at its next look, if git tracks it under one.

    Returns whether the index entry was re-entered; waits up to `INDEX_LOCK_WAIT_S` for another git's
    index.lock. Never raises: a failed refresh must not fail the save (HTTP 500) of a file that is already
    written, so a git error is logged and left to git's own next look.
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
        _git_writing_index(top, "update-index", "--cacheinfo", f"{mode},{blob},{name}")
        return True
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("workbench: could not refresh git's index entry of %s: %s", path, detail)
        return False


def refresh_before_save(model: dict | None = None, path: str = "", contents_manager: Any = None, **_: Any) -> bool:
    """The jupyter_server pre-save hook (called with `model`, `path`, `contents_manager`): `refresh_git_index` of
    the file the save is about to write, before it writes it. False where the path is not a file of the
    contents manager's folder."""
    try:
        os_path = contents_manager._get_os_path(path)
    except Exception:  # not a file contents manager, a path outside its root: nothing of git's to refresh
        return False
    return refresh_git_index(os_path)


def drop_closed_widget_views(model: dict, **_: Any) -> int:
    """Drop the outputs that display a widget missing from the notebook's saved widget state; return how many.

    A jupyter_server pre-save hook (called with `model`, `path`, `contents_manager`): `model["content"]` is the
    notebook JupyterLab sends. Without saved widget state (`saveState` off) nothing is known, nothing dropped.
    """
    content = model.get("content") if model.get("type") == "notebook" else None
    widgets = (content or {}).get("metadata", {}).get("widgets", {}).get(WIDGET_STATE, {})
    state = widgets.get("state") if isinstance(widgets, dict) else None
    if not isinstance(state, dict):
        return 0

    def shows_a_closed_widget(output: Any) -> bool:
        data = output.get("data") if isinstance(output, dict) else None
        view = data.get(WIDGET_VIEW) if isinstance(data, dict) else None
        return isinstance(view, dict) and bool(view.get("model_id")) and view["model_id"] not in state

    dropped = 0
    holders = [c for c in content.get("cells", []) if isinstance(c, dict) and isinstance(c.get("outputs"), list)]
    holders += [m["state"] for m in state.values() if isinstance(m, dict) and m.get("model_name") == "OutputModel"
                and isinstance(m.get("state"), dict) and isinstance(m["state"].get("outputs"), list)]
    for holder in holders:
        before = len(holder["outputs"])
        holder["outputs"] = [o for o in holder["outputs"] if not shows_a_closed_widget(o)]
        dropped += before - len(holder["outputs"])
    return dropped


class OwnWrites:
    """The hash this server reports for a file it wrote itself: the one the file had before its first such write,
    for as long as nothing else writes it; any other file's, its content's own.

    # NOTE: JupyterLab saves in three requests (read the file's hash, write, read the hash back) and checks the first
    # against the hash it last read back; two saves of one notebook at once (Ctrl+S while an autosave is in flight)
    # let one's check land between the other's write and its read back, on a hash the page has not seen: "File
    # Changed ... Overwrite / Revert" (issue 43; the browser test, 1 of 28 saves in four CI runs). Its own writes are
    # no change made elsewhere: where the file is as this server last wrote it (size, time, inode), its hash stays;
    # a write by anything else shows as before.
    """

    def __init__(self) -> None:
        # os path -> (the file's stat as this server wrote it, or while it writes the time that write must end by;
        # the hash it keeps)
        self._kept: dict[str, tuple[tuple | float | None, str]] = {}

    def _keeps(self, os_path: str) -> str | None:
        kept = self._kept.get(os_path)
        if kept is None:
            return None
        writing = isinstance(kept[0], float) and time.monotonic() < kept[0]
        return kept[1] if writing or kept[0] == _stat(os_path) else None

    def before_save(self, model: dict | None = None, path: str = "", contents_manager: Any = None, **_: Any) -> None:
        """A pre-save hook: the hash the file keeps through this write (its own where something else wrote it last)."""
        try:
            os_path = contents_manager._get_os_path(path)
            kept = self._keeps(os_path) or contents_manager._get_hash(Path(os_path).read_bytes())["hash"]
        except Exception:  # noqa: BLE001 - a new file, not a file manager's: nothing to keep
            return
        self._kept[os_path] = (time.monotonic() + WRITE_S, kept)

    def after_save(self, os_path: str = "", **_: Any) -> None:
        """A post-save hook: the file as this server wrote it."""
        kept = self._kept.get(os_path)
        if kept is not None:
            self._kept[os_path] = (_stat(os_path), kept[1])

    def hash_of(self, os_path: str, found: str) -> str:
        """The hash to report for `os_path`, whose content hashes to `found`."""
        return self._keeps(os_path) or found

    def install(self, manager: Any) -> None:
        """Hook into `manager` (a jupyter_server contents manager): its saves, and its `get` that reports a hash."""
        manager.register_pre_save_hook(self.before_save)
        manager.register_post_save_hook(self.after_save)
        get = manager.get

        def reported(model: dict, path: str) -> dict:
            if model.get("hash") is not None and model.get("type") != "directory":
                model["hash"] = self.hash_of(manager._get_os_path(path), model["hash"])
            return model

        if inspect.iscoroutinefunction(get):
            async def get_async(path: str, *args: Any, **kwargs: Any) -> dict:
                return reported(await get(path, *args, **kwargs), path)
            manager.get = get_async
        else:
            manager.get = lambda path, *args, **kwargs: reported(get(path, *args, **kwargs), path)


def _stat(os_path: str) -> tuple | None:
    try:
        st = Path(os_path).stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": EXTENSION}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    server_app.contents_manager.register_pre_save_hook(drop_closed_widget_views)
    server_app.contents_manager.register_pre_save_hook(refresh_before_save)
    OwnWrites().install(server_app.contents_manager)
    server_app.log.info("workbench: views of closed widgets dropped on save; git reads each saved file through "
                        "its clean filter")


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
