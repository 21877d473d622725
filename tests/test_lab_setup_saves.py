"""Two notebooks saved at once leave `git status` clean (issue 43: the save hook met git's `index.lock: File
exists` and one notebook stayed ` M` until `git add`), and the hooks never touch the file a save wrote (its
mtime is what JupyterLab compares before its next save: a newer one raises "File Changed")."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import nbformat
import pytest

from workbench import lab_setup

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo,
                          capture_output=True, text=True, check=True).stdout


def _notebook(outputs: bool) -> dict:
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("print(1)", id="c1")
    if outputs:
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="1\n" * 50)]
        cell.execution_count = 1
    nb.cells.append(cell)
    return json.loads(nbformat.writes(nb))


@pytest.fixture
def repo(tmp_path):
    """A checkout with two stripped notebooks committed under the nbstripout clean filter, as `make hooks` sets."""
    repo = tmp_path / "clone"
    repo.mkdir()
    (repo / ".gitattributes").write_text("*.ipynb filter=nbstripout\n")
    (repo / ".gitignore").write_text(".ipynb_checkpoints/\n")
    for name in ("a", "b"):
        (repo / f"{name}.ipynb").write_text(json.dumps(_notebook(outputs=False), indent=1) + "\n")
    _git(repo, "init", "-q")
    _git(repo, "config", "filter.nbstripout.clean", f'"{sys.executable}" -m nbstripout --keep-id')
    _git(repo, "config", "filter.nbstripout.smudge", "cat")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "stripped")
    assert _git(repo, "status", "--porcelain") == ""
    return repo


def _hold_index_lock(repo, seconds: float) -> threading.Thread:
    """Another git at work: its index.lock there for `seconds`, then gone."""
    lock = repo / ".git" / "index.lock"
    lock.write_text("")

    def release():
        time.sleep(seconds)
        lock.unlink()

    thread = threading.Thread(target=release)
    thread.start()
    return thread


def test_a_refresh_waits_out_another_gits_index_lock(repo):
    (repo / "a.ipynb").write_text(json.dumps(_notebook(outputs=True), indent=1) + "\n")
    assert _git(repo, "status", "--porcelain") == " M a.ipynb\n"  # git's size rule: listed until refreshed
    holder = _hold_index_lock(repo, 0.6)
    start = time.monotonic()
    assert lab_setup.refresh_git_index(str(repo / "a.ipynb")) is True
    holder.join()
    assert time.monotonic() - start >= 0.5 and _git(repo, "status", "--porcelain") == ""


def test_a_lock_that_stays_is_given_up_on_logged(repo, monkeypatch, caplog):
    monkeypatch.setattr(lab_setup, "INDEX_LOCK_WAIT_S", 0.3)
    monkeypatch.setattr(lab_setup._git_writing_index, "__defaults__", (0.3,))
    (repo / "a.ipynb").write_text(json.dumps(_notebook(outputs=True), indent=1) + "\n")
    (repo / ".git" / "index.lock").write_text("")
    with caplog.at_level(logging.WARNING):
        assert lab_setup.refresh_git_index(str(repo / "a.ipynb")) is False
    assert "index.lock" in caplog.text and "a.ipynb" in caplog.text


def test_two_notebooks_saved_at_once_leave_git_status_clean(repo):
    """Both saves through JupyterLab's contents manager with the extension loaded, at once, on two threads (as two
    browser tabs' saves may be served), while a third git holds the index: both hooks wait their turn."""
    from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

    manager = AsyncLargeFileManager(root_dir=str(repo))
    lab_setup._load_jupyter_server_extension(SimpleNamespace(contents_manager=manager,
                                                             log=logging.getLogger("jupyter_server")))
    models = {}

    def save(name):
        model = {"type": "notebook", "format": "json", "content": _notebook(outputs=True)}
        models[name] = asyncio.run(manager.save(model, f"{name}.ipynb"))

    holder = _hold_index_lock(repo, 0.5)
    savers = [threading.Thread(target=save, args=(name,)) for name in ("a", "b")]
    for saver in savers:
        saver.start()
    for saver in savers + [holder]:
        saver.join(60)
    assert set(models) == {"a", "b"}
    assert "1\\n" in (repo / "a.ipynb").read_text()  # the outputs stay on disk
    assert _git(repo, "status", "--porcelain") == "" and _git(repo, "diff", "--cached") == ""
    for name, model in models.items():  # the hooks never touched the file after the save read its mtime
        on_disk = asyncio.run(manager.get(f"{name}.ipynb", content=False))["last_modified"]
        assert on_disk == model["last_modified"], name


def test_git_runs_before_the_write_and_never_between_the_write_and_the_reply(repo, monkeypatch):
    """JupyterLab saves in two requests (write, then read the hash back); a check between them finds a hash it has
    not seen ("File Changed", issue 43). Git's work at save time (five commands, seconds on a loaded machine) held
    the write's reply and widened that window; it now runs before the write."""
    from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

    events = []
    git = lab_setup._git
    monkeypatch.setattr(lab_setup, "_git", lambda *args: events.append("git") or git(*args))
    manager = AsyncLargeFileManager(root_dir=str(repo))
    write = manager._save_notebook

    async def recorded_write(*args, **kwargs):
        events.append("write")
        return await write(*args, **kwargs)

    monkeypatch.setattr(manager, "_save_notebook", recorded_write)
    lab_setup._load_jupyter_server_extension(SimpleNamespace(contents_manager=manager,
                                                             log=logging.getLogger("jupyter_server")))
    model = {"type": "notebook", "format": "json", "content": _notebook(outputs=True)}
    asyncio.run(manager.save(model, "a.ipynb"))
    assert "git" in events and events[-1] == "write", events
    assert _git(repo, "status", "--porcelain") == ""
    assert lab_setup.refresh_before_save(model, "../outside.ipynb", manager) is False
    assert lab_setup.refresh_before_save(model, "a.ipynb", object()) is False


def _loaded(repo, manager_class=None):
    from jupyter_server.services.contents.largefilemanager import AsyncLargeFileManager

    manager = (manager_class or AsyncLargeFileManager)(root_dir=str(repo))
    lab_setup._load_jupyter_server_extension(SimpleNamespace(contents_manager=manager,
                                                             log=logging.getLogger("jupyter_server")))
    return manager


def _hash(manager, name: str) -> str:
    got = manager.get(name, content=False, require_hash=True)
    return (asyncio.run(got) if asyncio.iscoroutine(got) else got)["hash"]


def _real_hash(manager, path) -> str:
    return manager._get_hash(path.read_bytes())["hash"]


def test_a_check_between_anothers_write_and_its_read_back_finds_the_hash_the_page_holds(repo, monkeypatch):
    """JupyterLab's save: read the hash, write, read it back; Ctrl+S during an autosave put one's check between the
    other's write and read back, on a hash the page had not seen ("File Changed", issue 43). This server's own writes
    keep the hash the page read; a write by anything else still shows."""
    manager = _loaded(repo)
    page = _hash(manager, "a.ipynb")  # as JupyterLab opened it
    assert page == _real_hash(manager, repo / "a.ipynb")
    write, checks = manager._save_notebook, []

    async def write_then_check(*args, **kwargs):
        out = await write(*args, **kwargs)
        checks.append(_real_hash(manager, repo / "a.ipynb"))
        checks.append(await manager.get("a.ipynb", content=False, require_hash=True))  # the other save's check
        return out

    monkeypatch.setattr(manager, "_save_notebook", write_then_check)
    asyncio.run(manager.save({"type": "notebook", "format": "json", "content": _notebook(outputs=True)}, "a.ipynb"))
    new_content, check = checks
    assert new_content != page and check["hash"] == page  # the content changed; the page's hash still holds
    assert _hash(manager, "a.ipynb") == page  # the read back, and every check after it
    monkeypatch.setattr(manager, "_save_notebook", write)
    asyncio.run(manager.save({"type": "notebook", "format": "json", "content": _notebook(outputs=False)}, "a.ipynb"))
    assert _hash(manager, "a.ipynb") == page
    (repo / "a.ipynb").write_text(json.dumps(_notebook(outputs=True)))  # another program writes the file
    elsewhere = _hash(manager, "a.ipynb")
    assert elsewhere != page and elsewhere == _real_hash(manager, repo / "a.ipynb")
    asyncio.run(manager.save({"type": "notebook", "format": "json", "content": _notebook(outputs=False)}, "a.ipynb"))
    assert _hash(manager, "a.ipynb") == elsewhere  # overwritten from the page that saw the other write


def test_a_save_that_never_ended_keeps_no_hash_past_its_deadline(repo, monkeypatch):
    from jupyter_server.services.contents.filemanager import FileContentsManager

    monkeypatch.setattr(lab_setup, "WRITE_S", 0.0)
    manager = _loaded(repo, FileContentsManager)  # a synchronous `get` is wrapped as well
    own = lab_setup.OwnWrites()
    own.before_save(path="b.ipynb", contents_manager=manager)  # a write that failed: no post-save hook
    (repo / "b.ipynb").write_text(json.dumps(_notebook(outputs=True)))
    assert own.hash_of(str(repo / "b.ipynb"), "found") == "found"
    assert _hash(manager, "b.ipynb") == _real_hash(manager, repo / "b.ipynb")
