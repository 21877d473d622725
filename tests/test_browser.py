"""Every notebook as a user meets it: JupyterLab in a real Chromium, Run All, one widget, Ctrl+S, reopened.

On a temporary copy of the repository (its own git repository, set up by `make hooks`' recipe), JupyterLab
starts on a free port with a temporary token and the settings `make` installs (`workbench.lab_setup`). For
each notebook: open it, Run All, check no output is an error or kineto's profiler markers, operate its
first widget (the kernel must read Busy while the widget works), save with Ctrl+S, check `git status
--porcelain` is empty, then reopen it on a fresh kernel and check every widget still displays and the page holds
the file as saved. Autosave runs every few seconds (AUTOSAVE_S), so Ctrl+S after Run All meets autosaves as a long
run does, and must raise no "File Changed" dialog; a widget must show something (its progress) within
WIDGET_FIRST_SIGN_S of its click. Two notebooks saved at once leave `git status` clean. Last, the report pages
the runs wrote have no dead link and no raw NaN, and no report page (the committed references included) makes a
network request.

It takes minutes (seven kernels, each notebook run whole), so it is its own CI step: `.ci/run` runs it after
`make test` with WORKBENCH_BROWSER_TESTS=1; without that, or without Chromium or Playwright's Python package,
it is skipped with the reason. Playwright drives the system Chromium (WORKBENCH_CHROMIUM, default
/usr/bin/chromium; Debian's `chromium` package) and never downloads a browser. The notebooks run with the
smoke profile's values typed into their parameters cell, as a user shortens a run
(WORKBENCH_BROWSER_PROFILE=defaults runs the parameters cells as committed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from tests.report.page_checks import dead_links, raw_numbers
from workbench.devices import repo_root
from workbench.report import available_notebooks, load_profile

ROOT = repo_root()
CHROMIUM = os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium")
PROFILE = os.environ.get("WORKBENCH_BROWSER_PROFILE", "smoke")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_SECONDS = 900  # one notebook's Run All, at most (smoke values; minutes on a loaded 2-core machine)
AUTOSAVE_S = 5  # JupyterLab's autosave interval here (its default is 120 s; a long Run All meets several)
WIDGET_FIRST_SIGN_S = 3.0  # a widget's first output (a progress bar, a line) after its click, at most

pytestmark = [
    pytest.mark.skipif(not os.environ.get("WORKBENCH_BROWSER_TESTS"),
                       reason="the browser test is its own CI step (.ci/run sets WORKBENCH_BROWSER_TESTS=1)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="needs Playwright's Python package (pip install -e '.[dev]')"),
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK),
                       reason=f"needs Chromium at {CHROMIUM} (apt-get install chromium, or set WORKBENCH_CHROMIUM)"),
    pytest.mark.skipif(shutil.which("git") is None or shutil.which("make") is None, reason="needs git and make"),
]

NOTEBOOKS = available_notebooks(ROOT / "notebooks")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args], cwd=repo,
                          capture_output=True, text=True, check=True).stdout


def _with_profile_values(path: Path, profile: str) -> None:
    """Type the profile's values into the notebook's parameters cell, as a user shortens a run."""
    values = load_profile(path.stem, profile, path.parent)
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    lines = []
    for line in cell.source.split("\n"):
        match = re.match(r"(\w+)(\s*=\s*)(.*?)(\s+#.*)?$", line)
        if match and match.group(1) in values:
            line = f"{match.group(1)}{match.group(2)}{values[match.group(1)]!r}{match.group(4) or ''}"
        lines.append(line)
    cell.source = "\n".join(lines)
    nbformat.write(nb, path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on a copy of the working tree (its own git repository, `make hooks` run there)."""
    work = tmp_path_factory.mktemp("lab")
    repo, prefix = work / "repo", work / "venv"
    files = _git(ROOT, "ls-files", "--cached", "--others", "--exclude-standard", "-z").split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    if PROFILE != "defaults":
        for name in NOTEBOOKS:
            _with_profile_values(repo / "notebooks" / f"{name}.ipynb", PROFILE)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "copy")
    recipe = subprocess.run(["make", "-s", "-n", "-o", ".venv/.installed", "hooks"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    recipe = recipe.replace(f'--prefix "{ROOT / ".venv"}"', f'--prefix "{prefix}"')
    prefix.mkdir()
    subprocess.run(["bash", "-c", recipe], cwd=repo, check=True)
    overrides = prefix / "share" / "jupyter" / "lab" / "settings" / "overrides.d"
    (overrides / "zz-browser-test.json").write_text(json.dumps(
        {"@jupyterlab/docmanager-extension:plugin": {"autosave": True, "autosaveInterval": AUTOSAVE_S}}))
    assert _git(repo, "status", "--porcelain") == ""
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(repo), "JUPYTER_PATH": str(repo), "JUPYTER_CONFIG_PATH": str(prefix / "etc" / "jupyter"),
           **{var: str(work / var.lower()) for var in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR",
                                                       "JUPYTERLAB_SETTINGS_DIR", "JUPYTERLAB_WORKSPACES_DIR")}}
    log = (work / "lab.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--allow-root",
         f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={repo / 'notebooks'}",
         "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: what the page holds, to compare with the disk
         f"--LabApp.app_settings_dir={prefix / 'share' / 'jupyter' / 'lab' / 'settings'}"],
        cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start: {(work / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield {"base": base, "token": token, "repo": repo, "log": work / "lab.log", "seconds": {}}
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        yield context
        context.close()


def _status(page) -> str:
    """The notebook's kernel status as the status bar reads it (Idle, Busy, Connecting, ...)."""
    text = page.locator(".jp-StatusBar-Widget").first.inner_text()
    found = re.search(r"\|\s*(\w+)", text)
    return found.group(1) if found else text


def _open(page, lab: dict, name: str) -> None:
    # NOTE: a fresh workspace (`reset`): JupyterLab reopens the last session's notebooks, hidden behind this one
    page.goto(f"{lab['base']}/lab/tree/{name}.ipynb?reset&token={lab['token']}")
    page.wait_for_selector(".jp-Notebook", timeout=120_000)
    deadline = time.monotonic() + 180
    while _status(page) != "Idle":
        dialog = page.locator(".jp-Dialog")
        if dialog.count():
            pytest.fail(f"{name}: JupyterLab asks: {dialog.first.inner_text()!r} (the kernel did not start)")
        if time.monotonic() > deadline:
            pytest.fail(f"{name}: the kernel did not become idle; status {_status(page)!r}")
        time.sleep(0.5)


_RUNNING = "() => [...document.querySelectorAll('.jp-InputPrompt')].some(e => e.textContent.includes('*'))"


def _run_all(page, name: str) -> float:
    start = time.monotonic()
    page.click("div.lm-MenuBar-itemLabel:text-is('Run')")
    page.click("li.lm-Menu-item:has-text('Run All Cells')")
    page.wait_for_function(_RUNNING, timeout=60_000)
    page.wait_for_function(f"() => !({_RUNNING})()", timeout=RUN_SECONDS * 1000, polling=1000)
    return time.monotonic() - start


_WATCH_DISABLED = """b => new MutationObserver(() => { if (b.disabled) b.dataset.wasDisabled = 'yes'; })
    .observe(b, {attributes: true, attributeFilter: ['disabled']})"""


# The time (performance.now()) the output first changed after the click: a progress bar, a line, a table
_WATCH_OUTPUT = """o => new MutationObserver(() => {
        o.dataset.firstChange = o.dataset.firstChange || performance.now(); })
    .observe(o, {childList: true, subtree: true, characterData: true})"""


def _operate_a_widget(page, name: str) -> tuple[list[str], float | None]:
    """Click the first widget's run button (every notebook's widgets are `interact_manual`) and watch the kernel
    until its output changes; return the samples where the widget was working while the kernel read Idle, and
    the seconds from the click to the output's first change (None: not seen)."""
    button = page.locator("button.widget-button:has-text('Run Interact')").first
    if not page.locator("button.widget-button:has-text('Run Interact')").count():
        pytest.fail(f"{name}: no widget with a run button after Run All")
    output = button.locator("xpath=following-sibling::div[contains(@class,'widget-output')]").first
    before = output.inner_text()
    button.scroll_into_view_if_needed()
    # NOTE: a widget that works for less than one polling interval is disabled and enabled again between two
    # samples, so the page itself records that the button was ever disabled (an observer, set before the click)
    button.evaluate(_WATCH_DISABLED)
    output.evaluate(_WATCH_OUTPUT)
    button.evaluate("b => { b.dataset.clicked = performance.now(); }")
    button.click()
    idle_while_working, deadline, idle_before = [], time.monotonic() + RUN_SECONDS, False
    while time.monotonic() < deadline:
        disabled, status = button.is_disabled(), _status(page)
        seen_disabled = button.evaluate("b => b.dataset.wasDisabled === 'yes'")
        # NOTE: two samples in a row: the button and the status bar are read one after the other, so a widget that
        # finishes between the two reads once showed a disabled button beside an Idle kernel (a CI run, 1 of 17)
        if disabled and status == "Idle" and idle_before:
            idle_while_working.append(f"{time.monotonic():.1f}")
        idle_before = disabled and status == "Idle"
        if seen_disabled and not disabled and status == "Idle" and output.inner_text() != before:
            first = output.evaluate("o => Number(o.dataset.firstChange || 0)")
            clicked = button.evaluate("b => Number(b.dataset.clicked)")
            return idle_while_working, (first - clicked) / 1000 if first else None
        time.sleep(0.2)
    pytest.fail(f"{name}: the widget's output did not change within {RUN_SECONDS} s")


_DIRTY = "() => !!document.querySelector('.lm-TabBar-tab.jp-mod-current.jp-mod-dirty')"


def _save(page, name: str, *, settle_s: float = 2.0) -> None:
    """Ctrl+S, then wait for the tab to read saved; fail on any dialog meanwhile ("File Changed", an error), also
    one that opens just after (an autosave racing the save)."""
    page.locator(".jp-Notebook .jp-Cell").first.click()  # focus the notebook, not a widget
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    deadline, clean_since = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        dialog = page.locator(".jp-Dialog")
        if dialog.count():
            pytest.fail(f"{name}: saving asked {dialog.first.inner_text()!r}")
        if page.evaluate(_DIRTY):
            clean_since = None
        elif clean_since is None:
            clean_since = time.monotonic()
        elif time.monotonic() - clean_since >= settle_s:
            return
        time.sleep(0.2)
    pytest.fail(f"{name}: still unsaved 60 s after Ctrl+S")


def _git_status_settled(repo: Path, seconds: float = 15) -> str:
    """`git status --porcelain`, asked again for up to `seconds` while it lists something (an autosave's index
    refresh may still be running)."""
    deadline = time.monotonic() + seconds
    while (status := _git(repo, "status", "--porcelain")) and time.monotonic() < deadline:
        time.sleep(1)
    return status


_MODEL_KEYS = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    return w && w.context ? JSON.stringify(w.context.model.toJSON()) : null; }"""


def _differences(page_json: str | None, path: Path) -> list[str]:
    """Where the notebook the page holds differs from the file at `path` (both read by nbformat, which joins
    sources and texts stored as lists of lines): metadata keys and cell keys."""
    if not page_json:
        return ["(the page's model is not readable)"]
    held, disk = nbformat.reads(page_json, as_version=4), nbformat.read(path, as_version=4)
    found = [f"metadata.{k}" for k in set(held.get("metadata", {})) | set(disk.get("metadata", {}))
             if held.get("metadata", {}).get(k) != disk.get("metadata", {}).get(k)]
    for i, (a, b) in enumerate(zip(held.get("cells", []), disk.get("cells", []), strict=False)):
        found += [f"cell {i} {k}" for k in set(a) | set(b) if a.get(k) != b.get(k)]
    if len(held.get("cells", [])) != len(disk.get("cells", [])):
        found.append("number of cells")
    return found


def _shut_down_kernels(page, lab: dict) -> None:
    headers = {"Authorization": f"token {lab['token']}"}
    for kernel in page.request.get(f"{lab['base']}/api/kernels", headers=headers).json():
        page.request.delete(f"{lab['base']}/api/kernels/{kernel['id']}", headers=headers)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_saves_clean_and_reopens_in_jupyterlab(lab, browser, name):
    page = browser.new_page()
    try:
        _open(page, lab, name)
        lab["seconds"][name] = seconds = _run_all(page, name)
        idle_while_working, first_sign_s = _operate_a_widget(page, name)
        _save(page, name)
        status = _git_status_settled(lab["repo"])
        _shut_down_kernels(page, lab)
        page.close()
        saved_file = lab["repo"] / "notebooks" / f"{name}.ipynb"
        as_saved = lab["repo"].parent / f"{name}.as-saved.ipynb"  # an autosave may rewrite the file meanwhile
        shutil.copy(saved_file, as_saved)
        page = browser.new_page()  # reopened on a new kernel: the widgets come back from the saved state
        _open(page, lab, name)
        time.sleep(3)
        widget_errors = page.locator("text=Error displaying widget").count()  # no model, no state saved
        widgets_shown = page.locator(".jupyter-widgets.widget-button").count()
        dirty = page.evaluate(_DIRTY)
        changed = _differences(page.evaluate(_MODEL_KEYS), as_saved)
    finally:
        _shut_down_kernels(page, lab)
        page.close()
    saved = nbformat.read(lab["repo"] / "notebooks" / f"{name}.ipynb", as_version=4)
    outputs = [o for c in saved.cells if c.cell_type == "code" for o in c.outputs]
    errors = [f"{o.ename}: {o.evalue}" for o in outputs if o.output_type == "error"]
    markers = [o.text[:200] for o in outputs if o.output_type == "stream" and "USDT:" in o.text]
    shown = "not seen" if first_sign_s is None else f"{first_sign_s:.1f} s"
    print(f"{name}: Run All {seconds:.0f} s, widget's first output {shown} after its click "
          f"(load {os.getloadavg()[0]:.1f}); reopened dirty: {dirty} {changed}")
    assert not errors, f"{name}: error outputs {errors}"
    assert not markers, f"{name}: kineto's profiler markers in the outputs: {markers}"
    assert outputs and status == "", f"{name}: git status after Ctrl+S:\n{status}"
    assert not idle_while_working, f"{name}: the kernel read Idle while the widget worked ({idle_while_working})"
    assert widget_errors == 0 and widgets_shown, f"{name} reopened: {widget_errors} errors"
    # NOTE: a reopened notebook whose saved widget state is restored reads changed (the tab's dot) with nothing
    # changed: ipywidgets' JupyterLab manager marks the notebook dirty whenever it registers a widget model or
    # clears its state on a kernel change, when `saveState` is on (`setDirty`), and saveState is what brings
    # the widgets back (lab_setup). What is held is the file as saved, and that is what this asserts (against a
    # copy taken before the reopen: once dirty, an autosave may write it again, less the views of closed widgets).
    assert not changed, f"{name}: reopened, the page holds a notebook other than the file: {changed}"
    assert first_sign_s is not None and first_sign_s <= WIDGET_FIRST_SIGN_S, (
        f"{name}: the widget showed nothing for {shown} after its click")


def _output_text(output) -> str:
    data = output.get("data", {})
    if "text/html" in data:
        return re.sub(r"<style.*?</style>|<[^>]+>", " ", "".join(data["text/html"]), flags=re.S)
    return "".join(data.get("text/plain", "")) if data else output.get("text", "")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_outputs_show_no_raw_nan(lab, name):
    if name not in lab["seconds"]:
        pytest.skip(f"{name} did not run in this session")
    saved = nbformat.read(lab["repo"] / "notebooks" / f"{name}.ipynb", as_version=4)
    raw = [f"cell {i}: {m.group(0)}" for i, c in enumerate(saved.cells) if c.cell_type == "code" for o in c.outputs
           for m in re.finditer(r"(?<![\w.])[-+]?(nan|inf)%?(?![\w])", _output_text(o), re.I)]
    assert not raw, f"{name}: {len(raw)} raw values shown, first {raw[:5]}"


def test_report_pages_have_no_dead_link_and_no_raw_nan(lab):
    reports = lab["repo"] / "reports"
    if not lab["seconds"]:
        pytest.skip("no notebook ran in this session")
    pages = [reports / "index.html", reports / "interactive" / "index.html"]
    assert all(p.is_file() for p in pages), sorted(str(p) for p in reports.rglob("*.html"))
    assert {p.name for p in (reports / "interactive").iterdir() if p.is_dir()} == set(lab["seconds"])
    for page in pages:
        assert not dead_links(page), dead_links(page)
        assert not raw_numbers(page), raw_numbers(page)
    print("Run All seconds:", json.dumps({k: round(v) for k, v in lab["seconds"].items()}))


def _run_first_code_cell(page) -> None:
    """Run the notebook's first code cell (its parameters): the file changes only in what git's filter strips."""
    page.locator(".jp-Notebook .jp-CodeCell").first.click()
    page.keyboard.press("Escape")
    page.keyboard.press("Shift+Enter")
    page.wait_for_function("() => [...document.querySelectorAll('.jp-InputPrompt')].some(e => /\\[\\d+\\]/.test("
                           "e.textContent))", timeout=120_000)
    page.wait_for_function(_DIRTY, timeout=60_000)


def test_two_notebooks_saved_at_once_leave_git_status_clean(lab, browser):
    """Issue 43: two notebooks saved at once met git's index.lock in the save hook; one stayed ` M`."""
    names = [n for n in ("tour", "calcgraph", "efficient_densenet") if n in NOTEBOOKS][:2]
    pages = [browser.new_page() for _ in names]
    try:
        for page, name in zip(pages, names, strict=True):
            _open(page, lab, name)
            _run_first_code_cell(page)
        for page in pages:
            page.locator(".jp-Notebook .jp-Cell").first.click()
            page.keyboard.press("Escape")
        for page in pages:  # one right after the other, neither waiting for the first to finish
            page.keyboard.press("Control+s")
        for page, name in zip(pages, names, strict=True):
            page.wait_for_function(f"() => !({_DIRTY})()", timeout=60_000)
            assert not page.locator(".jp-Dialog").count(), f"{name}: {page.locator('.jp-Dialog').first.inner_text()}"
        status = _git_status_settled(lab["repo"], seconds=5)
    finally:
        for page in pages:
            _shut_down_kernels(page, lab)
            page.close()
    assert status == "", f"git status after {' and '.join(names)} saved at once:\n{status}"


def test_no_report_page_makes_a_network_request(lab, browser):
    """Issue 43: every notebook page loaded require.js and MathJax from a CDN (errors offline). Each page under
    reports/ (the committed references, and the index pages the runs above wrote) is opened from disk and every
    request it makes is recorded."""
    pages = sorted((lab["repo"] / "reports").rglob("*.html"))
    assert any("reference" in p.parts for p in pages), "no committed reference page to open"
    remote: dict[str, list[str]] = {}
    page = browser.new_page()
    try:
        seen: list[str] = []
        page.on("request", lambda request: seen.append(request.url))
        for path in pages:
            seen.clear()
            page.goto(path.as_uri(), wait_until="load", timeout=60_000)
            page.wait_for_timeout(500)  # a module script's import() runs after load
            away = [u for u in seen if not u.startswith(("file:", "data:", "about:", "blob:"))]
            if away:
                remote[str(path.relative_to(lab["repo"]))] = away
    finally:
        page.close()
    assert not remote, f"{len(remote)} pages reach the network: {json.dumps(remote, indent=1)[:2000]}"
