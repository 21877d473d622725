"""A notebook's report page: the executed notebook as HTML that reads offline and shows no raw NaN (issue 43).

nbconvert's lab template loads require.js, MathJax, mermaid and the widget renderer from a CDN. The notebooks
use none of them (no TeX, no diagrams; reports run with `interactive=False`, so no live widgets), and a page
opened offline met errors, so the page is exported with a template that leaves those blocks out
(`export_page`). A DataFrame a notebook shows raw (not through `ledger.table`) prints its missing values as
NaN, None or inf; `tidy_page` reads them "—", as `table` and the ledger do.

Pages exported before this (the committed references under `reports/reference/`, which keep no executed
notebook to export again) are rewritten by the same `tidy_page`: `python -m workbench.report.pages
[FOLDER ...]` (default `reports/`) rewrites each `*.html` under the folders whose text it changes, and says
which. The rewrite is idempotent and touches nothing else on the page.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

__all__ = ["MISSING", "export_page", "tidy_page", "tidy_pages", "remote_sources"]

MISSING = "—"  # how a missing or non-finite value reads, as in `ledger.format_value` and `ledger.table`

# The lab template with the blocks that load from a CDN left empty (nbconvert's `extra_loaders`).
_OFFLINE = "workbench_offline.html.j2"
_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""

# A table cell (<td>; header cells are names, not values) holding only a missing or non-finite value as pandas
# or a Styler prints it: NaN, nan, None, NaT, <NA>, inf, -inf, +inf%; or a list of values with one among them
# (a spread "[-inf, 202]", as ledgers printed an open end before `format_value` read it "—").
_CELL = re.compile(r"(<td\b[^>]*>)([^<]*)(</td\s*>)")
_RAW_VALUE = re.compile(r"\s*(?:[-+]?(?i:nan|inf|infinity)%?|None|NaT|&lt;NA&gt;)\s*")
_RAW_IN_LIST = re.compile(r"(?<![\w.])[-+]?(?i:nan|inf|infinity)(?![\w])")
_SCRIPT = re.compile(r"<script\b([^>]*)>(.*?)</script\s*>\n?", re.S | re.I)
_REMOTE = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", re.I)
_REMOTE_BODY = re.compile(r"""import\s*\(\s*["'](?:https?:)?//|["']https?://[^"']*\.m?js["']""", re.I)
_MATHJAX_COMMENTS = re.compile(r"<!-- (?:Load mathjax|MathJax configuration|End of mathjax configuration) -->\n?")
_LINK = re.compile(r"<link\b[^>]*>\n?", re.I)


def _remote_script(match: re.Match) -> bool:
    attrs, body = match.group(1), match.group(2)
    return bool(_REMOTE.search(attrs) or _REMOTE_BODY.search(body) or "text/x-mathjax-config" in attrs)


def _tidy_cell(match: re.Match) -> str:
    start, content, end = match.groups()
    if _RAW_VALUE.fullmatch(content):
        return f"{start}{MISSING}{end}"
    if content.strip().startswith("[") and content.strip().endswith("]"):
        return f"{start}{_RAW_IN_LIST.sub(MISSING, content)}{end}"
    return match.group(0)


def remote_sources(text: str) -> list[str]:
    """The opening tags of `text`'s scripts and links that load from another host (http:, https: or //)."""
    found = [f"<script{m.group(1)}>" for m in _SCRIPT.finditer(text) if _remote_script(m)]
    return found + [m.group(0).strip() for m in _LINK.finditer(text) if _REMOTE.search(m.group(0))]


def tidy_page(text: str) -> str:
    """`text` with every table cell that shows only NaN, None, NaT, <NA> or inf reading "—", and without the
    scripts and links that load from another host (require.js, MathJax and its configuration, mermaid)."""
    text = _CELL.sub(_tidy_cell, text)
    text = _SCRIPT.sub(lambda m: "" if _remote_script(m) else m.group(0), text)
    text = _LINK.sub(lambda m: "" if _REMOTE.search(m.group(0)) else m.group(0), text)
    return _MATHJAX_COMMENTS.sub("", text)


def export_page(notebook: Path) -> Path:
    """Write `notebook` (an executed .ipynb) as `<same name>.html` beside it, offline and tidied; the page."""
    import jinja2
    import nbconvert
    import nbformat

    exporter = nbconvert.HTMLExporter(template_name="lab", template_file=_OFFLINE,
                                      extra_loaders=[jinja2.DictLoader({_OFFLINE: _TEMPLATE})])
    body, _ = exporter.from_notebook_node(nbformat.read(notebook, as_version=4))
    page = notebook.with_suffix(".html")
    with page.open("w", encoding="utf-8", newline="") as file:
        file.write(tidy_page(body))
    return page


def tidy_pages(*folders: str | Path) -> list[Path]:
    """Rewrite, through `tidy_page`, every `*.html` under `folders` whose text it changes; those pages."""
    changed = []
    for folder in folders:
        for page in sorted(Path(folder).rglob("*.html")):
            if page.is_symlink() or not page.is_file():
                continue
            with page.open(encoding="utf-8", newline="") as file:  # a progress bar's "\r" is kept as written
                text = file.read()
            tidied = tidy_page(text)
            if tidied != text:
                with page.open("w", encoding="utf-8", newline="") as file:
                    file.write(tidied)
                changed.append(page)
    return changed


def main(argv: list[str] | None = None) -> int:
    folders = (sys.argv[1:] if argv is None else argv) or ["reports"]
    missing = [f for f in folders if not Path(f).is_dir()]
    if missing:
        print(f"pages: not a folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    changed = tidy_pages(*folders)
    for page in changed:
        print(f"tidied {page}")
    print(f"{len(changed)} page(s) rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
