"""Report pages read offline and show no raw NaN (issue 43): the committed references and a fresh export."""

from __future__ import annotations

import subprocess
import sys

import nbformat
import numpy as np
import pandas as pd
import pytest

from tests.report.page_checks import raw_numbers, remote_loads
from workbench.devices import repo_root
from workbench.report.pages import MISSING, export_page, tidy_page, tidy_pages

ROOT = repo_root()
PAGES = sorted((ROOT / "reports").rglob("*.html"))


def test_there_are_committed_pages_to_check():
    names = {p.name for p in PAGES}
    assert {"packed_bit_optimizers.html", "variable_batch_size.html"} <= names, sorted(names)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT / "reports")))
def test_no_committed_page_shows_a_raw_nan(page):
    raw = raw_numbers(page)
    assert not raw, f"{len(raw)} cells read raw, first {raw[:5]}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT / "reports")))
def test_no_committed_page_loads_from_another_host(page):
    assert not remote_loads(page)


def _notebook_with_a_frame(path):
    frame = pd.DataFrame({"network": ["googlenet", "vgg"], "paper_mb": [15.0, np.nan],
                          "gain_vs_fbs_pct": [np.nan, -np.inf], "fastest": [None, "vbs"]})
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_markdown_cell("# A page"))
    nb.cells.append(nbformat.v4.new_code_cell("frame", execution_count=1, outputs=[nbformat.v4.new_output(
        "execute_result", execution_count=1, data={"text/html": frame.to_html(), "text/plain": str(frame)})]))
    nbformat.write(nb, path)
    return path


def test_an_exported_page_is_offline_and_reads_missing_values_as_a_dash(tmp_path):
    page = export_page(_notebook_with_a_frame(tmp_path / "page.ipynb"))
    assert page == tmp_path / "page.html"
    assert not remote_loads(page), remote_loads(page)
    assert not raw_numbers(page), raw_numbers(page)
    text = page.read_text()
    assert "cdnjs" not in text and "mathjax" not in text.lower()
    assert text.count(f"<td>{MISSING}</td>") == 4 and "googlenet" in text and "<td>15.0</td>" in text


def test_tidy_page_rewrites_value_cells_only():
    page = ("<table><tr><th>NaN</th><td>NaN</td><td> -inf </td><td class='x'>nan%</td><td>None</td>"
            "<td>&lt;NA&gt;</td><td>[-inf, 202]</td><td>[2.5, inf]</td><td>infinity</td><td>Nancy</td>"
            "<td>info</td><td>1.5</td></tr></table><p>on an inf/NaN the step is skipped</p><pre>a\rb</pre>")
    tidied = tidy_page(page)
    assert tidied == ("<table><tr><th>NaN</th><td>—</td><td>—</td><td class='x'>—</td><td>—</td><td>—</td>"
                      "<td>[—, 202]</td><td>[2.5, —]</td><td>—</td><td>Nancy</td><td>info</td><td>1.5</td></tr>"
                      "</table><p>on an inf/NaN the step is skipped</p><pre>a\rb</pre>")
    assert tidy_page(tidied) == tidied


def test_tidy_page_drops_what_loads_from_another_host():
    page = ('<head><script src="https://cdn.example/require.min.js"></script>\n<script src="local.js"></script>'
            '<link rel="stylesheet" href="//cdn.example/a.css"><link rel="icon" href="icon.png">'
            '<script type="module">const m = await import("https://cdn.example/m.mjs");</script>'
            '<script>var a = 1;</script></head><body><a href="https://example.org">a paper</a></body>')
    tidied = tidy_page(page)
    assert tidied == ('<head><script src="local.js"></script><link rel="icon" href="icon.png">'
                      '<script>var a = 1;</script></head><body><a href="https://example.org">a paper</a></body>')


def test_tidy_pages_rewrites_changed_pages_and_keeps_carriage_returns(tmp_path):
    (tmp_path / "a").mkdir()
    raw = tmp_path / "a" / "raw.html"
    raw.write_bytes(b"<pre>bar 1\rbar 2</pre><table><tr><td>NaN</td></tr></table>")
    clean = tmp_path / "clean.html"
    clean.write_bytes(b"<p>fine</p>")
    before = clean.stat().st_mtime_ns
    assert tidy_pages(tmp_path) == [raw]
    assert raw.read_bytes() == "<pre>bar 1\rbar 2</pre><table><tr><td>—</td></tr></table>".encode()
    assert clean.stat().st_mtime_ns == before and tidy_pages(tmp_path) == []


def test_the_command_tidies_a_folder_and_refuses_a_missing_one(tmp_path):
    (tmp_path / "p.html").write_text("<td>inf</td>")
    done = subprocess.run([sys.executable, "-m", "workbench.report.pages", str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "1 page(s) rewritten" in done.stdout and not done.stderr, done
    assert (tmp_path / "p.html").read_text() == "<td>—</td>"
    done = subprocess.run([sys.executable, "-m", "workbench.report.pages", str(tmp_path / "nope")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and "not a folder" in done.stderr
